package balancer

import (
	"math"
	"net/netip"
	"sync/atomic"
)

// roundRobin hands out backends in turn.
type roundRobin struct {
	backends []*Backend
	next     atomic.Uint64
	spill    atomic.Uint64
}

var _ Balancer = (*roundRobin)(nil)

// Pick returns the next backend in turn, or, if that one is ejected, the
// next in a rotation over the non-ejected ones.
func (r *roundRobin) Pick(netip.Addr) *Backend {
	n := r.next.Add(1) - 1
	b := r.backends[n%uint64(len(r.backends))]
	if b.Ejected() {
		return spill(r.backends, nil, &r.spill, b)
	}
	return b
}

// maxSchedule bounds the length of a weighted round-robin schedule, and so
// its memory (4 bytes an entry) and the time to build it. Larger weight
// sums are scaled down to fit, give or take one entry per backend since
// every backend keeps at least one.
const maxSchedule = 1 << 16

// weightedRoundRobin replays a precomputed smooth weighted round-robin
// schedule.
type weightedRoundRobin struct {
	backends []*Backend
	weights  []uint64 // reduced weights, summing to the cycle's length
	schedule []uint32 // indices into backends; nil when every weight is 1
	next     atomic.Uint64
	spill    atomic.Uint64
}

var _ Balancer = (*weightedRoundRobin)(nil)

func newWeightedRoundRobin(backends []*Backend) *weightedRoundRobin {
	weights := reduceWeights(backends)
	schedule, _ := smoothSchedule(weights)
	return &weightedRoundRobin{backends: backends, weights: weights, schedule: schedule}
}

// smoothSchedule returns one cycle of smooth weighted round-robin over
// weights, each at least 1, as in nginx's ngx_http_upstream_get_peer
// (src/http/ngx_http_upstream_round_robin.c): every step adds each weight
// to its backend's current value, picks the largest (the first on ties)
// and subtracts the total from it. Over a cycle of total steps each
// backend is picked exactly weight times, and the picks are interleaved:
// weights 5,1,1 give a a b a c a a, where plain weighted round-robin sends
// a burst of five a's. With every weight 1 the cycle is the backends in
// order, and smoothSchedule returns nil for it.
//
// Step by step, that is a scan of every backend per pick. Instead, a
// kinetic tournament (Basch, Guibas and Hershberger, "Data structures for
// mobile data", 1999) keeps the largest current value: between two picks
// of a backend its value grows linearly, so each node of a tree over the
// backends keeps the larger of its children's and the step at which the
// other overtakes it, and a step revisits only the nodes whose winner
// changed and the picked backend's path to the root. The picks are the
// scan's exactly. work counts the nodes evaluated, for tests.
func smoothSchedule(weights []uint64) (schedule []uint32, work int) {
	n := len(weights)
	var total uint64
	equal := true
	for _, w := range weights {
		total += w
		equal = equal && w == 1
	}
	if equal {
		return nil, 0
	}
	// After a backend's k-th pick, its current value at step s (after the
	// step's addition) is s·w - k·total: the additions of s steps less
	// the total once per pick. The values stay below total², which fits
	// an int64 for any count of backends that fits in memory, since
	// reduceWeights bounds total by maxSchedule plus the backends.
	t := tournament{w: weights, total: int64(total), picks: make([]int64, n), win: make([]int32, 2*n), exp: make([]int64, 2*n)}
	for i := range n {
		t.win[n+i] = int32(i)
		t.exp[n+i] = math.MaxInt64 // a leaf's value changes only when it is picked
	}
	for p := n - 1; p >= 1; p-- {
		t.eval(p, 1)
	}
	schedule = make([]uint32, total)
	for s := range int64(total) {
		step := s + 1
		t.refresh(1, step)
		best := int(t.win[1])
		schedule[s] = uint32(best)
		t.picks[best]++
		for p := (n + best) / 2; p >= 1; p /= 2 {
			t.eval(p, step)
		}
	}
	return schedule, t.work
}

// tournament is smoothSchedule's tree: node 1 is the root, node p has
// children 2p and 2p+1, and nodes n to 2n-1 are the backends' leaves.
// Ties go to the lower index explicitly, so the leaves' order in the tree
// does not matter.
type tournament struct {
	w     []uint64
	total int64
	picks []int64 // each backend's picks so far
	win   []int32 // each node's backend with the largest value
	// exp is the first step at which some node of p's subtree, p included,
	// may have another winner: the earliest step at which a loser
	// overtakes a winner, as far as the picks so far go.
	exp  []int64
	work int
}

// value returns backend i's current value at step s.
func (t *tournament) value(i int32, s int64) int64 {
	return s*int64(t.w[i]) - t.picks[i]*t.total
}

// beats reports whether backend a is picked over b at step s.
func (t *tournament) beats(a, b int32, s int64) bool {
	va, vb := t.value(a, s), t.value(b, s)
	return va > vb || va == vb && a < b
}

// eval sets node p's winner at step s from its children's, and when that
// may change.
func (t *tournament) eval(p int, s int64) {
	t.work++
	a, b := t.win[2*p], t.win[2*p+1]
	if !t.beats(a, b, s) {
		a, b = b, a
	}
	t.win[p] = a
	t.exp[p] = min(t.overtakes(a, b, s), t.exp[2*p], t.exp[2*p+1])
}

// overtakes returns the first step after s at which b beats a, which
// beats it at s, if neither is picked meanwhile; math.MaxInt64 if never.
func (t *tournament) overtakes(a, b int32, s int64) int64 {
	wa, wb := int64(t.w[a]), int64(t.w[b])
	if wb <= wa {
		return math.MaxInt64 // a's lead holds or grows
	}
	// b beats a at step x once x·(wb-wa) > c, or equals it with b first
	// on ties. a beats b at s ≥ 1, so c > 0.
	dw, c := wb-wa, (t.picks[b]-t.picks[a])*t.total
	x := c/dw + 1
	if b < a && c%dw == 0 {
		x = c / dw
	}
	return max(x, s+1)
}

// refresh brings the winners of node p's subtree up to step s, evaluating
// only the nodes whose winner may have changed.
func (t *tournament) refresh(p int, s int64) {
	if t.exp[p] > s {
		return
	}
	// A leaf never expires, so p is an inner node.
	t.refresh(2*p, s)
	t.refresh(2*p+1, s)
	t.eval(p, s)
}

// reduceWeights returns the backends' effective weights divided by their
// greatest common divisor, scaled down (keeping each at least 1) if their
// sum would exceed maxSchedule.
func reduceWeights(backends []*Backend) []uint64 {
	weights := make([]uint64, len(backends))
	var sum uint64
	big := false
	for i, b := range backends {
		weights[i] = uint64(b.weight())
		sum += weights[i] // may wrap; then big is set too
		big = big || weights[i] > maxSchedule || sum > maxSchedule
	}
	if big {
		// Floats are fine here: this runs once per rebuild, and the
		// result only needs to be proportional, not exact.
		var fsum float64
		for _, w := range weights {
			fsum += float64(w)
		}
		for i, w := range weights {
			weights[i] = max(1, uint64(float64(w)*maxSchedule/fsum))
		}
	}
	g := weights[0]
	for _, w := range weights[1:] {
		g = gcd(g, w)
	}
	for i := range weights {
		weights[i] /= g
	}
	return weights
}

// gcd returns the greatest common divisor of a and b.
func gcd(a, b uint64) uint64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// Pick returns the next backend in the schedule, or, if that one is
// ejected, the next in a weighted rotation over the non-ejected ones.
func (w *weightedRoundRobin) Pick(netip.Addr) *Backend {
	n := w.next.Add(1) - 1
	var b *Backend
	if w.schedule == nil {
		b = w.backends[n%uint64(len(w.backends))]
	} else {
		b = w.backends[w.schedule[n%uint64(len(w.schedule))]]
	}
	if b.Ejected() {
		return spill(w.backends, w.weights, &w.spill, b)
	}
	return b
}
