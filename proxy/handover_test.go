package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/listeners"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
)

// passSockets sends socks over a SOCK_SEQPACKET socketpair with
// SCM_RIGHTS, as one uproxy process hands them to the next, closes the
// sender's copies, and returns what arrived, keyed as sent.
func passSockets(t *testing.T, socks []listeners.HandoverSocket) []listeners.HandoverSocket {
	t.Helper()
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pair[0])
	defer unix.Close(pair[1])
	var keys []string
	var fds []int
	for _, s := range socks {
		keys = append(keys, fmt.Sprintf("%s=%d", s.Key, s.Port))
		fds = append(fds, int(s.File.Fd()))
	}
	if err := unix.Sendmsg(pair[0], []byte(strings.Join(keys, "\n")), unix.UnixRights(fds...), nil, 0); err != nil {
		t.Fatal(err)
	}
	listeners.CloseHandoverSockets(socks)
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4*len(socks)))
	n, oobn, flags, _, err := unix.Recvmsg(pair[1], buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		t.Fatalf("message truncated (flags %#x)", flags)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		t.Fatalf("control messages: %v, %v", msgs, err)
	}
	got, err := unix.ParseUnixRights(&msgs[0])
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(buf[:n]), "\n")
	if len(got) != len(lines) {
		t.Fatalf("%d descriptors for %d keys", len(got), len(lines))
	}
	var out []listeners.HandoverSocket
	for i, line := range lines {
		key, port, _ := strings.Cut(line, "=")
		var p uint16
		fmt.Sscan(port, &p)
		out = append(out, listeners.HandoverSocket{Key: key, Port: p, File: os.NewFile(uintptr(got[i]), key)})
	}
	return out
}

// runProxier runs p until stop is called; stop waits for Run to return.
func runProxier(p *Proxier) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }() // ends with stop
	return func() { cancel(); <-done }
}

// waitForFDs waits until the process has no more descriptors than base.
// The garbage collector runs meanwhile: the pipes that splice(2) pools
// are closed by finalizers.
func waitForFDs(t *testing.T, base int) {
	t.Helper()
	testwait.Until(t, 5*time.Second, "descriptors return to their baseline", func() bool {
		runtime.GC()
		return countFDs(t) <= base
	})
}

func roundTrip(c net.Conn, msg string) (string, error) {
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	buf := make([]byte, len(msg))
	_, err := io.ReadFull(c, buf)
	return string(buf), err
}

// TestHandoverAdoptsListeners hands one Proxier's listeners to another
// through a socketpair: the second serves the same ports, including a
// connection and a datagram that arrived while neither was accepting;
// the first drains its own connection; the socket of a service the
// second does not have is closed; and no descriptor leaks.
func TestHandoverAdoptsListeners(t *testing.T) {
	tcpBE := echoBackend(t)
	udpBE := udpBackend(t, "dns", true)
	baseFD := countFDs(t)
	func() {
		services := []*v1.Service{svc("web", "10.96.0.10", "http:80"), svc("dns", "10.96.0.53", "dns:53/UDP"), svc("gone", "10.96.0.11", "http:80")}
		slices := append(slicesFor("web", "http", tcpBE), udpSlice("dns-0", "dns", udpBE))
		slices = append(slices, slicesFor("gone", "http", tcpBE)...)

		oldRules := &recordingRules{}
		old := NewProxier(Config{LoopbackEndpoints: true, Rules: oldRules, Sync: changes.RunnerConfig{MinInterval: 10 * time.Millisecond}})
		stopOld := runProxier(old)
		old.Tracker().Replace(services, slices)
		web, dns, gone := oldRules.port(t, "default/web:http"), oldRules.port(t, "default/dns:dns"), oldRules.port(t, "default/gone:http")

		// A long-lived connection through the old process.
		long, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", web))
		if err != nil {
			t.Fatal(err)
		}
		defer long.Close()
		if got, err := roundTrip(long, "before"); err != nil || got != "before" {
			t.Fatalf("long-lived connection: %q, %v", got, err)
		}

		stopOld() // the sync goroutine owns the listeners: pause it to export them
		socks, err := old.ExportListeners()
		if err != nil {
			t.Fatal(err)
		}
		var keys []string
		for _, s := range socks {
			keys = append(keys, fmt.Sprintf("%s=%d", s.Key, s.Port))
		}
		want := []string{fmt.Sprintf("tcp4 default/gone:http=%d", gone), fmt.Sprintf("tcp4 default/web:http=%d", web), fmt.Sprintf("udp4 default/dns:dns=%d", dns)}
		if diff := cmp.Diff(want, keys); diff != "" {
			t.Fatalf("exported listeners (-want +got):\n%s", diff)
		}
		inherited := passSockets(t, socks)
		old.StopListening()

		// Nobody accepts now; the kernel queues.
		queued, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", web), time.Second)
		if err != nil {
			t.Fatalf("connection refused between the two processes: %v", err)
		}
		defer queued.Close()
		if _, err := queued.Write([]byte("queued")); err != nil {
			t.Fatal(err)
		}
		udpClient, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(dns))))
		if err != nil {
			t.Fatal(err)
		}
		defer udpClient.Close()
		if _, err := udpClient.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}

		newRules := &recordingRules{}
		next := NewProxier(Config{LoopbackEndpoints: true, Rules: newRules, Inherited: listeners.NewInherited(inherited), Sync: changes.RunnerConfig{MinInterval: 10 * time.Millisecond}})
		stopNext := runProxier(next)
		next.Tracker().Replace(services[:2], slices[:2])
		if got := newRules.port(t, "default/web:http"); got != web {
			t.Errorf("web: new listener port %d, want the inherited %d", got, web)
		}
		if got := newRules.port(t, "default/dns:dns"); got != dns {
			t.Errorf("dns: new listener port %d, want the inherited %d", got, dns)
		}

		queued.SetReadDeadline(time.Now().Add(3 * time.Second))
		buf := make([]byte, 6)
		if _, err := io.ReadFull(queued, buf); err != nil || string(buf) != "queued" {
			t.Errorf("queued connection: %q, %v", buf, err)
		}
		udpClient.SetReadDeadline(time.Now().Add(3 * time.Second))
		if n, err := udpClient.Read(buf); err != nil || string(buf[:n]) != "ping" {
			t.Errorf("queued datagram: %q, %v", buf[:n], err)
		}
		fresh, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", web))
		if err != nil {
			t.Fatalf("new connection after the handover: %v", err)
		}
		if got, err := roundTrip(fresh, "after"); err != nil || got != "after" {
			t.Errorf("new connection after the handover: %q, %v", got, err)
		}
		fresh.Close()
		if _, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", gone), time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("the listener of a service the new process lacks: dial = %v, want connection refused", err)
		}

		// The old process still carries its connection, then drains.
		if got, err := roundTrip(long, "during"); err != nil || got != "during" {
			t.Errorf("long-lived connection after the handover: %q, %v", got, err)
		}
		if n := old.ActiveConnections(); n != 1 {
			t.Errorf("old process carries %d connections, want the long-lived one", n)
		}
		long.Close()
		dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := old.Drain(dctx); err != nil {
			t.Errorf("Drain: %v", err)
		}

		queued.Close()
		stopNext()
		if err := next.Shutdown(dctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	}()
	waitForFDs(t, baseFD)
}

// TestInheritedSocketMustFit checks that a listener adopts only a socket
// bound as it would bind its own, and otherwise binds anew and closes
// the misfit.
func TestInheritedSocketMustFit(t *testing.T) {
	listen := func(network, addr string) func(t *testing.T) *os.File {
		return func(t *testing.T) *os.File {
			var c syscall.Conn
			if strings.HasPrefix(network, "udp") {
				pc, err := net.ListenPacket(network, addr)
				if err != nil {
					t.Fatal(err)
				}
				defer pc.Close()
				c = pc.(*net.UDPConn)
			} else {
				ln, err := net.Listen(network, addr)
				if err != nil {
					t.Fatal(err)
				}
				defer ln.Close()
				c = ln.(*net.TCPListener)
			}
			f, err := listeners.SocketFile(c, addr)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	unlistened := func(t *testing.T) *os.File {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Bind(fd, &unix.SockaddrInet4{}); err != nil {
			t.Fatal(err)
		}
		return os.NewFile(uintptr(fd), "bound, not listening")
	}
	for _, tc := range []struct {
		name   string
		socket func(t *testing.T) *os.File
		ports  listeners.PortRange
		want   bool // adopted
	}{
		{"fits", listen("tcp4", "0.0.0.0:0"), listeners.PortRange{}, true},
		{"loopback, as in tproxy mode", listen("tcp4", "127.0.0.1:0"), listeners.PortRange{}, false},
		{"IPv6", listen("tcp6", "[::]:0"), listeners.PortRange{}, false},
		{"UDP", listen("udp4", "0.0.0.0:0"), listeners.PortRange{}, false},
		{"not listening", unlistened, listeners.PortRange{}, false},
		{"outside the port range", listen("tcp4", "0.0.0.0:0"), listeners.PortRange{Base: 1, Size: 1}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			be := nameBackend(t, "a")
			baseFD := countFDs(t)
			f := tc.socket(t)
			var sc unix.Sockaddr
			rc, _ := f.SyscallConn()
			rc.Control(func(fd uintptr) { sc, _ = unix.Getsockname(int(fd)) })
			inheritedPort := 0
			if sa, ok := sc.(*unix.SockaddrInet4); ok {
				inheritedPort = sa.Port
			}
			rules := &recordingRules{}
			ports := tc.ports
			if ports.Size > 0 {
				// A free range that excludes the inherited port.
				ports = listeners.PortRange{Base: uint16(inheritedPort) + 1, Size: 100}
			}
			p := NewProxier(Config{LoopbackEndpoints: true, Rules: rules, PortRange: ports, Inherited: listeners.NewInherited([]listeners.HandoverSocket{{Key: "tcp4 default/web:http", File: f}}), Sync: changes.RunnerConfig{MinInterval: 10 * time.Millisecond}})
			stop := runProxier(p)
			p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", be))
			port := rules.port(t, "default/web:http")
			if got := port == inheritedPort; got != tc.want {
				t.Errorf("adopted = %v (inherited port %d, listener port %d), want %v", got, inheritedPort, port, tc.want)
			}
			if got, err := get(t, port); err != nil || got != "a" {
				t.Errorf("listener does not serve: %q, %v", got, err)
			}
			stop()
			if err := p.Shutdown(context.Background()); err != nil {
				t.Fatal(err)
			}
			waitForFDs(t, baseFD)
		})
	}
}

// TestAdoptedListenerWaitsForFirstSync checks that an adopted listener
// does not accept before a sync has fully succeeded (its queue is still
// served by the previous process), and that Shutdown before that sync
// neither hangs nor leaks.
func TestAdoptedListenerWaitsForFirstSync(t *testing.T) {
	be := echoBackend(t)
	baseFD := countFDs(t)
	func() {
		f, inheritedPort := inheritedTCP4(t)
		rules := &recordingRules{fail: errors.New("iptables-restore: exit status 1")}
		p := NewProxier(Config{LoopbackEndpoints: true, Rules: rules, Inherited: listeners.NewInherited([]listeners.HandoverSocket{{Key: "tcp4 default/web:http", File: f}}), Sync: changes.RunnerConfig{MinInterval: 10 * time.Millisecond}})
		stop := runProxier(p)
		p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", be))
		testwait.Until(t, 5*time.Second, "a failed sync", func() bool { rules.mu.Lock(); defer rules.mu.Unlock(); return rules.calls >= 1 })

		c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", inheritedPort))
		if err != nil {
			t.Fatalf("the inherited socket does not queue: %v", err)
		}
		defer c.Close()
		if _, err := c.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		if n, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("served before the first successful sync: read %d, %v", n, err)
		}
		if n := p.ActiveConnections(); n != 0 {
			t.Errorf("%d connections accepted before the first successful sync", n)
		}

		stop()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := p.Shutdown(sctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	}()
	waitForFDs(t, baseFD)
}

// inheritedTCP4 returns the duplicate of a TCP listening socket on an
// ephemeral port of every IPv4 address, as a previous process hands it
// over for default/web:http, and its port. The socket has no other
// descriptor.
func inheritedTCP4(t *testing.T) (*os.File, int) {
	t.Helper()
	ln, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	f, err := listeners.SocketFile(ln.(*net.TCPListener), "web")
	ln.Close() // the inherited duplicate keeps the socket
	if err != nil {
		t.Fatal(err)
	}
	return f, ln.Addr().(*net.TCPAddr).Port
}
