package main

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func testNode(name string, podCIDRs []string, addrs ...v1.NodeAddress) *v1.Node {
	return &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       v1.NodeSpec{PodCIDRs: podCIDRs},
		Status:     v1.NodeStatus{Addresses: addrs},
	}
}

// TestResolveNodeAddresses checks that 'primary' and detect-local mode
// NodeCIDR take this node's Node object as kube-proxy's NodeManager reads
// it: one IP per family, InternalIP before ExternalIP, --bind-address in
// place of its family's, and the Node's podCIDRs.
func TestResolveNodeAddresses(t *testing.T) {
	nodeA := testNode("node-a", []string{"10.244.1.0/24", "2001:db8:1::/64"},
		v1.NodeAddress{Type: v1.NodeHostName, Address: "node-a"},
		v1.NodeAddress{Type: v1.NodeExternalIP, Address: "198.51.100.7"},
		v1.NodeAddress{Type: v1.NodeInternalIP, Address: "192.0.2.10"},
		v1.NodeAddress{Type: v1.NodeInternalIP, Address: "2001:db8::10"},
		v1.NodeAddress{Type: v1.NodeInternalIP, Address: "192.0.2.11"})
	other := testNode("node-b", []string{"10.244.2.0/24"}, v1.NodeAddress{Type: v1.NodeInternalIP, Address: "192.0.2.20"})
	tests := []struct {
		name         string
		nodePorts    []string
		bind, detect string
		wantPorts    []string
		wantCluster  []string
	}{
		{"primary", []string{"primary"}, "", "", []string{"192.0.2.10/32", "2001:db8::10/128"}, []string{"10.96.0.0/12"}},
		{"primary with a bind address", []string{"primary"}, "192.0.2.99", "", []string{"192.0.2.99/32", "2001:db8::10/128"}, []string{"10.96.0.0/12"}},
		{"NodeCIDR", []string{"all"}, "", "NodeCIDR", []string{"0.0.0.0/0", "::/0"}, []string{"10.244.1.0/24", "2001:db8:1::/64"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := &runOptions{nodeName: "node-a", nodePortAddresses: tt.nodePorts,
				clusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12")}}
			o.kubeProxy.bindAddress, o.kubeProxy.detectLocalMode = tt.bind, tt.detect
			if err := o.resolveNodeAddresses(context.Background(), fake.NewClientset(other, nodeA), zap.NewNop()); err != nil {
				t.Fatal(err)
			}
			var ports, cluster []string
			for _, p := range o.nodePortCIDRs {
				ports = append(ports, p.String())
			}
			for _, p := range o.clusterCIDRs {
				cluster = append(cluster, p.String())
			}
			if diff := cmp.Diff(tt.wantPorts, ports); diff != "" {
				t.Errorf("node-port prefixes (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.wantCluster, cluster); diff != "" {
				t.Errorf("cluster CIDRs (-want +got):\n%s", diff)
			}
		})
	}
}

// TestNodeInfoWaitsForTheNode checks that a Node created late is found,
// and that one that never comes yields no address once the wait ends, as
// kube-proxy then assumes loopback.
func TestNodeInfoWaitsForTheNode(t *testing.T) {
	client := fake.NewClientset()
	go func() {
		// The Node is created while nodeInfo is already waiting: the
		// delay stands for the API server's, it waits on no code.
		time.Sleep(50 * time.Millisecond)
		client.CoreV1().Nodes().Create(context.Background(),
			testNode("late", nil, v1.NodeAddress{Type: v1.NodeInternalIP, Address: "192.0.2.30"}), metav1.CreateOptions{})
	}()
	ips, _ := nodeInfo(context.Background(), client, "late", 5*time.Second, 10*time.Millisecond, zap.NewNop())
	if diff := cmp.Diff([]netip.Addr{netip.MustParseAddr("192.0.2.30")}, ips, cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); diff != "" {
		t.Errorf("IPs of a late Node (-want +got):\n%s", diff)
	}
	start := time.Now()
	if ips, _ := nodeInfo(context.Background(), client, "never", 100*time.Millisecond, 10*time.Millisecond, zap.NewNop()); ips != nil {
		t.Errorf("IPs of a missing Node: %v, want none", ips)
	}
	if waited := time.Since(start); waited > 2*time.Second {
		t.Errorf("waited %v for a missing Node, want about the timeout", waited)
	}
}
