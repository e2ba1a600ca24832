package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/service"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

func TestExplain(t *testing.T) {
	a, b := nameBackend(t, "a"), nameBackend(t, "b")
	p, rules := startProxier(t, Config{})
	sh := svc("sh", "10.96.0.11", "http:80")
	sh.Annotations = map[string]string{service.AnnotationBalancer: "source-hash"}
	aff := svc("aff", "10.96.0.12", "http:80")
	aff.Spec.SessionAffinity = v1.ServiceAffinityClientIP
	lb := svc("lb", "10.96.0.13", "http:80")
	lb.Spec.Type = v1.ServiceTypeLoadBalancer
	lb.Spec.Ports[0].NodePort = 30080
	lb.Spec.LoadBalancerSourceRanges = []string{"192.0.2.0/24"}
	lb.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "10.96.200.1"}}
	slices := slicesFor("web", "http", a, b)
	slices = append(slices, slicesFor("sh", "http", a, b)...)
	slices = append(slices, slicesFor("aff", "http", a, b)...)
	slices = append(slices, slicesFor("lb", "http", a)...)
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80"), sh, aff, lb, svc("empty", "10.96.0.20", "http:80")}, slices)
	rules.port(t, "default/empty:http")
	// A connection from 127.0.0.1 records its affinity.
	affPort := rules.port(t, "default/aff:http")
	first, err := get(t, affPort)
	if err != nil {
		t.Fatal(err)
	}
	backendOf := map[string]string{"a": a.addr.String(), "b": b.addr.String()}
	testwait.Until(t, 5*time.Second, "a sync", func() bool { return p.Status().Ports != nil })
	client := netip.MustParseAddr("127.0.0.1")

	explain := func(dst string, proto v1.Protocol, from netip.Addr) introspect.Explanation {
		t.Helper()
		ex := p.Explain(netip.MustParseAddrPort(dst), proto, from)
		t.Logf("%s: %+v", dst, ex)
		return ex
	}
	if ex := explain("10.96.0.10:80", v1.ProtocolTCP, client); !ex.Caught || ex.Service != "default/web" || ex.Backend != "" ||
		!strings.Contains(ex.Pick, "next in turn") || len(ex.Candidates) != 2 || !strings.Contains(ex.OriginalDestination, "SO_ORIGINAL_DST") {
		t.Errorf("round-robin: %+v", ex)
	}
	ex1, ex2 := explain("10.96.0.11:80", v1.ProtocolTCP, client), explain("10.96.0.11:80", v1.ProtocolTCP, client)
	if ex1.Backend == "" || ex1.Backend != ex2.Backend {
		t.Errorf("source hash: %q then %q", ex1.Backend, ex2.Backend)
	}
	if ex := explain("10.96.0.12:80", v1.ProtocolTCP, client); ex.Backend != backendOf[first] || !strings.Contains(ex.Pick, "ClientIP affinity") {
		t.Errorf("affinity: %+v; the connection went to %s", ex, first)
	}
	if ex := explain("10.96.0.12:80", v1.ProtocolTCP, netip.MustParseAddr("10.1.1.1")); ex.Backend != "" || !strings.Contains(ex.Pick, "recorded for ClientIP affinity") {
		t.Errorf("affinity, new client: %+v", ex)
	}
	for _, c := range []struct{ dst, from, want string }{
		{"10.96.0.20:80", "", "no ready endpoints at all (0 endpoints of this family, 0 not ready): the kernel refuses the connection"},
		{"10.96.0.10:81", "", "port mismatch"},
		{"10.96.9.9:80", "", "no such service"},
		{"10.96.200.1:80", "203.0.113.1", "loadBalancerSourceRanges reject the client"},
	} {
		var from netip.Addr
		if c.from != "" {
			from = netip.MustParseAddr(c.from)
		}
		if ex := explain(c.dst, v1.ProtocolTCP, from); !strings.Contains(ex.Reason, c.want) {
			t.Errorf("%s from %q: reason %q, want %q", c.dst, c.from, ex.Reason, c.want)
		}
	}
	if ex := explain("10.96.0.10:80", v1.ProtocolUDP, client); ex.Caught || !strings.Contains(ex.Reason, "port mismatch") {
		t.Errorf("UDP to a TCP port: %+v", ex)
	}
	if ex := explain("10.96.200.1:80", v1.ProtocolTCP, netip.MustParseAddr("192.0.2.7")); !ex.Caught || ex.Kind != "LoadBalancerIP" || ex.Backend != a.addr.String() {
		t.Errorf("allowed source: %+v", ex)
	}
	// Explaining picked nothing: the affinity table still has one client.
	if ex := explain("10.96.0.12:80", v1.ProtocolTCP, netip.MustParseAddr("10.1.1.1")); ex.Backend != "" {
		t.Errorf("explain recorded an affinity: %+v", ex)
	}
}

// TestExplainLeastConnSampled checks that Explain names no endpoint for a
// least-conn service with more endpoints than the balancer scans, and
// says that it draws two at random instead.
func TestExplainLeastConnSampled(t *testing.T) {
	p, _ := startProxier(t, Config{})
	lc := svc("lc", "10.96.0.15", "http:80")
	lc.Annotations = map[string]string{service.AnnotationBalancer: "least-conn"}
	var eps []ep
	for i := range balancer.MaxLeastConnScan + 1 {
		eps = append(eps, ep{IP: fmt.Sprintf("127.0.0.%d", i+2)})
	}
	p.Tracker().Replace([]*v1.Service{lc}, []*discovery.EndpointSlice{slice("lc-0", "lc", "http", 8080, eps...)})
	testwait.Until(t, 5*time.Second, "a sync", func() bool { return p.Status().Ports != nil })
	ex := p.Explain(netip.MustParseAddrPort("10.96.0.15:80"), v1.ProtocolTCP, netip.MustParseAddr("127.0.0.1"))
	if ex.Backend != "" || !strings.Contains(ex.Pick, "two endpoints drawn at random (power of two choices") {
		t.Errorf("explained %+v; want no endpoint named, and the two random choices", ex)
	}
}

// TestExplainLeastConn checks that Explain names the endpoint that a
// least-conn service picks next, as the balancer compares loads, and
// that the next connection does go there.
func TestExplainLeastConn(t *testing.T) {
	hold := func(name string) *backend {
		return startBackend(t, func(c net.Conn) { fmt.Fprintln(c, name); io.Copy(io.Discard, c) })
	}
	a, b := hold("a"), hold("b")
	addrOf := map[string]string{"a": a.addr.String(), "b": b.addr.String()}
	p, rules := startProxier(t, Config{})
	lc := svc("lc", "10.96.0.14", "http:80")
	lc.Annotations = map[string]string{service.AnnotationBalancer: "least-conn"}
	p.Tracker().Replace([]*v1.Service{lc}, slicesFor("lc", "http", a, b))
	port := rules.port(t, "default/lc:http")
	testwait.Until(t, 5*time.Second, "a sync", func() bool { return p.Status().Ports != nil })
	explain := func() introspect.Explanation {
		ex := p.Explain(netip.MustParseAddrPort("10.96.0.14:80"), v1.ProtocolTCP, netip.MustParseAddr("127.0.0.1"))
		t.Logf("%+v", ex)
		return ex
	}
	if ex := explain(); ex.Backend != "" || !strings.Contains(ex.Pick, "fewest active connections; 2 tie") {
		t.Fatalf("idle endpoints: %+v", ex)
	}
	open := func() string {
		c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(5 * time.Second))
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(line)
	}
	first := open()
	ex := explain()
	if ex.Backend == "" || ex.Backend == addrOf[first] || strings.Contains(ex.Pick, "tie") {
		t.Fatalf("with a connection held on %s: %+v", first, ex)
	}
	if second := open(); addrOf[second] != ex.Backend {
		t.Errorf("Explain named %s, the next connection went to %s (%s)", ex.Backend, second, addrOf[second])
	}
}

// TestExplainBackendsSee checks that Explain says which address the
// backends see, and why, as the data path decides it: a pod keeps its
// own to a cluster IP, an outside client and external traffic under
// externalTrafficPolicy Cluster get the node's, the node is the node,
// and the annotation and --masquerade-all override.
func TestExplainBackendsSee(t *testing.T) {
	a := nameBackend(t, "a")
	for _, masqAll := range []bool{false, true} {
		cfg := Config{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}
		cfg.MasqueradeAll = masqAll
		p, rules := startProxier(t, cfg)
		on, off := svc("on", "10.96.0.11", "http:80"), svc("off", "10.96.0.12", "http:80")
		on.Annotations = map[string]string{service.AnnotationPreserveSourceIP: "true"}
		off.Annotations = map[string]string{service.AnnotationPreserveSourceIP: "false"}
		web := svc("web", "10.96.0.10", "http:80")
		web.Spec.ExternalIPs = []string{"10.96.200.1"}
		sl := slicesFor("web", "http", a)
		sl = append(sl, slicesFor("on", "http", a)...)
		sl = append(sl, slicesFor("off", "http", a)...)
		p.Tracker().Replace([]*v1.Service{web, on, off}, sl)
		rules.port(t, "default/off:http")
		testwait.Until(t, 5*time.Second, "a sync", func() bool { return len(p.Status().Ports) == 3 })
		for _, c := range []struct{ dst, from, want string }{
			{"10.96.0.10:80", "10.244.1.5", "the client's own address, 10.244.1.5: as kube-proxy"},
			{"10.96.0.10:80", "192.0.2.7", "the node's address: the client is outside the pod networks"},
			{"10.96.0.10:80", "127.0.0.1", "the node's address: the client is the node"},
			{"10.96.0.10:80", "", "give --from"},
			{"10.96.200.1:80", "10.244.1.5", "the node's address: externalTrafficPolicy Cluster"},
			{"10.96.0.11:80", "192.0.2.7", `the client's own address, 192.0.2.7: the service's uproxy.io/preserve-source-ip is "true"`},
			{"10.96.0.12:80", "10.244.1.5", `the node's address: the service's uproxy.io/preserve-source-ip is "false"`},
		} {
			// --masquerade-all answers wherever the kube-proxy rule would.
			if masqAll && (strings.Contains(c.want, "as kube-proxy") || strings.Contains(c.want, "outside the pod networks") || strings.Contains(c.want, "externalTrafficPolicy")) {
				c.want = "the node's address: --masquerade-all"
			}
			var from netip.Addr
			if c.from != "" {
				from = netip.MustParseAddr(c.from)
			}
			if ex := p.Explain(netip.MustParseAddrPort(c.dst), v1.ProtocolTCP, from); !strings.Contains(ex.BackendsSee, c.want) {
				t.Errorf("masquerade-all %v, %s from %q: backends see %q, want %q", masqAll, c.dst, c.from, ex.BackendsSee, c.want)
			}
		}
	}
}
