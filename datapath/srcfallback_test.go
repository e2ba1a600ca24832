package datapath

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"
)

// fakeRoutes answers route lookups from a table, and counts them.
type fakeRoutes struct {
	mu      sync.Mutex
	table   map[netip.Addr]segment
	lookups map[netip.Addr]int
}

func (f *fakeRoutes) lookup(a netip.Addr) (segment, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.lookups == nil {
		f.lookups = map[netip.Addr]int{}
	}
	f.lookups[a]++
	s, ok := f.table[a]
	if !ok {
		return segment{}, errors.New("network is unreachable")
	}
	return s, nil
}

func TestSourceKeeperReason(t *testing.T) {
	const bridge, flannel, lo = 3, 4, 1
	routes := &fakeRoutes{table: map[netip.Addr]segment{
		netip.MustParseAddr("10.244.0.10"):  {link: bridge, direct: true},   // a pod on the node's bridge
		netip.MustParseAddr("10.244.0.11"):  {link: bridge, direct: true},   // another one
		netip.MustParseAddr("10.244.1.5"):   {link: flannel, direct: false}, // a pod of another node, via a gateway
		netip.MustParseAddr("10.244.0.1"):   {link: lo, direct: false},      // the node's own address (a local route)
		netip.MustParseAddr("192.0.2.7"):    {link: 2, direct: false},       // an external client, via the default gateway
		netip.MustParseAddr("10.244.9.2"):   {link: 9, direct: true},        // a routed pod on a veth of its own
		netip.MustParseAddr("2001:db8::10"): {link: bridge, direct: true},
		netip.MustParseAddr("2001:db8::11"): {link: bridge, direct: true},
	}}
	now := time.Unix(1000, 0)
	k := &sourceKeeper{lookup: routes.lookup}
	k.noReplyFrom(now, netip.MustParseAddr("10.244.9.2"), netip.MustParseAddr("10.244.1.5"))
	k.noReplyFrom(now.Add(-noReplyTTL), netip.MustParseAddr("192.0.2.7"), netip.MustParseAddr("10.244.1.5"))

	for _, tt := range []struct {
		name, client, backend string
		want                  string
	}{
		{"both pods on the bridge", "10.244.0.10", "10.244.0.11", "same_segment"},
		{"a pod calling itself", "10.244.0.10", "10.244.0.10", "same_segment"},
		{"IPv6 pods on the bridge", "2001:db8::10", "2001:db8::11", "same_segment"},
		{"backend on another node", "10.244.0.10", "10.244.1.5", ""},
		{"client is the node", "10.244.0.1", "10.244.0.11", ""},
		{"external client", "192.0.2.7", "10.244.0.11", ""},
		{"routed client, bridged backend", "10.244.9.2", "10.244.0.11", ""},
		{"no route to the client: try, and fall back on no reply", "198.51.100.1", "10.244.0.11", ""},
		{"a recent missing reply", "10.244.9.2", "10.244.1.5", "no_reply"},
		{"a missing reply that has expired", "192.0.2.7", "10.244.1.5", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := k.reason(now, netip.MustParseAddr(tt.client), netip.MustParseAddr(tt.backend))
			if diff := cmp.Diff(tt.want, fallbackReasonNames[r]); diff != "" {
				t.Errorf("reason(%s, %s) (-want +got):\n%s", tt.client, tt.backend, diff)
			}
		})
	}
}

// TestSourceKeeperCaches checks that the route lookups, netlink round
// trips, are made once per address per segmentTTL, not per connection.
func TestSourceKeeperCaches(t *testing.T) {
	a, b := netip.MustParseAddr("10.244.0.10"), netip.MustParseAddr("10.244.0.11")
	routes := &fakeRoutes{table: map[netip.Addr]segment{a: {link: 3, direct: true}, b: {link: 3, direct: true}}}
	k := &sourceKeeper{lookup: routes.lookup}
	now := time.Unix(1000, 0)
	for i := range 100 {
		if r := k.reason(now.Add(time.Duration(i)*time.Millisecond), a, b); r != fallbackSameSegment {
			t.Fatalf("connection %d: reason %q, want same_segment", i, fallbackReasonNames[r])
		}
	}
	if diff := cmp.Diff(map[netip.Addr]int{a: 1, b: 1}, routes.lookups); diff != "" {
		t.Errorf("lookups within the TTL (-want +got):\n%s", diff)
	}
	// The pod moved off the bridge: noticed once the entry expires.
	routes.mu.Lock()
	routes.table[b] = segment{link: 4}
	routes.mu.Unlock()
	if r := k.reason(now.Add(segmentTTL), a, b); r != fallbackNone {
		t.Errorf("after the TTL, with the backend routed elsewhere: reason %q, want none", fallbackReasonNames[r])
	}
	if diff := cmp.Diff(map[netip.Addr]int{a: 2, b: 2}, routes.lookups); diff != "" {
		t.Errorf("lookups after the TTL (-want +got):\n%s", diff)
	}
}

// TestSourceKeeperConcurrent runs the keeper from many diallers at once,
// for the race detector: every connection's goroutine or event loop
// shares one.
func TestSourceKeeperConcurrent(t *testing.T) {
	routes := &fakeRoutes{table: map[netip.Addr]segment{}}
	for i := range 16 {
		routes.table[netip.AddrFrom4([4]byte{10, 244, 0, byte(i)})] = segment{link: 3, direct: true}
	}
	k := &sourceKeeper{lookup: routes.lookup}
	now := time.Unix(1000, 0)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() { // ends after its loop
			defer wg.Done()
			for i := range 200 {
				c, b := netip.AddrFrom4([4]byte{10, 244, 0, byte(i % 16)}), netip.AddrFrom4([4]byte{10, 244, 0, byte(g)})
				if r := k.reason(now.Add(time.Duration(i)*time.Second), c, b); r == fallbackNone {
					t.Errorf("%s → %s: no fallback, want one", c, b)
					return
				}
				if i%10 == 0 {
					k.noReplyFrom(now, c, b)
				}
				k.firstFallback("default/web")
			}
		}()
	}
	wg.Wait()
}

func TestTransparentFailure(t *testing.T) {
	for _, tt := range []struct {
		name string
		err  error
		want string
	}{
		{"event loop's deadline", errConnectTimeout, "no_reply"},
		{"dialer's context", &net.OpError{Op: "dial", Net: "tcp", Err: os.ErrDeadlineExceeded}, "no_reply"},
		{"no capability", fmt.Errorf("setting IP_TRANSPARENT: %w", unix.EPERM), "transparent_error"},
		{"the client's ports in use", &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("bind", unix.EADDRINUSE)}, "transparent_error"},
		{"bind, raw", os.NewSyscallError("bind", unix.EADDRNOTAVAIL), "transparent_error"},
		{"refused", os.NewSyscallError("connect", unix.ECONNREFUSED), ""},
		{"refused, dialer", &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", unix.ECONNREFUSED)}, ""},
		{"unreachable", os.NewSyscallError("connect", unix.EHOSTUNREACH), ""},
	} {
		if diff := cmp.Diff(tt.want, fallbackReasonNames[transparentFailure(tt.err)]); diff != "" {
			t.Errorf("%s: transparentFailure(%v) (-want +got):\n%s", tt.name, tt.err, diff)
		}
	}
}
