package balancer

import (
	"math/bits"
	"net/netip"
	"sync/atomic"
)

// MaxLeastConnScan is the count of backends up to which a least-conn
// balancer scans them all for the least loaded. Scanning a few costs about
// what two random draws do and gives nginx's least_conn pick exactly; past
// it, a scan on every new connection would grow with the Service, on the
// event loops, so the balancer takes the less loaded of two backends drawn
// at random instead (Mitzenmacher, "The Power of Two Choices in Randomized
// Load Balancing", 2001), as Envoy's least-request and nginx's "random two
// least_conn" do: that keeps the spread of load within a few connections
// of the scan's, whatever the count of backends.
const MaxLeastConnScan = 16

// sampleTries bounds the random draws of one pick that land on ejected
// backends before it walks the list for one that is not: two choices need
// two draws while few backends are ejected, and a walk is left for when
// most of them are.
const sampleTries = 8

// leastConn picks the backend with the fewest active connections per unit
// of weight: exactly among at most MaxLeastConnScan backends, and the less
// loaded of two random ones among more. The unweighted kind gives every
// backend weight 1.
type leastConn struct {
	backends []*Backend
	weights  []uint64
	// next takes turns among tied backends (a scan), or is the state of
	// the random draws (SplitMix64, so a pick does not lock or allocate).
	next atomic.Uint64
	// alias draws backends in proportion to their weights; nil when they
	// are drawn uniformly (equal weights) or scanned.
	alias *aliasTable
}

var _ Balancer = (*leastConn)(nil)

func newLeastConn(backends []*Backend, weighted bool) *leastConn {
	var weights []uint64
	equal := true
	if weighted {
		// Reduced weights are at most maxSchedule, so that comparing loads
		// by cross multiplication cannot overflow before a backend has
		// 2^47 connections.
		weights = reduceWeights(backends)
		for _, w := range weights {
			equal = equal && w == 1
		}
	} else {
		weights = make([]uint64, len(backends))
		for i := range weights {
			weights[i] = 1
		}
	}
	l := &leastConn{backends: backends, weights: weights}
	if len(backends) > MaxLeastConnScan && !equal {
		l.alias = newAliasTable(weights)
	}
	return l
}

// Pick returns a least-loaded backend (see leastConn), preferring those
// not ejected.
func (l *leastConn) Pick(netip.Addr) *Backend {
	b, _ := l.pick()
	return b
}

// pick is Pick, also returning how many backends it looked at, each
// counted once.
func (l *leastConn) pick() (*Backend, int) {
	if len(l.backends) <= MaxLeastConnScan {
		return l.pickScan(), len(l.backends)
	}
	return l.pickSampled()
}

// pickScan returns a backend with the lowest Active()/weight among the
// non-ejected backends, or among all of them if every one is ejected.
//
// Ties take turns in proportion to weight, as in nginx's least_conn ("if
// there are several such servers, they are tried in turn using a weighted
// round-robin balancing method"). This needs a second pass over the ties,
// but simply rotating where the scan starts would not do: the backend after
// a busy one would win the busy one's turns too. And idle backends, all at
// zero, are common with short connections; without weighted turns a
// weighted-least-conn balancer would then ignore the weights.
func (l *leastConn) pickScan() *Backend {
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

// LeastLoaded returns the backends with the lowest Active()/weight of b, a
// least-conn or weighted-least-conn balancer (possibly wrapped for
// affinity), skipping ejected ones as Pick does: those among which Pick
// picks next unless PowerOfTwoChoices(b). It takes no turn. Nil when b is
// another kind of balancer. Explanations use it to say what Pick would do.
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

// PowerOfTwoChoices reports whether b, a least-conn or weighted-least-conn
// balancer (possibly wrapped for affinity), picks the less loaded of two
// backends drawn at random rather than the least loaded of all: whether it
// has more than MaxLeastConnScan backends. False for any other balancer.
func PowerOfTwoChoices(b Balancer) bool {
	l, ok := Unwrap(b).(*leastConn)
	return ok && len(l.backends) > MaxLeastConnScan
}

// load returns backend i's active connection count, clamped at zero in
// case a caller released more than it acquired.
func (l *leastConn) load(i int) uint64 {
	return uint64(max(l.backends[i].Active(), 0))
}

// pickSampled returns the less loaded per unit of weight of two backends
// drawn at random, in proportion to their weights, among those not
// ejected; the first drawn on ties, so that idle backends, which tie,
// share the connections by weight. It looks at two backends while few are
// ejected. When sampleTries draws found fewer than two that are not, it
// takes the one it found, or else walks the list from a random place for
// one; and only when every backend is ejected does it choose among all.
func (l *leastConn) pickSampled() (*Backend, int) {
	a, b, looked := -1, -1, 0
	for range sampleTries {
		i := l.draw()
		looked++
		if i == a || l.backends[i].Ejected() {
			continue
		}
		if a < 0 {
			a = i
			continue
		}
		b = i
		break
	}
	switch {
	case b >= 0:
		return l.backends[l.lighter(a, b)], looked
	case a >= 0:
		return l.backends[a], looked
	}
	n := len(l.backends)
	start := l.draw()
	for k := range n {
		i := start + k
		if i >= n {
			i -= n
		}
		looked++
		if !l.backends[i].Ejected() {
			return l.backends[i], looked
		}
	}
	return l.backends[l.lighter(l.draw(), l.draw())], looked + 2
}

// lighter returns whichever of backends a and b has the lower
// Active()/weight, a on ties.
func (l *leastConn) lighter(a, b int) int {
	if l.load(b)*l.weights[a] < l.load(a)*l.weights[b] {
		return b
	}
	return a
}

// draw returns a backend's index at random, in proportion to weight.
func (l *leastConn) draw() int {
	// SplitMix64 (see mix64): its state steps by the golden ratio's bits.
	x := mix64(l.next.Add(skipSeed))
	if l.alias != nil {
		return l.alias.draw(x)
	}
	i, _ := bits.Mul64(x, uint64(len(l.backends)))
	return int(i)
}

// aliasTable draws indices in proportion to integer weights in constant
// time: Walker's alias method, built as by Vose ("A linear algorithm for
// generating random numbers with a given distribution", 1991), in integers
// so that the proportions are exact. Column i of n, each of height total,
// is i's up to cut[i] and alias[i]'s above.
type aliasTable struct {
	total uint64
	cut   []uint64
	alias []uint32
}

// newAliasTable returns the table for weights, each at least 1.
func newAliasTable(weights []uint64) *aliasTable {
	n := uint64(len(weights))
	t := &aliasTable{cut: make([]uint64, n), alias: make([]uint32, n)}
	for _, w := range weights {
		t.total += w
	}
	// Each weight's share of the n columns, in units of which a column
	// holds total: heights sum to n·total.
	height := make([]uint64, n)
	var small, large []uint32
	for i, w := range weights {
		height[i] = w * n
		if height[i] < t.total {
			small = append(small, uint32(i))
		} else {
			large = append(large, uint32(i))
		}
	}
	for len(small) > 0 && len(large) > 0 {
		s, g := small[len(small)-1], large[len(large)-1]
		small = small[:len(small)-1]
		t.cut[s], t.alias[s] = height[s], g
		height[g] -= t.total - height[s]
		if height[g] < t.total {
			large = large[:len(large)-1]
			small = append(small, g)
		}
	}
	// What remains fills its own column exactly: the heights' sum says so.
	for _, i := range append(small, large...) {
		t.cut[i], t.alias[i] = t.total, i
	}
	return t
}

// draw returns an index for the random x.
func (t *aliasTable) draw(x uint64) int {
	col, rest := bits.Mul64(x, uint64(len(t.cut)))
	if r, _ := bits.Mul64(rest, t.total); r >= t.cut[col] {
		return int(t.alias[col])
	}
	return int(col)
}
