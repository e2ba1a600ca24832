package proxy

import (
	"context"
	"io"
	"net"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"
)

// TestAcceptedSocketsInheritOptions checks that sockets accepted raw, as
// acceptRaw does, carry TCP keep-alive with Go's default timing and
// TCP_NODELAY, which are set only once, on the listening socket: by
// listenConfig for uproxy's own listeners, by setAcceptOptions for one
// from elsewhere.
func TestAcceptedSocketsInheritOptions(t *testing.T) {
	p := NewProxier(Config{})
	own := func() net.Listener {
		ln, err := p.listen(context.Background(), "tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return ln
	}
	elsewhere := func() net.Listener {
		ln, err := (&net.ListenConfig{KeepAlive: -1}).Listen(context.Background(), "tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		rc, err := ln.(syscall.Conn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		if err := setAcceptOptions(rc); err != nil {
			t.Fatal(err)
		}
		return ln
	}
	for name, open := range map[string]func() net.Listener{"uproxy's listener": own, "a listener from elsewhere": elsewhere} {
		t.Run(name, func(t *testing.T) { acceptedSocketOptions(t, open()) })
	}
}

func acceptedSocketOptions(t *testing.T, ln net.Listener) {
	defer ln.Close()
	rc, err := ln.(syscall.Conn).SyscallConn()
	if err != nil {
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
	got := map[string]int{}
	for name, o := range map[string][2]int{
		"SO_KEEPALIVE":  {unix.SOL_SOCKET, unix.SO_KEEPALIVE},
		"TCP_KEEPIDLE":  {unix.IPPROTO_TCP, unix.TCP_KEEPIDLE},
		"TCP_KEEPINTVL": {unix.IPPROTO_TCP, unix.TCP_KEEPINTVL},
		"TCP_KEEPCNT":   {unix.IPPROTO_TCP, unix.TCP_KEEPCNT},
		"TCP_NODELAY":   {unix.IPPROTO_TCP, unix.TCP_NODELAY},
	} {
		v, err := unix.GetsockoptInt(nfd, o[0], o[1])
		if err != nil {
			t.Errorf("%s: %v", name, err)
		}
		got[name] = v
	}
	want := map[string]int{"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 15, "TCP_KEEPINTVL": 15, "TCP_KEEPCNT": 9, "TCP_NODELAY": 1}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("accepted socket's options (-want +got):\n%s", diff)
	}
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
	waitUntil(t, "the first session is carried", func() bool { return p.ActiveConnections() == 1 })
	// The test's own goroutines: the backend's handler per connection.
	base := runtime.NumGoroutine()
	for i := 1; i <= n; i++ {
		conns = append(conns, echoOnce(t, port, i))
	}
	waitUntil(t, "every session is registered", func() bool { return p.ActiveConnections() == n+1 })
	var proxyG int
	deadline := time.Now().Add(5 * time.Second)
	for {
		proxyG = runtime.NumGoroutine() - base - n // less one backend handler per connection
		if proxyG <= 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if proxyG > 0 {
		t.Fatalf("the proxy holds %d goroutines for %d idle connections; want none", proxyG, n)
	}
}
