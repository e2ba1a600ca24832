package main

import (
	"context"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/internal/testlab"
)

// TestE2ENetworkPolicy checks that a backend's ingress policy means what
// it says through a cluster IP, with default flags but for the pod
// network, in both modes and both listener layouts, on a node that a
// bridge CNI set up. Each backend (one on the clients' bridge, one routed
// on a link of its own, one on a second node) stands for a pod isolated
// by a NetworkPolicy that admits only role=client: its own iptables
// admit the node's addresses, as the engines that exempt the node do,
// and the client pod's, and drop the rest. The client reaches every
// backend and is seen with its own address; the other pod, on the same
// bridge as the client and the first backend, is never served, neither
// through the node's address, which a proxy that dials from it would
// have made the policy admit.
func TestE2ENetworkPolicy(t *testing.T) {
	for _, variant := range []string{"redirect", "tproxy", "redirect/shared", "tproxy/shared"} {
		mode, layout, _ := strings.Cut(variant, "/")
		if layout == "" {
			layout = "per-service"
		}
		t.Run(variant, func(t *testing.T) {
			c := newClusterWith(t, 1, testlab.Options{Bridge: "cni0"})
			if err := c.lab.BridgeCNI(); err != nil {
				t.Skipf("skipping: %v", err)
			}
			near := c.pods[0]
			routed, err := c.lab.AddRoutedPod("rweb")
			if err != nil {
				t.Fatal(err)
			}
			far, err := c.lab.AddRemotePod("far")
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range []*testlab.Pod{routed, far} {
				if _, err := c.lab.Start(p.NS, p.Name, c.bench, "serve", "--name", p.Name, "--listen", ":8080"); err != nil {
					t.Fatal(err)
				}
			}
			other, err := c.lab.AddPod("other")
			if err != nil {
				t.Fatal(err)
			}
			client := c.client.IP.String()
			// The node's addresses towards each backend.
			nodeAddrs := []string{"10.244.0.1", "10.244.1.1", "198.51.100.1"}
			for _, p := range []*testlab.Pod{near, routed, far} {
				var cmds [][]string
				for _, src := range append(nodeAddrs, client) {
					cmds = append(cmds, []string{"iptables", "-A", "INPUT", "-p", "tcp", "--dport", "8080", "-s", src, "-m", "comment", "--comment", "policy: the node and role=client", "-j", "ACCEPT"})
				}
				cmds = append(cmds, []string{"iptables", "-A", "INPUT", "-p", "tcp", "--dport", "8080", "-m", "comment", "--comment", "policy: isolated", "-j", "DROP"})
				for _, cmd := range cmds {
					if out, err := c.lab.Exec(context.Background(), p.NS, cmd...); err != nil {
						t.Fatalf("%v in %s: %v\n%s", cmd, p.Name, err, out)
					}
				}
			}
			backends := []struct {
				name, vip string
				pod       *testlab.Pod
			}{{"same bridge", "10.96.0.41", near}, {"routed", "10.96.0.42", routed}, {"second node", "10.96.0.43", far}}
			for _, b := range backends {
				c.write(b.pod.Name+".yaml", serviceYAML(b.pod.Name, b.vip, 80, nil, false, b.pod))
			}
			c.start(0, "--mode", mode, "--listener", layout, "--cluster-cidr", "10.244.0.0/16", "--endpoint-dial-timeout", "300ms")
			c.waitSynced()

			for _, b := range backends {
				url := "http://" + b.vip + "/"
				if r := c.get(c.client.NS, url, 3); r.Errors > 0 || r.Peers[client] != 3 {
					t.Errorf("%s: the client pod: backends saw %v, %d errors (%s); want 3 requests seen from %s", b.name, r.Peers, r.Errors, r.FirstError, client)
				}
				if r := c.get(other.NS, url, 2); r.Errors != 2 || len(r.Peers) > 0 {
					t.Errorf("%s: the other pod: backends saw %v, %d errors; want both requests refused or timed out, none served", b.name, r.Peers, r.Errors)
				}
			}
			if t.Failed() {
				for _, cmd := range [][]string{{"iptables-save", "-c", "-t", "mangle"}, {"ip", "rule"}} {
					out, _ := c.lab.Exec(context.Background(), c.lab.Node, cmd...)
					t.Logf("%v:\n%s", cmd, out)
				}
			}
		})
	}
}
