package datapath

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/internal/testbackend"
	"github.com/uproxy/uproxy/internal/testwait"
)

// udpBackend answers every datagram with "name:" and the datagram's
// length, or echoes it when echo is set.
func udpBackend(t testing.TB, name string, echo bool) netip.AddrPort {
	return testbackend.UDP(t, name, echo)
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
			p := startEngine(t, Config{EventLoops: 2, IOURing: ring, UDPTimeout: time.Minute})
			dns, dns2 := serve(t, p, "udp4", "default/dns:dns", echo), serve(t, p, "udp4", "default/dns2:dns", echo)
			for _, l := range []*Listener{dns, dns2} {
				port := int(l.Port)
				for range 4 {
					exchange(t, dialUDP(t, port), []byte("x"))
				}
			}
			// flowsOf counts the flows of the service port listener svc, and
			// checks each against its listener, if that is still open.
			flowsOf := func(svc *Listener) int {
				name := svc.Name
				n := 0
				flows := p.flowTable()
				for _, k := range flows.Keys() {
					f, ok := flows.Peek(k)
					if !ok || f.svc != svc {
						continue
					}
					n++
					l := k.l
					if l.PC != nil || l.raw == nil || l.raw.readable == nil {
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
			if n, n2 := flowsOf(dns), flowsOf(dns2); n != 4 || n2 != 4 {
				t.Fatalf("flows: %d of dns and %d of dns2, want 4 each", n, n2)
			}
			dns.Close() // as the proxier does when the service goes
			testwait.Until(t, 5*time.Second, "the closed listener's flows end", func() bool { return flowsOf(dns) == 0 })
			if n := flowsOf(dns2); n != 4 {
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
			{"IPv4", "udp4", "127.0.0.1", ""},
			{"IPv6", "udp6", "::1", ""},
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
				p := startEngine(t, Config{IOURing: dp.ring})
				port := int(serve(t, p, tt.network, "default/dns:dns", echo).Port)
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
