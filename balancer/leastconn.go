package balancer

import (
	"net/netip"
	"sync/atomic"
)

// leastConn picks the backend with the fewest active connections per unit
// of weight. The unweighted kind gives every backend weight 1.
type leastConn struct {
	backends []*Backend
	weights  []uint64
	next     atomic.Uint64 // takes turns among tied backends
}

var _ Balancer = (*leastConn)(nil)

func newLeastConn(backends []*Backend, weighted bool) *leastConn {
	var weights []uint64
	if weighted {
		// Reduced weights are at most maxSchedule, so that comparing loads
		// by cross multiplication cannot overflow before a backend has
		// 2^47 connections.
		weights = reduceWeights(backends)
	} else {
		weights = make([]uint64, len(backends))
		for i := range weights {
			weights[i] = 1
		}
	}
	return &leastConn{backends: backends, weights: weights}
}

// Pick returns a backend with the lowest Active()/weight among the
// non-ejected backends, or among all of them if every one is ejected.
//
// Ties take turns in proportion to weight, as in nginx's least_conn ("if
// there are several such servers, they are tried in turn using a weighted
// round-robin balancing method"). This needs a second pass over the ties,
// but simply rotating where the scan starts would not do: the backend after
// a busy one would win the busy one's turns too. And idle backends, all at
// zero, are common with short connections; without weighted turns a
// weighted-least-conn balancer would then ignore the weights.
func (l *leastConn) Pick(netip.Addr) *Backend {
	s := l.scan()
	if s.best < 0 {
		return l.backends[0] // every backend was ejected during the scan
	}
	if s.tieWeight == l.weights[s.best] {
		return l.backends[s.best]
	}
	r := (l.next.Add(1) - 1) % s.tieWeight
	for i, b := range l.backends {
		if !l.tied(i, s) {
			continue
		}
		w := l.weights[i]
		if r < w {
			return b
		}
		r -= w
	}
	return l.backends[s.best] // loads changed since the first pass
}

// lcScan is the outcome of leastConn.scan.
type lcScan struct {
	best                int // a least loaded backend; -1 if none is eligible
	bestLoad, tieWeight uint64
	skipEjected         bool
}

// scan finds a backend with the lowest Active()/weight among the
// non-ejected backends (all of them if every one is ejected), and the sum
// of the weights of the backends tied with it.
func (l *leastConn) scan() lcScan {
	s := lcScan{best: -1, skipEjected: anyHealthy(l.backends)}
	for i, b := range l.backends {
		if s.skipEjected && b.Ejected() {
			continue
		}
		// load/w < bestLoad/bestW, without division, as nginx's
		// ngx_http_upstream_get_least_conn_peer compares them.
		load, w := l.load(i), l.weights[i]
		switch {
		case s.best < 0 || load*l.weights[s.best] < s.bestLoad*w:
			s.best, s.bestLoad, s.tieWeight = i, load, w
		case load*l.weights[s.best] == s.bestLoad*w:
			s.tieWeight += w
		}
	}
	return s
}

// tied reports whether backend i is, still, one of the least loaded that
// s found.
func (l *leastConn) tied(i int, s lcScan) bool {
	return !(s.skipEjected && l.backends[i].Ejected()) && l.load(i)*l.weights[s.best] == s.bestLoad*l.weights[i]
}

// LeastLoaded returns the backends among which b, a least-conn or
// weighted-least-conn balancer (possibly wrapped for affinity), would
// pick next: those with the lowest Active()/weight, skipping ejected ones
// as Pick does. It takes no turn. Nil when b is another kind of balancer.
// Explanations use it to say what Pick would do.
func LeastLoaded(b Balancer) []*Backend {
	l, ok := Unwrap(b).(*leastConn)
	if !ok {
		return nil
	}
	s := l.scan()
	if s.best < 0 {
		return nil
	}
	var ties []*Backend
	for i, b := range l.backends {
		if l.tied(i, s) {
			ties = append(ties, b)
		}
	}
	return ties
}

// load returns backend i's active connection count, clamped at zero in
// case a caller released more than it acquired.
func (l *leastConn) load(i int) uint64 {
	return uint64(max(l.backends[i].Active(), 0))
}
