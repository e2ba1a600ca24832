package healthcheck

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testwait"
)

// checkNoLeaks records the number of goroutines and, at cleanup, waits up
// to 5s for it to come back down; it fails with every stack if not. Tests
// that use it must not run in parallel.
func checkNoLeaks(t *testing.T) {
	t.Helper()
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		if !testwait.Poll(5*time.Second, func() bool { return runtime.NumGoroutine() <= before }) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Errorf("goroutines: %d before, %d after; stacks:\n%s", before, runtime.NumGoroutine(), buf)
		}
	})
}

// response is what the tests compare of an HTTP answer.
type response struct {
	Code   int
	Header map[string]string // only the headers the test names
	Body   string
}

// headerNames are the headers compared in every response.
var headerNames = []string{"Content-Type", "X-Content-Type-Options", "X-Load-Balancing-Endpoint-Weight"}

func toResponse(code int, h http.Header, body string) response {
	r := response{Code: code, Header: map[string]string{}, Body: body}
	for _, n := range headerNames {
		if v := h.Values(n); len(v) > 0 {
			r.Header[n] = strings.Join(v, ",")
		}
	}
	return r
}

// get fetches http://addr+path without keep-alives, so no client
// goroutine outlives the call.
func get(t *testing.T, addr, path string) (response, error) {
	t.Helper()
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + addr + path)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, err
	}
	return toResponse(resp.StatusCode, resp.Header, string(body)), nil
}

// mustGet is get that fails the test on error.
func mustGet(t *testing.T, addr, path string) response {
	t.Helper()
	r, err := get(t, addr, path)
	if err != nil {
		t.Fatalf("GET %s%s: %v", addr, path, err)
	}
	return r
}

// refused reports whether nothing accepts connections on addr.
func refused(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return true
	}
	c.Close()
	return false
}

// fakeNet is an injected ListenFunc: every requested address is served
// on 127.0.0.1 with a kernel-chosen port, so tests need no root and no
// fixed ports. It records calls, fails on request, and tracks which
// listeners are open.
type fakeNet struct {
	mu     sync.Mutex
	fail   map[string]error  // requested addr → error to return
	actual map[string]string // requested addr → real 127.0.0.1 address
	open   map[string]bool   // requested addr → listener open
	calls  []string          // "network addr", in order
}

func newFakeNet() *fakeNet {
	return &fakeNet{fail: map[string]error{}, actual: map[string]string{}, open: map[string]bool{}}
}

func (f *fakeNet) listen(network, addr string) (net.Listener, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, network+" "+addr)
	if err := f.fail[addr]; err != nil {
		return nil, &net.OpError{Op: "listen", Net: network, Addr: strAddr(addr), Err: err}
	}
	if f.open[addr] {
		return nil, fmt.Errorf("fakeNet: %s is already open", addr)
	}
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	f.actual[addr] = ln.Addr().String()
	f.open[addr] = true
	return &trackedListener{Listener: ln, f: f, addr: addr}, nil
}

func (f *fakeNet) setFail(addr string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err == nil {
		delete(f.fail, addr)
	} else {
		f.fail[addr] = err
	}
}

// real returns where requested addr was last served.
func (f *fakeNet) real(t *testing.T, addr string) string {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	a, ok := f.actual[addr]
	if !ok {
		t.Fatalf("%s was never listened on", addr)
	}
	return a
}

// openAddrs returns the requested addresses whose listeners are open.
func (f *fakeNet) openAddrs() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for a, ok := range f.open {
		if ok {
			out = append(out, a)
		}
	}
	slices.Sort(out)
	return out
}

func (f *fakeNet) takeCalls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := f.calls
	f.calls = nil
	return c
}

type trackedListener struct {
	net.Listener
	f    *fakeNet
	addr string
	once sync.Once
}

func (l *trackedListener) Close() error {
	err := l.Listener.Close()
	l.once.Do(func() {
		l.f.mu.Lock()
		l.f.open[l.addr] = false
		l.f.mu.Unlock()
	})
	return err
}

// errContains fails unless err mentions every part.
func errContains(t *testing.T, err error, parts ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("error = nil, want one mentioning %q", parts)
	}
	for _, p := range parts {
		if !strings.Contains(err.Error(), p) {
			t.Errorf("error %q does not mention %q", err, p)
		}
	}
}

// strAddr is a net.Addr for fake errors.
type strAddr string

func (a strAddr) Network() string { return "tcp" }
func (a strAddr) String() string  { return string(a) }

var errBusy = errors.New("address already in use (injected)")
