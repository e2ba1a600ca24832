package balancer

import (
	"slices"
	"testing"
)

// TestRendezvous checks the table-free source hash that NewSourceHash
// falls back to: the same picks whatever order the backends come in, an
// even spread, and on a backend's removal only its own clients move.
func TestRendezvous(t *testing.T) {
	const n, keys = 10, 100_000
	bs := nBackends(n)
	clients := randomClients(keys)
	reversed := slices.Clone(bs)
	slices.Reverse(reversed)
	bal, other := NewSourceHash(bs, nil), NewSourceHash(reversed, nil)
	before := assign(bal, clients)
	if !slices.Equal(before, assign(other, clients)) {
		t.Error("the picks depend on the order of the backends")
	}
	idx := index(bs)
	got := make([]int, n)
	for _, b := range before {
		got[idx[b]]++
	}
	for i, c := range got {
		if c < keys/n*85/100 || c > keys/n*115/100 {
			t.Errorf("backend %d got %d of %d keys, want within 15%% of %d (all: %v)", i, c, keys, keys/n, got)
		}
	}
	removed := slices.Delete(slices.Clone(bs), 3, 4)
	all, extra := moved(before, assign(NewSourceHash(removed, nil), clients), removed)
	if all < 0.08 || all > 0.12 || extra != 0 {
		t.Errorf("removing 1 of 10 backends moved %.4f of keys, %.4f between the others; want about 0.1 and none", all, extra)
	}
}

// TestRendezvousEjection checks that an ejected backend's clients move to
// a stable second choice, the others stay, and they return on readmission.
func TestRendezvousEjection(t *testing.T) {
	clients := randomClients(10_000)
	bs := nBackends(5)
	bal := NewSourceHash(bs, nil)
	before := assign(bal, clients)
	bs[2].SetEjected(true)
	during := assign(bal, clients)
	for i := range clients {
		if during[i] == bs[2] || (before[i] != bs[2] && during[i] != before[i]) {
			t.Fatalf("client %v: %v before, %v with %v ejected", clients[i], before[i], during[i], bs[2])
		}
	}
	for _, b := range bs {
		b.SetEjected(true)
	}
	if !slices.Equal(assign(bal, clients), before) {
		t.Error("with every backend ejected, the picks are not the first choices")
	}
	for _, b := range bs {
		b.SetEjected(false)
	}
	if !slices.Equal(assign(bal, clients), before) {
		t.Error("clients did not return after readmission")
	}
}
