package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/uproxy/uproxy/proxy/routing"

	"github.com/google/go-cmp/cmp"
	proxyproto "github.com/pires/go-proxyproto"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testbackend"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/listeners"
	"github.com/uproxy/uproxy/proxy/service"
)

// recordingRules is a RuleSyncer that remembers the last intercepts.
type recordingRules struct {
	mu    sync.Mutex
	last  []routing.Intercept
	calls int
	full  bool // the last call's
	fail  error
	// unguarded is returned as RuleStats.Unguarded.
	unguarded [2]bool
	// onSync, when set, is called at each call, with mu held.
	onSync func()
}

func (r *recordingRules) SyncRules(_ context.Context, in []routing.Intercept, full bool) (RuleStats, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	r.full = full
	if r.onSync != nil {
		r.onSync()
	}
	if r.fail != nil {
		return RuleStats{}, r.fail
	}
	r.last = in
	// As if one iptables-restore wrote them.
	return RuleStats{Rules: len(in), Written: len(in), Commands: 1, Unguarded: r.unguarded}, nil
}

// port returns the listener port of the intercept for service name (as
// "default/web:http") once it exists.
func (r *recordingRules) port(t testing.TB, name string) int {
	t.Helper()
	return int(r.intercept(t, name).ListenPort)
}

// intercept returns the first intercept for service name once it exists.
func (r *recordingRules) intercept(t testing.TB, name string) routing.Intercept {
	t.Helper()
	var found routing.Intercept
	testwait.Until(t, 5*time.Second, "an intercept for "+name, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, i := range r.last {
			if i.Service.String() == name {
				found = i
				return true
			}
		}
		return false
	})
	return found
}

func (r *recordingRules) has(name string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, i := range r.last {
		if i.Service.String() == name {
			return true
		}
	}
	return false
}

// startProxier runs a Proxier until the test ends, then shuts it down and
// checks that no session is left.
func startProxier(t testing.TB, cfg Config) (*Proxier, *recordingRules) {
	t.Helper()
	rules := &recordingRules{}
	cfg.Rules = rules
	cfg.Sync.MinInterval = 10 * time.Millisecond
	cfg.LoopbackEndpoints = true // the test backends listen on 127.0.0.1
	if cfg.Stats == nil {
		cfg.Stats = new(datapath.Stats) // for the tests that tell the data paths apart
	}
	p := NewProxier(cfg)
	startedProxiers.Add(t, p)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		<-done
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer scancel()
		if err := p.Shutdown(sctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	return p, rules
}

// proxyWeb starts a Proxier with cfg that serves default/web:http
// (10.96.0.10:80) from be, and returns it with the service's listener
// port once the listener is open.
func proxyWeb(t *testing.T, cfg Config, be *backend) (*Proxier, int) {
	t.Helper()
	p, rules := startProxier(t, cfg)
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", be))
	return p, rules.port(t, "default/web:http")
}

// backend is a TCP server on 127.0.0.1 (testbackend.TCP); ln and addr
// are its listener and address.
type backend struct {
	*testbackend.TCP
	ln   net.Listener
	addr netip.AddrPort
}

func wrapBackend(b *testbackend.TCP) *backend { return &backend{TCP: b, ln: b.LN, addr: b.Addr} }

func startBackend(t *testing.T, handle func(net.Conn)) *backend {
	return wrapBackend(testbackend.StartTCP(t, handle))
}

// nameBackend answers every connection with its name and closes.
func nameBackend(t *testing.T, name string) *backend { return wrapBackend(testbackend.Name(t, name)) }

// echoBackend echoes until EOF (testbackend.Echo).
func echoBackend(t *testing.T) *backend { return wrapBackend(testbackend.Echo(t)) }

// sliceFor returns a slice whose endpoints are the backends; the port is
// the first backend's (all test backends on 127.0.0.1 have distinct ports,
// so each gets its own slice).
func slicesFor(svcName, portName string, bs ...*backend) []*discovery.EndpointSlice {
	var out []*discovery.EndpointSlice
	for i, b := range bs {
		out = append(out, slice(fmt.Sprintf("%s-%d", svcName, i), svcName, portName, int32(b.addr.Port()), ep{IP: b.addr.Addr().String()}))
	}
	return out
}

func get(t *testing.T, port int) (string, error) {
	t.Helper()
	c, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", port), 2*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

func TestProxyDistributesAndFollowsChanges(t *testing.T) {
	a, b, c := nameBackend(t, "a"), nameBackend(t, "b"), nameBackend(t, "c")
	p, rules := startProxier(t, Config{})
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", a, b, c))
	port := rules.port(t, "default/web:http")

	count := func(n int) map[string]int {
		got := map[string]int{}
		for range n {
			name, err := get(t, port)
			if err != nil {
				t.Fatalf("request failed: %v", err)
			}
			got[name]++
		}
		return got
	}
	if diff := cmp.Diff(map[string]int{"a": 10, "b": 10, "c": 10}, count(30)); diff != "" {
		t.Errorf("round-robin spread (-want +got):\n%s", diff)
	}

	// Drop c and mark b not ready: only a gets traffic, on the same listener.
	sl := slicesFor("web", "http", a, b)
	sl[1].Endpoints[0].Conditions.Ready = new(bool)
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, sl)
	testwait.Until(t, 5*time.Second, "only a serves", func() bool { return cmp.Equal(count(4), map[string]int{"a": 4}) })
	if got := rules.port(t, "default/web:http"); got != port {
		t.Errorf("endpoint change moved the listener from %d to %d", port, got)
	}
}

// blackhole returns an address whose SYNs go unanswered: a listening
// socket with a full accept queue (Linux drops SYNs it cannot queue).
func blackhole(t *testing.T) netip.AddrPort {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, _ := syscall.Getsockname(fd)
	addr := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(sa.(*syscall.SockaddrInet4).Port))
	// Fill the queue (backlog 0 still admits one connection, plus one in
	// SYN-RECV on some kernels), until a dial times out.
	for range 8 {
		c, err := net.DialTimeout("tcp4", addr.String(), 200*time.Millisecond)
		if err != nil {
			return addr
		}
		t.Cleanup(func() { c.Close() })
	}
	t.Fatal("could not fill the accept queue")
	return addr
}

func TestProxyFailsOverRefusedAndBlackholedEndpoints(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		good := nameBackend(t, "good")
		refused := nameBackend(t, "refused")
		refused.ln.Close()
		hole := blackhole(t)
		p, rules := startProxier(t, Config{Config: datapath.Config{IOURing: dp.ring, DialTimeout: 200 * time.Millisecond, EjectBase: time.Minute}})
		slices := slicesFor("web", "http", refused, good)
		slices = append(slices, slice("web-hole", "web", "http", int32(hole.Port()), ep{IP: "127.0.0.1"}))
		p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slices)
		port := rules.port(t, "default/web:http")
		for i := range 20 {
			name, err := get(t, port)
			if err != nil || name != "good" {
				t.Fatalf("request %d = %q, %v; want good", i, name, err)
			}
		}
	})
}

func TestProxyPassesHalfClose(t *testing.T) {
	// The backend reads the whole request, then answers: it needs the
	// client's EOF to arrive while its own direction is still open.
	be := startBackend(t, func(c net.Conn) {
		n, _ := io.Copy(io.Discard, c)
		fmt.Fprintf(c, "got %d bytes\n", n)
	})
	_, port := proxyWeb(t, Config{}, be)
	c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(make([]byte, 100000)); err != nil {
		t.Fatal(err)
	}
	c.(*net.TCPConn).CloseWrite()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "got 100000 bytes\n" {
		t.Fatalf("response %q, %v", got, err)
	}
}

func TestProxyIdleTimeout(t *testing.T) {
	be := echoBackend(t)
	const idle = 200 * time.Millisecond
	_, port := proxyWeb(t, Config{Config: datapath.Config{IdleTimeout: idle}}, be)

	// A connection that talks every idle/4 stays open for many periods.
	busy, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	buf := make([]byte, 1)
	for i := range 20 {
		busy.SetDeadline(time.Now().Add(time.Second))
		if _, err := busy.Write([]byte{byte(i)}); err != nil {
			t.Fatalf("busy write %d: %v", i, err)
		}
		if _, err := io.ReadFull(busy, buf); err != nil || buf[0] != byte(i) {
			t.Fatalf("busy read %d: %v", i, err)
		}
		time.Sleep(idle / 4) // traffic more often than the idle timeout: the point
	}

	// A quiet one is closed after one to two periods (plus scheduling).
	// The clock starts before the dial: the proxy's starts when it
	// accepts, which a slow test goroutine may see long after.
	start := time.Now()
	quiet, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer quiet.Close()
	quiet.SetDeadline(time.Now().Add(5 * time.Second))
	_, err = quiet.Read(buf)
	if elapsed := time.Since(start); err == nil || elapsed < idle || elapsed > 4*idle {
		t.Fatalf("quiet connection ended after %v with %v; want an error between %v and %v", elapsed, err, idle, 4*idle)
	}
}

func TestProxyChecksOriginalDestination(t *testing.T) {
	be := nameBackend(t, "a")
	dst := netip.MustParseAddrPort("10.96.0.10:80")
	var mu sync.Mutex
	p, rules := startProxier(t, Config{Config: datapath.Config{OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) {
		mu.Lock()
		defer mu.Unlock()
		return dst, nil
	}}})
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", be))
	port := rules.port(t, "default/web:http")
	if name, err := get(t, port); err != nil || name != "a" {
		t.Fatalf("matching destination: %q, %v", name, err)
	}
	mu.Lock()
	dst = netip.MustParseAddrPort("10.96.0.11:80") // another service's VIP
	mu.Unlock()
	if name, err := get(t, port); err == nil {
		t.Fatalf("mismatched destination was proxied (got %q)", name)
	}
}

func TestProxySessionAffinity(t *testing.T) {
	a, b := nameBackend(t, "a"), nameBackend(t, "b")
	p, rules := startProxier(t, Config{})
	s := svc("web", "10.96.0.10", "http:80")
	s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
	p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", a, b))
	port := rules.port(t, "default/web:http")
	first, err := get(t, port)
	if err != nil {
		t.Fatal(err)
	}
	for range 10 {
		if name, err := get(t, port); err != nil || name != first {
			t.Fatalf("affinity broken: got %q, %v; want %q", name, err, first)
		}
	}
}

func TestReloadKeepsUnchangedConnections(t *testing.T) {
	be := echoBackend(t)
	other := nameBackend(t, "other")
	p, rules := startProxier(t, Config{})
	web := svc("web", "10.96.0.10", "http:80")
	gone := svc("gone", "10.96.0.12", "http:80")
	p.Tracker().Replace([]*v1.Service{web, gone}, append(slicesFor("web", "http", be), slicesFor("gone", "http", other)...))
	port := rules.port(t, "default/web:http")
	c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	roundTrip := func(msg string) {
		t.Helper()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
			t.Fatalf("echo %q: got %q, %v", msg, buf, err)
		}
	}
	roundTrip("before")

	// Add a service, remove one, and add an endpoint to web.
	p.Tracker().Replace([]*v1.Service{web, svc("new", "10.96.0.13", "http:80")},
		append(slicesFor("web", "http", be, other), slicesFor("new", "http", other)...))
	rules.port(t, "default/new:http")
	testwait.Until(t, 5*time.Second, "gone is removed", func() bool { return !rules.has("default/gone:http") })
	roundTrip("after")
	if got := rules.port(t, "default/web:http"); got != port {
		t.Errorf("web's listener moved from %d to %d", port, got)
	}
}

// stoppedWithOneSession starts a proxier for one echo Service, opens one
// connection through it, and stops its sync loop, leaving the listener and
// the session for the test to stop.
func stoppedWithOneSession(t *testing.T) (*Proxier, net.Conn, int) {
	t.Helper()
	be := echoBackend(t)
	rules := &recordingRules{}
	p := NewProxier(Config{LoopbackEndpoints: true, Rules: rules, Sync: changes.RunnerConfig{MinInterval: 10 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", be))
	port := rules.port(t, "default/web:http")
	c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	testwait.Until(t, 5*time.Second, "the session is registered", func() bool { return p.ActiveConnections() == 1 })
	cancel()
	<-done
	return p, c, port
}

func TestShutdownDrains(t *testing.T) {
	p, c, port := stoppedWithOneSession(t)

	// The client finishes its exchange during the drain.
	go func() {
		time.Sleep(100 * time.Millisecond) // into the drain, which Shutdown starts below
		c.Write([]byte("bye"))
		c.(*net.TCPConn).CloseWrite()
	}()
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer scancel()
	start := time.Now()
	if err := p.Shutdown(sctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if got, _ := io.ReadAll(c); string(got) != "bye" {
		t.Errorf("drained connection lost data: %q", got)
	}
	if time.Since(start) > 4*time.Second {
		t.Error("Shutdown waited for the deadline although the connection ended")
	}
	if _, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", port), time.Second); err == nil {
		t.Error("listener still accepts after Shutdown")
	}
}

// TestShutdownForcesAfterDeadline covers both ways of stopping, which end
// in the one drain: Shutdown, and a handover's StopListening then Drain.
func TestShutdownForcesAfterDeadline(t *testing.T) {
	for _, tt := range []struct {
		name string
		stop func(*Proxier, context.Context) error
	}{
		{"Shutdown", (*Proxier).Shutdown},
		{"StopListening and Drain", func(p *Proxier, ctx context.Context) error { p.StopListening(); return p.Drain(ctx) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, c, port := stoppedWithOneSession(t)
			sctx, scancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			defer scancel()
			if err := tt.stop(p, sctx); err == nil || !strings.Contains(err.Error(), "closed 1 connections") {
				t.Fatalf("stop = %v, want a drain timeout that closed 1 connection", err)
			}
			c.SetDeadline(time.Now().Add(time.Second))
			if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
				t.Errorf("forced connection not closed: %v", err)
			}
			if _, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", port), time.Second); err == nil {
				t.Error("listener still accepts after stopping")
			}
		})
	}
}

func TestRuleFailureForcesFullResync(t *testing.T) {
	be := nameBackend(t, "a")
	p, rules := startProxier(t, Config{})
	rules.mu.Lock()
	rules.fail = errors.New("iptables-restore: exit status 1")
	rules.mu.Unlock()
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", be))
	testwait.Until(t, 5*time.Second, "two failed attempts", func() bool { rules.mu.Lock(); defer rules.mu.Unlock(); return rules.calls >= 2 })
	rules.mu.Lock()
	rules.fail = nil
	rules.mu.Unlock()
	rules.port(t, "default/web:http") // the retry succeeds without any new event
	if !p.LastSync().After(time.Time{}) {
		t.Error("LastSync not recorded")
	}
}

// TestPeriodicResyncKeepsSnapshots checks that a full sync verifies the
// rules but re-applies only the services that changed, keeping the other
// snapshots (and their balancers' positions), and that a forced one (a
// zone change) re-applies every service.
func TestPeriodicResyncKeepsSnapshots(t *testing.T) {
	rules := &recordingRules{}
	p := newTestProxier(t, Config{LoopbackEndpoints: true, Rules: rules})
	webSlice := func(ip string) *discovery.EndpointSlice {
		return slice("web-0", "web", "http", 8080, ep{IP: ip})
	}
	p.Tracker().Replace(
		[]*v1.Service{svc("web", "10.96.0.10", "http:80"), svc("api", "10.96.0.11", "http:80")},
		[]*discovery.EndpointSlice{webSlice("10.244.0.1"), slice("api-0", "api", "http", 8080, ep{IP: "10.244.0.2"})})
	sync := func(full bool) {
		t.Helper()
		if err := p.sync(t.Context(), full); err != nil {
			t.Fatal(err)
		}
	}
	snaps := func() map[string]*routing.Snapshot {
		m := map[string]*routing.Snapshot{}
		for name, ls := range p.services {
			for _, l := range ls {
				m[name.Name] = l.snap.Load()
			}
		}
		return m
	}
	// rebuilt lists the services whose snapshot is not the one in before.
	rebuilt := func(before map[string]*routing.Snapshot) []string {
		var out []string
		for name, s := range snaps() {
			if before[name] != s {
				out = append(out, name)
			}
		}
		slices.Sort(out)
		return out
	}
	sync(true)
	for _, step := range []struct {
		name   string
		change func()
		full   bool
		want   []string
	}{
		{"periodic full sync, nothing changed", func() {}, true, nil},
		{"periodic full sync, web's endpoints changed", func() { p.Tracker().OnSliceUpsert(webSlice("10.244.0.3")) }, true, []string{"web"}},
		{"partial sync, web's endpoints changed", func() { p.Tracker().OnSliceUpsert(webSlice("10.244.0.4")) }, false, []string{"web"}},
		{"zone change", func() { p.SetZone("zone-a") }, false, []string{"api", "web"}},
	} {
		before := snaps()
		rules.mu.Lock()
		calls := rules.calls
		rules.mu.Unlock()
		step.change()
		sync(step.full)
		if diff := cmp.Diff(step.want, rebuilt(before)); diff != "" {
			t.Errorf("%s: rebuilt snapshots (-want +got):\n%s", step.name, diff)
		}
		rules.mu.Lock()
		if step.full && (rules.calls != calls+1 || !rules.full) {
			t.Errorf("%s: the rules were not verified (calls %d -> %d, full %v)", step.name, calls, rules.calls, rules.full)
		}
		rules.mu.Unlock()
	}
}

// TestNoLeaks runs many connections, of every ending, and checks that
// goroutines and file descriptors return to their baseline.
func TestNoLeaks(t *testing.T) {
	be := echoBackend(t)
	refused := nameBackend(t, "x")
	refused.ln.Close()
	baseG, baseFD := runtime.NumGoroutine(), countFDs(t)
	func() {
		p, rules := startProxier(t, Config{Config: datapath.Config{IdleTimeout: time.Second}})
		p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80"), svc("dead", "10.96.0.11", "http:80")},
			append(slicesFor("web", "http", be), slicesFor("dead", "http", refused)...))
		port, dead := rules.port(t, "default/web:http"), rules.port(t, "default/dead:http")
		var wg sync.WaitGroup
		for i := range 200 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				target := port
				if i%10 == 0 {
					target = dead
				}
				c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", target))
				if err != nil {
					return
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(5 * time.Second))
				switch i % 3 {
				case 0: // clean half-close
					c.Write([]byte("hello"))
					c.(*net.TCPConn).CloseWrite()
					io.ReadAll(c)
				case 1: // abrupt reset
					c.(*net.TCPConn).SetLinger(0)
				default: // write and drop
					c.Write([]byte("x"))
				}
			}()
		}
		wg.Wait()
		testwait.Until(t, 5*time.Second, "sessions end", func() bool { return p.ActiveConnections() == 0 })
		p.Shutdown(context.Background())
	}()
	testwait.Until(t, 5*time.Second, "goroutines and fds return to baseline", func() bool {
		return runtime.NumGoroutine() <= baseG+2 && countFDs(t) <= baseFD+2
	})
}

func countFDs(t *testing.T) int {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip("no /proc/self/fd")
	}
	return len(entries)
}

// TestFirstSyncOpensListenersInServiceOrder checks that a sync opening
// many listeners at once (openListeners, which finishes them on other
// goroutines) hands out the port range in the services' order, as
// opening them one by one did, and that a listener it cannot open is
// reported, left out of the rules and retried, while the rest serve.
func TestFirstSyncOpensListenersInServiceOrder(t *testing.T) {
	const n = 12
	base := int(freePortRange(t, n))
	be := nameBackend(t, "a")
	core, logs := observer.New(zap.ErrorLevel)
	// One namespace fills the whole range: no quota keeps a part for others.
	p, rules := startProxier(t, Config{Config: datapath.Config{Logger: zap.New(core)}, PortRange: listeners.PortRange{Base: uint16(base), Size: n}, MaxListenersPerNamespace: -1})
	var svcs []*v1.Service
	var eps []*discovery.EndpointSlice
	for i := range n + 1 { // one more than the range holds
		name := fmt.Sprintf("s%02d", i)
		svcs = append(svcs, svc(name, fmt.Sprintf("10.96.0.%d", 10+i), "http:80"))
		eps = append(eps, slicesFor(name, "http", be)...)
	}
	p.Tracker().Replace(svcs, eps)
	for i := range n {
		name := fmt.Sprintf("default/s%02d:http", i)
		if got := rules.port(t, name); got != base+i {
			t.Errorf("%s listens on %d; want %d, the range's ports in the services' order", name, got, base+i)
		}
	}
	if got, err := get(t, rules.port(t, "default/s05:http")); err != nil || got != "a" {
		t.Errorf("s05 answered %q, %v; want a", got, err)
	}
	last := fmt.Sprintf("default/s%02d:http", n)
	if rules.has(last) {
		t.Errorf("%s has an intercept, with every port of the range taken", last)
	}
	const spent = "every port of --proxy-port-range is taken"
	testwait.Until(t, 5*time.Second, "the refusal is logged", func() bool {
		return logs.FilterMessageSnippet(spent).Len() > 0
	})
	if e := logs.FilterMessageSnippet(spent).All()[0]; fmt.Sprint(e.ContextMap()["services"]) != fmt.Sprintf("[default/s%02d]", n) {
		t.Errorf("the refusal names %v; want [default/s%02d]", e.ContextMap()["services"], n)
	}
	// A port comes free: the failed service is retried and takes it.
	p.Tracker().Replace(svcs[1:], eps[1:])
	if got := rules.port(t, last); got != base {
		t.Errorf("%s listens on %d after s00 left; want %d", last, got, base)
	}
}

// TestSyncReplacesListenersOnAFullRange checks that listeners replaced
// on a full port range get the ports the old ones free: the old ones are
// closed only once the rules no longer send traffic to them, and
// the new ones, which could not open in that sync, are retried at once.
func TestSyncReplacesListenersOnAFullRange(t *testing.T) {
	base := freePortRange(t, 2)
	be := nameBackend(t, "a")
	p, rules := startProxier(t, Config{PortRange: listeners.PortRange{Base: base, Size: 2}})
	objects := func(port string) ([]*v1.Service, []*discovery.EndpointSlice) {
		return []*v1.Service{svc("a", "10.96.0.10", port+":80"), svc("b", "10.96.0.11", port+":80")},
			append(slicesFor("a", port, be), slicesFor("b", port, be)...)
	}
	p.Tracker().Replace(objects("http"))
	rules.port(t, "default/a:http")
	rules.port(t, "default/b:http")
	// Both service ports are renamed: two listeners close, two open.
	p.Tracker().Replace(objects("web"))
	for _, name := range []string{"default/a:web", "default/b:web"} {
		if got, err := get(t, rules.port(t, name)); err != nil || got != "a" {
			t.Errorf("%s answered %q, %v; want a", name, got, err)
		}
	}
}

func TestListenerPortsComeFromTheRange(t *testing.T) {
	be := nameBackend(t, "a")
	// Take a port inside the range so the allocator has to skip it.
	base := int(freePortRange(t, 3))
	busy, err := net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", base))
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	p, rules := startProxier(t, Config{PortRange: listeners.PortRange{Base: uint16(base), Size: 3}})
	p.Tracker().Replace([]*v1.Service{svc("a", "10.96.0.10", "http:80"), svc("b", "10.96.0.11", "http:80")},
		append(slicesFor("a", "http", be), slicesFor("b", "http", be)...))
	pa, pb := rules.port(t, "default/a:http"), rules.port(t, "default/b:http")
	got := map[int]bool{pa: true, pb: true}
	if !cmp.Equal(got, map[int]bool{base + 1: true, base + 2: true}) {
		t.Errorf("listener ports %d and %d; want %d and %d (skipping the busy %d)", pa, pb, base+1, base+2, base)
	}
	// The range is full now: a third service cannot listen, and says so,
	// while the others keep working.
	p.Tracker().Replace([]*v1.Service{svc("a", "10.96.0.10", "http:80"), svc("b", "10.96.0.11", "http:80"), svc("c", "10.96.0.12", "http:80")},
		append(slicesFor("a", "http", be), slicesFor("b", "http", be)...))
	testwait.Never(t, 100*time.Millisecond, "a service got a listener outside the range", func() bool { return rules.has("default/c:http") })
	if name, err := get(t, pa); err != nil || name != "a" {
		t.Errorf("service a broke: %q, %v", name, err)
	}
}

func TestProxyProtocolHeader(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) { proxyProtocolHeader(t, dp) })
}

func proxyProtocolHeader(t *testing.T, dp dataPath) {
	for _, version := range []string{"v1", "v2"} {
		t.Run(version, func(t *testing.T) {
			// The backend reads the header and answers with what it says.
			be := startBackend(t, func(c net.Conn) {
				pc := proxyproto.NewConn(c)
				h := pc.ProxyHeader()
				if h == nil {
					fmt.Fprintln(c, "no header")
					return
				}
				fmt.Fprintf(c, "v%d %s %s\n", h.Version, h.SourceAddr, h.DestinationAddr)
			})
			p, rules := startProxier(t, Config{Config: datapath.Config{IOURing: dp.ring, OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) {
				return netip.MustParseAddrPort("10.96.0.10:80"), nil
			}}})
			s := svc("web", "10.96.0.10", "http:80")
			s.Annotations = map[string]string{service.AnnotationProxyProtocol: version}
			p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", be))
			port := rules.port(t, "default/web:http")
			c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			line, err := bufio.NewReader(c).ReadString('\n')
			want := fmt.Sprintf("%s %s 10.96.0.10:80\n", version, c.LocalAddr())
			if err != nil || line != want {
				t.Fatalf("backend saw %q (%v); want %q", line, err, want)
			}
		})
	}
}

// TestEndpointChangesDoNotTouchRules checks that a change of endpoints
// only swaps the balancer: the kernel rules are not rewritten.
func TestEndpointChangesDoNotTouchRules(t *testing.T) {
	a, b := nameBackend(t, "a"), nameBackend(t, "b")
	p, rules := startProxier(t, Config{})
	web := svc("web", "10.96.0.10", "http:80")
	p.Tracker().Replace([]*v1.Service{web}, slicesFor("web", "http", a))
	port := rules.port(t, "default/web:http")
	rules.mu.Lock()
	before := rules.calls
	rules.mu.Unlock()
	p.Tracker().Replace([]*v1.Service{web}, slicesFor("web", "http", b))
	testwait.Until(t, 5*time.Second, "traffic moves to b", func() bool { name, err := get(t, port); return err == nil && name == "b" })
	rules.mu.Lock()
	defer rules.mu.Unlock()
	if rules.calls != before {
		t.Errorf("an endpoint-only change called the rule syncer %d times", rules.calls-before)
	}
}

// listenForServices gives p services s00 to s<n-1> (10.96.1.1 and up,
// port http:80, no endpoints) and waits until each has its listener.
func listenForServices(t *testing.T, p *Proxier, rules *recordingRules, n int) {
	t.Helper()
	listenForServicePorts(t, p, rules, n, "http:80")
}

// listenForServicePorts is listenForServices with port, a port as svc
// takes it ("name:port[/protocol]"), in place of http:80.
func listenForServicePorts(t *testing.T, p *Proxier, rules *recordingRules, n int, port string) {
	t.Helper()
	var svcs []*v1.Service
	for i := range n {
		svcs = append(svcs, svc(fmt.Sprintf("s%02d", i), fmt.Sprintf("10.96.1.%d", i+1), port))
	}
	p.Tracker().Replace(svcs, nil)
	name, _, _ := strings.Cut(port, ":")
	for i := range n {
		rules.port(t, fmt.Sprintf("default/s%02d:%s", i, name))
	}
}

// TestListenerHoldsOneDescriptor checks that a TCP listener holds a single
// descriptor: with event loops, the duplicate they accept on replaces
// the listener's own, so 10,000 services fit in 10,000 descriptors, not
// 20,000.
func TestListenerHoldsOneDescriptor(t *testing.T) {
	const n = 50
	base := countFDs(t)
	p, rules := startProxier(t, Config{})
	listenForServices(t, p, rules, n)
	if got := countFDs(t) - base; got > n+5 {
		t.Errorf("%d services' listeners hold %d descriptors; want about one each", n, got)
	}
}

// TestListenerGuardFollowsRuleWrites checks that the proxier marks its
// listeners guarded (datapath.Listener.Guarded, which lets a UDP listener
// skip conntrack for new flows) only once a rules write that listed them
// succeeded: not before the first write, not after a failed one, and not
// for a listener added since the last write until the next one.
func TestListenerGuardFollowsRuleWrites(t *testing.T) {
	rules := &recordingRules{}
	p := newTestProxier(t, Config{LoopbackEndpoints: true, Rules: rules})
	dns := svc("kube-dns", "10.96.0.10", "dns:53/UDP")
	dnsSlice := slice("kube-dns-0", "kube-dns", "dns", 53, ep{IP: "10.244.0.1"})
	guarded := func() map[string]bool {
		m := map[string]bool{}
		for name, ls := range p.services {
			for _, l := range ls {
				m[name.Name] = l.Guarded.Load()
			}
		}
		return m
	}
	sync := func(full bool, fail error) error {
		t.Helper()
		rules.mu.Lock()
		rules.fail = fail
		rules.mu.Unlock()
		return p.sync(t.Context(), full)
	}
	failure := errors.New("iptables-restore: exit status 1")
	p.Tracker().Replace([]*v1.Service{dns}, []*discovery.EndpointSlice{dnsSlice})
	if err := sync(false, failure); err == nil {
		t.Fatal("sync succeeded although the rules write failed")
	}
	if diff := cmp.Diff(map[string]bool{"kube-dns": false}, guarded()); diff != "" {
		t.Errorf("after a failed rules write (-want +got):\n%s", diff)
	}
	if err := sync(true, nil); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string]bool{"kube-dns": true}, guarded()); diff != "" {
		t.Errorf("after a rules write (-want +got):\n%s", diff)
	}
	// A new service's listener is open before the write that guards it.
	var during map[string]bool
	rules.mu.Lock()
	rules.onSync = func() { during = guarded() }
	rules.mu.Unlock()
	p.Tracker().Replace(
		[]*v1.Service{dns, svc("syslog", "10.96.0.11", "syslog:514/UDP")},
		[]*discovery.EndpointSlice{dnsSlice, slice("syslog-0", "syslog", "syslog", 514, ep{IP: "10.244.0.2"})})
	if err := sync(false, nil); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string]bool{"kube-dns": true, "syslog": false}, during); diff != "" {
		t.Errorf("during the rules write that adds a listener (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(map[string]bool{"kube-dns": true, "syslog": true}, guarded()); diff != "" {
		t.Errorf("after it (-want +got):\n%s", diff)
	}
	rules.mu.Lock()
	rules.onSync = nil
	rules.mu.Unlock()
	if err := sync(true, failure); err == nil {
		t.Fatal("sync succeeded although the rules write failed")
	}
	if diff := cmp.Diff(map[string]bool{"kube-dns": false, "syslog": false}, guarded()); diff != "" {
		t.Errorf("after a failed full resync (-want +got):\n%s", diff)
	}
}

// TestUnsyncedFamilyMarksNoListener checks that a rules write that
// succeeded without writing one family's rules (ip6tables missing)
// leaves that family's listeners unguarded, so that their UDP listeners
// check every new flow with conntrack: nothing in the kernel drops
// datagrams sent straight to them.
func TestUnsyncedFamilyMarksNoListener(t *testing.T) {
	rules := &recordingRules{unguarded: [2]bool{false, true}}
	p := newTestProxier(t, Config{LoopbackEndpoints: true, Rules: rules})
	dns := svc("kube-dns", "10.96.0.10", "dns:53/UDP")
	dns.Spec.ClusterIPs = []string{"10.96.0.10", "2001:db8::10"}
	p.Tracker().Replace([]*v1.Service{dns}, []*discovery.EndpointSlice{
		slice("kube-dns-4", "kube-dns", "dns", 53, ep{IP: "10.244.0.1"}),
		slice("kube-dns-6", "kube-dns", "dns", 53, ep{IP: "2001:db8:244::1"}),
	})
	if err := p.sync(t.Context(), true); err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, ls := range p.services {
		for _, l := range ls {
			got[map[bool]string{false: "IPv4", true: "IPv6"}[l.Key.V6]] = l.Guarded.Load()
		}
	}
	if diff := cmp.Diff(map[string]bool{"IPv4": true, "IPv6": false}, got); diff != "" {
		t.Errorf("listeners guarded, by family (-want +got):\n%s", diff)
	}
}

// TestUDPCheckEveryFlowMarksNoListener checks that with UDPCheckEveryFlow
// a rules write that succeeded marks no listener guarded, so that every
// new UDP flow is still checked with conntrack.
func TestUDPCheckEveryFlowMarksNoListener(t *testing.T) {
	p := newTestProxier(t, Config{LoopbackEndpoints: true, Rules: &recordingRules{}, UDPCheckEveryFlow: true})
	p.Tracker().Replace([]*v1.Service{svc("kube-dns", "10.96.0.10", "dns:53/UDP")},
		[]*discovery.EndpointSlice{slice("kube-dns-0", "kube-dns", "dns", 53, ep{IP: "10.244.0.1"})})
	if err := p.sync(t.Context(), true); err != nil {
		t.Fatal(err)
	}
	var marked []string
	for name, ls := range p.services {
		for _, l := range ls {
			if l.Guarded.Load() {
				marked = append(marked, name.Name)
			}
		}
	}
	if len(marked) > 0 {
		t.Errorf("listeners of %v marked guarded with UDPCheckEveryFlow", marked)
	}
}

// newTestProxier returns NewProxier(cfg), shut down when the test ends.
func newTestProxier(t *testing.T, cfg Config) *Proxier {
	t.Helper()
	p := NewProxier(cfg)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := p.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	return p
}

// TestListenerBudget checks Config.MaxListeners: the service ports past
// it get no listener and no intercept, are counted and said in one line
// per sync rather than one per port, and open once listeners are closed;
// the others serve meanwhile. Listeners past the open-files limit made
// every rules write fail, and then no service was proxied.
func TestListenerBudget(t *testing.T) {
	const budget, n = 3, 5
	be := nameBackend(t, "a")
	reg := prometheus.NewRegistry()
	m := introspect.NewMetrics(reg)
	core, logs := observer.New(zap.ErrorLevel)
	p, rules := startProxier(t, Config{Config: datapath.Config{Logger: zap.New(core)}, Metrics: m, MaxListeners: budget})
	var svcs []*v1.Service
	var eps []*discovery.EndpointSlice
	for i := range n {
		name := fmt.Sprintf("s%d", i)
		svcs = append(svcs, svc(name, fmt.Sprintf("10.96.0.%d", 10+i), "http:80"))
		eps = append(eps, slicesFor(name, "http", be)...)
	}
	p.Tracker().Replace(svcs, eps)
	for i := range budget {
		if got, err := get(t, rules.port(t, fmt.Sprintf("default/s%d:http", i))); err != nil || got != "a" {
			t.Errorf("s%d answered %q, %v; want a", i, got, err)
		}
	}
	for i := budget; i < n; i++ {
		if name := fmt.Sprintf("default/s%d:http", i); rules.has(name) {
			t.Errorf("%s has an intercept past the budget of %d listeners", name, budget)
		}
	}
	without := func() float64 {
		return series(t, reg, "uproxy_service_ports_without_listener")["uproxy_service_ports_without_listener{ip_family=IPv4}"]
	}
	testwait.Until(t, 5*time.Second, "the ports without a listener are counted", func() bool { return without() == n-budget })
	if got := logs.FilterMessage("cannot open listener; will retry").Len(); got != 0 {
		t.Errorf("%d error lines name a port past the budget; want one line per sync", got)
	}
	summary := logs.FilterMessageSnippet("the listener budget is spent").All()
	if len(summary) == 0 {
		t.Fatal("no line says the listener budget is spent")
	}
	if got := summary[0].ContextMap()["servicePorts"]; got != int64(n-budget) {
		t.Errorf("the line counts %v service ports; want %d", got, n-budget)
	}
	// Two services leave: the two waiting get their listeners.
	p.Tracker().Replace(svcs[2:], eps[2:])
	for i := budget; i < n; i++ {
		if got, err := get(t, rules.port(t, fmt.Sprintf("default/s%d:http", i))); err != nil || got != "a" {
			t.Errorf("s%d answered %q, %v; want a", i, got, err)
		}
	}
	testwait.Until(t, 5*time.Second, "no port is without a listener", func() bool { return without() == 0 })
}

// TestStatusOnlyServiceUpdate checks that an update that changes only a
// Service's status, as the cloud controller assigns a load balancer's
// address after creation, reaches the rules, through the informer's
// upserts and through a manifest folder's Replace alike.
func TestStatusOnlyServiceUpdate(t *testing.T) {
	lb := func(ingress ...string) *v1.Service {
		s := svc("web", "10.96.0.10", "http:80")
		s.Spec.Type = v1.ServiceTypeLoadBalancer
		s.Spec.LoadBalancerSourceRanges = []string{"192.0.2.0/25"}
		for _, ip := range ingress {
			s.Status.LoadBalancer.Ingress = append(s.Status.LoadBalancer.Ingress, v1.LoadBalancerIngress{IP: ip})
		}
		return s
	}
	sls := []*discovery.EndpointSlice{slice("web-1", "web", "http", 8080, ep{IP: "10.244.0.1"})}
	for _, tt := range []struct {
		name   string
		update func(*changes.Tracker, *v1.Service)
	}{
		{"upsert", func(tr *changes.Tracker, s *v1.Service) { tr.OnServiceUpsert(s) }},
		{"replace", func(tr *changes.Tracker, s *v1.Service) { tr.Replace([]*v1.Service{s}, sls) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rules := &recordingRules{}
			p := NewProxier(Config{Rules: rules})
			t.Cleanup(func() { p.Shutdown(context.Background()) })
			p.Tracker().Replace([]*v1.Service{lb()}, sls)
			if err := p.sync(t.Context(), false); err != nil {
				t.Fatal(err)
			}
			lbIntercepts := func() []string {
				rules.mu.Lock()
				defer rules.mu.Unlock()
				var out []string
				for _, in := range rules.last {
					if in.Kind == routing.LoadBalancerIP {
						out = append(out, fmt.Sprintf("%s:%d %v", in.VIP, in.Port, in.SourceRanges))
					}
				}
				return out
			}
			if got := lbIntercepts(); len(got) != 0 {
				t.Fatalf("load-balancer intercepts before the status update: %v", got)
			}
			tt.update(p.Tracker(), lb("192.0.2.80"))
			if err := p.sync(t.Context(), false); err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff([]string{"192.0.2.80:80 [192.0.2.0/25]"}, lbIntercepts()); diff != "" {
				t.Errorf("load-balancer intercepts after the status update (-want +got):\n%s", diff)
			}
		})
	}
}
