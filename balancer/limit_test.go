package balancer

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
)

func TestTryAcquire(t *testing.T) {
	tests := []struct {
		name   string
		limit  int64
		active int // acquired before the call
		want   bool
	}{
		{"no limit", 0, 1000, true},
		{"negative means no limit", -1, 5, true},
		{"room", 3, 2, true},
		{"full", 3, 3, false},
		{"over (limit lowered)", 2, 5, false},
		{"limit one, idle", 1, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := NewBackend(netip.MustParseAddrPort("10.244.0.1:80"), 0)
			for range tt.active {
				b.Acquire()
			}
			got := b.TryAcquire(tt.limit)
			if got != tt.want {
				t.Fatalf("TryAcquire(%d) with %d active = %v, want %v", tt.limit, tt.active, got, tt.want)
			}
			want := int64(tt.active)
			if got {
				want++
			}
			if b.Active() != want {
				t.Errorf("Active() = %d after TryAcquire, want %d", b.Active(), want)
			}
		})
	}
}

// TestTryAcquireRace checks that racing callers never take a backend past
// its limit: exactly limit of them win.
func TestTryAcquireRace(t *testing.T) {
	const limit, callers = 7, 64
	b := NewBackend(netip.MustParseAddrPort("10.244.0.1:80"), 0)
	var won atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range callers {
		wg.Go(func() {
			<-start
			if b.TryAcquire(limit) {
				won.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	if won.Load() != limit || b.Active() != limit {
		t.Fatalf("%d callers won, %d active; want %d and %d", won.Load(), b.Active(), limit, limit)
	}
	b.Release()
	if !b.TryAcquire(limit) {
		t.Fatal("a released slot cannot be taken again")
	}
}
