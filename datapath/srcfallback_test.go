package datapath

import (
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/testwait"
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

// decide returns the reason of an attempt from client to backend made on
// a goroutine: it waits for the routes, then decides.
func decide(k *sourceKeeper, now time.Time, client, backend netip.Addr) int {
	return k.reason(now, client, backend, k.wait(now, client, backend))
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
		// Pods on a bridge whose frames pass iptables (br_netfilter).
		netip.MustParseAddr("10.244.2.10"): {link: bridge + 10, direct: true, bridged: true},
		netip.MustParseAddr("10.244.2.11"): {link: bridge + 10, direct: true, bridged: true},
	}}
	now := time.Unix(1000, 0)
	k := &sourceKeeper{lookup: routes.lookup}
	// The rules take the replies off the bridge that passes iptables.
	caught := &sourceKeeper{lookup: routes.lookup, bridgedReplies: true}
	for _, k := range []*sourceKeeper{k, caught} {
		k.noReplyFrom(now, netip.MustParseAddr("10.244.9.2"), netip.MustParseAddr("10.244.1.5"))
		k.noReplyFrom(now.Add(-noReplyTTL), netip.MustParseAddr("192.0.2.7"), netip.MustParseAddr("10.244.1.5"))
	}

	for _, tt := range []struct {
		name, client, backend string
		want                  string
	}{
		{"pods on a bridge that passes iptables, no rules to catch the replies", "10.244.2.10", "10.244.2.11", "same_segment"},
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
			r := decide(k, now, netip.MustParseAddr(tt.client), netip.MustParseAddr(tt.backend))
			if diff := cmp.Diff(tt.want, fallbackReasonNames[r]); diff != "" {
				t.Errorf("reason(%s, %s) (-want +got):\n%s", tt.client, tt.backend, diff)
			}
			// Only the bridge that passes iptables changes when the
			// rules catch what it carries.
			want := tt.want
			if tt.client == "10.244.2.10" {
				want = ""
			}
			r = decide(caught, now, netip.MustParseAddr(tt.client), netip.MustParseAddr(tt.backend))
			if diff := cmp.Diff(want, fallbackReasonNames[r]); diff != "" {
				t.Errorf("with the bridged replies caught, reason(%s, %s) (-want +got):\n%s", tt.client, tt.backend, diff)
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
		if r := decide(k, now.Add(time.Duration(i)*time.Millisecond), a, b); r != fallbackSameSegment {
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
	if r := decide(k, now.Add(segmentTTL), a, b); r != fallbackNone {
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
				if r := decide(k, now.Add(time.Duration(i)*time.Second), c, b); r == fallbackNone {
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

// TestFallBackNotForLocalClients checks which failed dials from the
// client's address are retried from the node's: one that could not take
// the address (bound to a port the kernel picked) always; one that timed
// out only for a client behind a gateway, whose replies may take another
// way back. A client the node reaches directly (a pod of this node) gets
// its replies through the node, so its timeout is what its backend's
// NetworkPolicy answered, which a retry from the node's address would
// get around. Every failure that is not retried counts against the
// backend.
func TestFallBackNotForLocalClients(t *testing.T) {
	client := netip.MustParseAddrPort("10.244.0.10:40000")
	anyPort := netip.AddrPortFrom(client.Addr(), 0)
	timeout := fmt.Errorf("connect: %w", os.ErrDeadlineExceeded)
	bind := os.NewSyscallError("bind", unix.EADDRNOTAVAIL)
	refused := os.NewSyscallError("connect", unix.ECONNREFUSED)
	for _, tt := range []struct {
		name     string
		local    bool
		err      error
		want     bool
		failures int
	}{
		{"a local pod's dial timed out", true, timeout, false, 1},
		{"a local pod's dial was refused", true, refused, false, 1},
		{"a local pod's address could not be taken", true, bind, true, 0},
		{"a remote client's dial timed out", false, timeout, true, 0},
		{"a remote client's dial was refused", false, refused, false, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := NewEngine(Config{}, outsideClients{})
			b := balancer.NewBackend(netip.MustParseAddrPort("10.244.0.11:8080"), 0)
			snap := &Snapshot{Name: portName("default/web:http")}
			d := &tcpDial{p: p, snap: snap, b: b, from: anyPort, src: srcAttempt{keep: client, local: tt.local}}
			b.Acquire()
			if got := d.fallBack(tt.err); got != tt.want {
				t.Errorf("fallBack(%v) = %v, want %v", tt.err, got, tt.want)
			}
			if tt.want {
				// The retry dials the same backend from the node's address.
				if addr, ok := d.retryFromNode(); !ok || addr != b.Addr || d.from.IsValid() {
					t.Errorf("retry: %v %v from %v, want %v from the node's address", addr, ok, d.from, b.Addr)
				}
			} else {
				d.failed(tt.err)
			}
			if got := p.Failures(b); got != tt.failures {
				t.Errorf("after the failure, the backend has %d failures, want %d", got, tt.failures)
			}
		})
	}
}

// TestChooseSourceHairpin checks that a client that is its own backend
// is dialled from the node's address, as kube-proxy masquerades it, and
// so is a backend on the node's own address (a host-network endpoint),
// whose replies no rule can take back to the dialling socket.
func TestChooseSourceHairpin(t *testing.T) {
	p := NewEngine(Config{}, cidrClients{node: netip.MustParseAddr("10.244.0.1")})
	p.src.lookup = func(netip.Addr) (segment, error) { return segment{}, nil }
	client := netip.MustParseAddrPort("10.244.0.10:40000")
	for _, tt := range []struct {
		backend string
		want    netip.AddrPort
	}{
		{"10.244.0.10:8080", netip.AddrPort{}},
		{"10.244.0.1:6443", netip.AddrPort{}},
		{"10.244.0.11:8080", client},
	} {
		d := &tcpDial{p: p, b: balancer.NewBackend(netip.MustParseAddrPort(tt.backend), 0), src: srcAttempt{keep: client}}
		d.chooseSource()
		if d.from != tt.want {
			t.Errorf("backend %s: dials from %v, want %v", tt.backend, d.from, tt.want)
		}
	}
}

// TestRetryAnotherPort checks that a dial from the client's address and
// port that finds them taken for the backend (EADDRNOTAVAIL, as when
// the last attempt's socket still holds them) is retried at once from
// the client's address with another port, not from the node's, which
// would hand a client that its backend's policy refuses to the node.
func TestRetryAnotherPort(t *testing.T) {
	p := NewEngine(Config{}, outsideClients{})
	client := netip.MustParseAddrPort("10.244.0.10:40000")
	b := balancer.NewBackend(netip.MustParseAddrPort("10.244.0.11:8080"), 0)
	b.Acquire()
	d := &tcpDial{p: p, snap: testSnapshot("default/web:http"), b: b, from: client, src: srcAttempt{keep: client, local: true}}
	if !d.fallBack(os.NewSyscallError("connect", unix.EADDRNOTAVAIL)) {
		t.Fatal("fallBack(EADDRNOTAVAIL) = false, want a retry")
	}
	addr, ok := d.retryFromNode()
	if want := netip.AddrPortFrom(client.Addr(), 0); !ok || addr != b.Addr || d.from != want {
		t.Errorf("retry: %v %v from %v, want %v from %v", addr, ok, d.from, b.Addr, want)
	}
	// With a port the kernel picked, EADDRNOTAVAIL is the client
	// address's ports running out: that one is the node's to work around.
	if !d.fallBack(os.NewSyscallError("connect", unix.EADDRNOTAVAIL)) {
		t.Fatal("fallBack(EADDRNOTAVAIL) from any port = false, want a retry")
	}
	if _, ok := d.retryFromNode(); !ok || d.from.IsValid() {
		t.Errorf("ports of the client's address exhausted: retry from %v, want the node's address", d.from)
	}
}

// TestClientSocketOwner checks that a socket that dials from a client's
// address is not root's, so that policy engines that let the node's root
// sockets pass (kube-network-policies) police it as the client's, while
// the node's own dials stay the process's.
func TestClientSocketOwner(t *testing.T) {
	if !testlab.RunInNetns(t) {
		return
	}
	backend := netip.MustParseAddrPort("10.244.0.11:8080")
	// On one thread throughout, so that its filesystem uid can be checked
	// after the dials.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for _, tt := range []struct {
		name string
		from netip.AddrPort
		want uint32
	}{
		{"from a client's address", netip.MustParseAddrPort("10.244.0.10:40000"), clientSocketUID},
		{"from the node's address", netip.AddrPort{}, uint32(os.Getuid())},
	} {
		fd, err := rawSocket(unix.SOCK_STREAM, backend, tt.from, 0)
		if err != nil {
			t.Fatalf("%s: %v", tt.name, err)
		}
		var st unix.Stat_t
		err = unix.Fstat(fd, &st)
		unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
		if st.Uid != tt.want {
			t.Errorf("%s: the socket is uid %d's, want %d's", tt.name, st.Uid, tt.want)
		}
	}
	// The goroutine dial path (listeners the event loops cannot take)
	// too: a net.Dialer's socket, from a client's address.
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	p := startEngine(t, Config{})
	c, err := p.dial("tcp", netip.MustParseAddrPort(ln.Addr().String()), netip.MustParseAddr("127.0.0.5"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.Fstat(int(fd), &st) }); err != nil || serr != nil {
		t.Fatal(err, serr)
	}
	if st.Uid != clientSocketUID {
		t.Errorf("a goroutine's dial from a client's address: the socket is uid %d's, want %d's", st.Uid, clientSocketUID)
	}
	// The thread's own filesystem uid is back.
	if prev, _ := unix.SetfsuidRetUid(-1); prev != os.Getuid() {
		t.Errorf("the thread's filesystem uid is %d after the dial, want %d", prev, os.Getuid())
	}
}

// TestSourceKeeperDirect checks which clients the node reaches directly,
// whose replies come back through it: a pod on the node's bridge or on a
// veth of its own, not a pod of another node or a host behind a gateway,
// nor an address with no route.
func TestSourceKeeperDirect(t *testing.T) {
	routes := &fakeRoutes{table: map[netip.Addr]segment{
		netip.MustParseAddr("10.244.0.10"): {link: 3, direct: true},
		netip.MustParseAddr("10.244.9.2"):  {link: 9, direct: true},
		netip.MustParseAddr("10.244.1.5"):  {link: 4},
		netip.MustParseAddr("192.0.2.7"):   {link: 2},
	}}
	k := &sourceKeeper{lookup: routes.lookup}
	now := time.Unix(1000, 0)
	got := map[string]bool{}
	for _, a := range []string{"10.244.0.10", "10.244.9.2", "10.244.1.5", "192.0.2.7", "198.51.100.1"} {
		addr := netip.MustParseAddr(a)
		got[a] = k.wait(now, addr, addr).client.local()
	}
	want := map[string]bool{"10.244.0.10": true, "10.244.9.2": true, "10.244.1.5": false, "192.0.2.7": false, "198.51.100.1": false}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("direct (-want +got):\n%s", diff)
	}
}

// TestSourceKeeperEvictsLeastRecentlyUsed checks that a full cache makes
// room by forgetting its least recently used entry alone: the others
// stay cached, and cost no lookup again.
func TestSourceKeeperEvictsLeastRecentlyUsed(t *testing.T) {
	a, b, c, d := netip.MustParseAddr("10.244.0.1"), netip.MustParseAddr("10.244.0.2"), netip.MustParseAddr("10.244.0.3"), netip.MustParseAddr("10.244.0.4")
	backend := netip.MustParseAddr("10.244.1.5")
	now := time.Unix(1000, 0)

	t.Run("routes", func(t *testing.T) {
		routes := &fakeRoutes{table: map[netip.Addr]segment{}}
		k := &sourceKeeper{lookup: routes.lookup, size: 3}
		k.wait(now, a, b)
		k.wait(now, c, c) // full
		k.wait(now, a, a) // b is the least recently used now
		k.wait(now, d, d) // b makes room
		for _, addr := range []netip.Addr{a, c, d, b} {
			k.wait(now, addr, addr)
		}
		if diff := cmp.Diff(map[netip.Addr]int{a: 1, b: 2, c: 1, d: 1}, routes.lookups); diff != "" {
			t.Errorf("lookups (-want +got):\n%s", diff)
		}
	})

	t.Run("missing replies", func(t *testing.T) {
		k := &sourceKeeper{lookup: (&fakeRoutes{}).lookup, size: 3}
		for _, client := range []netip.Addr{a, b, c} {
			k.noReplyFrom(now, client, backend)
		}
		noRoutes := routePair{}
		k.reason(now, a, backend, noRoutes) // b is the least recently used now
		k.noReplyFrom(now, d, backend)      // b makes room
		got := map[netip.Addr]string{}
		for _, client := range []netip.Addr{a, b, c, d} {
			got[client] = fallbackReasonNames[k.reason(now, client, backend, noRoutes)]
		}
		want := map[netip.Addr]string{a: "no_reply", b: "", c: "no_reply", d: "no_reply"}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("reasons (-want +got):\n%s", diff)
		}
	})
}

// blockingRoutes answers every route lookup with an unknown segment, as a
// failed lookup is, and counts them; the lookup of slow waits until
// unblock, as a netlink round trip that takes its time, and signals
// asked when it starts.
type blockingRoutes struct {
	slow    netip.Addr
	asked   chan struct{}
	release chan struct{}
	once    sync.Once

	mu      sync.Mutex
	lookups map[netip.Addr]int
}

func newBlockingRoutes(slow netip.Addr) *blockingRoutes {
	return &blockingRoutes{slow: slow, asked: make(chan struct{}, 1), release: make(chan struct{}), lookups: map[netip.Addr]int{}}
}

func (r *blockingRoutes) lookup(a netip.Addr) (segment, error) {
	r.mu.Lock()
	r.lookups[a]++
	r.mu.Unlock()
	if a == r.slow {
		select {
		case r.asked <- struct{}{}:
		default:
		}
		<-r.release
	}
	return segment{}, nil
}

func (r *blockingRoutes) unblock() { r.once.Do(func() { close(r.release) }) }

// waitAsked waits for the slow lookup to start.
func (r *blockingRoutes) waitAsked(t *testing.T) {
	t.Helper()
	select {
	case <-r.asked:
	case <-time.After(5 * time.Second):
		t.Fatalf("the route to %s was never looked up", r.slow)
	}
}

// heard is a routeWaiter that passes the routes on.
type heard chan routePair

func (h heard) routed(r routePair) { h <- r }

// TestSourceKeeperAwait checks that a decision that misses the cache
// does not wait for the lookup: await returns at once, one lookup
// answers every decision that asked for the address meanwhile, and the
// resolver goroutine exits once no lookup is left.
func TestSourceKeeperAwait(t *testing.T) {
	slow, backend := netip.MustParseAddr("10.244.0.10"), netip.MustParseAddr("10.244.0.11")
	routes := newBlockingRoutes(slow)
	defer routes.unblock()
	k := &sourceKeeper{lookup: routes.lookup}
	now := time.Unix(1000, 0)
	first, second := make(heard, 1), make(heard, 1)
	k.await(now, slow, backend, first)
	routes.waitAsked(t)
	k.await(now, slow, slow, second)
	if _, _, ok := k.cached(now, slow, backend); ok {
		t.Fatal("the route being looked up is cached already")
	}
	select {
	case <-first:
		t.Fatal("a decision heard its routes before the lookup answered")
	case <-second:
		t.Fatal("a decision heard its routes before the lookup answered")
	default:
	}
	routes.unblock()
	for _, h := range []heard{first, second} {
		select {
		case <-h:
		case <-time.After(5 * time.Second):
			t.Fatal("a decision never heard its routes")
		}
	}
	routes.mu.Lock()
	got := maps.Clone(routes.lookups)
	routes.mu.Unlock()
	if diff := cmp.Diff(map[netip.Addr]int{slow: 1, backend: 1}, got); diff != "" {
		t.Errorf("lookups (-want +got):\n%s", diff)
	}
	testwait.Until(t, 5*time.Second, "the resolver goroutine to exit with no lookup left", func() bool {
		k.mu.Lock()
		defer k.mu.Unlock()
		return !k.resolving
	})
}

// TestRouteLookupOffTheLoopTCP checks that an event loop does not wait
// for the route lookup of a new client that keeps its address: while the
// lookup hangs, the loop goes on accepting and serving other clients,
// and the waiting connection is dialled, from the client's own address
// as a lookup made on the spot would have it, once the answer comes.
func TestRouteLookupOffTheLoopTCP(t *testing.T) {
	if !testlab.RunInNetns(t) {
		return
	}
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		slow, other := netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("127.0.0.3")
		routes := newBlockingRoutes(slow)
		p := startEngine(t, Config{EventLoops: 1, IOURing: dp.ring})
		t.Cleanup(routes.unblock) // before the engine drains
		p.clients = podClients{}
		p.src.lookup = routes.lookup
		// The backend answers with the address the connection comes from.
		be := startBackend(t, func(c net.Conn) {
			defer c.Close()
			fmt.Fprint(c, netip.MustParseAddrPort(c.RemoteAddr().String()).Addr())
		})
		l := serve(t, p, "tcp4", "default/web:http", be.addr)
		snap := testSnapshot("default/web:http", be.addr)
		snap.SourceIP = SourceClient
		l.Snap.Store(snap)
		connect := func(from netip.Addr) net.Conn {
			t.Helper()
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: from.AsSlice()}, Timeout: 5 * time.Second}
			c, err := d.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", l.Port))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			c.SetDeadline(time.Now().Add(5 * time.Second))
			return c
		}
		seen := func(c net.Conn) string {
			b, err := io.ReadAll(c)
			if err != nil {
				return err.Error()
			}
			return string(b)
		}

		// The other client's route, and the backend's, are cached.
		if got := seen(connect(other)); got != other.String() {
			t.Fatalf("the backend saw the connection from %q, want %q", got, other)
		}
		waiting := connect(slow)
		routes.waitAsked(t)
		if got := seen(connect(other)); got != other.String() {
			t.Fatalf("while a route is looked up, the loop's next connection: the backend saw it from %q, want %q", got, other)
		}
		routes.unblock()
		if got := seen(waiting); got != slow.String() {
			t.Errorf("once its route is known, the waiting connection: the backend saw it from %q, want %q", got, slow)
		}
	})
}

// TestRouteLookupOffTheLoopUDP is TestRouteLookupOffTheLoopTCP for UDP:
// a new client's datagram waits for its route off the loop, which goes
// on relaying other clients' datagrams, flows and pooled queries alike.
func TestRouteLookupOffTheLoopUDP(t *testing.T) {
	if !testlab.RunInNetns(t) {
		return
	}
	for _, mode := range []UDPMode{UDPFlow, UDPRequestReply} {
		t.Run(fmt.Sprint(mode), func(t *testing.T) {
			slow, other := netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("127.0.0.3")
			routes := newBlockingRoutes(slow)
			p := startEngine(t, Config{EventLoops: 1})
			t.Cleanup(routes.unblock) // before the engine drains
			p.clients = podClients{}
			p.src.lookup = routes.lookup
			be := sourceUDPBackend(t)
			l := serve(t, p, "udp4", "default/dns:dns", be)
			snap := testSnapshot("default/dns:dns", be)
			snap.Metrics = testPortMetrics(snap.Backends...)
			snap.UDPMode, snap.SourceIP = mode, SourceClient
			l.Snap.Store(snap)
			client := func(from netip.Addr) *net.UDPConn {
				t.Helper()
				c, err := net.DialUDP("udp4", &net.UDPAddr{IP: from.AsSlice()}, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: int(l.Port)})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.Close() })
				return c
			}

			// The other client's route, and the backend's, are cached.
			if got := exchange(t, client(other), []byte("q")); got != other.String() {
				t.Fatalf("the backend saw the datagram from %q, want %q", got, other)
			}
			waiting := client(slow)
			if _, err := waiting.Write([]byte("q")); err != nil {
				t.Fatal(err)
			}
			routes.waitAsked(t)
			if got := exchange(t, client(other), []byte("q")); got != other.String() {
				t.Fatalf("while a route is looked up, the loop's next client: the backend saw its datagram from %q, want %q", got, other)
			}
			routes.unblock()
			waiting.SetReadDeadline(time.Now().Add(5 * time.Second))
			buf := make([]byte, 100)
			n, err := waiting.Read(buf)
			if err != nil {
				t.Fatalf("the datagram that waited for its route: no reply: %v", err)
			}
			if got := string(buf[:n]); got != slow.String() {
				t.Errorf("once its route is known, the datagram that waited: the backend saw it from %q, want %q", got, slow)
			}
		})
	}
}

// sourceUDPBackend answers each datagram with the address it came from.
func sourceUDPBackend(t *testing.T) netip.AddrPort {
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { // ends when the cleanup closes pc
		defer close(done)
		buf := make([]byte, 100)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo([]byte(netip.MustParseAddrPort(from.String()).Addr().String()), from)
		}
	}()
	t.Cleanup(func() { pc.Close(); <-done })
	return netip.MustParseAddrPort(pc.LocalAddr().String())
}

// BenchmarkSourceKeeperCached measures a connection's source choice when
// the routes are cached, as on every connection of a steady client: what
// each event loop pays, from every loop at once.
func BenchmarkSourceKeeperCached(b *testing.B) {
	k := &sourceKeeper{lookup: func(netip.Addr) (segment, error) { return segment{link: 3, direct: true}, nil }}
	now := time.Unix(1000, 0)
	var clients [64]netip.Addr
	for i := range clients {
		clients[i] = netip.AddrFrom4([4]byte{10, 244, 0, byte(i + 1)})
	}
	backend := netip.MustParseAddr("10.244.1.5")
	for _, c := range clients {
		k.wait(now, c, backend)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			c := clients[i%len(clients)]
			i++
			if _, _, ok := k.cached(now, c, backend); !ok {
				b.Fatal("not cached")
			}
		}
	})
}

// TestHeldDatagrams checks what an event loop holds of the datagrams
// whose routes are being looked up: no more than maxHeldBytes (the rest
// is dropped, as a full socket buffer drops it), and each one given back
// once its routes are known, here dropped because its listener closed
// while it waited, where a new flow would never be read again.
func TestHeldDatagrams(t *testing.T) {
	slow := netip.MustParseAddr("127.0.0.2")
	routes := newBlockingRoutes(slow)
	defer routes.unblock()
	p := NewEngine(Config{}, podClients{})
	p.src.lookup = routes.lookup
	el, err := newEventLoop(loopOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer el.stop()
	// A listener that was closed, and that would otherwise take a new
	// flow from the node's address.
	closed := &Listener{Name: portName("default/dns:dns"), UDP: true, raw: &loopListener{rawSock: rawSock{fd: -1}}}
	// A backend that never replies.
	be, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	snap := testSnapshot("default/dns:dns", netip.MustParseAddrPort(be.LocalAddr().String()))
	snap.SourceIP = SourceNode
	closed.Snap.Store(snap)
	target := udpTarget{el: el, svc: closed, key: flowKey{l: closed, client: netip.AddrPortFrom(slow, 5353)}}
	b := snap.Backends[0]
	onLoop := func(f func() int) int {
		got := make(chan int, 1)
		el.post(func() { got <- f() })
		return <-got
	}

	const size = 60000
	fits := maxHeldBytes / (size + heldOverhead)
	held := onLoop(func() int {
		for range fits + 1 {
			p.hold(target, udpPick{b: b}, make([]byte, size), 1)
		}
		return el.held
	})
	if want := fits * (size + heldOverhead); held != want {
		t.Errorf("the loop holds %d bytes, want %d: %d datagrams, the last one dropped", held, want, fits)
	}
	routes.unblock()
	testwait.Until(t, 5*time.Second, "the held datagrams to be given back", func() bool {
		return onLoop(func() int { return el.held }) == 0
	})
	if n := p.UDPFlows(); n != 0 {
		t.Errorf("%d UDP flows for a closed listener, want none", n)
	}
}

// TestHeldDatagramKeepsLongFlow checks that a datagram of a client that
// has become a long flow, held while its routes are looked up, is still
// one of a long flow when it resumes: the lookup of its last query
// consumed that record, so the pick it waits with must carry it, or the
// datagram would go out as a new pooled query.
func TestHeldDatagramKeepsLongFlow(t *testing.T) {
	slow := netip.MustParseAddr("127.0.0.2")
	routes := newBlockingRoutes(slow)
	defer routes.unblock()
	p := NewEngine(Config{}, podClients{})
	p.src.lookup = routes.lookup
	el, err := newEventLoop(loopOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer el.stop()
	l := &Listener{Name: portName("default/dns:dns"), UDP: true, raw: &loopListener{rawSock: rawSock{fd: -1}}}
	snap := testSnapshot("default/dns:dns", netip.MustParseAddrPort("127.0.0.1:53"))
	snap.SourceIP, snap.UDPMode = SourceClient, UDPRequestReply
	l.Snap.Store(snap)
	target := udpTarget{el: el, svc: l, key: flowKey{l: l, client: netip.AddrPortFrom(slow, 5353)}}
	rq := &recentQuery{backend: snap.Backends[0], svc: l, answered: true, long: true}
	got := make(chan *udpPick, 1)
	el.post(func() {
		_, waits, _ := p.udpFlowFor(target, nil, rq, nil)
		got <- waits
	})
	waits := <-got
	if waits == nil {
		t.Fatal("the datagram did not wait for its client's route")
	}
	if !waits.long || waits.b != snap.Backends[0] {
		t.Errorf("the pick it waits with is %+v, want the long flow's backend, marked long", *waits)
	}
}
