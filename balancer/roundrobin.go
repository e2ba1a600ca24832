package balancer

import (
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
// its memory (4 bytes an entry) and its O(length × backends) construction.
// Larger weight sums are scaled down to fit, give or take one entry per
// backend since every backend keeps at least one.
const maxSchedule = 1 << 16

// weightedRoundRobin replays a precomputed smooth weighted round-robin
// schedule.
type weightedRoundRobin struct {
	backends []*Backend
	weights  []uint64 // reduced weights, summing to len(schedule)
	schedule []uint32 // indices into backends
	next     atomic.Uint64
	spill    atomic.Uint64
}

var _ Balancer = (*weightedRoundRobin)(nil)

func newWeightedRoundRobin(backends []*Backend) *weightedRoundRobin {
	weights := reduceWeights(backends)
	var total uint64
	for _, w := range weights {
		total += w
	}
	// Smooth weighted round-robin, as in nginx's ngx_http_upstream_get_peer
	// (src/http/ngx_http_upstream_round_robin.c): every step adds each
	// weight to its backend's current value, picks the largest (the first
	// on ties) and subtracts the total from it. Over a cycle of total steps
	// each backend is picked exactly weight times, and the picks are
	// interleaved: weights 5,1,1 give a a b a c a a, where plain weighted
	// round-robin sends a burst of five a's.
	current := make([]int64, len(backends))
	schedule := make([]uint32, total)
	for s := range schedule {
		best := 0
		for i, w := range weights {
			current[i] += int64(w)
			if current[i] > current[best] {
				best = i
			}
		}
		current[best] -= int64(total)
		schedule[s] = uint32(best)
	}
	return &weightedRoundRobin{backends: backends, weights: weights, schedule: schedule}
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
	b := w.backends[w.schedule[n%uint64(len(w.schedule))]]
	if b.Ejected() {
		return spill(w.backends, w.weights, &w.spill, b)
	}
	return b
}
