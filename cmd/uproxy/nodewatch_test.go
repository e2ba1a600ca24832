package main

import (
	"net/netip"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// TestNodeWatch checks when a change of this node's Node stops uproxy, as
// it stops kube-proxy: its IPs when --nodeport-addresses names primary,
// its podCIDRs with detect-local mode NodeCIDR, and nothing it does not
// use.
func TestNodeWatch(t *testing.T) {
	node := func(cidrs []string, ips ...string) *v1.Node {
		n := &v1.Node{Spec: v1.NodeSpec{PodCIDRs: cidrs}}
		for _, ip := range ips {
			n.Status.Addresses = append(n.Status.Addresses, v1.NodeAddress{Type: v1.NodeInternalIP, Address: ip})
		}
		return n
	}
	start := nodeWatch{
		ips:      []netip.Addr{netip.MustParseAddr("192.0.2.1")},
		podCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24")},
	}
	for _, tt := range []struct {
		name               string
		watchIPs, watchPod bool
		n                  *v1.Node
		want               string // substring of the error; "" for none
	}{
		{"unchanged", true, true, node([]string{"10.244.1.0/24"}, "192.0.2.1"), ""},
		{"deleted", true, true, nil, ""},
		{"new IP", true, true, node([]string{"10.244.1.0/24"}, "192.0.2.2"), "IPs changed from [192.0.2.1] to [192.0.2.2]"},
		{"an IP added", true, false, node(nil, "192.0.2.1", "2001:db8::1"), "IPs changed"},
		{"new IP, not used", false, true, node([]string{"10.244.1.0/24"}, "192.0.2.2"), ""},
		{"new podCIDR", true, true, node([]string{"10.244.2.0/24"}, "192.0.2.1"), "podCIDRs changed from [10.244.1.0/24] to [10.244.2.0/24]"},
		{"new podCIDR, not used", true, false, node([]string{"10.244.2.0/24"}, "192.0.2.1"), ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			w := start
			w.watchIPs, w.watchPodCIDRs = tt.watchIPs, tt.watchPod
			err := w.changed(tt.n)
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("changed() = %v, want nil", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("changed() = %v, want %q", err, tt.want)
			}
		})
	}
}
