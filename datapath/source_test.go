package datapath

import (
	"net/netip"
	"testing"
)

// cidrClients is a Clients with a node address and pod networks.
type cidrClients struct {
	node netip.Addr
	pods []netip.Prefix
}

func (c cidrClients) Node(a netip.Addr) bool { return a == c.node || a.IsLoopback() }

func (c cidrClients) Pod(a netip.Addr) (pod, known bool) {
	for _, p := range c.pods {
		if p.Contains(a) {
			return true, true
		}
	}
	return false, len(c.pods) > 0
}

// TestKeepClient checks the address backends see against kube-proxy's
// masquerade rules: a pod keeps its address to a cluster IP, an outside
// client does not when the pod networks are known; external traffic
// keeps it only under externalTrafficPolicy Local; the node and
// --masquerade-all never; the annotation overrides both ways, but never
// makes the node a transparent client.
func TestKeepClient(t *testing.T) {
	withPods := cidrClients{node: netip.MustParseAddr("192.0.2.1"), pods: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("2001:db8:244::/64")}}
	noPods := cidrClients{node: withPods.node}
	const (
		pod      = "10.244.1.5"
		outside  = "192.0.2.99"
		node     = "192.0.2.1"
		pod6     = "2001:db8:244::5"
		loopback = "127.0.0.1"
	)
	cluster, local := Policy{}, Policy{ExternalLocal: true}
	for _, tt := range []struct {
		name      string
		src       SourceIP
		masqAll   bool
		pol       Policy
		clusterIP bool
		client    string
		clients   Clients
		want      bool
	}{
		{"pod to a cluster IP", SourceAsKubeProxy, false, cluster, true, pod, withPods, true},
		{"IPv6 pod to a cluster IP", SourceAsKubeProxy, false, cluster, true, pod6, withPods, true},
		{"outside client to a cluster IP", SourceAsKubeProxy, false, cluster, true, outside, withPods, false},
		{"outside client to a cluster IP, pod networks unknown", SourceAsKubeProxy, false, cluster, true, outside, noPods, true},
		{"the node to a cluster IP", SourceAsKubeProxy, false, cluster, true, node, withPods, false},
		{"loopback to a cluster IP", SourceAsKubeProxy, false, cluster, true, loopback, withPods, false},
		{"pod to a node port, policy Cluster", SourceAsKubeProxy, false, cluster, false, pod, withPods, false},
		{"outside client to a node port, policy Cluster", SourceAsKubeProxy, false, cluster, false, outside, withPods, false},
		{"pod to a node port, policy Local", SourceAsKubeProxy, false, local, false, pod, withPods, true},
		{"outside client to a node port, policy Local", SourceAsKubeProxy, false, local, false, outside, withPods, true},
		{"the node to a node port, policy Local", SourceAsKubeProxy, false, local, false, node, withPods, false},
		{"masquerade-all, pod to a cluster IP", SourceAsKubeProxy, true, cluster, true, pod, withPods, false},
		{"masquerade-all, policy Local", SourceAsKubeProxy, true, local, false, outside, withPods, false},
		{"annotation true, outside client to a cluster IP", SourceClient, false, cluster, true, outside, withPods, true},
		{"annotation true, policy Cluster", SourceClient, false, cluster, false, outside, withPods, true},
		{"annotation true, masquerade-all", SourceClient, true, cluster, true, pod, withPods, true},
		{"annotation true, the node", SourceClient, false, cluster, true, node, withPods, false},
		{"annotation false, pod to a cluster IP", SourceNode, false, cluster, true, pod, withPods, false},
		{"annotation false, policy Local", SourceNode, false, local, false, outside, withPods, false},
		{"no Clients", SourceClient, false, cluster, true, pod, nil, false},
		{"no client address", SourceAsKubeProxy, false, cluster, true, "", withPods, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var client netip.Addr
			if tt.client != "" {
				client = netip.MustParseAddr(tt.client)
			}
			if got := KeepClient(tt.src, tt.masqAll, tt.pol, tt.clusterIP, client, tt.clients); got != tt.want {
				t.Errorf("KeepClient(%v, masqueradeAll %v, %+v, cluster IP %v, %s) = %v, want %v", tt.src, tt.masqAll, tt.pol, tt.clusterIP, tt.client, got, tt.want)
			}
		})
	}
}
