package httplimit

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/uproxy/uproxy/internal/testwait"
)

// serveTest serves h on loopback with cfg until the test ends, and
// returns the address and the server's limiter.
func serveTest(t *testing.T, cfg ServerConfig, h http.Handler) (string, *ConnLimiter) {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lim := cfg.Limiter()
	srv := cfg.Server(h, lim, nil)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lim.Listener(ln)) }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("Serve = %v, want ErrServerClosed", err)
		}
	})
	return ln.Addr().String(), lim
}

var ok = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") })

// dial connects to addr; the test closes the connection when it ends.
func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// request sends a keep-alive GET on c and reads the answer's body.
func request(t *testing.T, c net.Conn, r *bufio.Reader) string {
	t.Helper()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(r, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(body)
}

// closedWithin reports whether the server closes c within d: a read ends
// with EOF or a reset rather than the deadline.
func closedWithin(c net.Conn, r io.Reader, d time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(d))
	defer c.SetReadDeadline(time.Time{})
	_, err := r.Read(make([]byte, 1))
	return err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
}

// get fetches http://addr/ on a connection of its own within timeout.
func get(addr string, timeout time.Duration) (string, error) {
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: timeout}).Get("http://" + addr + "/")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return string(body), err
}

// TestServerClosesIdleConnections checks that the server closes both kinds
// of idle connection: one that never sends a request (ReadHeaderTimeout)
// and a kept-alive one between requests (IdleTimeout). Before, a kept-alive
// connection was held for ever.
func TestServerClosesIdleConnections(t *testing.T) {
	const d = 100 * time.Millisecond
	addr, lim := serveTest(t, ServerConfig{ReadHeaderTimeout: d, IdleTimeout: d}, ok)
	silent := dial(t, addr)
	kept := dial(t, addr)
	r := bufio.NewReader(kept)
	if got := request(t, kept, r); got != "ok" {
		t.Fatalf("answer %q, want ok", got)
	}
	for _, tc := range []struct {
		name string
		c    net.Conn
		r    io.Reader
	}{{"never sent a request", silent, silent}, {"kept alive after one", kept, r}} {
		if !closedWithin(tc.c, tc.r, 5*time.Second) {
			t.Errorf("a connection that %s is still open", tc.name)
		}
	}
	testwait.Until(t, 5*time.Second, "the limiter counts no connection", func() bool { return lim.Open() == 0 })
}

// TestConnLimiterClosesLongestIdle checks that at the bound a new
// connection is served at once, the longest idle one closed to make room,
// while idle connections' time-outs are far off: a health probe must not
// wait behind idle connections. Idle is counted from a kept-alive
// connection's last request, not from its accept.
func TestConnLimiterClosesLongestIdle(t *testing.T) {
	const limit = 4
	addr, lim := serveTest(t, ServerConfig{ReadHeaderTimeout: time.Minute, IdleTimeout: time.Minute, MaxConnections: limit}, ok)
	type conn struct {
		name string
		c    net.Conn
		r    *bufio.Reader
	}
	var conns []*conn
	open := func(name string) *conn {
		n := lim.Open() + 1
		c := dial(t, addr)
		cn := &conn{name, c, bufio.NewReader(c)}
		conns = append(conns, cn)
		testwait.Until(t, 5*time.Second, fmt.Sprintf("%s counted", name), func() bool { return lim.Open() == n })
		return cn
	}
	open("a")
	kept := open("kept")
	open("b")
	open("c")
	// kept is idle from its request on: after a, b and c. The server
	// marks it idle shortly after the answer is on the wire.
	if got := request(t, kept.c, kept.r); got != "ok" {
		t.Fatalf("answer %q, want ok", got)
	}
	testwait.Until(t, 5*time.Second, "kept idle again", func() bool {
		lim.mu.Lock()
		defer lim.mu.Unlock()
		return lim.idle.Len() == limit
	})
	var closed []string
	for i, fill := range []string{"d", "e", "f", ""} {
		if body, err := get(addr, 2*time.Second); err != nil || body != "ok" {
			t.Fatalf("probe %d at the bound: %q, %v; want ok", i, body, err)
		}
		var victim *conn
		for _, cn := range conns {
			if !slices.Contains(closed, cn.name) && closedWithin(cn.c, cn.r, 20*time.Millisecond) {
				if victim != nil {
					t.Fatalf("probe %d closed %s and %s, want one", i, victim.name, cn.name)
				}
				victim = cn
			}
		}
		if victim == nil {
			t.Fatalf("probe %d closed no idle connection", i)
		}
		closed = append(closed, victim.name)
		// The probe's own connection ends with its answer: fill its
		// place for the next probe to find the bound.
		testwait.Until(t, 5*time.Second, "the probe's connection is forgotten", func() bool { return lim.Open() == limit-1 })
		if fill != "" {
			open(fill)
		}
	}
	if diff := cmp.Diff([]string{"a", "b", "c", "kept"}, closed); diff != "" {
		t.Errorf("idle connections closed, in order (-want +got):\n%s", diff)
	}
}

// TestConnLimiterWaitsWhileAllBusy checks that a connection past the
// bound is not served while every connection is in a request, and is
// served as soon as one ends; and that closing the server ends the wait.
func TestConnLimiterWaitsWhileAllBusy(t *testing.T) {
	const limit = 2
	var entered atomic.Int64
	release := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		entered.Add(1)
		<-release
		io.WriteString(w, "ok")
	})
	addr, lim := serveTest(t, ServerConfig{MaxConnections: limit}, h)
	t.Cleanup(func() { close(release) })
	type result struct {
		body string
		err  error
	}
	results := make(chan result, limit+1)
	for range limit {
		go func() { b, err := get(addr, 5*time.Second); results <- result{b, err} }()
	}
	testwait.Until(t, 5*time.Second, "both requests in their handler", func() bool { return entered.Load() == limit })
	go func() { b, err := get(addr, 5*time.Second); results <- result{b, err} }()
	testwait.Until(t, 5*time.Second, "the third connection waits for room", func() bool {
		lim.mu.Lock()
		defer lim.mu.Unlock()
		return lim.waiting == 1
	})
	if n := entered.Load(); n != limit {
		t.Fatalf("%d requests in their handler while at the bound, want %d", n, limit)
	}
	for range limit + 1 {
		release <- struct{}{}
		if r := <-results; r.err != nil || r.body != "ok" {
			t.Errorf("answer %q, %v; want ok", r.body, r.err)
		}
	}
}

// TestConnLimiterCloseEndsWait checks that closing the server ends an
// Accept waiting for room.
func TestConnLimiterCloseEndsWait(t *testing.T) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	cfg := ServerConfig{MaxConnections: 1}
	lim := cfg.Limiter()
	srv := cfg.Server(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { close(entered); <-release }), lim, nil)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lim.Listener(ln)) }()
	busy := dial(t, ln.Addr().String())
	io.WriteString(busy, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	<-entered
	dial(t, ln.Addr().String())
	testwait.Until(t, 5*time.Second, "the second connection waits for room", func() bool {
		lim.mu.Lock()
		defer lim.mu.Unlock()
		return lim.waiting == 1
	})
	srv.Close()
	select {
	case err := <-served:
		if !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("Serve = %v, want ErrServerClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return after Close")
	}
}

// TestServerConfigDefaults checks the zero ServerConfig's server.
func TestServerConfigDefaults(t *testing.T) {
	type timeouts struct{ ReadHeader, Read, Write, Idle time.Duration }
	srv := ServerConfig{}.Server(ok, nil, nil)
	got := timeouts{srv.ReadHeaderTimeout, srv.ReadTimeout, srv.WriteTimeout, srv.IdleTimeout}
	want := timeouts{DefaultReadHeaderTimeout, DefaultReadTimeout, DefaultWriteTimeout, DefaultIdleTimeout}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("time-outs (-want +got):\n%s", diff)
	}
	if srv.ConnState != nil {
		t.Error("a server without a limiter has a ConnState hook")
	}
	if n := (ServerConfig{}).Limiter().max; n != DefaultMaxConnections {
		t.Errorf("the default limiter holds %d connections, want %d", n, DefaultMaxConnections)
	}
}
