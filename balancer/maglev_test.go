package balancer

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
)

// randomClients returns n random IPv4 client addresses, the same on every
// run.
func randomClients(n int) []netip.Addr {
	r := rand.New(rand.NewPCG(1, 2))
	cs := make([]netip.Addr, n)
	for i := range cs {
		cs[i] = netip.AddrFrom4([4]byte{byte(r.Uint32()), byte(r.Uint32()), byte(r.Uint32()), byte(r.Uint32())})
	}
	return cs
}

// assign returns each client's backend under bal.
func assign(bal Balancer, clients []netip.Addr) []*Backend {
	bs := make([]*Backend, len(clients))
	for i, c := range clients {
		bs[i] = bal.Pick(c)
	}
	return bs
}

func TestMaglevSizesArePrime(t *testing.T) {
	for _, m := range maglevSizes {
		for d := uint64(2); d*d <= m; d++ {
			if m%d == 0 {
				t.Errorf("table size %d is divisible by %d", m, d)
				break
			}
		}
	}
}

// TestMaglevTableSize checks that a table's size follows the number of
// backends N, the smallest of maglevSizes with M ≥ 100·N, and that
// MaglevTableBytes tells its memory before it is built.
func TestMaglevTableSize(t *testing.T) {
	tests := []struct {
		backends int
		want     int
	}{
		{1, 2053},
		{10, 2053},
		{20, 2053},
		{21, 8209},
		{82, 8209},
		{83, 32771},
		{327, 32771},
		{328, 65537},
		{655, 65537},
		{656, 655373},
	}
	for _, tt := range tests {
		bs := nBackends(tt.backends)
		m := New(SourceHash, bs).(*maglev[uint16])
		if got := len(m.table); got != tt.want {
			t.Errorf("%d backends: table size %d, want %d", tt.backends, got, tt.want)
		}
		table := NewMaglevTable(bs)
		if got, want := table.Bytes(), MaglevTableBytes(tt.backends); got != want || table.Len() != tt.want {
			t.Errorf("%d backends: table of %d entries holds %d bytes; MaglevTableBytes says %d", tt.backends, table.Len(), got, want)
		}
	}
}

// TestMaglevTableShared checks that backend lists with the same IP
// addresses, whatever their ports and order, share one table, and that a
// balancer over the shared table picks as one with a table of its own.
func TestMaglevTableShared(t *testing.T) {
	http := nBackends(10)
	var metrics, fewer []*Backend
	for i := len(http) - 1; i >= 0; i-- { // another order, another port
		metrics = append(metrics, NewBackend(netip.AddrPortFrom(http[i].Addr.Addr(), 9090), 0))
	}
	fewer = http[1:]
	if MaglevKey(http) != MaglevKey(metrics) {
		t.Error("backends at the same addresses on another port have another key")
	}
	if MaglevKey(http) == MaglevKey(fewer) {
		t.Error("9 of the 10 backends have the key of all 10")
	}
	table := NewMaglevTable(http)
	a, b := NewSourceHash(http, table), NewSourceHash(metrics, table)
	own := New(SourceHash, http)
	if got := a.(*maglev[uint16]).table; &got[0] != &table.t16[0] {
		t.Error("NewSourceHash built a table of its own instead of using the shared one")
	}
	for _, c := range randomClients(10_000) {
		x, y, z := a.Pick(c), b.Pick(c), own.Pick(c)
		if x.Addr.Addr() != y.Addr.Addr() || x.Addr != z.Addr || y.Addr.Port() != 9090 {
			t.Fatalf("client %v: %v with the shared table, %v on the other port, %v with a table of its own", c, x, y, z)
		}
	}
	// A table for other addresses is not used.
	c := NewSourceHash(fewer, table)
	for _, cl := range randomClients(1000) {
		if got := c.Pick(cl); got == http[0] {
			t.Fatalf("client %v sent to %v, which is not among the balancer's backends", cl, got)
		}
	}
	if SourceHashMethod(a) != "Maglev" || SourceHashMethod(NewSourceHash(http, nil)) != "rendezvous" || SourceHashMethod(own) != "Maglev" {
		t.Error("SourceHashMethod does not name the hashing")
	}
}

// TestMaglevTableShares checks the paper's balance guarantee: every backend
// owns ⌊M/N⌋ or ⌈M/N⌉ slots.
func TestMaglevTableShares(t *testing.T) {
	for _, n := range []int{1, 3, 10, 100} {
		m := New(SourceHash, nBackends(n)).(*maglev[uint16])
		slots := make([]int, n)
		for _, i := range m.table {
			slots[i]++
		}
		lo, hi := len(m.table)/n, (len(m.table)+n-1)/n
		if min, max := slices.Min(slots), slices.Max(slots); min < lo || max > hi {
			t.Errorf("%d backends: slots per backend range over [%d, %d], want within [%d, %d]", n, min, max, lo, hi)
		}
	}
}

func TestMaglevDistribution(t *testing.T) {
	const n, keys = 10, 100_000
	bs := nBackends(n)
	bal := New(SourceHash, bs)
	idx := index(bs)
	got := make([]int, n)
	for _, b := range assign(bal, randomClients(keys)) {
		got[idx[b]]++
	}
	for i, c := range got {
		if c < keys/n*85/100 || c > keys/n*115/100 {
			t.Errorf("backend %d got %d of %d keys, want within 15%% of %d (all: %v)", i, c, keys, keys/n, got)
		}
	}
}

func TestMaglevDeterministic(t *testing.T) {
	bs := nBackends(10)
	// The same addresses as new Backend values in another order, as
	// another proxy instance would see them.
	other := make([]*Backend, len(bs))
	for i, b := range bs {
		other[len(bs)-1-i] = NewBackend(b.Addr, b.Weight)
	}
	a, b := New(SourceHash, bs), New(SourceHash, other)
	for i, c := range randomClients(10_000) {
		if x, y := a.Pick(c), b.Pick(c); x.Addr != y.Addr {
			t.Fatalf("client %d (%v): %v in one balancer, %v in the other", i, c, x, y)
		}
	}
	// Pinned values guard against the mapping changing between releases,
	// which would move every client of every proxy on upgrade. (They moved
	// once, when tables came to be sized by their backends.)
	for _, tt := range []struct {
		client string
		want   string
	}{
		{"192.168.1.1", "10.0.0.5:80"},
		{"::ffff:192.168.1.1", "10.0.0.5:80"}, // IPv4-mapped hashes as IPv4
		{"10.1.2.3", "10.0.0.6:80"},
		{"172.16.0.9", "10.0.0.9:80"},
		{"2001:db8::1", "10.0.0.10:80"},
		{"fd00::42", "10.0.0.3:80"},
	} {
		if got := a.Pick(netip.MustParseAddr(tt.client)).Addr.String(); got != tt.want {
			t.Errorf("Pick(%s) = %s, want %s", tt.client, got, tt.want)
		}
	}
}

// moved compares two assignments: it returns the fraction of keys whose
// backend changed, and the fraction that moved between two backends of
// common, the backends in both lists, which consistent hashing should
// rarely do.
func moved(before, after []*Backend, common []*Backend) (all, extra float64) {
	in := index(common)
	var n, x int
	for i := range before {
		if before[i] == after[i] {
			continue
		}
		n++
		_, from := in[before[i]]
		_, to := in[after[i]]
		if from && to {
			x++
		}
	}
	return float64(n) / float64(len(before)), float64(x) / float64(len(before))
}

func TestMaglevConsistency(t *testing.T) {
	clients := randomClients(100_000)
	bs := nBackends(11)
	ten := bs[:10]
	before := assign(New(SourceHash, ten), clients)

	removed := slices.Delete(slices.Clone(ten), 3, 4)
	all, extra := moved(before, assign(New(SourceHash, removed), clients), removed)
	if all < 0.08 || all > 0.13 {
		t.Errorf("removing 1 of 10 backends moved %.4f of keys, want 0.08 to 0.13", all)
	}
	if extra > 0.02 {
		t.Errorf("removing 1 of 10 backends moved %.4f of keys between surviving backends, want at most 0.02", extra)
	}

	all, extra = moved(before, assign(New(SourceHash, bs), clients), ten)
	if all < 0.07 || all > 0.12 {
		t.Errorf("adding an 11th backend moved %.4f of keys, want about 1/11", all)
	}
	if extra > 0.02 {
		t.Errorf("adding an 11th backend moved %.4f of keys between old backends, want at most 0.02", extra)
	}
}

// TestMaglevEjection checks that an ejected backend's clients fall back to
// a stable choice among the others while every other client stays put, and
// return when it is readmitted.
func TestMaglevEjection(t *testing.T) {
	clients := randomClients(10_000)
	bs := nBackends(5)
	bal := New(SourceHash, bs)
	before := assign(bal, clients)
	bs[2].SetEjected(true)
	during := assign(bal, clients)
	idx := index(bs)
	got := make([]int, len(bs))
	for i := range clients {
		switch {
		case during[i] == bs[2]:
			t.Fatalf("client %v sent to ejected backend", clients[i])
		case before[i] != bs[2] && during[i] != before[i]:
			t.Fatalf("client %v moved from healthy %v to %v", clients[i], before[i], during[i])
		case before[i] == bs[2]:
			got[idx[during[i]]]++
		}
	}
	for i, c := range got {
		if i != 2 && c == 0 {
			t.Errorf("the ejected backend's clients went to %v; none to backend %d", got, i)
		}
	}
	if again := assign(bal, clients); !slices.Equal(again, during) {
		t.Error("fallback choices changed between calls")
	}
	bs[2].SetEjected(false)
	if after := assign(bal, clients); !slices.Equal(after, before) {
		t.Error("clients did not return after readmission")
	}
}
