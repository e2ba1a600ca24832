package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/routing"

	"github.com/uproxy/uproxy/proxy/listeners"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/service"
)

// TestEndpointRefusal checks which endpoint addresses a service port
// refuses: addresses no Service may send to, the service port's own
// intercepted addresses, and the node's own service ports on its
// addresses; and that the rest, a host-network pod on the node's address
// included, are used.
func TestEndpointRefusal(t *testing.T) {
	p := NewProxier(Config{
		LocalAddrs: func() ([]netip.Addr, error) {
			return []netip.Addr{netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("2001:db8::1")}, nil
		},
		ServerAddrs:       []netip.AddrPort{netip.MustParseAddrPort("0.0.0.0:10256"), netip.MustParseAddrPort("127.0.0.1:10249")},
		ClusterCIDRs:      []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")},
		NodeEndpointPorts: service.PortRanges{{First: 8080, Last: 8080}, {First: 9100, Last: 9110}},
	})
	t.Cleanup(func() { p.Shutdown(context.Background()) })
	p.addrs.refresh()
	s := svc("web", "10.96.0.10", "http:80")
	s.Spec.Type = v1.ServiceTypeLoadBalancer
	s.Spec.ExternalIPs = []string{"192.0.2.50", "10.244.1.5"}
	s.Spec.Ports[0].NodePort = 30080
	s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "192.0.2.60"}}
	sp := service.Ports(s, service.Defaults{})[0]
	l, err := p.sockets.Open(t.Context(), listeners.Key{Name: sp.Name})
	if err != nil {
		t.Fatal(err)
	}
	listenerPort := fmt.Sprintf("192.0.2.1:%d", l.Port)

	for _, tt := range []struct {
		ep   string
		want string // "" when the endpoint is used
	}{
		{"10.244.0.5:8080", ""},
		{"192.0.2.1:8080", ""}, // a host-network pod on this node, on an allowed port
		{"192.0.2.1:9110", ""}, // the same, the last of a range
		{"192.0.2.1:10250", "an address of this node, on a port that --node-endpoint-ports does not allow"}, // the kubelet
		{"[2001:db8::1]:9111", "an address of this node, on a port that --node-endpoint-ports does not allow"},
		{"192.0.2.9:10250", ""}, // another node's kubelet: as any pod could
		{"[fd00:ec2::254]:80", "in fd00:ec2::254/128, a network no endpoint may be in (--endpoint-deny-cidrs)"},
		{"100.100.100.200:80", "in 100.100.100.200/32, a network no endpoint may be in (--endpoint-deny-cidrs)"},
		{"168.63.129.16:80", "in 168.63.129.16/32, a network no endpoint may be in (--endpoint-deny-cidrs)"},
		{"[::ffff:168.63.129.16]:80", "in 168.63.129.16/32, a network no endpoint may be in (--endpoint-deny-cidrs)"},
		{"192.0.2.50:8080", ""}, // the external IP, on another port
		{"10.96.0.10:8080", ""}, // the cluster IP, on another port
		{"192.0.2.9:30080", "a port of the node-port range on an address outside the pod networks: a node's proxy would intercept it and could send it back"}, // another node's node port: a loop between nodes
		{"192.0.2.9:32767", "a port of the node-port range on an address outside the pod networks: a node's proxy would intercept it and could send it back"},
		{"192.0.2.9:32768", ""},  // outside the range
		{"10.244.3.7:30080", ""}, // a pod listening on a port of the range
		{"192.0.2.1:30999", "a port of the node-port range on an address outside the pod networks: a node's proxy would intercept it and could send it back"}, // this node, another Service's node port
		{"[2001:db8::5]:80", ""}, // an IPv6 pod
		{"[::ffff:10.244.0.6]:80", ""},
		{"127.0.0.1:10249", "a loopback address"},
		{"127.0.0.53:53", "a loopback address"},
		{"[::1]:80", "a loopback address"},
		{"169.254.169.254:80", "a link-local address"},
		{"[fe80::1]:80", "a link-local address"},
		{"0.0.0.0:80", "an unspecified address"},
		{"[::]:80", "an unspecified address"},
		{"224.0.0.251:5353", "a multicast address"},
		{"[ff02::fb]:5353", "a multicast address"},
		{"255.255.255.255:80", "the broadcast address"},
		{"10.96.0.10:80", "the service port's own address and port: the proxy's connections to it would be intercepted again"},
		{"192.0.2.50:80", "the service port's own address and port: the proxy's connections to it would be intercepted again"},
		{"192.0.2.60:80", "the service port's own address and port: the proxy's connections to it would be intercepted again"},
		{"[::ffff:192.0.2.50]:80", "the service port's own address and port: the proxy's connections to it would be intercepted again"},
		// An external IP that is a pod's address: one hop, to the pod's
		// node, whose proxy delivers it.
		{"10.244.1.5:80", ""},
		{"192.0.2.1:30080", "the service port's own node port on an address of this node"},
		{listenerPort, "a listener port of the proxy on an address of this node"},
		{"192.0.2.1:10256", "an address of the proxy's own servers"},
		{"[2001:db8::1]:10256", "an address of the proxy's own servers"},
	} {
		t.Run(tt.ep, func(t *testing.T) {
			ap := netip.MustParseAddrPort(tt.ep)
			ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
			if got := p.endpointRefusal(sp, ap); got != tt.want {
				t.Errorf("endpointRefusal(%s) = %q, want %q", ap, got, tt.want)
			}
		})
	}

	// Loopback endpoints are let through for tests, nothing else is.
	p.cfg.LoopbackEndpoints = true
	if got := p.endpointRefusal(sp, netip.MustParseAddrPort("127.0.0.1:8080")); got != "" {
		t.Errorf("with LoopbackEndpoints, 127.0.0.1:8080 refused: %q", got)
	}
	if got := p.endpointRefusal(sp, netip.MustParseAddrPort("127.0.0.1:10249")); got == "" {
		t.Error("with LoopbackEndpoints, the metrics server 127.0.0.1:10249 is used")
	}
	p.cfg.LoopbackEndpoints = false

	// The API server's own Service may have the node's addresses, on
	// any port; an operator's list replaces the default deny list.
	api := service.Ports(svc("kubernetes", "10.96.0.1", "https:443"), service.Defaults{})[0]
	if got := p.endpointRefusal(api, netip.MustParseAddrPort("192.0.2.1:6443")); got != "" {
		t.Errorf("the API server's endpoint on this node refused: %q", got)
	}
	p.cfg.DeniedEndpoints = []netip.Prefix{}
	if got := p.endpointRefusal(sp, netip.MustParseAddrPort("168.63.129.16:80")); got != "" {
		t.Errorf("with an empty deny list, 168.63.129.16:80 refused: %q", got)
	}
	p.cfg.DeniedEndpoints = []netip.Prefix{netip.MustParsePrefix("10.250.0.0/16")}
	if got := p.endpointRefusal(sp, netip.MustParseAddrPort("10.250.3.4:80")); got == "" {
		t.Error("an endpoint in the operator's deny list is used")
	}

	// With detect-local mode NodeCIDR the proxier's ClusterCIDRs are this
	// node's pod network; a pod of another node is still a pod.
	p.addrs.clusterCIDRs = []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24")}
	if got := p.endpointRefusal(sp, netip.MustParseAddrPort("10.244.3.7:30080")); got != "" {
		t.Errorf("another node's pod at a port of the node-port range refused: %q", got)
	}
	// Without the pod networks, only this node's addresses are refused
	// at the node-port range: another node's cannot be told from a pod's.
	p.addrs.podNetworks = nil
	if got := p.endpointRefusal(sp, netip.MustParseAddrPort("192.0.2.9:30080")); got != "" {
		t.Errorf("without pod networks, 192.0.2.9:30080 refused: %q", got)
	}
	if got := p.endpointRefusal(sp, netip.MustParseAddrPort("192.0.2.1:30999")); got == "" {
		t.Error("without pod networks, this node's address at a port of the node-port range is used")
	}
}

// TestRefusedEndpointIsLogged checks that a refused endpoint is left out
// with a log line naming its EndpointSlice and field, and that the
// service's other endpoints serve.
func TestRefusedEndpointIsLogged(t *testing.T) {
	be := nameBackend(t, "good")
	core, logs := observer.New(zap.WarnLevel)
	p, rules := startProxier(t, Config{Config: datapath.Config{Logger: zap.New(core)}})
	sl := slice("web-x", "web", "http", int32(be.addr.Port()), ep{IP: "169.254.169.254"}, ep{IP: be.addr.Addr().String()})
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, []*discovery.EndpointSlice{sl})
	port := rules.port(t, "default/web:http")
	for range 4 {
		if got, err := get(t, port); err != nil || got != "good" {
			t.Fatalf("got %q, %v; want good", got, err)
		}
	}
	testwait.Until(t, 5*time.Second, "the refusal is logged", func() bool {
		return logs.FilterMessage("refusing an endpoint; the service's other endpoints are used").Len() > 0
	})
	got := logs.FilterMessage("refusing an endpoint; the service's other endpoints are used").All()[0].ContextMap()
	want := map[string]any{
		"kind": "EndpointSlice", "object": "default/web-x", "field": "endpoints[0].addresses[0]",
		"endpoint": fmt.Sprintf("169.254.169.254:%d", be.addr.Port()), "servicePort": "default/web:http", "reason": "a link-local address",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("log line (-want +got):\n%s", diff)
	}
}

// TestEndpointsPastTheBound checks that a service port with more
// endpoints than Config.MaxEndpointsPerPort balances over that many of
// them, and that each change that leaves some out is logged once, with
// the count left out.
func TestEndpointsPastTheBound(t *testing.T) {
	a, b, c, d := nameBackend(t, "a"), nameBackend(t, "b"), nameBackend(t, "c"), nameBackend(t, "d")
	core, logs := observer.New(zap.WarnLevel)
	p, rules := startProxier(t, Config{Config: datapath.Config{Logger: zap.New(core)}, MaxEndpointsPerPort: 2})
	web := svc("web", "10.96.0.10", "http:80")
	p.Tracker().Replace([]*v1.Service{web}, slicesFor("web", "http", a, b, c))
	port := rules.port(t, "default/web:http")
	const message = "too many endpoints for one service port; balancing over a subset of them"
	seen := map[string]bool{}
	for range 20 {
		name, err := get(t, port)
		if err != nil {
			t.Fatalf("request failed: %v", err)
		}
		seen[name] = true
	}
	if len(seen) != 2 {
		t.Errorf("connections reached %v, want two of the three endpoints", seen)
	}
	if n := len(p.Status().Ports[0].Endpoints); n != 2 {
		t.Errorf("status lists %d endpoints, want 2", n)
	}
	want := []map[string]any{{
		"servicePort": "default/web:http", "family": "IPv4", "endpoints": int64(3), "leftOut": int64(1), "maxEndpointsPerPort": int64(2),
	}}
	logged := func() []map[string]any {
		var out []map[string]any
		for _, e := range logs.FilterMessage(message).All() {
			out = append(out, e.ContextMap())
		}
		return out
	}
	if diff := cmp.Diff(want, logged()); diff != "" {
		t.Errorf("log lines after the first sync (-want +got):\n%s", diff)
	}
	p.Tracker().Replace([]*v1.Service{web}, slicesFor("web", "http", a, b, c, d))
	testwait.Until(t, 5*time.Second, "the change is logged", func() bool { return logs.FilterMessage(message).Len() == 2 })
	want = append(want, map[string]any{
		"servicePort": "default/web:http", "family": "IPv4", "endpoints": int64(4), "leftOut": int64(2), "maxEndpointsPerPort": int64(2),
	})
	if diff := cmp.Diff(want, logged()); diff != "" {
		t.Errorf("log lines after a change (-want +got):\n%s", diff)
	}
}

func TestMaxEndpointsPerPort(t *testing.T) {
	tests := []struct {
		set, want int
	}{
		{0, DefaultMaxEndpointsPerPort},
		{-1, 0},
		{25, 25},
	}
	for _, tt := range tests {
		c := Config{MaxEndpointsPerPort: tt.set}
		if got := c.maxEndpointsPerPort(); got != tt.want {
			t.Errorf("MaxEndpointsPerPort %d: bound %d, want %d", tt.set, got, tt.want)
		}
	}
}

// probeRules is a RuleSyncer that runs probe with every set of
// intercepts before it takes them.
type probeRules struct {
	recordingRules
	probe func(in []routing.Intercept)
}

func (r *probeRules) SyncRules(ctx context.Context, in []routing.Intercept, full bool) (RuleStats, error) {
	r.probe(in)
	return r.recordingRules.SyncRules(ctx, in, full)
}

// TestSyncWritesRulesBeforeClosingListeners checks that a listener a
// service lets go stays open until the rules that send traffic to it are
// rewritten: closed first, its port would be free, while those rules
// still redirect the service's traffic there, for any local process to
// bind.
func TestSyncWritesRulesBeforeClosingListeners(t *testing.T) {
	be := nameBackend(t, "a")
	var (
		mu       sync.Mutex
		old      int // the listener port of default/web:http, once known
		checked  bool
		boundErr error
	)
	rules := &probeRules{probe: func(in []routing.Intercept) {
		mu.Lock()
		defer mu.Unlock()
		for _, i := range in {
			if i.Service.String() == "default/web:http" {
				old = int(i.ListenPort)
				return
			}
		}
		if old == 0 || checked {
			return
		}
		// The rules are about to lose the service: its port must still
		// be held.
		checked = true
		ln, err := net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", old))
		if err == nil {
			ln.Close()
		}
		boundErr = err
	}}
	p := NewProxier(Config{Rules: rules, LoopbackEndpoints: true, Sync: changes.RunnerConfig{MinInterval: 10 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()
	defer func() {
		cancel()
		<-done
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer scancel()
		p.Shutdown(sctx)
	}()
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", be))
	port := rules.port(t, "default/web:http")
	p.Tracker().Replace(nil, nil)
	testwait.Until(t, 5*time.Second, "the service's rules are gone", func() bool { return !rules.has("default/web:http") })
	mu.Lock()
	if !checked {
		t.Fatal("the rules never lost the service")
	}
	if !errors.Is(boundErr, syscall.EADDRINUSE) {
		t.Errorf("binding the listener port %d while the rules still sent traffic there: %v; want EADDRINUSE", port, boundErr)
	}
	mu.Unlock()
	testwait.Until(t, 5*time.Second, "the listener port is free once the rules are gone", func() bool {
		ln, err := net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port))
		if err == nil {
			ln.Close()
		}
		return err == nil
	})
}
