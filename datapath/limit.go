package datapath

import (
	"errors"
	"sync/atomic"

	"github.com/uproxy/uproxy/balancer"
)

// errEndpointsFull is returned when every endpoint a connection could go
// to is at the service's per-endpoint connection limit.
var errEndpointsFull = errors.New("every endpoint is at its connection limit")

// ConnSlots counts the TCP connections of one service port in progress,
// against its uproxy.io/max-connections limit, and the port's part of
// the engine's pooled UDP sockets and UDP flows, for its fair share of
// their bounds (udpfair.go). One ConnSlots serves the port's listeners
// of both families and every snapshot they build, so the counts survive
// endpoint changes; the sync goroutine hands it from one snapshot to the
// next (the proxier keeps one per service port). Safe for concurrent use.
type ConnSlots struct {
	n   atomic.Int64
	udp udpShare // guarded by the engine's udpFairness.mu
}

// acquire takes a slot if fewer than limit connections are in progress
// (zero or less: no limit, and the slot is always taken) and reports
// whether it did. The caller releases a slot it took exactly once. A nil
// ConnSlots (a snapshot built without one) counts nothing and never refuses.
func (s *ConnSlots) acquire(limit int) bool {
	if s == nil {
		return true
	}
	if limit <= 0 {
		s.n.Add(1)
		return true
	}
	for {
		n := s.n.Load()
		if n >= int64(limit) {
			return false
		}
		if s.n.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

func (s *ConnSlots) release() {
	if s != nil {
		s.n.Add(-1)
	}
}

// spare returns a backend of the set that bal balances (the snapshot's
// cluster or local balancer) with fewer than limit connections in
// progress, Acquired: the least busy of those not ejected, or of all of
// them when every one is ejected (as the balancers choose). It returns nil
// when every candidate is full. It is the fallback when the balancer's own
// pick is full: some balancers (source-hash, affinity) would pick the same
// full backend again and again.
func (s *Snapshot) spare(bal balancer.Balancer, limit int64) *balancer.Backend {
	bs := s.ClusterBackends
	if bal == s.Local {
		bs = s.LocalBackends
	}
	healthy := false
	for _, b := range bs {
		if !b.Ejected() {
			healthy = true
			break
		}
	}
	// A failed TryAcquire means a racing connection took the last slot of
	// the backend found; look again, at most once per backend.
	for range bs {
		var best *balancer.Backend
		for _, b := range bs {
			if healthy && b.Ejected() || b.Active() >= limit {
				continue
			}
			if best == nil || b.Active() < best.Active() {
				best = b
			}
		}
		if best == nil {
			return nil
		}
		if best.TryAcquire(limit) {
			return best
		}
	}
	return nil
}
