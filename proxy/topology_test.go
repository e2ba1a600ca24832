package proxy

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/uproxy/uproxy/balancer"
)

func TestCategorizeEndpoints(t *testing.T) {
	// e builds an endpoint: name's last octet, flags r(eady) s(erving)
	// t(erminating), node, zone hints, node hints.
	e := func(n int, flags, node string, zones, nodes []string) Endpoint {
		ep := Endpoint{Addr: netip.MustParseAddrPort(fmt.Sprintf("10.244.0.%d:80", n)), NodeName: node}
		if zones != nil || nodes != nil {
			ep.Hints = &EndpointHints{Zones: zones, Nodes: nodes}
		}
		for _, f := range flags {
			switch f {
			case 'r':
				ep.Ready = true
			case 's':
				ep.Serving = true
			case 't':
				ep.Terminating = true
			}
		}
		return ep
	}
	addrs := func(eps []Endpoint) []int {
		var out []int
		for _, ep := range eps {
			out = append(out, int(ep.Addr.Addr().As4()[3]))
		}
		return out
	}
	z := func(s ...string) []string { return s }
	clusterSvc := &ServicePort{}
	internalLocal := &ServicePort{InternalPolicyLocal: true}
	externalLocal := &ServicePort{NodePort: 30080, ExternalPolicyLocal: true}
	tests := []struct {
		name         string
		sp           *ServicePort
		eps          []Endpoint
		cluster      []int
		local        []int
		topologyMode string
	}{
		{"ready only", clusterSvc, []Endpoint{e(1, "rs", "n1", nil, nil), e(2, "st", "n2", nil, nil), e(3, "", "n1", nil, nil)}, []int{1}, nil, ""},
		{"fallback to serving terminating", clusterSvc, []Endpoint{e(2, "st", "n2", nil, nil), e(3, "t", "n1", nil, nil)}, []int{2}, nil, ""},
		{"internal local uses only local endpoints", internalLocal, []Endpoint{e(1, "rs", "me", nil, nil), e(2, "rs", "n2", nil, nil)}, nil, []int{1}, ""},
		{"external local keeps both sets", externalLocal, []Endpoint{e(1, "rs", "me", nil, nil), e(2, "rs", "n2", nil, nil)}, []int{1, 2}, []int{1}, ""},
		{"local falls back separately from cluster", externalLocal, []Endpoint{e(1, "st", "me", nil, nil), e(2, "rs", "n2", nil, nil)}, []int{2}, []int{1}, ""},
		{"no local endpoints", externalLocal, []Endpoint{e(2, "rs", "n2", nil, nil)}, []int{2}, nil, ""},
		{"zone hints", clusterSvc, []Endpoint{e(1, "rs", "n1", z("zone-a"), nil), e(2, "rs", "n2", z("zone-b"), nil), e(3, "rs", "n3", z("zone-a"), nil)}, []int{1, 3}, nil, "PreferSameZone"},
		{"partial zone hints are ignored", clusterSvc, []Endpoint{e(1, "rs", "n1", z("zone-a"), nil), e(2, "rs", "n2", nil, nil)}, []int{1, 2}, nil, ""},
		{"no hint for our zone is ignored", clusterSvc, []Endpoint{e(1, "rs", "n1", z("zone-b"), nil), e(2, "rs", "n2", z("zone-c"), nil)}, []int{1, 2}, nil, ""},
		{"node hints win over zone hints", clusterSvc, []Endpoint{e(1, "rs", "me", z("zone-a"), z("me")), e(2, "rs", "n2", z("zone-a"), z("n2"))}, []int{1}, nil, "PreferSameNode"},
		{"node hints for other nodes fall back to zone", clusterSvc, []Endpoint{e(1, "rs", "n1", z("zone-a"), z("n1")), e(2, "rs", "n2", z("zone-b"), z("n2"))}, []int{1}, nil, "PreferSameZone"},
		{"hints of unready endpoints do not count", clusterSvc, []Endpoint{e(1, "rs", "n1", z("zone-a"), nil), e(2, "", "n2", nil, nil)}, []int{1}, nil, "PreferSameZone"},
		{"no endpoints", externalLocal, nil, nil, nil, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := CategorizeEndpoints(tt.eps, tt.sp, "me", "zone-a")
			if diff := cmp.Diff([]any{tt.cluster, tt.local, tt.topologyMode}, []any{addrs(got.Cluster), addrs(got.Local), got.TopologyMode}); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

// sentinel is a Balancer that only identifies itself.
type sentinel string

func (sentinel) Pick(netip.Addr) *balancer.Backend { return nil }

func TestSnapshotRouteAppliesTrafficPolicies(t *testing.T) {
	vip := netip.MustParseAddrPort("10.96.0.10:80")
	ext := netip.MustParseAddr("192.0.2.10")
	pod := netip.MustParseAddr("10.244.1.5")
	node := netip.MustParseAddr("10.244.0.1")
	outsider := netip.MustParseAddr("192.0.2.99")
	internal := func(ip netip.Addr) bool { return ip == node || netip.MustParsePrefix("10.244.0.0/16").Contains(ip) }
	snap := func(sp ServicePort) *snapshot {
		sp.Port = 80
		return &snapshot{sp: &sp, vip: vip, external: []netip.Addr{ext}, nodePort: sp.NodePort, cluster: sentinel("cluster"), local: sentinel("local")}
	}
	tests := []struct {
		name   string
		sp     ServicePort
		dst    string
		known  bool
		client netip.Addr
		want   balancer.Balancer
	}{
		{"cluster IP", ServicePort{NodePort: 30080}, "10.96.0.10:80", true, pod, sentinel("cluster")},
		{"unknown destination means cluster IP", ServicePort{}, "", false, outsider, sentinel("cluster")},
		{"internal policy local", ServicePort{InternalPolicyLocal: true}, "10.96.0.10:80", true, pod, sentinel("local")},
		{"node port, cluster policy", ServicePort{NodePort: 30080}, "10.244.0.1:30080", true, outsider, sentinel("cluster")},
		{"node port, external local, outside client", ServicePort{NodePort: 30080, ExternalPolicyLocal: true}, "10.244.0.1:30080", true, outsider, sentinel("local")},
		{"node port, external local, pod client short-circuits", ServicePort{NodePort: 30080, ExternalPolicyLocal: true}, "10.244.0.1:30080", true, pod, sentinel("cluster")},
		{"node port, external local, node client short-circuits", ServicePort{NodePort: 30080, ExternalPolicyLocal: true}, "10.244.0.1:30080", true, node, sentinel("cluster")},
		{"external IP, external local", ServicePort{ExternalPolicyLocal: true}, "192.0.2.10:80", true, outsider, sentinel("local")},
		{"external IP on the wrong port", ServicePort{}, "192.0.2.10:81", true, outsider, nil},
		{"another service's VIP", ServicePort{}, "10.96.0.11:80", true, pod, nil},
		{"no node port", ServicePort{}, "10.244.0.1:30080", true, outsider, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var dst netip.AddrPort
			if tt.dst != "" {
				dst = netip.MustParseAddrPort(tt.dst)
			}
			if got := snap(tt.sp).route(dst, tt.known, tt.client, internal); got != tt.want {
				t.Errorf("route() = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestPolicySet covers the traffic-policy decision that the data path
// (snapshot.route) and Explain share.
func TestPolicySet(t *testing.T) {
	pod := netip.MustParseAddr("10.244.1.5")
	outsider := netip.MustParseAddr("192.0.2.99")
	internal := func(ip netip.Addr) bool { return netip.MustParsePrefix("10.244.0.0/16").Contains(ip) }
	everyone := func(netip.Addr) bool { return true } // Explain without --from
	tests := []struct {
		name        string
		sp          ServicePort
		toClusterIP bool
		client      netip.Addr
		internal    func(netip.Addr) bool
		want        endpointSet
	}{
		{"cluster IP, no policy", ServicePort{}, true, pod, internal, clusterSet},
		{"cluster IP, internal Local", ServicePort{InternalPolicyLocal: true}, true, pod, internal, localInternal},
		{"cluster IP ignores external Local", ServicePort{ExternalPolicyLocal: true}, true, outsider, internal, clusterSet},
		{"cluster IP, both Local", ServicePort{InternalPolicyLocal: true, ExternalPolicyLocal: true}, true, outsider, internal, localInternal},
		{"external, no policy", ServicePort{}, false, outsider, internal, clusterSet},
		{"external ignores internal Local", ServicePort{InternalPolicyLocal: true}, false, outsider, internal, clusterSet},
		{"external Local, outside client", ServicePort{ExternalPolicyLocal: true}, false, outsider, internal, localExternal},
		{"external Local, pod client short-circuits", ServicePort{ExternalPolicyLocal: true}, false, pod, internal, clusterShortCircuit},
		{"both Local, outside client", ServicePort{InternalPolicyLocal: true, ExternalPolicyLocal: true}, false, outsider, internal, localExternal},
		{"external Local, client not given", ServicePort{ExternalPolicyLocal: true}, false, netip.Addr{}, everyone, clusterShortCircuit},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := policySet(&tt.sp, tt.toClusterIP, tt.client, tt.internal)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("policySet (-want +got):\n%s", diff)
			}
			if got.local() != (tt.want == localInternal || tt.want == localExternal) {
				t.Errorf("local() = %v for %v", got.local(), got)
			}
		})
	}
}
