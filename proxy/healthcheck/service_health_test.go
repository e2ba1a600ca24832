package healthcheck

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"k8s.io/apimachinery/pkg/types"
	testingclock "k8s.io/utils/clock/testing"
)

// The expected bodies below are kube-proxy's, from k8s.io/kubernetes
// v1.37.2 pkg/proxy/healthcheck/service_health.go (hcHandler.ServeHTTP):
// a dedented, newline-trimmed, tab-indented JSON template with
// "service" {namespace, name}, "localEndpoints" and "serviceProxyHealthy";
// headers Content-Type: application/json, X-Content-Type-Options: nosniff
// and X-Load-Balancing-Endpoint-Weight: <localEndpoints>; 200 only when
// localEndpoints != 0 and the proxy is healthy, else 503.

func nsn(ns, name string) types.NamespacedName {
	return types.NamespacedName{Namespace: ns, Name: name}
}

// svcResponse is kube-proxy's answer for a service.
func svcResponse(code int, ns, name string, endpoints int, proxyHealthy bool) response {
	return response{
		Code: code,
		Header: map[string]string{
			"Content-Type":                     "application/json",
			"X-Content-Type-Options":           "nosniff",
			"X-Load-Balancing-Endpoint-Weight": strconv.Itoa(endpoints),
		},
		Body: fmt.Sprintf("{\n\t\"service\": {\n\t\t\"namespace\": %q,\n\t\t\"name\": %q\n\t},\n\t\"localEndpoints\": %d,\n\t\"serviceProxyHealthy\": %v\n}", ns, name, endpoints, proxyHealthy),
	}
}

func TestServiceHealthBody(t *testing.T) {
	// One literal, written out, so the template above is checked too.
	want := "{\n" +
		"\t\"service\": {\n" +
		"\t\t\"namespace\": \"default\",\n" +
		"\t\t\"name\": \"web\"\n" +
		"\t},\n" +
		"\t\"localEndpoints\": 3,\n" +
		"\t\"serviceProxyHealthy\": true\n" +
		"}"
	if got := serviceBody(nsn("default", "web"), 3, true); got != want {
		t.Errorf("serviceBody = %q, want %q", got, want)
	}
}

func TestServiceHealthResponses(t *testing.T) {
	checkNoLeaks(t)
	clk := testingclock.NewFakeClock(t0)
	proxy := NewProxyHealth(ProxyHealthConfig{Clock: clk, HealthTimeout: 10 * time.Second})
	proxy.Updated()
	fn := newFakeNet()
	s := NewServiceHealth(ServiceHealthConfig{Listen: fn.listen, ProxyHealth: proxy})
	defer s.Close()
	web := nsn("default", "web")
	if err := s.SyncServices(map[types.NamespacedName]uint16{web: 30123}); err != nil {
		t.Fatalf("SyncServices: %v", err)
	}
	addr := fn.real(t, "0.0.0.0:30123")

	tests := []struct {
		name         string
		endpoints    map[types.NamespacedName]int
		proxyHealthy bool
		want         response
	}{
		{"no endpoints yet", nil, true, svcResponse(503, "default", "web", 0, true)},
		{"one local endpoint", map[types.NamespacedName]int{web: 1}, true, svcResponse(200, "default", "web", 1, true)},
		{"weight is the count", map[types.NamespacedName]int{web: 18}, true, svcResponse(200, "default", "web", 18, true)},
		{"zero local endpoints", map[types.NamespacedName]int{web: 0}, true, svcResponse(503, "default", "web", 0, true)},
		{"endpoints but the proxy is unhealthy", map[types.NamespacedName]int{web: 7}, false, svcResponse(503, "default", "web", 7, false)},
		{"none and the proxy is unhealthy", nil, false, svcResponse(503, "default", "web", 0, false)},
		{"the proxy recovers", map[types.NamespacedName]int{web: 7}, true, svcResponse(200, "default", "web", 7, true)},
	}
	for _, tt := range tests {
		if err := s.SyncEndpoints(tt.endpoints); err != nil {
			t.Fatalf("%s: SyncEndpoints: %v", tt.name, err)
		}
		if tt.proxyHealthy {
			proxy.Updated()
		} else {
			proxy.QueuedUpdate()
			clk.Step(10 * time.Second)
		}
		// Any path gets the same answer, as in kube-proxy.
		for _, path := range []string{"/", "/healthz"} {
			if diff := cmp.Diff(tt.want, mustGet(t, addr, path)); diff != "" {
				t.Errorf("%s: GET %s (-want +got):\n%s", tt.name, path, diff)
			}
		}
	}
}

func TestServiceHealthNilProxyIsHealthy(t *testing.T) {
	checkNoLeaks(t)
	fn := newFakeNet()
	s := NewServiceHealth(ServiceHealthConfig{Listen: fn.listen})
	defer s.Close()
	svc := nsn("ns", "a")
	if err := s.SyncServices(map[types.NamespacedName]uint16{svc: 31000}); err != nil {
		t.Fatal(err)
	}
	s.SyncEndpoints(map[types.NamespacedName]int{svc: 2})
	if diff := cmp.Diff(svcResponse(200, "ns", "a", 2, true), mustGet(t, fn.real(t, "0.0.0.0:31000"), "/")); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

// TestServiceHealthSync follows kube-proxy's TestServer: services are
// added, kept, re-ported and removed, and endpoint counts follow.
func TestServiceHealthSync(t *testing.T) {
	checkNoLeaks(t)
	fn := newFakeNet()
	s := NewServiceHealth(ServiceHealthConfig{Listen: fn.listen})
	defer s.Close()
	a, b, c, d := nsn("a", "a"), nsn("b", "b"), nsn("c", "c"), nsn("d", "d")

	type want struct {
		addr      string // requested address
		endpoints int
	}
	steps := []struct {
		name      string
		services  map[types.NamespacedName]uint16 // nil: no SyncServices
		endpoints map[types.NamespacedName]int
		keepEps   bool                          // skip SyncEndpoints
		wantCalls []string                      // Listen calls made by this step
		want      map[types.NamespacedName]want // served services
		wantOpen  []string
	}{{
		name:      "nothing",
		services:  map[types.NamespacedName]uint16{},
		endpoints: map[types.NamespacedName]int{a: 93}, // unknown: dropped
		want:      map[types.NamespacedName]want{},
	}, {
		name:      "one service, no endpoints",
		services:  map[types.NamespacedName]uint16{a: 9376},
		wantCalls: []string{"tcp 0.0.0.0:9376"},
		want:      map[types.NamespacedName]want{a: {"0.0.0.0:9376", 0}},
		wantOpen:  []string{"0.0.0.0:9376"},
	}, {
		name:      "endpoints arrive",
		endpoints: map[types.NamespacedName]int{a: 18},
		want:      map[types.NamespacedName]want{a: {"0.0.0.0:9376", 18}},
		wantOpen:  []string{"0.0.0.0:9376"},
	}, {
		name:      "nil endpoints: zero",
		endpoints: nil,
		want:      map[types.NamespacedName]want{a: {"0.0.0.0:9376", 0}},
		wantOpen:  []string{"0.0.0.0:9376"},
	}, {
		name:      "three services, sorted opening",
		services:  map[types.NamespacedName]uint16{a: 9376, c: 11113, b: 12909},
		endpoints: map[types.NamespacedName]int{a: 9, b: 3, c: 7},
		wantCalls: []string{"tcp 0.0.0.0:12909", "tcp 0.0.0.0:11113"},
		want:      map[types.NamespacedName]want{a: {"0.0.0.0:9376", 9}, b: {"0.0.0.0:12909", 3}, c: {"0.0.0.0:11113", 7}},
		wantOpen:  []string{"0.0.0.0:11113", "0.0.0.0:12909", "0.0.0.0:9376"},
	}, {
		name:      "remove a, keep b with its count, re-port c (count reset), add d",
		services:  map[types.NamespacedName]uint16{b: 12909, c: 11114, d: 11878},
		keepEps:   true,
		wantCalls: []string{"tcp 0.0.0.0:11114", "tcp 0.0.0.0:11878"},
		want:      map[types.NamespacedName]want{b: {"0.0.0.0:12909", 3}, c: {"0.0.0.0:11114", 0}, d: {"0.0.0.0:11878", 0}},
		wantOpen:  []string{"0.0.0.0:11114", "0.0.0.0:11878", "0.0.0.0:12909"},
	}, {
		name:      "endpoints for all, including the removed a",
		endpoints: map[types.NamespacedName]int{a: 9, b: 3, c: 7, d: 6},
		want:      map[types.NamespacedName]want{b: {"0.0.0.0:12909", 3}, c: {"0.0.0.0:11114", 7}, d: {"0.0.0.0:11878", 6}},
		wantOpen:  []string{"0.0.0.0:11114", "0.0.0.0:11878", "0.0.0.0:12909"},
	}, {
		name:      "b missing from endpoints: zero",
		endpoints: map[types.NamespacedName]int{c: 7, d: 6},
		want:      map[types.NamespacedName]want{b: {"0.0.0.0:12909", 0}, c: {"0.0.0.0:11114", 7}, d: {"0.0.0.0:11878", 6}},
		wantOpen:  []string{"0.0.0.0:11114", "0.0.0.0:11878", "0.0.0.0:12909"},
	}, {
		name:      "a port moves from d to a new service in one sync",
		services:  map[types.NamespacedName]uint16{b: 12909, c: 11114, a: 11878},
		keepEps:   true,
		wantCalls: []string{"tcp 0.0.0.0:11878"},
		want:      map[types.NamespacedName]want{a: {"0.0.0.0:11878", 0}, b: {"0.0.0.0:12909", 0}, c: {"0.0.0.0:11114", 7}},
		wantOpen:  []string{"0.0.0.0:11114", "0.0.0.0:11878", "0.0.0.0:12909"},
	}, {
		name:     "all removed",
		services: map[types.NamespacedName]uint16{},
		want:     map[types.NamespacedName]want{},
	}}

	// everServed remembers the real address of every listener opened, to
	// check that removed ones refuse connections.
	everServed := map[string]bool{}
	for _, st := range steps {
		if st.services != nil {
			if err := s.SyncServices(st.services); err != nil {
				t.Fatalf("%s: SyncServices: %v", st.name, err)
			}
		}
		if !st.keepEps {
			if err := s.SyncEndpoints(st.endpoints); err != nil {
				t.Fatalf("%s: SyncEndpoints: %v", st.name, err)
			}
		}
		if diff := cmp.Diff(st.wantCalls, fn.takeCalls()); diff != "" {
			t.Errorf("%s: Listen calls (-want +got):\n%s", st.name, diff)
		}
		if diff := cmp.Diff(st.wantOpen, fn.openAddrs()); diff != "" {
			t.Errorf("%s: open listeners (-want +got):\n%s", st.name, diff)
		}
		live := map[string]bool{}
		for svc, w := range st.want {
			addr := fn.real(t, w.addr)
			live[addr], everServed[addr] = true, true
			code := 200
			if w.endpoints == 0 {
				code = 503
			}
			if diff := cmp.Diff(svcResponse(code, svc.Namespace, svc.Name, w.endpoints, true), mustGet(t, addr, "/")); diff != "" {
				t.Errorf("%s: %s (-want +got):\n%s", st.name, svc, diff)
			}
		}
		for addr := range everServed {
			if !live[addr] && !refused(addr) {
				t.Errorf("%s: %s still accepts connections after its service was closed", st.name, addr)
			}
		}
	}
}

func TestServiceHealthBindFailureKeepsOthers(t *testing.T) {
	checkNoLeaks(t)
	fn := newFakeNet()
	fn.setFail("0.0.0.0:2002", errBusy)
	s := NewServiceHealth(ServiceHealthConfig{Listen: fn.listen})
	defer s.Close()
	a, b, c := nsn("ns", "a"), nsn("ns", "b"), nsn("ns", "c")
	ports := map[types.NamespacedName]uint16{a: 2001, b: 2002, c: 2003}
	counts := map[types.NamespacedName]int{a: 1, b: 1, c: 1}

	err := s.SyncServices(ports)
	errContains(t, err, "ns/b", "2002", "already in use")
	if !errors.Is(err, errBusy) {
		t.Errorf("error %v does not wrap the listen error", err)
	}
	for _, other := range []string{"ns/a", "ns/c"} {
		if msg := err.Error(); strings.Contains(msg, other) {
			t.Errorf("error %q mentions %s, which opened fine", msg, other)
		}
	}
	s.SyncEndpoints(counts)
	for svc, addr := range map[types.NamespacedName]string{a: "0.0.0.0:2001", c: "0.0.0.0:2003"} {
		if diff := cmp.Diff(svcResponse(200, "ns", svc.Name, 1, true), mustGet(t, fn.real(t, addr), "/")); diff != "" {
			t.Errorf("%s (-want +got):\n%s", svc, diff)
		}
	}

	// The failed service is retried on every sync; the others are left
	// alone.
	fn.takeCalls()
	errContains(t, s.SyncServices(ports), "ns/b")
	if diff := cmp.Diff([]string{"tcp 0.0.0.0:2002"}, fn.takeCalls()); diff != "" {
		t.Errorf("retry Listen calls (-want +got):\n%s", diff)
	}
	fn.setFail("0.0.0.0:2002", nil)
	if err := s.SyncServices(ports); err != nil {
		t.Fatalf("SyncServices once the port is free: %v", err)
	}
	s.SyncEndpoints(counts)
	if diff := cmp.Diff(svcResponse(200, "ns", "b", 1, true), mustGet(t, fn.real(t, "0.0.0.0:2002"), "/")); diff != "" {
		t.Errorf("ns/b after retry (-want +got):\n%s", diff)
	}
}

// TestServiceHealthBindFailureRealPort uses the real net.Listen and
// interface addresses: a port held by someone else fails alone.
func TestServiceHealthBindFailureRealPort(t *testing.T) {
	checkNoLeaks(t)
	busy, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	busyPort := uint16(busy.Addr().(*net.TCPAddr).Port)
	freePort := func() uint16 {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return uint16(ln.Addr().(*net.TCPAddr).Port)
	}()

	s := NewServiceHealth(ServiceHealthConfig{Addresses: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}})
	defer s.Close()
	taken, ok := nsn("ns", "taken"), nsn("ns", "ok")
	err = s.SyncServices(map[types.NamespacedName]uint16{taken: busyPort, ok: freePort})
	errContains(t, err, "ns/taken", strconv.Itoa(int(busyPort)))
	if !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("error %v is not EADDRINUSE", err)
	}
	s.SyncEndpoints(map[types.NamespacedName]int{ok: 2})
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(int(freePort)))
	if diff := cmp.Diff(svcResponse(200, "ns", "ok", 2, true), mustGet(t, addr, "/")); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	s.Close()
	if !refused(addr) {
		t.Errorf("%s still accepts connections after Close", addr)
	}
}

// TestServiceHealthPartialBind: a service listens on every matching node
// address; if one fails, those already opened for it are closed.
func TestServiceHealthPartialBind(t *testing.T) {
	checkNoLeaks(t)
	fn := newFakeNet()
	s := NewServiceHealth(ServiceHealthConfig{
		Addresses: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")},
		Listen:    fn.listen,
	})
	defer s.Close()
	s.interfaceAddrs = ifAddrs("10.0.0.1/24", "10.0.0.2/24", "192.168.0.1/24")

	svc := nsn("ns", "a")
	fn.setFail("10.0.0.2:3000", errBusy)
	errContains(t, s.SyncServices(map[types.NamespacedName]uint16{svc: 3000}), "ns/a", "3000", "10.0.0.2:3000")
	if diff := cmp.Diff([]string{"tcp4 10.0.0.1:3000", "tcp4 10.0.0.2:3000"}, fn.takeCalls()); diff != "" {
		t.Errorf("Listen calls (-want +got):\n%s", diff)
	}
	if open := fn.openAddrs(); len(open) != 0 {
		t.Errorf("open after a partial failure: %v, want none", open)
	}

	fn.setFail("10.0.0.2:3000", nil)
	if err := s.SyncServices(map[types.NamespacedName]uint16{svc: 3000}); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"10.0.0.1:3000", "10.0.0.2:3000"}, fn.openAddrs()); diff != "" {
		t.Errorf("open (-want +got):\n%s", diff)
	}
	s.SyncEndpoints(map[types.NamespacedName]int{svc: 1})
	for _, a := range []string{"10.0.0.1:3000", "10.0.0.2:3000"} {
		if diff := cmp.Diff(svcResponse(200, "ns", "a", 1, true), mustGet(t, fn.real(t, a), "/")); diff != "" {
			t.Errorf("%s (-want +got):\n%s", a, diff)
		}
	}
}

// ifAddrs returns an interfaceAddrs func listing CIDRs, as Linux does.
func ifAddrs(cidrs ...string) func() ([]net.Addr, error) {
	return func() ([]net.Addr, error) {
		var out []net.Addr
		for _, c := range cidrs {
			ip, n, err := net.ParseCIDR(c)
			if err != nil {
				return nil, err
			}
			n.IP = ip
			out = append(out, n)
		}
		return out, nil
	}
}

func TestBindAddresses(t *testing.T) {
	node := ifAddrs("127.0.0.1/8", "10.1.2.3/16", "192.168.1.1/24", "::1/128", "2001:db8::1/64", "fe80::1/64")
	tests := []struct {
		name     string
		prefixes []string
		ifAddrs  func() ([]net.Addr, error)
		want     []bindAddr
		wantErr  string
	}{
		{"empty: one dual-stack wildcard", nil, node, []bindAddr{{"tcp", "0.0.0.0"}}, ""},
		{"both zero prefixes: the same", []string{"0.0.0.0/0", "::/0"}, node, []bindAddr{{"tcp", "0.0.0.0"}}, ""},
		{"IPv4 zero prefix only", []string{"0.0.0.0/0"}, node, []bindAddr{{"tcp4", "0.0.0.0"}}, ""},
		{"IPv6 zero prefix only", []string{"::/0"}, node, []bindAddr{{"tcp6", "::"}}, ""},
		{"one IPv4 prefix", []string{"10.0.0.0/8"}, node, []bindAddr{{"tcp4", "10.1.2.3"}}, ""},
		{"IPv4 prefixes and all of IPv6", []string{"10.0.0.0/8", "192.168.1.0/24", "::/0"}, node,
			[]bindAddr{{"tcp4", "10.1.2.3"}, {"tcp4", "192.168.1.1"}, {"tcp6", "::"}}, ""},
		{"overlapping prefixes: each address once", []string{"10.0.0.0/8", "10.1.0.0/16"}, node, []bindAddr{{"tcp4", "10.1.2.3"}}, ""},
		{"loopback only when asked", []string{"127.0.0.0/8", "::1/128"}, node, []bindAddr{{"tcp4", "127.0.0.1"}, {"tcp6", "::1"}}, ""},
		{"IPv6 link-local skipped", []string{"2001:db8::/32", "fe80::/10"}, node, []bindAddr{{"tcp6", "2001:db8::1"}}, ""},
		{"IPv4-mapped prefix counts as IPv4", []string{"::ffff:10.0.0.0/104"}, node, []bindAddr{{"tcp4", "10.1.2.3"}}, ""},
		{"no match", []string{"172.16.0.0/12"}, node, nil, "no node address in [172.16.0.0/12]"},
		{"interface error", []string{"10.0.0.0/8"}, func() ([]net.Addr, error) { return nil, errors.New("netlink down") },
			nil, "listing node addresses: netlink down"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var prefixes []netip.Prefix
			for _, p := range tt.prefixes {
				prefixes = append(prefixes, netip.MustParsePrefix(p))
			}
			s := NewServiceHealth(ServiceHealthConfig{Addresses: prefixes})
			s.interfaceAddrs = tt.ifAddrs
			got, err := s.bindAddresses()
			if tt.wantErr != "" {
				errContains(t, err, tt.wantErr)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.want, got, cmp.AllowUnexported(bindAddr{})); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

func TestServiceHealthNoAddressIsAnError(t *testing.T) {
	fn := newFakeNet()
	s := NewServiceHealth(ServiceHealthConfig{Addresses: []netip.Prefix{netip.MustParsePrefix("172.16.0.0/12")}, Listen: fn.listen})
	defer s.Close()
	s.interfaceAddrs = ifAddrs("10.0.0.1/8")
	err := s.SyncServices(map[types.NamespacedName]uint16{nsn("ns", "a"): 1, nsn("ns", "b"): 2})
	errContains(t, err, "ns/a health check port 1", "ns/b health check port 2", "no node address")
	if calls := fn.takeCalls(); len(calls) != 0 {
		t.Errorf("Listen called: %v", calls)
	}
}

func TestServiceHealthClose(t *testing.T) {
	checkNoLeaks(t)
	fn := newFakeNet()
	s := NewServiceHealth(ServiceHealthConfig{Listen: fn.listen})
	ports := map[types.NamespacedName]uint16{nsn("ns", "a"): 1, nsn("ns", "b"): 2, nsn("ns", "c"): 3}
	if err := s.SyncServices(ports); err != nil {
		t.Fatal(err)
	}
	var addrs []string
	for _, p := range []string{"0.0.0.0:1", "0.0.0.0:2", "0.0.0.0:3"} {
		addrs = append(addrs, fn.real(t, p))
	}
	// An idle client connection is open when Close is called: Close must
	// end its server goroutine too.
	idle, err := net.Dial("tcp", addrs[0])
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	mustGet(t, addrs[1], "/")

	s.Close()
	for _, a := range addrs {
		if !refused(a) {
			t.Errorf("%s accepts connections after Close", a)
		}
	}
	if open := fn.openAddrs(); len(open) != 0 {
		t.Errorf("listeners open after Close: %v", open)
	}
	errContains(t, s.SyncServices(ports), "after Close")
	s.Close() // idempotent
}

// TestServiceHealthConcurrent runs requests against syncs, for the race
// detector.
func TestServiceHealthConcurrent(t *testing.T) {
	checkNoLeaks(t)
	proxy := NewProxyHealth(ProxyHealthConfig{})
	fn := newFakeNet()
	s := NewServiceHealth(ServiceHealthConfig{Listen: fn.listen, ProxyHealth: proxy})
	defer s.Close()
	a, b := nsn("ns", "a"), nsn("ns", "b")
	if err := s.SyncServices(map[types.NamespacedName]uint16{a: 1}); err != nil {
		t.Fatal(err)
	}
	addr := fn.real(t, "0.0.0.0:1")
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			s.SyncEndpoints(map[types.NamespacedName]int{a: i % 3})
			proxy.QueuedUpdate()
			proxy.Updated()
			ports := map[types.NamespacedName]uint16{a: 1}
			if i%2 == 0 {
				ports[b] = 2
			}
			if err := s.SyncServices(ports); err != nil {
				t.Errorf("SyncServices: %v", err)
				return
			}
		}
	})
	for range 50 {
		r := mustGet(t, addr, "/")
		if r.Code != 200 && r.Code != 503 {
			t.Errorf("code %d", r.Code)
		}
	}
	close(stop)
	wg.Wait()
}
