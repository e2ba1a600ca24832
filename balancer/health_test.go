package balancer

import (
	"net/netip"
	"slices"
	"testing"
	"time"
)

// TestHealthBacksOff checks the ejection times of consecutive failures
// (doubling from the base, capped), that the timer re-admits, and that a
// success or Forget resets the count.
func TestHealthBacksOff(t *testing.T) {
	var waits []time.Duration
	var readmit []func()
	h := NewHealth(time.Second, 5*time.Second, func(d time.Duration, f func()) {
		waits = append(waits, d)
		readmit = append(readmit, f)
	})
	b := NewBackend(netip.MustParseAddrPort("10.244.0.1:80"), 0)
	for range 4 {
		h.Failure(b)
	}
	if want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 5 * time.Second}; !slices.Equal(want, waits) {
		t.Errorf("ejection times %v, want %v", waits, want)
	}
	if !b.Ejected() || h.Failures(b) != 4 {
		t.Errorf("after 4 failures: ejected %v, %d failures", b.Ejected(), h.Failures(b))
	}
	readmit[len(readmit)-1]()
	if b.Ejected() {
		t.Error("still ejected after its timer fired")
	}
	h.Success(b)
	if h.Failures(b) != 0 {
		t.Errorf("%d failures after a success, want 0", h.Failures(b))
	}
	waits = nil
	h.Failure(b)
	h.Forget(b)
	h.Failure(b)
	if !slices.Equal(waits, []time.Duration{time.Second, time.Second}) {
		t.Errorf("ejection times after Forget: %v; want the base each time", waits)
	}
}

// TestHealthDefaults checks the zero settings: 1s, doubling up to 30s.
func TestHealthDefaults(t *testing.T) {
	var last time.Duration
	h := NewHealth(0, 0, func(d time.Duration, _ func()) { last = d })
	b := NewBackend(netip.MustParseAddrPort("10.244.0.1:80"), 0)
	h.Failure(b)
	if last != time.Second {
		t.Errorf("first ejection %v, want 1s", last)
	}
	for range 10 {
		h.Failure(b)
	}
	if last != 30*time.Second {
		t.Errorf("ejection after many failures %v, want 30s", last)
	}
}
