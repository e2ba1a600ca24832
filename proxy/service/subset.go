package service

import (
	"cmp"
	"slices"
)

// SubsetEndpoints returns at most limit of eps, in their order, and how
// many it left out; eps itself when it has no more than limit, or when
// limit is zero or negative (no bound).
//
// It keeps the endpoints that traffic may use first: this node's ready
// ones, so that a Local policy keeps working, then the other ready ones,
// then the serving terminating ones that CategorizeEndpoints falls back
// to, this node's first. Within each of those it keeps the endpoints whose
// hash with seed ranks highest, as rendezvous hashing does: the subset is
// the same at every sync, an endpoint that comes or goes changes it by at
// most one, and nodes with different seeds keep different subsets, so
// that together they still reach every endpoint.
func SubsetEndpoints(eps []Endpoint, limit int, node, seed string) ([]Endpoint, int) {
	if limit <= 0 || len(eps) <= limit {
		return eps, 0
	}
	type rank struct {
		class int
		hash  uint64
		i     int
	}
	ranks := make([]rank, len(eps))
	seeded := fnv1a(fnvOffset, []byte(seed))
	for i, e := range eps {
		local := node != "" && e.NodeName == node
		class := 4 // never used: not ready, and not serving while terminating
		switch {
		case e.Ready && local:
			class = 0
		case e.Ready:
			class = 1
		case e.Serving && e.Terminating && local:
			class = 2
		case e.Serving && e.Terminating:
			class = 3
		}
		a := e.Addr.Addr().As16()
		h := fnv1a(seeded, a[:])
		h = fnv1a(h, []byte{byte(e.Addr.Port() >> 8), byte(e.Addr.Port())})
		ranks[i] = rank{class, fmix64(h), i}
	}
	slices.SortFunc(ranks, func(a, b rank) int {
		return cmp.Or(cmp.Compare(a.class, b.class), cmp.Compare(b.hash, a.hash), cmp.Compare(a.i, b.i))
	})
	keep := make([]bool, len(eps))
	for _, r := range ranks[:limit] {
		keep[r.i] = true
	}
	out := make([]Endpoint, 0, limit)
	for i, e := range eps {
		if keep[i] {
			out = append(out, e)
		}
	}
	return out, len(eps) - limit
}

// fnvOffset is FNV-1a's initial state.
const fnvOffset = 14695981039346656037

// fnv1a continues the 64-bit FNV-1a hash h over b (hash/fnv's, without
// an allocation per endpoint).
func fnv1a(h uint64, b []byte) uint64 {
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	return h
}

// fmix64 is MurmurHash3's finalizer. FNV-1a carries its last bytes into
// the high bits only through its multiplier's few set bits, and the ranks
// compare whole hashes: it spreads every byte over every bit.
func fmix64(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}
