package balancer

import (
	"net/netip"
	"slices"
)

// maglevSizes are the lookup table sizes M, smallest first. Maglev
// (Eisenbud et al., NSDI 2016, §3.4) needs M prime and much larger than the
// number of backends N; with M > 100·N no backend's share of the table
// differs from another's by more than about a hundredth, the paper's
// bound. These are the two sizes the paper evaluates (§5.3). Beyond 6553
// backends the larger table still works, with coarser balance.
var maglevSizes = []uint64{65537, 655373}

// maglev is Maglev consistent hashing on the client address. It ignores
// backend weights: the paper's plain algorithm gives every backend an equal
// share of the table. T is the narrowest index type that fits the backends.
type maglev[T uint16 | uint32] struct {
	backends []*Backend // sorted by address
	table    []T        // indices into backends
}

var (
	_ Balancer = (*maglev[uint16])(nil)
	_ Balancer = (*maglev[uint32])(nil)
)

// newMaglev returns a Maglev balancer over backends, which it sorts by
// address: the population order breaks ties between backends, so sorting
// makes the table depend only on the set of addresses, and every proxy
// instance sends a given client to the same backend whatever order it
// learned the endpoints in.
func newMaglev(backends []*Backend) Balancer {
	slices.SortStableFunc(backends, func(a, b *Backend) int { return a.Addr.Compare(b.Addr) })
	size := maglevSizes[len(maglevSizes)-1]
	for _, m := range maglevSizes {
		if uint64(len(backends))*100 <= m {
			size = m
			break
		}
	}
	if len(backends) <= 1<<16 {
		return &maglev[uint16]{backends: backends, table: populate[uint16](backends, size)}
	}
	return &maglev[uint32]{backends: backends, table: populate[uint32](backends, size)}
}

// populate fills a lookup table of the given prime size as in the paper's
// Pseudocode 1: each backend has a permutation of the table's slots, and
// the backends take turns claiming the next slot of their permutation that
// is still free until every slot is taken. Because every backend claims
// slots at the same rate, each ends up with size/N of them, give or take
// one, while a backend's permutation never changes, so adding or removing
// a backend disturbs few other slots (§3.4).
func populate[T uint16 | uint32](backends []*Backend, size uint64) []T {
	// §3.4: offset ← h1(name) mod M, skip ← h2(name) mod (M−1) + 1, and
	// permutation[j] = (offset + j·skip) mod M. Since M is prime, every
	// skip is coprime with it and the permutation visits every slot.
	pos := make([]uint64, len(backends))
	skip := make([]uint64, len(backends))
	for i, b := range backends {
		h := fnv1a([]byte(b.Addr.String()))
		pos[i] = h % size
		skip[i] = mix64(h)%(size-1) + 1
	}
	table := make([]T, size)
	taken := make([]bool, size)
	for filled := uint64(0); ; {
		for i := range backends {
			for taken[pos[i]] {
				pos[i] = (pos[i] + skip[i]) % size
			}
			table[pos[i]] = T(i)
			taken[pos[i]] = true
			if filled++; filled == size {
				return table
			}
		}
	}
}

// Pick returns the backend in the client's slot of the table. If that
// backend is ejected, it walks forward from the slot to the first backend
// that is not, so the client's fallback is stable too and the ejected
// backend's clients spread over the others in proportion to their slots.
func (m *maglev[T]) Pick(client netip.Addr) *Backend {
	size := uint64(len(m.table))
	i := hashAddr(client) % size
	b := m.backends[m.table[i]]
	if !b.Ejected() || !anyHealthy(m.backends) {
		return b
	}
	for range size - 1 {
		if i++; i == size {
			i = 0
		}
		if c := m.backends[m.table[i]]; !c.Ejected() {
			return c
		}
	}
	return b // every backend was ejected during the walk
}

// hashAddr returns a stable hash of a client address, the same in every
// process and on every node (unlike hash/maphash, which is seeded at
// random), so that all proxies map a client to the same backend. IPv4 and
// IPv4-mapped IPv6 addresses hash alike.
func hashAddr(a netip.Addr) uint64 {
	b := a.As16()
	return mix64(fnv1a(b[:]))
}

// fnv1a returns the 64-bit FNV-1a hash of b. It is hash/fnv's New64a
// inlined, so that hashing a client address does not allocate.
func fnv1a(b []byte) uint64 {
	h := uint64(14695981039346656037)
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	return h
}

// mix64 is the SplitMix64 finalizer (Steele, Lea and Flood, OOPSLA 2014), a
// bijection in which every input bit affects every output bit. It serves as
// Maglev's second hash h2, and evens out FNV's weak avalanche on the short,
// mostly constant 16-byte client keys before they are reduced modulo M.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
