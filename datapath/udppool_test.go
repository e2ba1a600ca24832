package datapath

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/testwait"
)

// TestUDPPoolBySourceAddress runs a request-reply port in tproxy mode,
// in a namespace of its own, with clients on two addresses that stand
// for pods: a client whose address its backend sees gets the sockets of
// a pool of that address's (transparent, bound to it), reused by its
// later queries; where the node's routes put the clients on their
// backend's segment, the address falls back to the node's
// (srcfallback.go), and the queries share the node's pool, as those of a
// port that dials from the node's address.
func TestUDPPoolBySourceAddress(t *testing.T) {
	if !testlab.RunInNetns(t) {
		return
	}
	// The clients send to addresses of their own, where the kernel's
	// TPROXY rule would send them to a listener on loopback: to the
	// listener's port on 127.0.0.2, .3 and .4, which a listener on every
	// address receives. A reply leaves from a socket bound to the
	// address the client sent to (tproxySocket), which takes that
	// address's later datagrams from the listener: hence one address per
	// client.
	vips := []netip.Addr{netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("127.0.0.3"), netip.MustParseAddr("127.0.0.4")}
	listenUDP := func(ctx context.Context, network, _ string) (*net.UDPConn, error) {
		lc := transparentListenConfig()
		transparent := lc.Control
		lc.Control = func(network, address string, c syscall.RawConn) error {
			if err := transparent(network, address, c); err != nil {
				return err
			}
			var serr error
			if err := c.Control(func(fd uintptr) {
				// As the reply sockets do, so that they can bind next to it.
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
			}); err != nil {
				return err
			}
			return serr
		}
		pc, err := lc.ListenPacket(ctx, network, "0.0.0.0:0")
		if err != nil {
			return nil, err
		}
		return pc.(*net.UDPConn), nil
	}
	type counts struct {
		Replies       int
		Flows, Pooled int
		Fallbacks     uint64
	}
	clients := []netip.Addr{netip.MustParseAddr("127.0.0.5"), netip.MustParseAddr("127.0.0.6"), netip.MustParseAddr("127.0.0.5")}
	for _, tt := range []struct {
		name        string
		source      SourceIP
		sameSegment bool
		want        counts
	}{
		// One pool per client address, each query reusing its own.
		{"the clients' addresses", SourceClient, false, counts{Replies: 3, Pooled: 2}},
		{"the clients' addresses, on their backend's segment", SourceClient, true, counts{Replies: 3, Pooled: 1, Fallbacks: 3}},
		{"the node's address", SourceNode, false, counts{Replies: 3, Pooled: 1}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			be := udpBackend(t, "a", false)
			p := startEngine(t, Config{Transparent: true, EventLoops: 1, ListenUDP: listenUDP})
			// The clients stand for pods.
			p.clients = podClients{}
			p.src.lookup = func(netip.Addr) (segment, error) {
				if tt.sameSegment {
					return segment{link: 1, direct: true}, nil
				}
				return segment{}, nil
			}
			l := serve(t, p, "udp4", "default/dns:dns", be)
			snap := testSnapshot("default/dns:dns", be)
			snap.VIP, snap.External = netip.AddrPortFrom(vips[0], l.Port), vips[1:]
			snap.Metrics = testPortMetrics(snap.Backends...)
			snap.UDPMode, snap.SourceIP = UDPRequestReply, tt.source
			l.Snap.Store(snap)

			var got counts
			for i, vip := range vips {
				// From addresses of their own: the backend's, 127.0.0.1,
				// would be a hairpin, never dialled from the client's.
				c, err := net.DialUDP("udp4", &net.UDPAddr{IP: clients[i].AsSlice()}, net.UDPAddrFromAddrPort(netip.AddrPortFrom(vip, l.Port)))
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				if r := exchange(t, c, []byte("q")); r == "a:1" {
					got.Replies++
				}
			}
			got.Flows, got.Pooled = p.UDPFlows(), int(p.poolOpen.Load())
			got.Fallbacks = snap.Metrics.C.SourceFallbacks[fallbackSameSegment].Load()
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

// query sends one datagram from a new client socket, as a stub resolver
// does, and returns the reply, or "" after wait.
func query(t *testing.T, port uint16, wait time.Duration) string {
	c, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: int(port)})
	if err != nil {
		t.Error(err)
		return ""
	}
	defer c.Close()
	if _, err := c.Write([]byte("q")); err != nil {
		t.Error(err)
		return ""
	}
	c.SetReadDeadline(time.Now().Add(wait))
	buf := make([]byte, 100)
	n, err := c.Read(buf)
	if err != nil {
		return ""
	}
	return string(buf[:n])
}

// serveQueries serves the request-reply port default/dns:dns of engine
// p from bs, as the control plane does a UDP port numbered 53.
func serveQueries(t *testing.T, p *Engine, bs ...netip.AddrPort) (*Listener, *Snapshot) {
	t.Helper()
	l := serve(t, p, "udp4", "default/dns:dns", bs...)
	snap := testSnapshot("default/dns:dns", bs...)
	snap.VIP = netip.MustParseAddrPort("10.96.0.10:53")
	snap.Metrics = testPortMetrics(snap.Backends...)
	snap.UDPMode = UDPRequestReply
	l.Snap.Store(snap)
	return l, snap
}

// TestUDPPoolNoLeaks runs many one-query clients through the pools, and
// checks that every pooled socket and goroutine is gone after shutdown,
// and that the pool never held more sockets than it needed.
func TestUDPPoolNoLeaks(t *testing.T) {
	be := udpBackend(t, "a", false)
	baseG, baseFD := runtime.NumGoroutine(), countFDs(t)
	func() {
		p := startEngine(t, Config{EventLoops: 2})
		l, snap := serveQueries(t, p, be)
		var wg sync.WaitGroup
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 50 {
					if got := query(t, l.Port, 3*time.Second); got != "a:1" {
						t.Errorf("reply %q", got)
						return
					}
				}
			}()
		}
		wg.Wait()
		if n := p.UDPFlows(); n != 0 {
			t.Errorf("%d flows after one-query clients, want 0", n)
		}
		// At most one socket per query in flight.
		if open := p.poolOpen.Load(); open < 1 || open > 4 {
			t.Errorf("%d pooled sockets for 4 clients", open)
		}
		if g := value(snap.Metrics.M.UDPPoolSockets); g != float64(p.poolOpen.Load()) {
			t.Errorf("uproxy_udp_pool_sockets = %v, want %d", g, p.poolOpen.Load())
		}
		// As the proxier's Shutdown does.
		p.Refuse()
		l.Close()
		p.Drain(context.Background())
	}()
	testwait.Until(t, 5*time.Second, "goroutines and descriptors return to baseline", func() bool {
		return runtime.NumGoroutine() <= baseG+2 && countFDs(t) <= baseFD
	})
}

// TestUDPPoolAsksConntrackOncePerClient runs a request-reply port in
// redirect mode, UDPOriginalDst standing for conntrack: a client that
// keeps its port sends every query through the pool, but its original
// destination is looked up once, as a flow's is; a client that conntrack
// knows nothing of is still dropped.
func TestUDPPoolAsksConntrackOncePerClient(t *testing.T) {
	be := udpBackend(t, "a", false)
	var mu sync.Mutex
	lookups := map[uint16]int{} // by client port
	known := map[uint16]bool{}
	p := startEngine(t, Config{
		EventLoops: 1,
		UDPOriginalDst: func(client, local netip.AddrPort) (netip.AddrPort, error) {
			mu.Lock()
			defer mu.Unlock()
			lookups[client.Port()]++
			if !known[client.Port()] {
				return netip.AddrPort{}, errors.New("no conntrack entry")
			}
			return netip.MustParseAddrPort("10.96.0.10:53"), nil
		},
	})
	l, snap := serveQueries(t, p, be)
	c, stranger := dialUDP(t, int(l.Port)), dialUDP(t, int(l.Port))
	cport := netip.MustParseAddrPort(c.LocalAddr().String()).Port()
	mu.Lock()
	known[cport] = true
	mu.Unlock()
	for i := range 5 {
		if got := exchange(t, c, []byte("q")); got != "a:1" {
			t.Fatalf("query %d: reply %q", i, got)
		}
	}
	stranger.Write([]byte("q"))
	stranger.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if n, err := stranger.Read(make([]byte, 10)); err == nil {
		t.Errorf("a datagram that was not redirected got a %d-byte reply", n)
	}
	sport := netip.MustParseAddrPort(stranger.LocalAddr().String()).Port()
	mu.Lock()
	got := map[string]int{"client": lookups[cport], "stranger": lookups[sport]}
	mu.Unlock()
	if diff := cmp.Diff(map[string]int{"client": 1, "stranger": 1}, got); diff != "" {
		t.Errorf("original destination lookups (-want +got):\n%s", diff)
	}
	if sent, flows := value(snap.Metrics.M.UDPPoolQueries[PoolSent]), p.UDPFlows(); sent != 5 || flows != 0 {
		t.Errorf("%v queries pooled and %d flows, want 5 and 0", sent, flows)
	}
}

// value reads a gauge's or a counter's value.
func value(m prometheus.Metric) float64 {
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		return -1
	}
	if d.Gauge != nil {
		return d.Gauge.GetValue()
	}
	return d.Counter.GetValue()
}

// TestUDPPoolIdleSocketGivesWay checks that pools of many source
// addresses cannot hold the engine's bound on pooled sockets in idle
// ones: at the bound, a query from a new client's address closes the
// least recently used idle socket of another pool and is answered.
func TestUDPPoolIdleSocketGivesWay(t *testing.T) {
	if !testlab.RunInNetns(t) {
		return
	}
	be := udpBackend(t, "a", false)
	p := startEngine(t, Config{EventLoops: 1, UDPPoolMax: 1})
	p.clients = podClients{}
	p.src.lookup = func(netip.Addr) (segment, error) { return segment{}, nil }
	l := serve(t, p, "udp4", "default/dns:dns", be)
	snap := testSnapshot("default/dns:dns", be)
	snap.Metrics = testPortMetrics(snap.Backends...)
	snap.UDPMode, snap.SourceIP = UDPRequestReply, SourceClient
	l.Snap.Store(snap)
	var replies []string
	for _, from := range []net.IP{net.IPv4(127, 0, 0, 5), net.IPv4(127, 0, 0, 6), net.IPv4(127, 0, 0, 5)} {
		c, err := net.DialUDP("udp4", &net.UDPAddr{IP: from}, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: int(l.Port)})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		replies = append(replies, exchange(t, c, []byte("q")))
	}
	if diff := cmp.Diff([]string{"a:1", "a:1", "a:1"}, replies); diff != "" {
		t.Errorf("replies (-want +got):\n%s", diff)
	}
	if got := p.poolOpen.Load(); got != 1 {
		t.Errorf("%d pooled sockets open, want the bound, 1", got)
	}
}
