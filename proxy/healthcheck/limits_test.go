package healthcheck

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/uproxy/uproxy/internal/httplimit"
)

// runProxyHealth serves a healthy ProxyHealth with server limits srv on
// loopback until the test ends, and returns its address.
func runProxyHealth(t *testing.T, srv httplimit.ServerConfig) string {
	t.Helper()
	bound := make(chan string, 1)
	h := NewProxyHealth(ProxyHealthConfig{
		Addr:   "0.0.0.0:10256",
		Clock:  testingclock.NewFakeClock(t0),
		Server: srv,
		Listen: func(string, string) (net.Listener, error) {
			ln, err := net.Listen("tcp4", "127.0.0.1:0")
			if err == nil {
				bound <- ln.Addr().String()
			}
			return ln, err
		},
	})
	h.Updated()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	select {
	case addr := <-bound:
		return addr
	case err := <-done:
		t.Fatalf("Run returned early: %v", err)
		return ""
	}
}

// idleConn is a client connection that holds a server's connection open.
type idleConn struct {
	c net.Conn
	r *bufio.Reader
}

// openIdle connects to addr and, with path set, sends one kept-alive GET
// of it and reads the answer; the test closes the connection when it ends.
func openIdle(t *testing.T, addr, path string) idleConn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	ic := idleConn{c, bufio.NewReader(c)}
	if path == "" {
		return ic
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	defer c.SetDeadline(time.Time{})
	fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", path)
	resp, err := http.ReadResponse(ic.r, nil)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return ic
}

// closedWithin reports whether the server closes ic within d: a read ends
// with EOF or a reset rather than the deadline.
func (ic idleConn) closedWithin(d time.Duration) bool {
	ic.c.SetReadDeadline(time.Now().Add(d))
	defer ic.c.SetReadDeadline(time.Time{})
	_, err := ic.r.Read(make([]byte, 1))
	return err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
}

// probe GETs http://addr+path on a fresh connection within a load
// balancer's probe timeout.
func probe(addr, path string) (int, error) {
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 2 * time.Second}).Get("http://" + addr + path)
	if err != nil {
		return 0, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, nil
}

// TestProxyHealthClosesIdleConnections checks that the healthz server
// closes idle connections, kept-alive ones included, after its idle and
// header time-outs. Before, a kept-alive connection was held for ever,
// with its descriptor.
func TestProxyHealthClosesIdleConnections(t *testing.T) {
	checkNoLeaks(t)
	const d = 100 * time.Millisecond
	addr := runProxyHealth(t, httplimit.ServerConfig{ReadHeaderTimeout: d, IdleTimeout: d})
	var conns []idleConn
	for range 5 {
		conns = append(conns, openIdle(t, addr, ""), openIdle(t, addr, "/healthz"))
	}
	deadline := time.Now().Add(5 * time.Second)
	for i, ic := range conns {
		if !ic.closedWithin(time.Until(deadline)) {
			kind := map[bool]string{true: "silent", false: "kept alive"}[i%2 == 0]
			t.Errorf("idle connection %d (%s) is still open", i, kind)
		}
	}
}

// TestProxyHealthBoundsConnections checks that idle connections past the
// bound do not hold descriptors (the longest idle are closed), and that a
// health probe is answered at the bound at once, long before any idle
// connection's time-out.
func TestProxyHealthBoundsConnections(t *testing.T) {
	checkNoLeaks(t)
	const limit, extra = 4, 8
	addr := runProxyHealth(t, httplimit.ServerConfig{ReadHeaderTimeout: time.Minute, IdleTimeout: time.Minute, MaxConnections: limit})
	var conns []idleConn
	for range limit + extra {
		conns = append(conns, openIdle(t, addr, ""))
	}
	for i, ic := range conns[:extra] {
		if !ic.closedWithin(5 * time.Second) {
			t.Fatalf("connection %d of %d is still open with a bound of %d", i, limit+extra, limit)
		}
	}
	for i, ic := range conns[extra:] {
		if ic.closedWithin(20 * time.Millisecond) {
			t.Errorf("connection %d, one of the %d most recent, was closed", extra+i, limit)
		}
	}
	if code, err := probe(addr, "/healthz"); err != nil || code != http.StatusOK {
		t.Errorf("probe at the bound: %d, %v; want 200", code, err)
	}
}

// TestServiceHealthBoundsConnectionsTogether checks that the health-check
// servers of all services share one bound: idle connections to one
// service's port make room for a probe of another's.
func TestServiceHealthBoundsConnectionsTogether(t *testing.T) {
	checkNoLeaks(t)
	const limit = 4
	fn := newFakeNet()
	s := NewServiceHealth(ServiceHealthConfig{
		Listen: fn.listen,
		Server: httplimit.ServerConfig{ReadHeaderTimeout: time.Minute, IdleTimeout: time.Minute, MaxConnections: limit},
	})
	defer s.Close()
	web, db := nsn("default", "web"), nsn("default", "db")
	if err := s.SyncServices(map[types.NamespacedName]uint16{web: 30123, db: 30124}); err != nil {
		t.Fatal(err)
	}
	if err := s.SyncEndpoints(map[types.NamespacedName]int{web: 1, db: 1}); err != nil {
		t.Fatal(err)
	}
	webAddr, dbAddr := fn.real(t, "0.0.0.0:30123"), fn.real(t, "0.0.0.0:30124")
	// Silent connections, accepted in turn; the last one's answer says
	// that the server has accepted them all. (When a kept-alive
	// connection turns idle after its answer is on the wire is up to the
	// scheduler.)
	var conns []idleConn
	for i := range limit {
		path := ""
		if i == limit-1 {
			path = "/"
		}
		conns = append(conns, openIdle(t, webAddr, path))
	}
	if code, err := probe(dbAddr, "/"); err != nil || code != http.StatusOK {
		t.Errorf("probe of another service at the bound: %d, %v; want 200", code, err)
	}
	if !conns[0].closedWithin(5 * time.Second) {
		t.Error("the longest idle connection, to another service's port, is still open")
	}
}
