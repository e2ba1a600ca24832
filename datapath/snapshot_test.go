package datapath

import (
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/uproxy/uproxy/balancer"
)

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
	// port is what the route decision reads of a service port.
	type port struct {
		Policy
		nodePort uint16
	}
	snap := func(sp port) *Snapshot {
		return &Snapshot{Policy: sp.Policy, VIP: vip, External: []netip.Addr{ext}, NodePort: sp.nodePort, Cluster: sentinel("cluster"), Local: sentinel("local")}
	}
	tests := []struct {
		name   string
		sp     port
		dst    string
		known  bool
		client netip.Addr
		want   balancer.Balancer
	}{
		{"cluster IP", port{nodePort: 30080}, "10.96.0.10:80", true, pod, sentinel("cluster")},
		{"unknown destination means cluster IP", port{}, "", false, outsider, sentinel("cluster")},
		{"internal policy local", port{Policy: Policy{InternalLocal: true}}, "10.96.0.10:80", true, pod, sentinel("local")},
		{"node port, cluster policy", port{nodePort: 30080}, "10.244.0.1:30080", true, outsider, sentinel("cluster")},
		{"node port, external local, outside client", port{nodePort: 30080, Policy: Policy{ExternalLocal: true}}, "10.244.0.1:30080", true, outsider, sentinel("local")},
		{"node port, external local, pod client short-circuits", port{nodePort: 30080, Policy: Policy{ExternalLocal: true}}, "10.244.0.1:30080", true, pod, sentinel("cluster")},
		{"node port, external local, node client short-circuits", port{nodePort: 30080, Policy: Policy{ExternalLocal: true}}, "10.244.0.1:30080", true, node, sentinel("cluster")},
		{"external IP, external local", port{Policy: Policy{ExternalLocal: true}}, "192.0.2.10:80", true, outsider, sentinel("local")},
		{"external IP on the wrong port", port{}, "192.0.2.10:81", true, outsider, nil},
		{"another service's VIP", port{}, "10.96.0.11:80", true, pod, nil},
		{"no node port", port{}, "10.244.0.1:30080", true, outsider, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var dst netip.AddrPort
			if tt.dst != "" {
				dst = netip.MustParseAddrPort(tt.dst)
			}
			if got := snap(tt.sp).Route(dst, tt.known, tt.client, internal); got != tt.want {
				t.Errorf("Route() = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestPolicySet covers the traffic-policy decision that the data path
// (Snapshot.Route) and Explain share.
func TestPolicySet(t *testing.T) {
	pod := netip.MustParseAddr("10.244.1.5")
	outsider := netip.MustParseAddr("192.0.2.99")
	internal := func(ip netip.Addr) bool { return netip.MustParsePrefix("10.244.0.0/16").Contains(ip) }
	everyone := func(netip.Addr) bool { return true } // Explain without --from
	tests := []struct {
		name        string
		sp          Policy
		toClusterIP bool
		client      netip.Addr
		internal    func(netip.Addr) bool
		want        EndpointSet
	}{
		{"cluster IP, no policy", Policy{}, true, pod, internal, ClusterSet},
		{"cluster IP, internal Local", Policy{InternalLocal: true}, true, pod, internal, LocalInternal},
		{"cluster IP ignores external Local", Policy{ExternalLocal: true}, true, outsider, internal, ClusterSet},
		{"cluster IP, both Local", Policy{InternalLocal: true, ExternalLocal: true}, true, outsider, internal, LocalInternal},
		{"external, no policy", Policy{}, false, outsider, internal, ClusterSet},
		{"external ignores internal Local", Policy{InternalLocal: true}, false, outsider, internal, ClusterSet},
		{"external Local, outside client", Policy{ExternalLocal: true}, false, outsider, internal, LocalExternal},
		{"external Local, pod client short-circuits", Policy{ExternalLocal: true}, false, pod, internal, ClusterShortCircuit},
		{"both Local, outside client", Policy{InternalLocal: true, ExternalLocal: true}, false, outsider, internal, LocalExternal},
		{"external Local, client not given", Policy{ExternalLocal: true}, false, netip.Addr{}, everyone, ClusterShortCircuit},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := PolicySet(tt.sp, tt.toClusterIP, tt.client, tt.internal)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("PolicySet (-want +got):\n%s", diff)
			}
			if got.Local() != (tt.want == LocalInternal || tt.want == LocalExternal) {
				t.Errorf("Local() = %v for %v", got.Local(), got)
			}
		})
	}
}
