package balancer

import (
	"net/netip"
	"slices"
)

// maglevSizes are the lookup table sizes M, smallest first. Maglev
// (Eisenbud et al., NSDI 2016, §3.4) needs M prime and much larger than the
// number of backends N; with M ≥ 100·N no backend's share of the table
// differs from another's by more than about a hundredth, the paper's
// bound. A table takes the smallest size that holds N that way, so its
// memory follows the backends rather than a fixed size per service port.
// The sizes grow fourfold because a client keeps its backend only
// while M stays the same: a step to the next size remaps clients as a new
// table would, so steps are few. Past 6553 backends the largest table
// still works, with coarser balance.
var maglevSizes = []uint64{2053, 8209, 32771, 65537, 655373}

// maglevSize returns the table size for n backends.
func maglevSize(n int) uint64 {
	for _, m := range maglevSizes {
		if uint64(n)*100 <= m {
			return m
		}
	}
	return maglevSizes[len(maglevSizes)-1]
}

// MaglevTable is a Maglev lookup table for a list of backend addresses. It
// depends only on the backends' IP addresses, not on their ports, so the
// service ports of a Service whose endpoints are the same pods share one
// table, and a client reaches the same pod through each of them. A table
// is immutable and safe for concurrent use.
type MaglevTable struct {
	addrs []netip.Addr // the backends' addresses, sorted: what the table is for
	t16   []uint16     // indices into the sorted backends, when they fit 16 bits
	t32   []uint32     // otherwise
}

// MaglevTableBytes returns the memory a table for n backends holds, so
// that a caller can tell whether one fits before building it.
func MaglevTableBytes(n int) int64 {
	size := int64(maglevSize(n))
	if n <= 1<<16 {
		return size * 2
	}
	return size * 4
}

// NewMaglevTable builds the table for the addresses of backends.
func NewMaglevTable(backends []*Backend) *MaglevTable {
	t := &MaglevTable{addrs: MaglevAddrs(backends)}
	size := maglevSize(len(t.addrs))
	if len(t.addrs) <= 1<<16 {
		t.t16 = populate[uint16](t.addrs, size)
	} else {
		t.t32 = populate[uint32](t.addrs, size)
	}
	return t
}

// MaglevAddrs returns the sorted IP addresses of backends: the addresses
// a MaglevTable for them is built for.
func MaglevAddrs(backends []*Backend) []netip.Addr {
	addrs := make([]netip.Addr, len(backends))
	for i, b := range backends {
		addrs[i] = b.Addr.Addr()
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	return addrs
}

// MaglevKey returns a string that equals another's exactly when the two
// backend lists have the same IP addresses, and so can share a table.
func MaglevKey(backends []*Backend) string {
	addrs := MaglevAddrs(backends)
	b := make([]byte, 0, 16*len(addrs))
	for _, a := range addrs {
		s := a.As16()
		b = append(b, s[:]...)
	}
	return string(b)
}

// Len returns the number of entries (M).
func (t *MaglevTable) Len() int { return len(t.t16) + len(t.t32) }

// Bytes returns the memory the table's entries hold.
func (t *MaglevTable) Bytes() int64 { return int64(len(t.t16))*2 + int64(len(t.t32))*4 }

// fits reports whether t was built for the addresses of sorted, backends
// sorted by address.
func (t *MaglevTable) fits(sorted []*Backend) bool {
	return slices.EqualFunc(t.addrs, sorted, func(a netip.Addr, b *Backend) bool { return a == b.Addr.Addr() })
}

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

// sortBackends sorts backends by address: the population order breaks
// ties between backends, so sorting makes the table depend only on the
// set of addresses, and every proxy instance sends a given client to the
// same backend whatever order it learned the endpoints in.
func sortBackends(backends []*Backend) {
	slices.SortStableFunc(backends, func(a, b *Backend) int { return a.Addr.Compare(b.Addr) })
}

// newMaglev returns a Maglev balancer over backends, which it sorts, with
// a table of its own.
func newMaglev(backends []*Backend) Balancer {
	sortBackends(backends)
	return maglevWith(backends, NewMaglevTable(backends))
}

// maglevWith returns a Maglev balancer over sorted backends with table t,
// built for their addresses.
func maglevWith(sorted []*Backend, t *MaglevTable) Balancer {
	if t.t16 != nil {
		return &maglev[uint16]{backends: sorted, table: t.t16}
	}
	return &maglev[uint32]{backends: sorted, table: t.t32}
}

// NewSourceHash returns a source-hash balancer over a private copy of
// backends, which must not be empty or contain nil. With a table (built by
// NewMaglevTable for the same addresses, possibly for another service
// port) it is Maglev, as New(SourceHash) is, without building a table of
// its own. A nil table means rendezvous hashing instead: no table at all,
// the same client-to-backend mapping on every node that uses it, and as
// little disruption when a backend comes or goes, for a cost per new
// connection that grows with the backends. A table built for other
// addresses is not used: the balancer builds its own, so a caller's
// mistake costs memory, never a wrong pick.
func NewSourceHash(backends []*Backend, table *MaglevTable) Balancer {
	bs := slices.Clone(backends)
	sortBackends(bs)
	if table == nil {
		return newRendezvous(bs)
	}
	if !table.fits(bs) {
		table = NewMaglevTable(bs)
	}
	return maglevWith(bs, table)
}

// SourceHashMethod names the hashing a source-hash balancer uses:
// "Maglev" or "rendezvous"; "" for any other balancer.
func SourceHashMethod(b Balancer) string {
	switch b.(type) {
	case *maglev[uint16], *maglev[uint32]:
		return "Maglev"
	case *rendezvous:
		return "rendezvous"
	}
	return ""
}

// populate fills a lookup table of the given prime size as in the paper's
// Pseudocode 1: each backend has a permutation of the table's slots, and
// the backends take turns claiming the next slot of their permutation that
// is still free until every slot is taken. Because every backend claims
// slots at the same rate, each ends up with size/N of them, give or take
// one, while a backend's permutation never changes, so adding or removing
// a backend disturbs few other slots (§3.4).
func populate[T uint16 | uint32](backends []netip.Addr, size uint64) []T {
	// §3.4: offset ← h1(name) mod M, skip ← h2(name) mod (M−1) + 1, and
	// permutation[j] = (offset + j·skip) mod M. Since M is prime, every
	// skip is coprime with it and the permutation visits every slot.
	pos := make([]uint64, len(backends))
	skip := make([]uint64, len(backends))
	for i, a := range backends {
		h := hashAddr(a)
		pos[i] = h % size
		skip[i] = mix64(h^skipSeed)%(size-1) + 1
	}
	table := make([]T, size)
	taken := make([]bool, size)
	for filled := uint64(0); ; {
		for i := range backends {
			for taken[pos[i]] {
				// pos and skip are below size: a subtraction reduces the
				// sum, without a division per step.
				if pos[i] += skip[i]; pos[i] >= size {
					pos[i] -= size
				}
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

// skipSeed makes a backend's skip, Maglev's h2, a hash independent of its
// offset h1 = hashAddr: the golden ratio's bits, as SplitMix64 steps by.
const skipSeed = 0x9e3779b97f4a7c15

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
