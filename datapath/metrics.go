package datapath

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/uproxy/uproxy/balancer"
)

// The data path's metrics are plain atomic counters that each listener's
// Snapshot points to, one set per service port (PortMetrics) and one per
// backend (BackendMetrics), which the control plane creates, carries from
// one snapshot to the next, and turns into samples when scraped: a
// connection costs only atomic adds. Meters are the few that are
// Prometheus metrics of their own, shared by every service port.

// Reasons of uproxy_dial_errors_total (DialReasonNames).
const (
	DialRefused = iota
	DialTimeout
	DialUnreachable
	DialOther
	NumDialReasons
)

// DialReasonNames are the reason labels of uproxy_dial_errors_total.
var DialReasonNames = [NumDialReasons]string{"refused", "timeout", "unreachable", "other"}

// Results of uproxy_udp_pool_queries_total (PoolResultNames): what
// happened to a UDP query that went to a socket pool (udppool.go).
const (
	PoolSent     = iota // went out on a pooled socket
	PoolDropped         // the pool was at its bound
	PoolTimedOut        // no reply within the query timeout
	PoolLongFlow        // its client sent again: now a flow
	NumPoolResults
)

// PoolResultNames are the result labels of uproxy_udp_pool_queries_total.
var PoolResultNames = [NumPoolResults]string{"sent", "dropped", "timeout", "long_flow"}

// Meters are the data path's metrics that are not per service port.
type Meters struct {
	DialDuration prometheus.Histogram
	DialErrors   [NumDialReasons]prometheus.Counter
	UDPFlows     prometheus.Gauge
	UDPEvicted   prometheus.Counter
	// UDPPoolQueries count the queries of request-reply UDP ports by
	// result (PoolResultNames); UDPPoolSockets gauges their pooled
	// sockets, idle or awaiting a reply.
	UDPPoolQueries [NumPoolResults]prometheus.Counter
	UDPPoolSockets prometheus.Gauge
}

// PortMetrics are the counters of one service port and of its backends:
// what a snapshot holds. A nil *PortMetrics (metrics disabled) records
// nothing. Immutable once in a snapshot; the counters are atomic.
type PortMetrics struct {
	// Service ("namespace/name") and Port (its name, or number) are the
	// labels of the port's samples.
	Service, Port string
	C             *PortCounters
	// KeepsSource: the port may keep the client's address, so its
	// C.SourceFallbacks are reported.
	KeepsSource bool
	M           *Meters
	// Backends are the counters of each of keys (the snapshot's
	// backends), in the same order; byBackend indexes them past a few,
	// where a scan of keys costs more than a map (NewPortMetrics).
	Backends  []*BackendMetrics
	keys      []*balancer.Backend
	byBackend map[*balancer.Backend]*BackendMetrics
}

// smallSet is how many backends a PortMetrics finds by a scan.
const smallSet = 16

// NewPortMetrics returns pm with the counters bms of the backends keys
// (the same length and order): maps per port held more than the counters
// they indexed at scale, so few backends are found by a scan.
func NewPortMetrics(pm PortMetrics, keys []*balancer.Backend, bms []*BackendMetrics) *PortMetrics {
	pm.keys, pm.Backends = keys, bms
	if len(keys) > smallSet {
		pm.byBackend = make(map[*balancer.Backend]*BackendMetrics, len(keys))
		for i, b := range keys {
			pm.byBackend[b] = bms[i]
		}
	}
	return &pm
}

// PortCounters count one service port's traffic.
type PortCounters struct {
	Active                                     atomic.Int64
	Upstream, Downstream                       atomic.Uint64
	NoEndpoints, Refused, Limit, EndpointLimit atomic.Uint64
	// SourceFallbacks count, by reason (FallbackReasons), the connections
	// and flows dialled from the node's address though they would keep
	// the client's (KeepClient).
	SourceFallbacks [numFallbackReasons]atomic.Uint64
}

// BackendMetrics count one backend of a service port.
type BackendMetrics struct {
	Addr                 netip.AddrPort // the backend label
	OK, DialError, Picks atomic.Uint64
	// Round is the last round of the control plane's that used it; only
	// the control plane's sync goroutine reads or writes it.
	Round uint64
}

// Backend returns the counters of b, one of the snapshot's backends; nil
// when metrics are disabled or b is not one of them.
func (pm *PortMetrics) Backend(b *balancer.Backend) *BackendMetrics { return pm.backend(b) }

func (pm *PortMetrics) backend(b *balancer.Backend) *BackendMetrics {
	if pm == nil {
		return nil
	}
	if pm.byBackend != nil {
		return pm.byBackend[b]
	}
	for i, k := range pm.keys {
		if k == b {
			return pm.Backends[i]
		}
	}
	return nil
}

func (pm *PortMetrics) refusedDestination() {
	if pm != nil {
		pm.C.Refused.Add(1)
	}
}

func (pm *PortMetrics) noEndpoint() {
	if pm != nil {
		pm.C.NoEndpoints.Add(1)
	}
}

// limited counts a TCP connection refused at the service port's
// connection limit.
func (pm *PortMetrics) limited() {
	if pm != nil {
		pm.C.Limit.Add(1)
	}
}

// endpointsFull counts a TCP connection refused because every endpoint
// was at the per-endpoint connection limit.
func (pm *PortMetrics) endpointsFull() {
	if pm != nil {
		pm.C.EndpointLimit.Add(1)
	}
}

// sourceFallback counts a connection or flow dialled from the node's
// address though it would keep the client's (KeepClient), for reason.
func (pm *PortMetrics) sourceFallback(reason int) {
	if pm != nil {
		pm.C.SourceFallbacks[reason].Add(1)
	}
}

// connStart and connEnd bracket a proxied TCP connection.
func (pm *PortMetrics) connStart() {
	if pm != nil {
		pm.C.Active.Add(1)
	}
}

func (pm *PortMetrics) connEnd() {
	if pm != nil {
		pm.C.Active.Add(-1)
	}
}

func (pm *PortMetrics) up(n int64) {
	if pm != nil && n > 0 {
		pm.C.Upstream.Add(uint64(n))
	}
}

func (pm *PortMetrics) down(n int64) {
	if pm != nil && n > 0 {
		pm.C.Downstream.Add(uint64(n))
	}
}

func (pm *PortMetrics) flowOpened() {
	if pm != nil {
		pm.M.UDPFlows.Inc()
	}
}

func (pm *PortMetrics) flowClosed() {
	if pm != nil {
		pm.M.UDPFlows.Dec()
	}
}

// flowEvicted counts a flow that a full table ended to make room.
func (pm *PortMetrics) flowEvicted() {
	if pm != nil {
		pm.M.UDPEvicted.Inc()
	}
}

// poolSockets counts pooled sockets opened (1) and closed (-1).
func (pm *PortMetrics) poolSockets(d float64) {
	if pm != nil {
		pm.M.UDPPoolSockets.Add(d)
	}
}

// pooled counts a query's outcome, one of the Pool results.
func (pm *PortMetrics) pooled(r int) {
	if pm != nil {
		pm.M.UDPPoolQueries[r].Inc()
	}
}

// dialStart returns the time a dial starts, or zero when metrics are
// disabled (sparing the clock read).
func (pm *PortMetrics) dialStart() time.Time {
	if pm == nil {
		return time.Time{}
	}
	return time.Now()
}

// dialDone records one connection attempt that started at start.
func (pm *PortMetrics) dialDone(start time.Time, err error) {
	if pm == nil {
		return
	}
	pm.M.DialDuration.Observe(time.Since(start).Seconds())
	if err != nil {
		pm.M.DialErrors[dialReason(err)].Inc()
	}
}

func (bm *BackendMetrics) picked() {
	if bm != nil {
		bm.Picks.Add(1)
	}
}

func (bm *BackendMetrics) connected() {
	if bm != nil {
		bm.OK.Add(1)
	}
}

func (bm *BackendMetrics) failed() {
	if bm != nil {
		bm.DialError.Add(1)
	}
}

// dialReason classifies a dial error for uproxy_dial_errors_total.
func dialReason(err error) int {
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return DialRefused
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, syscall.ETIMEDOUT) || isNetTimeout(err):
		return DialTimeout
	case errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH):
		return DialUnreachable
	}
	return DialOther
}

func isNetTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
