package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/ptr"
)

// udpBackend answers every datagram with "name:" and the datagram's
// length, or echoes it when echo is set.
func udpBackend(t testing.TB, name string, echo bool) netip.AddrPort {
	t.Helper()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 65535)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			if echo {
				pc.WriteTo(buf[:n], from)
			} else {
				fmt.Fprintf(writerTo{pc, from}, "%s:%d", name, n)
			}
		}
	}()
	t.Cleanup(func() { pc.Close(); <-done })
	return netip.MustParseAddrPort(pc.LocalAddr().String())
}

type writerTo struct {
	pc net.PacketConn
	to net.Addr
}

func (w writerTo) Write(b []byte) (int, error) { return w.pc.WriteTo(b, w.to) }

func udpSlice(name, svc string, backends ...netip.AddrPort) *discovery.EndpointSlice {
	s := slice(name, svc, "dns", int32(backends[0].Port()))
	s.Ports[0].Protocol = ptr.To(v1.ProtocolUDP)
	for _, b := range backends {
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{Addresses: []string{b.Addr().String()}, Conditions: discovery.EndpointConditions{Ready: ptr.To(true)}})
	}
	return s
}

// udpSlices gives each backend (with its own port) its own slice.
func udpSlices(svc string, backends ...netip.AddrPort) []*discovery.EndpointSlice {
	var out []*discovery.EndpointSlice
	for i, b := range backends {
		out = append(out, udpSlice(fmt.Sprintf("%s-%d", svc, i), svc, b))
	}
	return out
}

// exchange sends msg from a connected client socket and returns the reply:
// a connected socket accepts only replies from the address it sent to.
func exchange(t *testing.T, c *net.UDPConn, msg []byte) string {
	t.Helper()
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	buf := make([]byte, 65535)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatalf("no reply: %v", err)
	}
	return string(buf[:n])
}

func dialUDP(t testing.TB, port int) *net.UDPConn {
	t.Helper()
	c, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestUDPFlows(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		a, b := udpBackend(t, "a", false), udpBackend(t, "b", false)
		p, rules := startProxier(t, Config{EventLoops: dp.loops, IOURing: dp.ring, UDPTimeout: 300 * time.Millisecond})
		dns := udpMode(svc("dns", "10.96.0.10", "dns:53/UDP"), "flow")
		p.Tracker().Replace([]*v1.Service{dns}, udpSlices("dns", a, b))
		port := rules.port(t, "default/dns:dns")

		// Each client sticks to one backend; two clients spread over both.
		c1, c2 := dialUDP(t, port), dialUDP(t, port)
		first := exchange(t, c1, []byte("hello"))
		for range 5 {
			if got := exchange(t, c1, []byte("hello")); got != first {
				t.Fatalf("flow moved from %q to %q", first, got)
			}
		}
		second := exchange(t, c2, []byte("hi"))
		if first[:1] == second[:1] {
			t.Errorf("two clients on the same backend %q under round-robin", first[:1])
		}
		if p.UDPFlows() != 2 {
			t.Errorf("%d flows, want 2", p.UDPFlows())
		}

		// Datagrams up to the maximum size are forwarded whole.
		if got := exchange(t, c1, bytes.Repeat([]byte{'x'}, 65507)); !strings.HasSuffix(got, ":65507") {
			t.Errorf("max-size datagram: backend saw %q", got)
		}

		// c1's backend is removed: its next datagram moves to the other one.
		var keep netip.AddrPort
		if first[:1] == "a" {
			keep = b
		} else {
			keep = a
		}
		p.Tracker().Replace([]*v1.Service{dns}, udpSlices("dns", keep))
		waitUntil(t, "c1 moves to the live backend", func() bool {
			return exchange(t, c1, []byte("again"))[:1] != first[:1]
		})

		// Idle flows expire.
		waitUntil(t, "flows expire", func() bool { return p.UDPFlows() == 0 })
	})
}

// TestUDPListenerOnItsLoop checks that, with event loops, one loop reads
// a UDP listener's socket, which has left the runtime's poller, and
// carries every flow it creates, so that a request and its reply are
// handled by one thread; and that closing the listener ends its flows on
// that loop at once, not at their timeout.
func TestUDPListenerOnItsLoop(t *testing.T) {
	for _, ring := range []bool{false, true} {
		t.Run(map[bool]string{false: "epoll", true: "ring"}[ring], func(t *testing.T) {
			if ring {
				if err := IOURingSupported(); err != nil {
					t.Skipf("skipping: the event loops cannot use io_uring here: %v", err)
				}
			}
			echo := udpBackend(t, "", true)
			p, rules := startProxier(t, Config{EventLoops: 2, IOURing: ring, UDPTimeout: time.Minute})
			dns, dns2 := udpMode(svc("dns", "10.96.0.10", "dns:53/UDP"), "flow"), udpMode(svc("dns2", "10.96.0.11", "dns:53/UDP"), "flow")
			p.Tracker().Replace([]*v1.Service{dns, dns2}, append(udpSlices("dns", echo), udpSlices("dns2", echo)...))
			for _, name := range []string{"default/dns:dns", "default/dns2:dns"} {
				port := rules.port(t, name)
				for range 4 {
					exchange(t, dialUDP(t, port), []byte("x"))
				}
			}
			// flowsOf counts the flows of the listener of service name, and
			// checks each against its listener, if that is still open.
			flowsOf := func(name string) int {
				n := 0
				flows := p.flowTable()
				for _, k := range flows.Keys() {
					f, ok := flows.Peek(k)
					if !ok || f.svc.key.name.Name != name {
						continue
					}
					n++
					l := k.l
					if l.pc != nil || l.raw == nil || l.raw.readable == nil {
						t.Fatalf("%s: the listener is read on a goroutine, not by a loop", name)
					}
					l.raw.mu.Lock()
					regs, open := slices.Clone(l.raw.regs), l.raw.fd >= 0
					l.raw.mu.Unlock()
					if open && (len(regs) != 1 || regs[0].loop != f.loop) {
						t.Errorf("%s: a flow of %s is on loop %p; its listener is registered with %d loops (%v)", name, k.client, f.loop, len(regs), regs)
					}
				}
				return n
			}
			if n, n2 := flowsOf("dns"), flowsOf("dns2"); n != 4 || n2 != 4 {
				t.Fatalf("flows: %d of dns and %d of dns2, want 4 each", n, n2)
			}
			p.Tracker().Replace([]*v1.Service{dns2}, udpSlices("dns2", echo))
			waitUntil(t, "the closed listener's flows end", func() bool { return flowsOf("dns") == 0 })
			if n := flowsOf("dns2"); n != 4 {
				t.Errorf("%d flows of dns2 after dns was removed, want 4", n)
			}
		})
	}
}

// TestUDPRepliesComeFromTheServiceAddress checks, for both families, that
// replies leave from the address the client sent to (IP_PKTINFO,
// IPV6_PKTINFO), whatever address the kernel would otherwise pick, and
// that a batch of datagrams queued at once is read and answered whole.
func TestUDPRepliesComeFromTheServiceAddress(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		for _, tt := range []struct {
			name, network, loopback, vip string
		}{
			{"IPv4", "udp4", "127.0.0.1", "10.96.0.10"},
			{"IPv6", "udp6", "::1", "2001:db8:96::10"},
		} {
			t.Run(tt.name, func(t *testing.T) {
				pc, err := net.ListenPacket(tt.network, net.JoinHostPort(tt.loopback, "0"))
				if err != nil {
					t.Skipf("no %s loopback: %v", tt.name, err)
				}
				go func() { // ends when pc is closed
					buf := make([]byte, 65535)
					for {
						n, from, err := pc.ReadFrom(buf)
						if err != nil {
							return
						}
						pc.WriteTo(buf[:n], from)
					}
				}()
				t.Cleanup(func() { pc.Close() })
				echo := netip.MustParseAddrPort(pc.LocalAddr().String())
				p, rules := startProxier(t, Config{EventLoops: dp.loops, IOURing: dp.ring})
				sl := udpSlice("dns", "dns", echo)
				if echo.Addr().Is6() {
					sl.AddressType = discovery.AddressTypeIPv6
				}
				p.Tracker().Replace([]*v1.Service{svc("dns", tt.vip, "dns:53/UDP")}, []*discovery.EndpointSlice{sl})
				port := rules.port(t, "default/dns:dns")
				// Without the kernel's REDIRECT, "the service address" is the
				// address the client sent to: an unconnected socket shows the
				// reply's source.
				c, err := net.ListenPacket(tt.network, net.JoinHostPort(tt.loopback, "0"))
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				to := &net.UDPAddr{IP: net.ParseIP(tt.loopback), Port: port}
				const queued = 2*flowBudget + 5 // more than one wake-up relays for a flow
				for i := range queued {
					if _, err := c.WriteTo([]byte(fmt.Sprint(i)), to); err != nil {
						t.Fatal(err)
					}
				}
				got := map[string]bool{}
				buf := make([]byte, 10)
				for range queued {
					c.SetReadDeadline(time.Now().Add(3 * time.Second))
					n, from, err := c.ReadFrom(buf)
					if err != nil {
						t.Fatalf("%d of %d replies: %v", len(got), queued, err)
					}
					if from.String() != to.String() {
						t.Errorf("reply %q from %v, want from %v", buf[:n], from, to)
					}
					got[string(buf[:n])] = true
				}
				if len(got) != queued {
					t.Errorf("%d distinct replies, want %d", len(got), queued)
				}
			})
		}
	})
}

func TestUDPEjectsRefusingBackend(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		good := udpBackend(t, "good", false)
		// A port nobody listens on answers with ICMP port unreachable.
		dead, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		deadAddr := netip.MustParseAddrPort(dead.LocalAddr().String())
		dead.Close()
		p, rules := startProxier(t, Config{EventLoops: dp.loops, IOURing: dp.ring, EjectBase: time.Minute})
		p.Tracker().Replace([]*v1.Service{svc("dns", "10.96.0.10", "dns:53/UDP")}, udpSlices("dns", deadAddr, good))
		port := rules.port(t, "default/dns:dns")
		// Whichever client lands on the dead backend first loses that datagram
		// (UDP has no retry), but the backend is ejected and no later datagram
		// is lost.
		for i := range 4 {
			c := dialUDP(t, port)
			c.Write([]byte("probe"))
			c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
			c.Read(make([]byte, 100))
			_ = i
		}
		for i := range 10 {
			c := dialUDP(t, port)
			if got := exchange(t, c, []byte("x")); !strings.HasPrefix(got, "good:") {
				t.Fatalf("client %d got %q", i, got)
			}
		}
	})
}

func TestUDPNoLeaks(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		echo := udpBackend(t, "", true)
		baseG, baseFD := runtime.NumGoroutine(), countFDs(t)
		func() {
			reg := prometheus.NewRegistry()
			// Without pooling, every one-query client is a flow
			// (TestUDPPoolNoLeaks checks the pools).
			p, rules := startProxier(t, Config{EventLoops: dp.loops, IOURing: dp.ring, UDPMaxFlows: 50, UDPPoolSize: -1, Metrics: NewMetrics(reg)})
			p.Tracker().Replace([]*v1.Service{svc("dns", "10.96.0.10", "dns:53/UDP")}, udpSlices("dns", echo))
			port := rules.port(t, "default/dns:dns")
			for range 200 {
				c := dialUDP(t, port)
				exchange(t, c, []byte("x"))
				c.Close()
			}
			if n := p.UDPFlows(); n > 50 {
				t.Errorf("%d flows, above the bound of 50", n)
			}
			// Each flow past the 50th made the table end its oldest one.
			// (Not one per client: the kernel may give a closed client's
			// port to the next, which then finds its flow still there.)
			opened, _ := scrape(t, reg, "uproxy_connections_total", map[string]string{"result": "ok"})
			if got, _ := scrape(t, reg, "uproxy_udp_flows_evicted_total", nil); opened < 100 || got != opened-50 {
				t.Errorf("uproxy_udp_flows_evicted_total = %v after %v flows; want all but 50 of them", got, opened)
			}
			// Evicted flows close their sockets: at most the 50 flows',
			// the listener's and the event loop's remain.
			waitUntil(t, "evicted flows' sockets close", func() bool { return countFDs(t) <= baseFD+50+4 })
			p.Shutdown(t.Context())
		}()
		// One goroutine stays: the flow table's expiry loop (see flowTable).
		waitUntil(t, "goroutines and descriptors return to baseline", func() bool {
			return runtime.NumGoroutine() <= baseG+2 && countFDs(t) <= baseFD
		})
	})
}

// loopbackUDP returns a UDP socket on 127.0.0.1, closed when the test
// ends, and its RawConn.
func loopbackUDP(t *testing.T) (*net.UDPConn, syscall.RawConn) {
	t.Helper()
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	return c, rc
}

// dupForTest returns a duplicate of rc's socket, as rawListenerFD makes
// one; the caller closes it.
func dupForTest(t *testing.T, rc syscall.RawConn) int {
	t.Helper()
	fd, err := dupRaw(rc)
	if err != nil {
		t.Fatal(err)
	}
	return fd
}

// TestReplySenderDoesNotAllocate checks that relaying a reply allocates
// nothing: RawConn.Write's function is bound once per sender, and the
// message, its address and its IP_PKTINFO live in the sender.
func TestReplySenderDoesNotAllocate(t *testing.T) {
	from, rc := loopbackUDP(t)
	to, _ := loopbackUDP(t)
	client := netip.MustParseAddrPort(to.LocalAddr().String())
	src := netip.MustParseAddr("127.0.0.1")
	rs, msg := newReplySender(), []byte("reply")
	if allocs := testing.AllocsPerRun(100, func() {
		if err := rs.send(replyPath{rc: rc, src: src}, msg, client); err != nil {
			t.Fatal(err)
		}
	}); allocs != 0 {
		t.Errorf("%v allocations per reply, want 0", allocs)
	}
	to.SetReadDeadline(time.Now().Add(time.Second))
	buf := make([]byte, 16)
	n, got, err := to.ReadFromUDPAddrPort(buf)
	if err != nil || string(buf[:n]) != "reply" || got != netip.MustParseAddrPort(from.LocalAddr().String()) {
		t.Errorf("received %q from %v (%v), want %q from %v", buf[:n], got, err, "reply", from.LocalAddr())
	}
}

// TestReplyQueue checks that a loop's queued replies go out with one
// sendmmsg, each to its own client with its own payload, that a reply
// the kernel refuses is reported and skipped without losing the ones
// after it, and that queueing and flushing allocate nothing.
func TestReplyQueue(t *testing.T) {
	from, rc := loopbackUDP(t)
	var clients []*net.UDPConn
	var flows []*udpFlow
	for range 2 {
		c, _ := loopbackUDP(t)
		clients = append(clients, c)
		flows = append(flows, &udpFlow{key: flowKey{client: netip.MustParseAddrPort(c.LocalAddr().String())}})
	}
	// Port 0 is no destination: sendmsg(2) fails with EINVAL.
	bad := &udpFlow{key: flowKey{client: netip.MustParseAddrPort("127.0.0.1:0")}}

	type outcome struct {
		Client netip.AddrPort
		N      int
		Failed bool
	}
	var got []outcome
	q := newReplyQueue(func(f *udpFlow, n int, err error) {
		got = append(got, outcome{f.key.client, n, err != nil})
	})
	path := replyPath{rc: rc, src: netip.MustParseAddr("127.0.0.1")}
	q.add(path, []byte("first"), flows[0])
	q.add(path, []byte("refused"), bad)
	q.add(path, []byte("second!"), flows[1])
	q.flush()
	want := []outcome{{flows[0].key.client, 5, false}, {bad.key.client, 0, true}, {flows[1].key.client, 7, false}}
	if diff := cmp.Diff(want, got, cmpopts.EquateComparable(netip.AddrPort{})); diff != "" {
		t.Errorf("outcomes (-want +got):\n%s", diff)
	}
	for i, c := range clients {
		c.SetReadDeadline(time.Now().Add(time.Second))
		buf := make([]byte, 16)
		n, src, err := c.ReadFromUDPAddrPort(buf)
		if wantMsg := []string{"first", "second!"}[i]; err != nil || string(buf[:n]) != wantMsg || src.String() != from.LocalAddr().String() {
			t.Errorf("client %d received %q from %v (%v); want %q from %v", i, buf[:n], src, err, wantMsg, from.LocalAddr())
		}
	}

	got = got[:0:cap(got)]
	msg := []byte("reply")
	if allocs := testing.AllocsPerRun(100, func() {
		q.add(path, msg, flows[0])
		q.add(path, msg, flows[1])
		q.flush()
		got = got[:0]
	}); allocs != 0 {
		t.Errorf("%v allocations per batch, want 0", allocs)
	}
}

// TestListenSocketReadDoesNotAllocate checks that reading a listener's
// datagrams allocates nothing once its buffers are pooled, over the
// runtime's poller and over an event loop's socket (loopListener): the
// function RawConn.Read calls is bound once per socket, and what it finds
// stays in the socket. The loop's socket never waits: it says EAGAIN when
// nothing is queued, and net.ErrClosed once closed. Under the race
// detector, whose sync.Pool drops buffers at random, allocations are not
// counted.
func TestListenSocketReadDoesNotAllocate(t *testing.T) {
	for _, loop := range []bool{false, true} {
		t.Run(map[bool]string{false: "poller", true: "loop"}[loop], func(t *testing.T) {
			pc, rc := loopbackUDP(t)
			var ll *loopListener
			if loop {
				ll = &loopListener{rawSock: rawSock{fd: dupForTest(t, rc)}}
				defer ll.close()
				rc = ll
			}
			ls, err := newListenSocket(rc, false, true, 8)
			if err != nil {
				t.Fatal(err)
			}
			if loop {
				ls.seesEmpty()
			}
			c, err := net.DialUDP("udp4", nil, pc.LocalAddr().(*net.UDPAddr))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			msg := []byte("request")
			batch := make([]datagram, 8)
			var got datagram
			if allocs := testing.AllocsPerRun(100, func() {
				if _, err := c.Write(msg); err != nil {
					t.Fatal(err)
				}
				n, err := ls.readBatch(batch)
				if err != nil || n != 1 {
					t.Fatalf("readBatch: %d, %v", n, err)
				}
				if loop && !ls.drained() {
					t.Fatal("the read did not find the queue empty")
				}
				got = batch[0]
				got.buf = nil
				listenBuffers.put(batch[0].buf)
				batch[0] = datagram{}
			}); allocs != 0 && !raceEnabled {
				t.Errorf("%v allocations per datagram read, want 0", allocs)
			}
			want := datagram{n: len(msg), client: netip.MustParseAddrPort(c.LocalAddr().String()), dst: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), 0)}
			if diff := cmp.Diff(want, got, cmp.AllowUnexported(datagram{}), cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
				t.Errorf("datagram (-want +got):\n%s", diff)
			}
			if !loop {
				return
			}
			if n, err := ls.readBatch(batch); err != unix.EAGAIN {
				t.Errorf("read of an empty socket: %d, %v; want EAGAIN", n, err)
			}
			ll.close()
			if n, err := ls.readBatch(batch); !errors.Is(err, net.ErrClosed) {
				t.Errorf("read of a closed socket: %d, %v; want net.ErrClosed", n, err)
			}
		})
	}
}
