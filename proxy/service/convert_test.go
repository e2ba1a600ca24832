package service

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/balancer"
)

func TestValidateService(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*v1.Service)
		wantErr string // substring; empty means valid
	}{
		{"valid", func(*v1.Service) {}, ""},
		{"bad cluster IP", func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "10.96.0.300", []string{"10.96.0.300"} }, `spec.clusterIPs[0]: "10.96.0.300" is not a valid IP`},
		{"clusterIP and clusterIPs differ", func(s *v1.Service) { s.Spec.ClusterIP = "10.96.0.11" }, "differs"},
		{"two IPv4 cluster IPs", func(s *v1.Service) { s.Spec.ClusterIPs = []string{"10.96.0.10", "10.96.0.11"} }, "same family"},
		{"dual-stack", func(s *v1.Service) { s.Spec.ClusterIPs = []string{"10.96.0.10", "2001:db8::10"} }, ""},
		{"port 0", func(s *v1.Service) { s.Spec.Ports[0].Port = 0 }, "spec.ports[0].port: 0 is not in 1-65535"},
		{"port 70000", func(s *v1.Service) { s.Spec.Ports[0].Port = 70000 }, "70000 is not in 1-65535"},
		{"unknown protocol", func(s *v1.Service) { s.Spec.Ports[0].Protocol = "QUIC" }, `unknown protocol "QUIC"`},
		{"SCTP is valid: its port alone is ignored", func(s *v1.Service) { s.Spec.Ports[0].Protocol = v1.ProtocolSCTP }, ""},
		{"duplicate port name", func(s *v1.Service) { s.Spec.Ports[1].Name = "http" }, `spec.ports[1].name: duplicate port name "http"`},
		{"duplicate port", func(s *v1.Service) { s.Spec.Ports[1].Port = 80 }, "duplicate port 80/TCP"},
		{"bad balancer", func(s *v1.Service) { s.Annotations = map[string]string{AnnotationBalancer: "random"} }, `unknown balancer "random"`},
		{"bad preserve-source-ip", func(s *v1.Service) { s.Annotations = map[string]string{AnnotationPreserveSourceIP: "yes please"} }, "uproxy.io/preserve-source-ip"},
		{"bad proxy-protocol", func(s *v1.Service) { s.Annotations = map[string]string{AnnotationProxyProtocol: "v3"} }, `"v3" is not v1 or v2`},
		{"bad source range", func(s *v1.Service) { s.Spec.LoadBalancerSourceRanges = []string{"10.0.0.0/33"} }, "loadBalancerSourceRanges[0]"},
		{"bad external IP", func(s *v1.Service) { s.Spec.ExternalIPs = []string{"10.96.300.1"} }, "spec.externalIPs[0]"},
		{"bad node port", func(s *v1.Service) { s.Spec.Ports[0].NodePort = 70000 }, "nodePort: 70000"},
		{"bad weights", func(s *v1.Service) { s.Annotations = map[string]string{AnnotationWeights: "10.244.0.1=x"} }, "uproxy.io/weights"},
		{"bad affinity timeout", func(s *v1.Service) {
			s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
			s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To[int32](0)}}
		}, "timeoutSeconds: 0"},
		{"headless is skipped, not invalid", func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "None", []string{"None"} }, ""},
		{"another proxy's service is not checked", func(s *v1.Service) {
			s.Labels = map[string]string{LabelServiceProxyName: "other"}
			s.Spec.Ports[0].Port = 0
		}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := svc("web", "10.96.0.10", "http:80", "https:443")
			tt.mutate(s)
			err := ValidateService(s)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("ValidateService() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("ValidateService() = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestValidateSlice(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*discovery.EndpointSlice)
		wantErr string
	}{
		{"valid", func(*discovery.EndpointSlice) {}, ""},
		{"bad IP", func(s *discovery.EndpointSlice) { s.Endpoints[0].Addresses[0] = "10.244.0.999" }, `endpoints[0].addresses[0]: "10.244.0.999" is not an IP`},
		{"wrong family", func(s *discovery.EndpointSlice) { s.Endpoints[0].Addresses[0] = "2001:db8::1" }, "does not match addressType IPv4"},
		{"port 0", func(s *discovery.EndpointSlice) { s.Ports[0].Port = ptr.To[int32](0) }, "ports[0].port: 0"},
		{"port missing", func(s *discovery.EndpointSlice) { s.Ports[0].Port = nil }, "ports[0].port: missing"},
		{"port too big", func(s *discovery.EndpointSlice) { s.Ports[0].Port = ptr.To[int32](65536) }, "65536 is not in 1-65535"},
		{"unknown protocol", func(s *discovery.EndpointSlice) { s.Ports[0].Protocol = ptr.To(v1.Protocol("ICMP")) }, `unknown protocol "ICMP"`},
		{"duplicate port name", func(s *discovery.EndpointSlice) { s.Ports = append(s.Ports, s.Ports[0]) }, `ports[1].name: duplicate port name "http"`},
		{"unknown address type", func(s *discovery.EndpointSlice) { s.AddressType = "IPv5" }, "unknown type"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := slice("web-1", "web", "http", 8080, ep{IP: "10.244.0.1"})
			tt.mutate(s)
			err := ValidateSlice(s)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("ValidateSlice() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("ValidateSlice() = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestServicePorts(t *testing.T) {
	s := svc("web", "10.96.0.10", "http:80", "dns:53/UDP")
	s.Spec.ClusterIPs = []string{"10.96.0.10", "2001:db8::10"}
	s.Annotations = map[string]string{AnnotationBalancer: "least-conn", AnnotationWeights: "10.244.0.1=3"}
	s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
	name := types.NamespacedName{Namespace: "default", Name: "web"}
	ips := []netip.Addr{netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("2001:db8::10")}
	weights := map[netip.Addr]int{netip.MustParseAddr("10.244.0.1"): 3}
	want := []*Port{
		{Name: PortName{name, "http", v1.ProtocolTCP}, ClusterIPs: ips, Port: 80, Balancer: balancer.LeastConn, Weights: weights, AffinityTimeout: DefaultAffinityTimeout},
		{Name: PortName{name, "dns", v1.ProtocolUDP}, ClusterIPs: ips, Port: 53, Balancer: balancer.LeastConn, Weights: weights, AffinityTimeout: DefaultAffinityTimeout, UDPMode: UDPRequestReply},
	}
	got := Ports(s, Defaults{Balancer: balancer.SourceHash})
	if diff := cmp.Diff(want, got, cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); diff != "" {
		t.Errorf("Ports() mismatch (-want +got):\n%s", diff)
	}

	plain := Ports(svc("db", "10.96.0.11", ":5432"), Defaults{Balancer: balancer.SourceHash})
	if len(plain) != 1 || plain[0].Balancer != balancer.SourceHash || plain[0].AffinityTimeout != 0 || plain[0].Name.String() != "default/db" {
		t.Errorf("defaults not applied: %+v", plain[0])
	}
	for _, skip := range []*v1.Service{
		func() *v1.Service { s := svc("h", "None", "a:80"); return s }(),
		func() *v1.Service { s := svc("e", "", "a:80"); s.Spec.Type = v1.ServiceTypeExternalName; return s }(),
		func() *v1.Service {
			s := svc("o", "10.96.0.12", "a:80")
			s.Labels = map[string]string{LabelServiceProxyName: "x"}
			return s
		}(),
	} {
		if got := Ports(skip, Defaults{}); got != nil {
			t.Errorf("Ports(%s) = %v, want nil (skipped)", skip.Name, got)
		}
	}
}

func TestPortEndpoints(t *testing.T) {
	name := PortName{types.NamespacedName{Namespace: "default", Name: "web"}, "http", v1.ProtocolTCP}
	sp := &Port{Name: name, Port: 80}
	// targetPort "web-http" (named) was resolved by the slice controller to
	// 8080 in one slice and 9090 in another (pods disagree on the number).
	a := slice("web-a", "web", "http", 8080, ep{IP: "10.244.0.1"}, ep{IP: "10.244.0.2", NotReady: true, Serving: true, Terminating: true})
	b := slice("web-b", "web", "http", 9090, ep{IP: "10.244.1.1"}, ep{IP: "10.244.0.1"})
	other := slice("web-c", "web", "metrics", 9100, ep{IP: "10.244.2.1"})
	udp := slice("web-d", "web", "http", 8080, ep{IP: "10.244.3.1"})
	udp.Ports[0].Protocol = ptr.To(v1.ProtocolUDP)
	headless := slice("web-e", "web", "http", 8080, ep{IP: "10.244.4.1"})
	headless.Labels[LabelHeadless] = ""
	v6 := slice("web-f", "web", "http", 8080, ep{IP: "2001:db8::1"})
	unset := slice("web-g", "web", "http", 8080, ep{IP: "10.244.5.1"})
	unset.Endpoints[0].Conditions = discovery.EndpointConditions{}

	got := PortEndpoints(sp, []*discovery.EndpointSlice{v6, b, a, other, udp, headless, unset})
	want := []Endpoint{
		{Addr: netip.MustParseAddrPort("10.244.0.1:8080"), Ready: true, Serving: true},
		{Addr: netip.MustParseAddrPort("10.244.0.2:8080"), Serving: true, Terminating: true},
		{Addr: netip.MustParseAddrPort("10.244.1.1:9090"), Ready: true, Serving: true},
		{Addr: netip.MustParseAddrPort("10.244.0.1:9090"), Ready: true, Serving: true},
		{Addr: netip.MustParseAddrPort("[2001:db8::1]:8080"), Ready: true, Serving: true},
		{Addr: netip.MustParseAddrPort("10.244.5.1:8080"), Ready: true, Serving: true},
	}
	if diff := cmp.Diff(want, got, cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
		t.Errorf("PortEndpoints() mismatch (-want +got):\n%s", diff)
	}
}

// TestPortEndpointsDeduplicates checks that an endpoint listed in two
// slices appears once, with the first slice's (by name) conditions, below
// and above SmallSet, where duplicates are found by a scan and by a map.
func TestPortEndpointsDeduplicates(t *testing.T) {
	name := PortName{types.NamespacedName{Namespace: "default", Name: "web"}, "http", v1.ProtocolTCP}
	sp := &Port{Name: name, Port: 80}
	for _, n := range []int{3, SmallSet, SmallSet + 1, 40} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			var first, second []ep
			var want []Endpoint
			for i := range n {
				ip := fmt.Sprintf("10.244.0.%d", i+1)
				first = append(first, ep{IP: ip})
				second = append(second, ep{IP: ip, NotReady: true})
				want = append(want, Endpoint{Addr: netip.MustParseAddrPort(ip + ":8080"), Ready: true, Serving: true})
			}
			a, b := slice("web-a", "web", "http", 8080, first...), slice("web-b", "web", "http", 8080, second...)
			got := PortEndpoints(sp, []*discovery.EndpointSlice{b, a})
			if diff := cmp.Diff(want, got, cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
				t.Errorf("PortEndpoints() mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// TestPortEndpointsPrefersRunningCopy checks that of an address listed
// twice, a terminating copy gives way to a running one whichever slice
// comes first, as in kube-proxy (a pod IP reused while the terminating
// pod that had it is still listed), and that unset conditions read as
// kube-proxy reads them: ready and serving true, terminating false.
func TestPortEndpointsPrefersRunningCopy(t *testing.T) {
	name := PortName{types.NamespacedName{Namespace: "default", Name: "web"}, "http", v1.ProtocolTCP}
	sp := &Port{Name: name, Port: 80}
	for _, n := range []int{2, SmallSet + 1} {
		var old, running []ep
		var want []Endpoint
		for i := range n {
			ip := fmt.Sprintf("10.244.0.%d", i+1)
			old = append(old, ep{IP: ip, NotReady: true, Serving: true, Terminating: true})
			running = append(running, ep{IP: ip})
			want = append(want, Endpoint{Addr: netip.MustParseAddrPort(ip + ":8080"), Ready: true, Serving: true})
		}
		a, b := slice("web-a", "web", "http", 8080, old...), slice("web-b", "web", "http", 8080, running...)
		for _, order := range [][]*discovery.EndpointSlice{{a, b}, {b, a}} {
			got := PortEndpoints(sp, order)
			if diff := cmp.Diff(want, got, cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
				t.Errorf("%d endpoints, slices %s then %s (-want +got):\n%s", n, order[0].Name, order[1].Name, diff)
			}
		}
	}

	notReady := slice("web-c", "web", "http", 8080, ep{IP: "10.244.1.1"})
	notReady.Endpoints[0].Conditions = discovery.EndpointConditions{Ready: ptr.To(false)}
	got := PortEndpoints(sp, []*discovery.EndpointSlice{notReady})
	want := []Endpoint{{Addr: netip.MustParseAddrPort("10.244.1.1:8080"), Serving: true}}
	if diff := cmp.Diff(want, got, cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
		t.Errorf("ready false, serving unset (-want +got):\n%s", diff)
	}
}

func TestParseWeights(t *testing.T) {
	tests := []struct {
		in      string
		want    map[netip.Addr]int
		wantErr string
	}{
		{"", nil, ""},
		{"10.244.0.11=3, 10.244.0.12=1", map[netip.Addr]int{netip.MustParseAddr("10.244.0.11"): 3, netip.MustParseAddr("10.244.0.12"): 1}, ""},
		{"2001:db8::1=2", map[netip.Addr]int{netip.MustParseAddr("2001:db8::1"): 2}, ""},
		{"10.244.0.11", nil, "want IP=weight"},
		{"10.244.0.x=1", nil, "bad IP"},
		{"10.244.0.11=0", nil, "weight must be"},
		{"10.244.0.11=1,10.244.0.11=2", nil, "listed twice"},
	}
	for _, tt := range tests {
		got, err := ParseWeights(tt.in)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("ParseWeights(%q) error = %v, want %q", tt.in, err, tt.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("ParseWeights(%q) = %v", tt.in, err)
		}
		if diff := cmp.Diff(tt.want, got, cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); diff != "" {
			t.Errorf("ParseWeights(%q) mismatch (-want +got):\n%s", tt.in, diff)
		}
	}
}

// TestNoExternalIPs checks that with the AllowServiceExternalIPs gate off
// (Defaults.NoExternalIPs) spec.externalIPs are ignored, as kube-proxy
// ignores them, and a load balancer's address is still served.
func TestNoExternalIPs(t *testing.T) {
	s := svc("web", "10.96.0.10", "http:80")
	s.Spec.Type = v1.ServiceTypeLoadBalancer
	s.Spec.ExternalIPs = []string{"192.0.2.10"}
	s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "192.0.2.20"}}
	for _, tt := range []struct {
		off  bool
		want []netip.Addr
	}{{false, []netip.Addr{netip.MustParseAddr("192.0.2.10")}}, {true, nil}} {
		sp := Ports(s, Defaults{NoExternalIPs: tt.off})[0]
		if diff := cmp.Diff(tt.want, sp.ExternalIPs, cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); diff != "" {
			t.Errorf("NoExternalIPs %v: external IPs (-want +got):\n%s", tt.off, diff)
		}
		if len(sp.LoadBalancerIPs) != 1 {
			t.Errorf("NoExternalIPs %v: load-balancer IPs %v, want the one", tt.off, sp.LoadBalancerIPs)
		}
	}
}
