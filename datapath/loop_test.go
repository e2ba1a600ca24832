package datapath

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/uproxy/uproxy/internal/testwait"
	"golang.org/x/sys/unix"
)

// acceptOptions are the options setAcceptOptions sets, as getsockopt
// reads them back.
var acceptOptions = map[string]int{"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 15, "TCP_KEEPINTVL": 15, "TCP_KEEPCNT": 9, "TCP_NODELAY": 1}

// socketOptions reads fd's options of acceptOptions.
func socketOptions(t *testing.T, fd int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for name, o := range map[string][2]int{
		"SO_KEEPALIVE":  {unix.SOL_SOCKET, unix.SO_KEEPALIVE},
		"TCP_KEEPIDLE":  {unix.IPPROTO_TCP, unix.TCP_KEEPIDLE},
		"TCP_KEEPINTVL": {unix.IPPROTO_TCP, unix.TCP_KEEPINTVL},
		"TCP_KEEPCNT":   {unix.IPPROTO_TCP, unix.TCP_KEEPCNT},
		"TCP_NODELAY":   {unix.IPPROTO_TCP, unix.TCP_NODELAY},
	} {
		v, err := unix.GetsockoptInt(fd, o[0], o[1])
		if err != nil {
			t.Errorf("%s: %v", name, err)
		}
		got[name] = v
	}
	return got
}

// TestAcceptedSocketsInheritOptions checks that sockets accepted raw, as
// the event loops accept them, carry TCP keep-alive with Go's default timing and
// TCP_NODELAY, which setAcceptOptions sets only once, on the listening
// socket.
func TestAcceptedSocketsInheritOptions(t *testing.T) {
	ln, err := (&net.ListenConfig{KeepAlive: -1}).Listen(context.Background(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	rc, err := ln.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if err := setAcceptOptions(rc); err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The handshake is over once Dial returns: the connection is queued.
	nfd, aerr := -1, error(nil)
	rc.Control(func(fd uintptr) { nfd, _, aerr = unix.Accept4(int(fd), unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC) })
	if aerr != nil {
		t.Fatal(aerr)
	}
	defer unix.Close(nfd)
	if diff := cmp.Diff(acceptOptions, socketOptions(t, nfd)); diff != "" {
		t.Errorf("accepted socket's options (-want +got):\n%s", diff)
	}
}

// TestListenersCarryAcceptOptions checks that uproxy's listening sockets
// carry setAcceptOptions' options, on epoll and on io_uring: their
// accepted sockets inherit them (TestAcceptedSocketsInheritOptions).
func TestListenersCarryAcceptOptions(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		be := nameBackend(t, "a")
		_, port := proxyWeb(t, Config{IOURing: dp.ring}, be)
		fd := listeningSocket(t, port)
		if diff := cmp.Diff(acceptOptions, socketOptions(t, fd)); diff != "" {
			t.Errorf("listener's options (-want +got):\n%s", diff)
		}
	})
}

// listeningSocket returns the descriptor, in this process, of the TCP
// socket listening on port.
func listeningSocket(t *testing.T, port int) int {
	t.Helper()
	return findSocket(t, fmt.Sprintf("listens on port %d", port), func(fd int) bool {
		sa, err := unix.Getsockname(fd)
		if a, ok := sa.(*unix.SockaddrInet4); err != nil || !ok || a.Port != port {
			return false
		}
		v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
		return err == nil && v == 1
	})
}

// connectedSocket returns the descriptor, in this process, of the TCP
// socket connected to 127.0.0.1:port (the proxy's side of a backend
// connection, not the backend's own).
func connectedSocket(t *testing.T, port int) int {
	t.Helper()
	return findSocket(t, fmt.Sprintf("is connected to port %d", port), func(fd int) bool {
		sa, err := unix.Getpeername(fd)
		a, ok := sa.(*unix.SockaddrInet4)
		return err == nil && ok && a.Port == port
	})
}

// findSocket returns the first descriptor of this process that match
// accepts; the test fails if there is none ("no socket of this process"
// and what).
func findSocket(t *testing.T, what string, match func(fd int) bool) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && match(fd) {
			return fd
		}
	}
	t.Fatalf("no socket of this process %s", what)
	return -1
}

// TestIdleConnectionsHoldNoGoroutine checks the event loops' point: once
// proxied connections are established and idle, the proxy holds no
// goroutine for them (with a goroutine per direction it held two each).
func TestIdleConnectionsHoldNoGoroutine(t *testing.T) {
	be := startBackend(t, func(c net.Conn) { io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{c}) })
	p, port := proxyWeb(t, Config{IdleTimeout: time.Hour}, be)
	const n = 200
	conns := make([]net.Conn, 0, n+1)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	// Before the count: a first connection starts the loops.
	conns = append(conns, echoOnce(t, port, 0))
	testwait.Until(t, 5*time.Second, "the first session is carried", func() bool { return p.ActiveConnections() == 1 })
	// The test's own goroutines: the backend's handler per connection.
	base := runtime.NumGoroutine()
	for i := 1; i <= n; i++ {
		conns = append(conns, echoOnce(t, port, i))
	}
	testwait.Until(t, 5*time.Second, "every session is registered", func() bool { return p.ActiveConnections() == n+1 })
	testwait.UntilOK(t, 5*time.Second, "the proxy to hold no goroutine for the idle connections", func() (bool, string) {
		proxyG := runtime.NumGoroutine() - base - n // less one backend handler per connection
		return proxyG <= 0, fmt.Sprintf("%d goroutines for %d idle connections", proxyG, n)
	})
}

// TestBackendKeepAliveComesLater checks that an event loop connects
// backends without keep-alive, and turns it on, with Go's default timing,
// at its next keep-alive round (armKeepAlive): a short connection never
// pays for it, a lasting one gets it.
func TestBackendKeepAliveComesLater(t *testing.T) {
	for _, tt := range []struct {
		name  string
		every time.Duration
		want  map[string]int
	}{
		{"before the round", time.Hour, map[string]int{"SO_KEEPALIVE": 0, "TCP_NODELAY": 1}},
		{"after the round", 50 * time.Millisecond, acceptOptions},
	} {
		t.Run(tt.name, func(t *testing.T) {
			be := echoBackend(t)
			_, port := proxyWeb(t, Config{BackendKeepAliveEvery: tt.every}, be)
			c := echoOnce(t, port, 0)
			defer c.Close()
			fd := connectedSocket(t, int(be.addr.Port()))
			pick := func(m map[string]int) map[string]int {
				out := map[string]int{}
				for k := range tt.want {
					out[k] = m[k]
				}
				return out
			}
			testwait.UntilOK(t, 5*time.Second, "the backend socket's options", func() (bool, string) {
				diff := cmp.Diff(tt.want, pick(socketOptions(t, fd)))
				return diff == "", "(-want +got):\n" + diff
			})
			if tt.every == time.Hour {
				// Still none a while later: nothing else turns it on.
				testwait.Never(t, 100*time.Millisecond, "the backend socket's options changed", func() bool {
					return !cmp.Equal(tt.want, pick(socketOptions(t, fd)))
				})
			}
		})
	}
}
