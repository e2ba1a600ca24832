package balancer

import (
	"net/netip"
	"testing"
	"time"
)

// fakeClock is a settable clock for AffinityConfig.Now.
type fakeClock struct{ now time.Time }

func (c *fakeClock) Now() time.Time          { return c.now }
func (c *fakeClock) Advance(d time.Duration) { c.now = c.now.Add(d) }

// newAffinityTest returns a table with a one-minute timeout on a fake
// clock, and a round-robin balancer over three backends wrapped by it.
// Round-robin makes every fresh decision differ from the previous one.
func newAffinityTest(maxEntries int) (*AffinityTable, *fakeClock, []*Backend, Balancer) {
	clock := &fakeClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	table := NewAffinityTable(AffinityConfig{Timeout: time.Minute, MaxEntries: maxEntries, Now: clock.Now})
	bs := nBackends(3)
	return table, clock, bs, table.Wrap(New(RoundRobin, bs), bs)
}

func TestAffinitySticks(t *testing.T) {
	_, _, bs, bal := newAffinityTest(0)
	c1, c2 := clientAddr(1), clientAddr(2)
	if got := bal.Pick(c1); got != bs[0] {
		t.Fatalf("first Pick = %v, want %v", got, bs[0])
	}
	if got := bal.Pick(c2); got != bs[1] {
		t.Fatalf("second client's Pick = %v, want %v", got, bs[1])
	}
	for range 10 {
		if got := bal.Pick(c1); got != bs[0] {
			t.Fatalf("repeat Pick = %v, want %v", got, bs[0])
		}
	}
	mapped := netip.AddrFrom16(c1.As16())
	if got := bal.Pick(mapped); got != bs[0] {
		t.Errorf("Pick(%v) = %v, want %v as for %v", mapped, got, bs[0], c1)
	}
}

func TestAffinityExpiry(t *testing.T) {
	table, clock, bs, bal := newAffinityTest(0)
	c := clientAddr(1)
	start := clock.now
	bal.Pick(c)

	addr, expires, ok := table.Lookup(c)
	if !ok || addr != bs[0].Addr || !expires.Equal(start.Add(time.Minute)) {
		t.Errorf("Lookup = %v, %v, %t; want %v, %v, true", addr, expires, ok, bs[0].Addr, start.Add(time.Minute))
	}

	// Each Pick refreshes the entry, so a client that keeps coming back
	// within the timeout keeps its backend indefinitely.
	for range 5 {
		clock.Advance(time.Minute - time.Nanosecond)
		if got := bal.Pick(c); got != bs[0] {
			t.Fatalf("Pick after %v = %v, want %v", clock.now.Sub(start), got, bs[0])
		}
	}
	if _, expires, _ := table.Lookup(c); !expires.Equal(clock.now.Add(time.Minute)) {
		t.Errorf("Lookup expires = %v, want a minute after the last Pick, %v", expires, clock.now.Add(time.Minute))
	}

	// Lookup does not refresh.
	clock.Advance(time.Minute / 2)
	table.Lookup(c)
	clock.Advance(time.Minute / 2)
	if _, _, ok := table.Lookup(c); ok {
		t.Error("Lookup found the entry a full timeout after its last Pick")
	}
	if got := bal.Pick(c); got != bs[1] {
		t.Errorf("Pick after expiry = %v, want round-robin's next, %v", got, bs[1])
	}
	if addr, _, _ := table.Lookup(c); addr != bs[1].Addr {
		t.Errorf("Lookup after expiry = %v, want the new backend %v", addr, bs[1].Addr)
	}
}

func TestAffinityBackendRemoved(t *testing.T) {
	table, _, bs, bal := newAffinityTest(0)
	c := clientAddr(1)
	if got := bal.Pick(c); got != bs[0] {
		t.Fatalf("Pick = %v, want %v", got, bs[0])
	}
	// The endpoint goes away: the proxy rebuilds without it and wraps the
	// new balancer with the same table.
	rest := bs[1:]
	bal = table.Wrap(New(RoundRobin, rest), rest)
	if got := bal.Pick(c); got != bs[1] {
		t.Errorf("Pick after removal = %v, want %v", got, bs[1])
	}
	// The endpoint comes back; the client stays where it moved.
	bal = table.Wrap(New(RoundRobin, bs), bs)
	if got := bal.Pick(c); got != bs[1] {
		t.Errorf("Pick after re-adding = %v, want %v", got, bs[1])
	}
}

func TestAffinityEjection(t *testing.T) {
	_, _, bs, bal := newAffinityTest(0)
	c := clientAddr(1)
	bal.Pick(c)
	bs[0].SetEjected(true)
	got := bal.Pick(c)
	if got == bs[0] {
		t.Fatal("Pick returned the ejected backend")
	}
	bs[0].SetEjected(false)
	if again := bal.Pick(c); again != got {
		t.Errorf("Pick after readmission = %v, want %v where the client moved", again, got)
	}
	for _, b := range bs {
		b.SetEjected(true)
	}
	if again := bal.Pick(c); again != got {
		t.Errorf("Pick with all ejected = %v, want %v, which is no worse than the others", again, got)
	}
}

func TestAffinityMaxEntries(t *testing.T) {
	table, clock, bs, bal := newAffinityTest(2)
	for i := range 3 {
		if got := bal.Pick(clientAddr(i)); got != bs[i] {
			t.Fatalf("client %d: Pick = %v, want %v", i, got, bs[i])
		}
	}
	if n := table.Len(); n != 2 {
		t.Errorf("Len = %d, want 2", n)
	}
	if _, _, ok := table.Lookup(clientAddr(2)); ok {
		t.Error("client beyond MaxEntries was recorded")
	}
	// Recorded clients still stick, and refreshing them does not evict.
	if got := bal.Pick(clientAddr(1)); got != bs[1] {
		t.Errorf("client 1: Pick = %v, want %v", got, bs[1])
	}
	// Once the old entries expire, a sweep makes room.
	clock.Advance(2 * time.Minute)
	bal.Pick(clientAddr(3))
	if _, _, ok := table.Lookup(clientAddr(3)); !ok {
		t.Error("new client not recorded after the old entries expired")
	}
	if n := table.Len(); n != 1 {
		t.Errorf("Len after sweep = %d, want 1", n)
	}
}

func TestAffinityDefaults(t *testing.T) {
	table := NewAffinityTable(AffinityConfig{})
	bs := nBackends(1)
	c := clientAddr(1)
	before := time.Now()
	table.Wrap(New(RoundRobin, bs), bs).Pick(c)
	_, expires, ok := table.Lookup(c)
	if lo, hi := before.Add(10800*time.Second), time.Now().Add(10800*time.Second); !ok || expires.Before(lo) || expires.After(hi) {
		t.Errorf("Lookup = %v, %t; want expiry 10800s after the Pick", expires, ok)
	}
	if table.max != 65536 {
		t.Errorf("max entries = %d, want 65536", table.max)
	}
}
