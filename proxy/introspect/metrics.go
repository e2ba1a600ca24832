package introspect

import (
	"net/netip"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/service"
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

// Metrics are the Prometheus metrics of a Proxier: kube-proxy's sync
// metrics, under kube-proxy's names, types and buckets, and uproxy's data
// path metrics. Create them with NewMetrics and pass them in Config.
//
// The data path metrics are plain atomic counters that each listener's
// snapshot points to, one set per service port and one per backend,
// carried from one snapshot to the next: a connection costs only atomic
// adds. They become Prometheus samples only when scraped (Collect walks
// the live snapshots), so a sync creates no label children, which for
// every service port and backend would dominate a large first sync
// (BenchmarkSyncAll). Counters of removed service ports and
// backends are dropped after the sync that removed them.
type Metrics struct {
	// kube-proxy's sync metrics (pkg/proxy/metrics/metrics.go). The ones
	// with an ip_family label get a child per family in use
	// (SetIPFamilies): uproxy syncs its families together, so each
	// family's child sees the same syncs, as kube-proxy's per-family
	// proxiers would.
	syncDuration        *prometheus.HistogramVec // ip_family
	syncFullDuration    *prometheus.HistogramVec // ip_family
	syncPartialDuration *prometheus.HistogramVec // ip_family
	syncLast            *prometheus.GaugeVec     // ip_family
	lastQueued          *prometheus.GaugeVec     // ip_family
	netProgramming      *prometheus.HistogramVec // ip_family
	noLocalEndpoints    *prometheus.GaugeVec     // traffic_policy, ip_family
	endpointChanges     prometheus.Counter
	serviceChanges      prometheus.Counter

	// families are the IP families in use (SetIPFamilies); IPv4 alone
	// until set.
	families atomic.Pointer[[]v1.IPFamily]
	// pending reports the changes recorded but not yet taken by a sync,
	// for the *_changes_pending gauges; set by NewProxier (the tracker's
	// counts), nil until then.
	pending atomic.Pointer[func() (services, endpoints int)]
	// overMax reads the data path's count of connections refused at its
	// bound, for uproxy_connections_over_max_total; set by NewProxier
	// (Engine.ConnectionsOverMax), nil until then.
	overMax atomic.Pointer[func() uint64]
	// noLocal holds, per service, how many of its ports in each family
	// have endpoints but none local under a Local policy (index:
	// family, then internal/external); noLocalTotal sums them. Owned by
	// the sync goroutine.
	noLocal      map[types.NamespacedName]NoLocalCounts
	noLocalTotal NoLocalCounts
	// noListener holds, per service, how many of its ports in each
	// family want a listener (their own, or a place on the shared one)
	// and could not open it;
	// noListenerTotal sums them. Owned by the sync goroutine.
	noListener       map[types.NamespacedName][2]int
	noListenerTotal  [2]int
	noListenerPorts  *prometheus.GaugeVec   // ip_family
	refusedAddresses *prometheus.CounterVec // reason

	// dp are the data path's own metrics, which every port's counters
	// point to.
	dp datapath.Meters

	// The families that Collect builds from the counters.
	connections *prometheus.Desc // service, port, backend, result
	active      *prometheus.Desc // service, port
	bytes       *prometheus.Desc // service, port, direction
	picks       *prometheus.Desc // service, backend
	fallbacks   *prometheus.Desc // service, port, reason

	// source walks the metrics of every live snapshot, for Collect; set
	// by NewProxier, nil until then.
	source atomic.Pointer[func(yield func(*datapath.PortMetrics) bool)]

	// Owned by the sync goroutine: the counters of each service
	// ("namespace/name"), one portState per port label, which snapshots
	// share (both families of a service port) and pass on to their
	// successors. A service has few ports, found by a scan.
	ports map[string][]*portState
	// round numbers the services the sync goroutine applies
	// (beginService); forPort marks what it hands out with it, and
	// retainService drops what the round did not mark.
	round uint64
}

// smallBackends is how many backends a port's counters scan before they
// index them by address: a scan of so few costs less than a map's hashing.
const smallBackends = 16

// portState is one service port's counters and those of its backends.
// The backends are found by address with a scan while there are few
// (smallBackends), through byAddr past that: at 10,000 services of 10
// endpoints, maps per port held more than the counters they indexed.
type portState struct {
	port     string // the port label
	c        *datapath.PortCounters
	backends []*datapath.BackendMetrics
	byAddr   map[netip.AddrPort]*datapath.BackendMetrics // nil up to smallBackends backends
	round    uint64                                      // the last round that used it (Metrics.round)
}

// backend returns the counters of the backend at ap, or nil.
func (st *portState) backend(ap netip.AddrPort) *datapath.BackendMetrics {
	if st.byAddr != nil {
		return st.byAddr[ap]
	}
	for _, bm := range st.backends {
		if bm.Addr == ap {
			return bm
		}
	}
	return nil
}

func (st *portState) add(bm *datapath.BackendMetrics) {
	st.backends = append(st.backends, bm)
	switch {
	case st.byAddr != nil:
		st.byAddr[bm.Addr] = bm
	case len(st.backends) > smallBackends:
		st.byAddr = make(map[netip.AddrPort]*datapath.BackendMetrics, len(st.backends))
		for _, b := range st.backends {
			st.byAddr[b.Addr] = b
		}
	}
}

// retain drops the backends that round did not use.
func (st *portState) retain(round uint64) {
	st.backends = slices.DeleteFunc(st.backends, func(bm *datapath.BackendMetrics) bool {
		if bm.Round == round {
			return false
		}
		delete(st.byAddr, bm.Addr)
		return true
	})
	if len(st.backends) <= smallBackends {
		st.byAddr = nil
	}
}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered, for tests that read them directly).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	syncBuckets := prometheus.ExponentialBuckets(0.001, 2, 15)
	m := &Metrics{
		syncDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_duration_seconds",
			Help:      "SyncProxyRules latency in seconds",
			Buckets:   syncBuckets,
		}, []string{"ip_family"}),
		syncFullDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_full_proxy_rules_duration_seconds",
			Help:      "SyncProxyRules latency in seconds for full resyncs",
			Buckets:   syncBuckets,
		}, []string{"ip_family"}),
		syncPartialDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_partial_proxy_rules_duration_seconds",
			Help:      "SyncProxyRules latency in seconds for partial resyncs",
			Buckets:   syncBuckets,
		}, []string{"ip_family"}),
		syncLast: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_last_timestamp_seconds",
			Help:      "The last time proxy rules were successfully synced",
		}, []string{"ip_family"}),
		lastQueued: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_last_queued_timestamp_seconds",
			Help:      "The last time a sync of proxy rules was queued",
		}, []string{"ip_family"}),
		netProgramming: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Subsystem: "kubeproxy",
			Name:      "network_programming_duration_seconds",
			Help:      "In Cluster Network Programming Latency in seconds",
			Buckets: mergeBuckets(
				prometheus.LinearBuckets(0.25, 0.25, 2), // 0.25s, 0.50s
				prometheus.LinearBuckets(1, 1, 59),      // 1s, 2s, 3s, ... 59s
				prometheus.LinearBuckets(60, 5, 12),     // 60s, 65s, 70s, ... 115s
				prometheus.LinearBuckets(120, 30, 7),    // 2min, 2.5min, 3min, ..., 5min
			),
		}, []string{"ip_family"}),
		noLocalEndpoints: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_no_local_endpoints_total",
			Help:      "Number of services with a Local traffic policy and no endpoints",
		}, []string{"traffic_policy", "ip_family"}),
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
		noLocal: map[types.NamespacedName]NoLocalCounts{},
		refusedAddresses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "uproxy_service_addresses_refused_total",
			Help: "Addresses that a Service names and uproxy refuses to intercept for it, counted when a refusal starts, by reason (cluster_ip_of_another_service: an external or load-balancer IP that is another Service's cluster IP).",
		}, []string{"reason"}),
		noListenerPorts: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "uproxy_service_ports_without_listener",
			Help: "Service ports that want a listener (their own, or a place on the shared one) and could not open it (out of descriptors or ports, or past --max-listeners), by IP family; their traffic is not intercepted until a retry opens it.",
		}, []string{"ip_family"}),
		noListener: map[types.NamespacedName][2]int{},
		connections: prometheus.NewDesc("uproxy_connections_total",
			"Connections (TCP) and flows (UDP) handled, by service port, backend and result (ok, dial_error, no_endpoints, refused_destination, limit, endpoint_limit).",
			[]string{"service", "port", "backend", "result"}, nil),
		active: prometheus.NewDesc("uproxy_active_connections",
			"Proxied TCP connections in progress, by service port.",
			[]string{"service", "port"}, nil),
		bytes: prometheus.NewDesc("uproxy_bytes_total",
			"Bytes proxied, by service port and direction (upstream: client to backend; downstream: backend to client). TCP counts when a direction ends.",
			[]string{"service", "port", "direction"}, nil),
		dp: datapath.Meters{DialDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "uproxy_dial_duration_seconds",
			Help:    "Time to connect to a backend, successful or not.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16), // 0.1ms to 3.3s
		}),
			UDPFlows: prometheus.NewGauge(prometheus.GaugeOpts{
				Name: "uproxy_udp_flows_active",
				Help: "Live UDP flows (client to backend associations).",
			}),
			UDPEvicted: prometheus.NewCounter(prometheus.CounterOpts{
				Name: "uproxy_udp_flows_evicted_total",
				Help: "UDP flows ended before their timeout because the flow table was full (--udp-max-flows): the least recently used flow of the Service port with the most flows, or of the new flow's own if that holds its fair share, makes room for a new one.",
			}),
			UDPPoolSockets: prometheus.NewGauge(prometheus.GaugeOpts{
				Name: "uproxy_udp_pool_sockets",
				Help: "Pooled UDP sockets connected to endpoints for request-reply queries, idle or awaiting a reply.",
			})},
		picks: prometheus.NewDesc("uproxy_balancer_picks_total",
			"Backends picked by the balancers (including failover retries), by service and backend.",
			[]string{"service", "backend"}, nil),
		fallbacks: prometheus.NewDesc("uproxy_source_ip_fallbacks_total",
			"Connections (TCP) and flows (UDP) that would keep the client's address dialled from the node's address instead, by reason (same_segment: client and backend share a link of the node past iptables; no_reply: a dial from an outside client's address got no reply; transparent_error: the socket could not take the client's address).",
			[]string{"service", "port", "reason"}, nil),
		ports: map[string][]*portState{},
	}
	dialErrors := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_dial_errors_total",
		Help: "Failed connection attempts to backends, by reason (refused, timeout, unreachable, other).",
	}, []string{"reason"})
	for i, r := range datapath.DialReasonNames {
		m.dp.DialErrors[i] = dialErrors.WithLabelValues(r)
	}
	udpPool := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_udp_pool_queries_total",
		Help: "UDP request-reply queries sent through pooled backend sockets, by result: sent, dropped (the endpoint's pool was at its bound, or the engine's at its bound and the query's Service port at its fair share; or its socket went to another Service port's query), timeout (no reply in time), long_flow (the client sent again, and became a flow).",
	}, []string{"result"})
	for i, r := range datapath.PoolResultNames {
		m.dp.UDPPoolQueries[i] = udpPool.WithLabelValues(r)
	}
	if reg != nil {
		endpointsPending := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_endpoint_changes_pending",
			Help:      "Pending proxy rules Endpoint changes",
		}, func() float64 { _, e := m.pendingChanges(); return float64(e) })
		servicesPending := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_service_changes_pending",
			Help:      "Pending proxy rules Service changes",
		}, func() float64 { s, _ := m.pendingChanges(); return float64(s) })
		// A CounterFunc: the data path counts in a plain atomic, read
		// only when scraped.
		overMax := prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "uproxy_connections_over_max_total",
			Help: "TCP connections reset on accept, before any backend was dialled, because the proxy carried --max-connections already, across every service port: the bound keeps their descriptors out of the reserve that iptables-restore needs.",
		}, func() float64 {
			if f := m.overMax.Load(); f != nil {
				return float64((*f)())
			}
			return 0
		})
		reg.MustRegister(m.syncDuration, m.syncFullDuration, m.syncPartialDuration, m.syncLast, m.lastQueued,
			m.netProgramming, m.noLocalEndpoints, m.noListenerPorts, m.refusedAddresses, m.endpointChanges, m.serviceChanges, endpointsPending, servicesPending,
			dataPathCollector{m}, m.dp.DialDuration, dialErrors, m.dp.UDPFlows, m.dp.UDPEvicted, udpPool, m.dp.UDPPoolSockets, overMax)
	}
	return m
}

// CountRefusedAddress counts an address a Service names that the proxier
// refused, for reason. A nil m counts nothing.
func (m *Metrics) CountRefusedAddress(reason string) {
	if m != nil {
		m.refusedAddresses.WithLabelValues(reason).Inc()
	}
}

// mergeBuckets concatenates bucket lists after a bucket of 0, as
// component-base's MergeBuckets does (it starts from make([]float64, 1)):
// kube-proxy's network programming histogram has an le="0" bucket, and
// dashboards built on it may read it.
func mergeBuckets(lists ...[]float64) []float64 {
	out := []float64{0}
	for _, l := range lists {
		out = append(out, l...)
	}
	return out
}

// SetIPFamilies sets the IP families in use: those whose rules the proxy
// programs, each reported under its own ip_family label as kube-proxy's
// per-family proxiers report theirs. Call it before the proxier runs;
// until then, IPv4 alone is reported.
func (m *Metrics) SetIPFamilies(families ...v1.IPFamily) {
	if m != nil {
		f := slices.Clone(families)
		m.families.Store(&f)
	}
}

// ipFamilies returns the families in use.
func (m *Metrics) ipFamilies() []v1.IPFamily {
	if f := m.families.Load(); f != nil {
		return *f
	}
	return []v1.IPFamily{v1.IPv4Protocol}
}

// Queued records, at now, that a sync was asked for: kube-proxy sets
// sync_proxy_rules_last_queued_timestamp_seconds when a change arrives and
// when its sync loop starts, so that an alert can compare it with the last
// successful sync and tell a hung sync loop from a quiet cluster.
func (m *Metrics) Queued(now time.Time) {
	if m == nil {
		return
	}
	for _, f := range m.ipFamilies() {
		m.lastQueued.WithLabelValues(string(f)).Set(unixSeconds(now))
	}
}

func unixSeconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }

// SetPending sets what the *_changes_pending gauges read when scraped.
func (m *Metrics) SetPending(f func() (services, endpoints int)) {
	if m != nil {
		m.pending.Store(&f)
	}
}

// SetConnectionsOverMax sets what uproxy_connections_over_max_total reads
// when scraped: the data path's count of connections refused at its
// bound (datapath.Engine.ConnectionsOverMax).
func (m *Metrics) SetConnectionsOverMax(f func() uint64) {
	if m != nil {
		m.overMax.Store(&f)
	}
}

func (m *Metrics) pendingChanges() (services, endpoints int) {
	if f := m.pending.Load(); f != nil {
		return (*f)()
	}
	return 0, 0
}

// ObserveSync records a successful sync (full or partial) that started at
// start and ended at end, and the trigger times of the endpoint changes
// it programmed: each in the family of its EndpointSlice, if that family
// is in use.
func (m *Metrics) ObserveSync(start, end time.Time, full bool, triggers map[types.NamespacedName][]changes.TriggerTime) {
	if m == nil {
		return
	}
	d := end.Sub(start).Seconds()
	byFamily := m.syncPartialDuration
	if full {
		byFamily = m.syncFullDuration
	}
	families := m.ipFamilies()
	for _, f := range families {
		fam := string(f)
		m.syncDuration.WithLabelValues(fam).Observe(d)
		byFamily.WithLabelValues(fam).Observe(d)
		m.syncLast.WithLabelValues(fam).Set(unixSeconds(end))
		i := FamilyIndex(f == v1.IPv6Protocol)
		m.noLocalEndpoints.WithLabelValues("internal", fam).Set(float64(m.noLocalTotal[i][0]))
		m.noLocalEndpoints.WithLabelValues("external", fam).Set(float64(m.noLocalTotal[i][1]))
		m.noListenerPorts.WithLabelValues(fam).Set(float64(m.noListenerTotal[i]))
	}
	for _, ts := range triggers {
		for _, t := range ts {
			if slices.Contains(families, t.Family) {
				m.netProgramming.WithLabelValues(string(t.Family)).Observe(end.Sub(t.At).Seconds())
			}
		}
	}
}

func (m *Metrics) CountChanges(services, endpoints int) {
	if m == nil {
		return
	}
	m.serviceChanges.Add(float64(services))
	m.endpointChanges.Add(float64(endpoints))
}

// NoLocalCounts counts service ports per family (0: IPv4, 1: IPv6) and
// policy (0: internal, 1: external).
type NoLocalCounts [2][2]int

// Count adds a service port of family v6 to c if noLocalOf says so.
func (c *NoLocalCounts) Count(v6 bool, sp *service.Port, eps []service.Endpoint, sets service.EndpointSets) {
	if internal, external := noLocalOf(sp, eps, sets); internal || external {
		f := FamilyIndex(v6)
		c[f][0] += b2i(internal)
		c[f][1] += b2i(external)
	}
}

// FamilyIndex indexes counts by family: 0 for IPv4, 1 for IPv6.
func FamilyIndex(v6 bool) int {
	if v6 {
		return 1
	}
	return 0
}

// noLocalOf reports, as kube-proxy's iptables proxier counts for
// sync_proxy_rules_no_local_endpoints_total, whether a service port in
// one family has usable endpoints somewhere in the cluster (eps, ready or
// serving and terminating) but, under a Local internal or external
// traffic policy, none on this node: that traffic is dropped.
func noLocalOf(sp *service.Port, eps []service.Endpoint, sets service.EndpointSets) (internal, external bool) {
	if len(sets.Local) > 0 || !slices.ContainsFunc(eps, func(e service.Endpoint) bool { return e.Ready || (e.Serving && e.Terminating) }) {
		return false, false // local endpoints, or none at all (rejected, not counted)
	}
	return sp.InternalPolicyLocal, sp.ExternalPolicyLocal
}

// SetNoLocal records the counts of one service's ports, replacing its
// previous ones; the gauges follow at the end of the sync. Called by the
// sync goroutine for each service it applies.
func (m *Metrics) SetNoLocal(service types.NamespacedName, c NoLocalCounts) {
	if m == nil {
		return
	}
	old := m.noLocal[service]
	for f := range c {
		for p := range c[f] {
			m.noLocalTotal[f][p] += c[f][p] - old[f][p]
		}
	}
	if c == (NoLocalCounts{}) {
		delete(m.noLocal, service)
	} else {
		m.noLocal[service] = c
	}
}

// portLabel is the port label: the port's name, or its number when the
// service has a single unnamed port.
func portLabel(sp *service.Port) string {
	if sp.Name.Port != "" {
		return sp.Name.Port
	}
	return strconv.Itoa(int(sp.Port))
}

// ForPort returns the counters of sp and of each of its backends, those
// of the previous snapshots where they exist. Called by the sync
// goroutine when it builds a snapshot.
func (m *Metrics) ForPort(sp *service.Port, backends []*balancer.Backend) *datapath.PortMetrics {
	if m == nil {
		return nil
	}
	svc, port := sp.Name.NamespacedName.String(), portLabel(sp)
	var st *portState
	for _, s := range m.ports[svc] {
		if s.port == port {
			st = s
			break
		}
	}
	if st == nil {
		st = &portState{port: port, c: &datapath.PortCounters{}, backends: make([]*datapath.BackendMetrics, 0, len(backends))}
		m.ports[svc] = append(m.ports[svc], st)
	}
	st.round = m.round
	bms := make([]*datapath.BackendMetrics, len(backends))
	for i, b := range backends {
		bm := st.backend(b.Addr)
		if bm == nil {
			bm = &datapath.BackendMetrics{Addr: b.Addr}
			st.add(bm)
		}
		bm.Round = m.round
		bms[i] = bm
	}
	return datapath.NewPortMetrics(datapath.PortMetrics{
		Service:     svc,
		Port:        port,
		C:           st.c,
		M:           &m.dp,
		KeepsSource: sp.SourceIP != datapath.SourceNode,
	}, backends, bms)
}

// BeginService starts a round: the service that the sync goroutine
// applies next gets all its snapshots' metrics from forPort, and then
// retainService drops the counters that none of them took.
func (m *Metrics) BeginService() {
	if m != nil {
		m.round++
	}
}

// RetainService drops the counters of every port and backend of service
// that the current round's snapshots do not use (beginService). Called by
// the sync goroutine for each service it applied, so a sync's cost follows
// the services that changed. Marking in forPort replaced a set of every
// live label built per service, which cost a tenth of the first sync of
// 10,000 services (BenchmarkSyncAll).
func (m *Metrics) RetainService(service string) {
	if m == nil {
		return
	}
	sts := slices.DeleteFunc(m.ports[service], func(st *portState) bool { return st.round != m.round })
	for _, st := range sts {
		st.retain(m.round)
	}
	if len(sts) == 0 {
		delete(m.ports, service)
	} else {
		m.ports[service] = sts
	}
}

// SetSource sets what Collect walks: the metrics of every live snapshot.
func (m *Metrics) SetSource(walk func(yield func(*datapath.PortMetrics) bool)) {
	if m != nil {
		m.source.Store(&walk)
	}
}

// dataPathCollector turns the data path counters into the samples of
// uproxy_connections_total, uproxy_active_connections,
// uproxy_bytes_total, uproxy_balancer_picks_total and
// uproxy_source_ip_fallbacks_total when scraped.
type dataPathCollector struct{ m *Metrics }

var _ prometheus.Collector = dataPathCollector{}

// Describe sends the families' descriptors.
func (c dataPathCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.m.connections
	ch <- c.m.active
	ch <- c.m.bytes
	ch <- c.m.picks
	ch <- c.m.fallbacks
}

// Collect walks the live snapshots (safe for concurrent use with syncs:
// snapshots are immutable and the counters atomic). Both families'
// listeners of a service port share its counters, and so are counted
// once; picks are summed over a service's ports.
func (c dataPathCollector) Collect(ch chan<- prometheus.Metric) {
	m := c.m
	walk := m.source.Load()
	if walk == nil {
		return
	}
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	seenPort := map[*datapath.PortCounters]bool{}
	seenBackend := map[*datapath.BackendMetrics]bool{}
	type pickKey struct {
		service string
		backend netip.AddrPort
	}
	picks := map[pickKey]uint64{}
	(*walk)(func(pm *datapath.PortMetrics) bool {
		if pm == nil {
			return true
		}
		svc, port := pm.Service, pm.Port
		if !seenPort[pm.C] {
			seenPort[pm.C] = true
			ch <- prometheus.MustNewConstMetric(m.active, prometheus.GaugeValue, float64(pm.C.Active.Load()), svc, port)
			counter(m.bytes, pm.C.Upstream.Load(), svc, port, "upstream")
			counter(m.bytes, pm.C.Downstream.Load(), svc, port, "downstream")
			counter(m.connections, pm.C.NoEndpoints.Load(), svc, port, "", resultNoEndpoints)
			counter(m.connections, pm.C.Refused.Load(), svc, port, "", resultRefusedDestination)
			counter(m.connections, pm.C.Limit.Load(), svc, port, "", resultLimit)
			counter(m.connections, pm.C.EndpointLimit.Load(), svc, port, "", resultEndpointLimit)
			if pm.KeepsSource {
				// Only the reasons that happened: every port may keep
				// its clients' addresses, and most never fall back.
				for r, name := range datapath.FallbackReasons() {
					if name != "" && pm.C.SourceFallbacks[r].Load() > 0 {
						counter(m.fallbacks, pm.C.SourceFallbacks[r].Load(), svc, port, name)
					}
				}
			}
		}
		for _, bm := range pm.Backends {
			if seenBackend[bm] {
				continue
			}
			seenBackend[bm] = true
			// The label is formatted here, per scrape, rather than held
			// by every backend of every service.
			addr := bm.Addr.String()
			counter(m.connections, bm.OK.Load(), svc, port, addr, resultOK)
			counter(m.connections, bm.DialError.Load(), svc, port, addr, resultDialError)
			picks[pickKey{svc, bm.Addr}] += bm.Picks.Load()
		}
		return true
	})
	for k, v := range picks {
		counter(m.picks, v, k.service, k.backend.String())
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// SetNoListener records how many ports of service, per family, have no
// listener, replacing its previous counts; the gauge follows at the end of
// the sync. Called by the sync goroutine for each service it applies.
func (m *Metrics) SetNoListener(service types.NamespacedName, c [2]int) {
	if m == nil {
		return
	}
	old := m.noListener[service]
	for f := range c {
		m.noListenerTotal[f] += c[f] - old[f]
	}
	if c == ([2]int{}) {
		delete(m.noListener, service)
	} else {
		m.noListener[service] = c
	}
}
