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
	skipEjected := anyHealthy(l.backends)
	best := -1
	var bestLoad, tieWeight uint64
	for i, b := range l.backends {
		if skipEjected && b.Ejected() {
			continue
		}
		// load/w < bestLoad/bestW, without division, as nginx's
		// ngx_http_upstream_get_least_conn_peer compares them.
		load, w := l.load(i), l.weights[i]
		switch {
		case best < 0 || load*l.weights[best] < bestLoad*w:
			best, bestLoad, tieWeight = i, load, w
		case load*l.weights[best] == bestLoad*w:
			tieWeight += w
		}
	}
	if best < 0 {
		return l.backends[0] // every backend was ejected during the scan
	}
	if tieWeight == l.weights[best] {
		return l.backends[best]
	}
	r := (l.next.Add(1) - 1) % tieWeight
	for i, b := range l.backends {
		w := l.weights[i]
		if skipEjected && b.Ejected() || l.load(i)*l.weights[best] != bestLoad*w {
			continue
		}
		if r < w {
			return b
		}
		r -= w
	}
	return l.backends[best] // loads changed since the first pass
}

// load returns backend i's active connection count, clamped at zero in
// case a caller released more than it acquired.
func (l *leastConn) load(i int) uint64 {
	return uint64(max(l.backends[i].Active(), 0))
}
