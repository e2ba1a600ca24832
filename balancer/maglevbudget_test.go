package balancer

import (
	"net/netip"
	"testing"
)

// TestMaglevBudget follows two owners through rebuilds: tables shared
// within an owner and kept across its rebuilds, the bound counted over
// every owner, rendezvous hashing past it, and an owner's tables dropped
// when it has none left.
func TestMaglevBudget(t *testing.T) {
	small, large := nBackends(3), nBackends(40)
	sizeSmall, sizeLarge := MaglevTableBytes(len(small)), MaglevTableBytes(len(large))
	b := &MaglevBudget[string]{Bound: sizeSmall + sizeLarge}

	// Two balancers over the same backends share one table.
	r := b.Begin("a")
	x, y := r.Balancer(small), r.Balancer(append([]*Backend(nil), small...))
	b.Commit(r)
	if got := SourceHashMethod(x) + "/" + SourceHashMethod(y); got != "Maglev/Maglev" {
		t.Fatalf("hashing of a's balancers: %s", got)
	}
	if b.Tables("a") != 1 || b.Bytes() != sizeSmall {
		t.Fatalf("after a's first build: %d tables, %d bytes; want 1 and %d", b.Tables("a"), b.Bytes(), sizeSmall)
	}
	table := b.Table("a", small)

	// A rebuild over the same backends keeps the table, not a copy.
	r = b.Begin("a")
	r.Balancer(small)
	b.Commit(r)
	if b.Table("a", small) != table || b.Bytes() != sizeSmall {
		t.Errorf("a's rebuild: a new table, or %d bytes; want the same table and %d", b.Bytes(), sizeSmall)
	}

	// Owner b fits one large table, and no second one of other backends
	// (the same ports at other addresses: a table is keyed by addresses).
	other := make([]*Backend, len(large))
	for i := range large {
		other[i] = NewBackend(netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, 0, byte(i + 1)}), 80), 0)
	}
	r = b.Begin("b")
	fit, over := r.Balancer(large), r.Balancer(other)
	b.Commit(r)
	if got := SourceHashMethod(fit) + "/" + SourceHashMethod(over); got != "Maglev/rendezvous" {
		t.Errorf("hashing of b's balancers at the bound: %s; want Maglev/rendezvous", got)
	}
	if r.Fallbacks != 1 || r.Wanted != MaglevTableBytes(len(other)) {
		t.Errorf("b's fallbacks: %d wanting %d bytes; want 1 wanting %d", r.Fallbacks, r.Wanted, MaglevTableBytes(len(other)))
	}
	if b.Bytes() != sizeSmall+sizeLarge {
		t.Errorf("%d bytes, want %d", b.Bytes(), sizeSmall+sizeLarge)
	}

	// Once a holds none, its bytes are free for b's second table.
	r = b.Begin("a")
	b.Commit(r)
	if b.Tables("a") != 0 || b.Bytes() != sizeLarge {
		t.Errorf("a without balancers: %d tables, %d bytes in all; want 0 and %d", b.Tables("a"), b.Bytes(), sizeLarge)
	}
	r = b.Begin("b")
	r.Balancer(large)
	second := r.Balancer(other[:len(small)])
	b.Commit(r)
	if SourceHashMethod(second) != "Maglev" || r.Fallbacks != 0 {
		t.Errorf("b's second table after a freed its bytes: %s, %d fallbacks", SourceHashMethod(second), r.Fallbacks)
	}
}

// TestMaglevBudgetDefault checks that the zero budget bounds the tables by
// DefaultMaglevBudget.
func TestMaglevBudgetDefault(t *testing.T) {
	var b MaglevBudget[string]
	r := b.Begin("a")
	if got := SourceHashMethod(r.Balancer(nBackends(3))); got != "Maglev" {
		t.Errorf("a small table under the default bound: %s", got)
	}
	if r.bound != DefaultMaglevBudget {
		t.Errorf("bound %d, want %d", r.bound, DefaultMaglevBudget)
	}
}
