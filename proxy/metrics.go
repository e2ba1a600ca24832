package proxy

import (
	"context"
	"errors"
	"net"
	"strconv"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/balancer"
)

// Results of uproxy_connections_total.
const (
	resultOK                 = "ok"                  // a backend accepted the connection (or UDP flow)
	resultDialError          = "dial_error"          // every attempt failed; backend is the last one tried
	resultNoEndpoints        = "no_endpoints"        // nothing to pick from
	resultRefusedDestination = "refused_destination" // not addressed to the listener's service
	resultLimit              = "limit"               // the service port was at uproxy.io/max-connections
	resultEndpointLimit      = "endpoint_limit"      // every endpoint was at uproxy.io/max-connections-per-endpoint
)

// Reasons of uproxy_dial_errors_total.
const (
	dialRefused = iota
	dialTimeout
	dialUnreachable
	dialOther
	numDialReasons
)

var dialReasonNames = [numDialReasons]string{"refused", "timeout", "unreachable", "other"}

// Metrics are the Prometheus metrics of a Proxier: kube-proxy's sync
// metrics, under kube-proxy's names, types and buckets, and uproxy's data
// path metrics. Create them with NewMetrics and pass them in Config.
//
// The data path never resolves a label child per connection: each
// listener's snapshot holds the children of its service port and of each
// of its backends, resolved when the snapshot is built, so a connection
// costs only atomic adds. Children of removed service ports and backends
// are deleted after the sync that removed them.
type Metrics struct {
	syncDuration    prometheus.Histogram
	syncLast        prometheus.Gauge
	netProgramming  prometheus.Histogram
	endpointChanges prometheus.Counter
	serviceChanges  prometheus.Counter

	connections  *prometheus.CounterVec // service, port, backend, result
	active       *prometheus.GaugeVec   // service, port
	bytes        *prometheus.CounterVec // service, port, direction
	dialDuration prometheus.Histogram
	dialErrors   [numDialReasons]prometheus.Counter
	udpFlows     prometheus.Gauge
	picks        *prometheus.CounterVec // service, backend

	// Owned by the sync goroutine: the label values whose children exist,
	// by service ("namespace/name").
	live map[string]map[metricLabels]bool
}

// metricLabels names the children of one service port (backend empty) or
// of one of its backends.
type metricLabels struct{ service, port, backend string }

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered, for tests that read them directly).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		syncDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_duration_seconds",
			Help:      "SyncProxyRules latency in seconds",
			Buckets:   prometheus.ExponentialBuckets(0.001, 2, 15),
		}),
		syncLast: prometheus.NewGauge(prometheus.GaugeOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_last_timestamp_seconds",
			Help:      "The last time proxy rules were successfully synced",
		}),
		netProgramming: prometheus.NewHistogram(prometheus.HistogramOpts{
			Subsystem: "kubeproxy",
			Name:      "network_programming_duration_seconds",
			Help:      "In Cluster Network Programming Latency in seconds",
			Buckets: mergeBuckets(
				prometheus.LinearBuckets(0.25, 0.25, 2), // 0.25s, 0.50s
				prometheus.LinearBuckets(1, 1, 59),      // 1s, 2s, 3s, ... 59s
				prometheus.LinearBuckets(60, 5, 12),     // 60s, 65s, 70s, ... 115s
				prometheus.LinearBuckets(120, 30, 7),    // 2min, 2.5min, 3min, ..., 5min
			),
		}),
		endpointChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_endpoint_changes_total",
			Help:      "Cumulative proxy rules Endpoint changes",
		}),
		serviceChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_service_changes_total",
			Help:      "Cumulative proxy rules Service changes",
		}),
		connections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "uproxy_connections_total",
			Help: "Connections (TCP) and flows (UDP) handled, by service port, backend and result (ok, dial_error, no_endpoints, refused_destination, limit, endpoint_limit).",
		}, []string{"service", "port", "backend", "result"}),
		active: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "uproxy_active_connections",
			Help: "Proxied TCP connections in progress, by service port.",
		}, []string{"service", "port"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "uproxy_bytes_total",
			Help: "Bytes proxied, by service port and direction (upstream: client to backend; downstream: backend to client). TCP counts when a direction ends.",
		}, []string{"service", "port", "direction"}),
		dialDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "uproxy_dial_duration_seconds",
			Help:    "Time to connect to a backend, successful or not.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16), // 100µs to 3.3s
		}),
		udpFlows: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "uproxy_udp_flows_active",
			Help: "Live UDP flows (client to backend associations).",
		}),
		picks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "uproxy_balancer_picks_total",
			Help: "Backends picked by the balancers (including failover retries), by service and backend.",
		}, []string{"service", "backend"}),
		live: map[string]map[metricLabels]bool{},
	}
	dialErrors := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_dial_errors_total",
		Help: "Failed connection attempts to backends, by reason (refused, timeout, unreachable, other).",
	}, []string{"reason"})
	for i, r := range dialReasonNames {
		m.dialErrors[i] = dialErrors.WithLabelValues(r)
	}
	if reg != nil {
		reg.MustRegister(m.syncDuration, m.syncLast, m.netProgramming, m.endpointChanges, m.serviceChanges,
			m.connections, m.active, m.bytes, m.dialDuration, dialErrors, m.udpFlows, m.picks)
	}
	return m
}

// mergeBuckets concatenates bucket lists, as component-base's MergeBuckets.
func mergeBuckets(lists ...[]float64) []float64 {
	var out []float64
	for _, l := range lists {
		out = append(out, l...)
	}
	return out
}

// observeSync records a successful sync that started at start and ended
// at end, and the trigger times of the endpoint changes it programmed.
func (m *Metrics) observeSync(start, end time.Time, triggers map[types.NamespacedName][]time.Time) {
	if m == nil {
		return
	}
	m.syncDuration.Observe(end.Sub(start).Seconds())
	m.syncLast.Set(float64(end.UnixNano()) / 1e9)
	for _, ts := range triggers {
		for _, t := range ts {
			m.netProgramming.Observe(end.Sub(t).Seconds())
		}
	}
}

func (m *Metrics) countChanges(services, endpoints int) {
	if m == nil {
		return
	}
	m.serviceChanges.Add(float64(services))
	m.endpointChanges.Add(float64(endpoints))
}

// portMetrics are the label children of one service port: what a
// snapshot holds. A nil *portMetrics (metrics disabled) records nothing.
type portMetrics struct {
	labels               metricLabels
	active               prometheus.Gauge
	upstream, downstream prometheus.Counter
	noEndpoints, refused prometheus.Counter
	limit, endpointLimit prometheus.Counter
	dialDuration         prometheus.Histogram
	dialErrors           *[numDialReasons]prometheus.Counter
	udpFlows             prometheus.Gauge
	backends             map[*balancer.Backend]*backendMetrics
}

// backendMetrics are the label children of one backend of a service port.
type backendMetrics struct {
	ok, dialError, picks prometheus.Counter
}

// portLabel is the port label: the port's name, or its number when the
// service has a single unnamed port.
func portLabel(sp *ServicePort) string {
	if sp.Name.Port != "" {
		return sp.Name.Port
	}
	return strconv.Itoa(int(sp.Port))
}

// forPort resolves the children of sp and of each of its backends. Called
// by the sync goroutine when it builds a snapshot.
func (m *Metrics) forPort(sp *ServicePort, backends []*balancer.Backend) *portMetrics {
	if m == nil {
		return nil
	}
	svc, port := sp.Name.NamespacedName.String(), portLabel(sp)
	pm := &portMetrics{
		labels:        metricLabels{service: svc, port: port},
		active:        m.active.WithLabelValues(svc, port),
		upstream:      m.bytes.WithLabelValues(svc, port, "upstream"),
		downstream:    m.bytes.WithLabelValues(svc, port, "downstream"),
		noEndpoints:   m.connections.WithLabelValues(svc, port, "", resultNoEndpoints),
		refused:       m.connections.WithLabelValues(svc, port, "", resultRefusedDestination),
		limit:         m.connections.WithLabelValues(svc, port, "", resultLimit),
		endpointLimit: m.connections.WithLabelValues(svc, port, "", resultEndpointLimit),
		dialDuration:  m.dialDuration,
		dialErrors:    &m.dialErrors,
		udpFlows:      m.udpFlows,
		backends:      make(map[*balancer.Backend]*backendMetrics, len(backends)),
	}
	for _, b := range backends {
		addr := b.Addr.String()
		pm.backends[b] = &backendMetrics{
			ok:        m.connections.WithLabelValues(svc, port, addr, resultOK),
			dialError: m.connections.WithLabelValues(svc, port, addr, resultDialError),
			picks:     m.picks.WithLabelValues(svc, addr),
		}
	}
	return pm
}

// retainService deletes the children of every port and backend of
// service that are not in live, and remembers live as the service's.
// Called by the sync goroutine for each service it applied: a sync's
// cost follows the services that changed, not the number of services.
func (m *Metrics) retainService(service string, live map[metricLabels]bool) {
	if m == nil {
		return
	}
	picks := map[[2]string]bool{}
	for l := range live {
		if l.backend != "" {
			picks[[2]string{l.service, l.backend}] = true
		}
	}
	for l := range m.live[service] {
		if live[l] {
			continue
		}
		if l.backend == "" {
			m.active.DeleteLabelValues(l.service, l.port)
			m.bytes.DeleteLabelValues(l.service, l.port, "upstream")
			m.bytes.DeleteLabelValues(l.service, l.port, "downstream")
			m.connections.DeleteLabelValues(l.service, l.port, "", resultNoEndpoints)
			m.connections.DeleteLabelValues(l.service, l.port, "", resultRefusedDestination)
			m.connections.DeleteLabelValues(l.service, l.port, "", resultLimit)
			m.connections.DeleteLabelValues(l.service, l.port, "", resultEndpointLimit)
			continue
		}
		m.connections.DeleteLabelValues(l.service, l.port, l.backend, resultOK)
		m.connections.DeleteLabelValues(l.service, l.port, l.backend, resultDialError)
		if !picks[[2]string{l.service, l.backend}] {
			m.picks.DeleteLabelValues(l.service, l.backend)
		}
	}
	if len(live) == 0 {
		delete(m.live, service)
		return
	}
	m.live[service] = live
}

// addLabels adds the label values that pm's children use to live.
func (pm *portMetrics) addLabels(live map[metricLabels]bool) {
	if pm == nil {
		return
	}
	live[pm.labels] = true
	for b := range pm.backends {
		l := pm.labels
		l.backend = b.Addr.String()
		live[l] = true
	}
}

// backend returns b's children; nil when metrics are disabled.
func (pm *portMetrics) backend(b *balancer.Backend) *backendMetrics {
	if pm == nil {
		return nil
	}
	return pm.backends[b]
}

func (pm *portMetrics) refusedDestination() {
	if pm != nil {
		pm.refused.Inc()
	}
}

func (pm *portMetrics) noEndpoint() {
	if pm != nil {
		pm.noEndpoints.Inc()
	}
}

// limited counts a TCP connection refused at the service port's
// connection limit.
func (pm *portMetrics) limited() {
	if pm != nil {
		pm.limit.Inc()
	}
}

// endpointsFull counts a TCP connection refused because every endpoint
// was at the per-endpoint connection limit.
func (pm *portMetrics) endpointsFull() {
	if pm != nil {
		pm.endpointLimit.Inc()
	}
}

// connStart and connEnd bracket a proxied TCP connection.
func (pm *portMetrics) connStart() {
	if pm != nil {
		pm.active.Inc()
	}
}

func (pm *portMetrics) connEnd() {
	if pm != nil {
		pm.active.Dec()
	}
}

func (pm *portMetrics) up(n int64) {
	if pm != nil && n > 0 {
		pm.upstream.Add(float64(n))
	}
}

func (pm *portMetrics) down(n int64) {
	if pm != nil && n > 0 {
		pm.downstream.Add(float64(n))
	}
}

func (pm *portMetrics) flowOpened() {
	if pm != nil {
		pm.udpFlows.Inc()
	}
}

func (pm *portMetrics) flowClosed() {
	if pm != nil {
		pm.udpFlows.Dec()
	}
}

// dialStart returns the time a dial starts, or zero when metrics are
// disabled (sparing the clock read).
func (pm *portMetrics) dialStart() time.Time {
	if pm == nil {
		return time.Time{}
	}
	return time.Now()
}

// dialDone records one connection attempt that started at start.
func (pm *portMetrics) dialDone(start time.Time, err error) {
	if pm == nil {
		return
	}
	pm.dialDuration.Observe(time.Since(start).Seconds())
	if err != nil {
		pm.dialErrors[dialReason(err)].Inc()
	}
}

func (bm *backendMetrics) picked() {
	if bm != nil {
		bm.picks.Inc()
	}
}

func (bm *backendMetrics) connected() {
	if bm != nil {
		bm.ok.Inc()
	}
}

func (bm *backendMetrics) failed() {
	if bm != nil {
		bm.dialError.Inc()
	}
}

// dialReason classifies a dial error for uproxy_dial_errors_total.
func dialReason(err error) int {
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return dialRefused
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, syscall.ETIMEDOUT) || isNetTimeout(err):
		return dialTimeout
	case errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH):
		return dialUnreachable
	}
	return dialOther
}

func isNetTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
