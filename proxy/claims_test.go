package proxy

import (
	"fmt"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/introspect"
	"github.com/uproxy/uproxy/proxy/routing"
)

// inNamespace moves a test Service and its slices to namespace ns.
func inNamespace(ns string, s *v1.Service, sl []*discovery.EndpointSlice) (*v1.Service, []*discovery.EndpointSlice) {
	s.Namespace = ns
	for _, e := range sl {
		e.Namespace = ns
	}
	return s, sl
}

// TestExternalIPCannotTakeClusterIP checks that a tenant who names
// another Service's cluster IP in spec.externalIPs gets none of its
// traffic, in both listener layouts, even from a namespace whose name
// sorts first; that the claim is refused, logged, counted and reported
// once; and that an address claimed before it was allocated is taken
// back when its Service appears, and given back when it goes.
func TestExternalIPCannotTakeClusterIP(t *testing.T) {
	for _, shared := range []bool{false, true} {
		t.Run(fmt.Sprintf("shared=%v", shared), func(t *testing.T) {
			victim, attacker := nameBackend(t, "victim"), nameBackend(t, "attacker")
			var (
				mu      sync.Mutex
				dst     = netip.MustParseAddrPort("10.96.0.10:80")
				refused []string
			)
			cfg := Config{
				Config: datapath.Config{OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) {
					mu.Lock()
					defer mu.Unlock()
					return dst, nil
				}},
				PortRange: quietPorts(t),
				OnRefuse: func(obj runtime.Object, err error) {
					mu.Lock()
					defer mu.Unlock()
					s := obj.(*v1.Service)
					refused = append(refused, s.Namespace+"/"+s.Name+": "+err.Error())
				},
			}
			if shared {
				cfg.SharedListeners = []v1.Protocol{v1.ProtocolTCP}
			}
			reg := prometheus.NewRegistry()
			cfg.Metrics = introspect.NewMetrics(reg)
			p, rules := startProxier(t, cfg)

			bad, badSlices := inNamespace("aa-tenant", svc("web", "10.96.0.20", "http:80"), slicesFor("web", "http", attacker))
			bad.Spec.ExternalIPs = []string{"10.96.0.10", "192.0.2.10"}
			good, goodSlices := inNamespace("zz-victim", svc("web", "10.96.0.10", "http:80"), slicesFor("web", "http", victim))

			// Claimed before it is allocated: the attacker has it, as
			// kube-proxy would give it.
			p.Tracker().Replace([]*v1.Service{bad}, badSlices)
			externals := func() []string {
				rules.mu.Lock()
				defer rules.mu.Unlock()
				var out []string
				for _, i := range rules.last {
					if i.Kind == routing.ExternalIP {
						out = append(out, i.Service.String()+" "+i.VIP.String())
					}
				}
				return out
			}
			both := []string{"aa-tenant/web:http 10.96.0.10", "aa-tenant/web:http 192.0.2.10"}
			testwait.Until(t, 5*time.Second, "the attacker's external IPs", func() bool { return cmp.Equal(externals(), both) })

			// The victim's Service arrives: its cluster IP is its own.
			p.Tracker().Replace([]*v1.Service{bad, good}, append(badSlices, goodSlices...))
			one := []string{"aa-tenant/web:http 192.0.2.10"}
			testwait.Until(t, 5*time.Second, "the claim on the cluster IP refused", func() bool { return cmp.Equal(externals(), one) })
			port := rules.port(t, "zz-victim/web:http")
			for range 4 {
				if got, err := get(t, port); err != nil || got != "victim" {
					t.Fatalf("to the victim's cluster IP: got %q, %v; want %q", got, err, "victim")
				}
			}

			// Later syncs of the attacker's Service, and a full one,
			// report nothing new.
			bad2 := bad.DeepCopy()
			bad2.Labels = map[string]string{"touched": "yes"}
			p.Tracker().OnServiceUpsert(bad2)
			rules.mu.Lock()
			before := rules.calls
			rules.mu.Unlock()
			p.Resync()
			testwait.Until(t, 5*time.Second, "a full resync", func() bool {
				rules.mu.Lock()
				defer rules.mu.Unlock()
				return rules.calls > before && rules.full
			})
			mu.Lock()
			want := []string{"aa-tenant/web: spec.externalIPs: 10.96.0.10 is the cluster IP of Service zz-victim/web; refused, the Service's other addresses are served"}
			if diff := cmp.Diff(want, refused); diff != "" {
				t.Errorf("refusals reported (-want +got):\n%s", diff)
			}
			mu.Unlock()
			if n, _ := scrape(t, reg, "uproxy_service_addresses_refused_total", map[string]string{"reason": "cluster_ip_of_another_service"}); n != 1 {
				t.Errorf("uproxy_service_addresses_refused_total = %v, want 1", n)
			}

			// The victim's Service goes: the address is free again.
			p.Tracker().Replace([]*v1.Service{bad}, badSlices)
			testwait.Until(t, 5*time.Second, "the address given back", func() bool { return cmp.Equal(externals(), both) })
		})
	}
}

// TestSharedRoutesRankClaimsAsRules checks that when two Services claim
// one address and port (an external IP of one, a load-balancer IP of the
// other, which the API server allows), a shared listener sends its
// traffic where the rules do: to the kind the rules match first, not to
// the name that sorts first.
func TestSharedRoutesRankClaimsAsRules(t *testing.T) {
	ext, lb := nameBackend(t, "external"), nameBackend(t, "lb")
	cfg := Config{
		Config: datapath.Config{OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) {
			return netip.MustParseAddrPort("192.0.2.50:80"), nil
		}},
		PortRange:       quietPorts(t),
		SharedListeners: []v1.Protocol{v1.ProtocolTCP},
	}
	p, rules := startProxier(t, cfg)
	a, aSlices := inNamespace("aa", svc("web", "10.96.0.20", "http:80"), slicesFor("web", "http", lb))
	a.Spec.Type = v1.ServiceTypeLoadBalancer
	a.Spec.Ports[0].NodePort = 30080
	a.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "192.0.2.50"}}
	z, zSlices := inNamespace("zz", svc("web", "10.96.0.30", "http:80"), slicesFor("web", "http", ext))
	z.Spec.ExternalIPs = []string{"192.0.2.50"}
	p.Tracker().Replace([]*v1.Service{a, z}, append(aSlices, zSlices...))
	port := rules.port(t, "zz/web:http")
	rules.intercept(t, "aa/web:http")

	// The rules' winner: the first claim on the address in their order.
	var first routing.Intercept
	rules.mu.Lock()
	for _, i := range rules.last {
		if i.VIP == netip.MustParseAddr("192.0.2.50") {
			first = i
			break
		}
	}
	rules.mu.Unlock()
	if first.Service.String() != "zz/web:http" || first.Kind != routing.ExternalIP {
		t.Fatalf("the rules' first claim on 192.0.2.50:80 is %s %s, want zz/web:http ExternalIP", first.Service, first.Kind)
	}
	for range 4 {
		if got, err := get(t, port); err != nil || got != "external" {
			t.Fatalf("through the shared listener: got %q, %v; want %q, where the rules send it", got, err, "external")
		}
	}
}
