package main

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/testwait"
)

// twoNodeYAML is the Services of TestE2ETwoNodes over web-0 (node1) and
// far (node2): a cluster IP and a node port (externalTrafficPolicy
// Cluster) over both, a node port with externalTrafficPolicy Local, and
// the loops: a node port whose endpoints are both nodes' addresses at
// that node port, two node ports whose endpoints are each other's on the
// other node, and one whose endpoints are the nodes' pod-bridge
// addresses, inside the pod networks, which no address rule can tell
// from a pod's and only the per-service-port connection bound ends.
func twoNodeYAML(near, far *testlab.Pod) string {
	eps := fmt.Sprintf(`endpoints:
- addresses: [%q]
  nodeName: node1
- addresses: [%q]
  nodeName: node2
`, near.IP, far.IP)
	svc := func(name, vip, typ, extra string, nodePort int, slice string) string {
		np := ""
		if nodePort != 0 {
			np = fmt.Sprintf(", nodePort: %d", nodePort)
		}
		return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: %[1]s}
spec:
  type: %[3]s
  clusterIP: %[2]s%[4]s
  ports: [{name: http, port: 80, targetPort: 8080%[5]s}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-x, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
%[6]s---
`, name, vip, typ, extra, np, slice)
	}
	loop := func(port int, addrs ...string) string {
		s := fmt.Sprintf("ports: [{name: http, port: %d}]\nendpoints:\n", port)
		for _, a := range addrs {
			s += fmt.Sprintf("- addresses: [%s]\n", a)
		}
		return s
	}
	withPort := func(s string) string { return "ports: [{name: http, port: 8080}]\n" + s }
	return svc("web", "10.96.0.10", "ClusterIP", "", 0, withPort(eps)) +
		svc("np", "10.96.0.11", "NodePort", "", 30080, withPort(eps)) +
		svc("local", "10.96.0.12", "NodePort", "\n  externalTrafficPolicy: Local", 30081, withPort(eps)) +
		svc("loop", "10.96.0.20", "NodePort", "", 30090, loop(30090, "198.51.100.1", "198.51.100.2")) +
		svc("loop-a", "10.96.0.21", "NodePort", "", 30091, loop(30092, "198.51.100.2")) +
		svc("loop-b", "10.96.0.22", "NodePort", "", 30092, loop(30091, "198.51.100.1")) +
		svc("loop-c", "10.96.0.23", "NodePort", "", 30093, loop(30093, "10.244.0.1", "10.244.2.1"))
}

// TestE2ETwoNodes runs uproxy on two nodes, each a namespace with pods
// on its own bridge, linked and routed as the nodes of a host-gw
// cluster, both serving the same manifests. In both modes:
//   - a cluster IP over a pod of each node serves the pods of both
//     nodes from both, and a node port serves an outside client on both
//     nodes' addresses; under externalTrafficPolicy Local each node
//     sends it to its own pod only;
//   - endpoints at the other node's address and node port, which would
//     make the nodes forward a connection to each other for ever, are
//     refused on both, with a log line naming the slice, and a client of
//     such a Service is refused;
//   - a loop through the nodes' pod-bridge addresses, which look like a
//     pod's, ends at the per-service-port connection bound: one client
//     connection takes neither node's descriptors, and a Service added
//     afterwards is applied on both.
func TestE2ETwoNodes(t *testing.T) {
	for _, mode := range []string{"redirect", "tproxy"} {
		t.Run(mode, func(t *testing.T) {
			c := newCluster(t, 1)
			near := c.pods[0]
			far, err := c.lab.AddRemotePod("far")
			if err != nil {
				t.Fatal(err)
			}
			farClient, err := c.lab.AddRemotePod("farclient")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := c.lab.Start(far.NS, far.Name, c.bench, "serve", "--name", far.Name, "--listen", ":8080"); err != nil {
				t.Fatal(err)
			}
			ext, err := c.lab.AddExternal("ext")
			if err != nil {
				t.Fatal(err)
			}
			node2 := c.lab.Node2()
			for _, ns := range []string{c.lab.Node, node2} {
				if _, err := c.lab.Exec(t.Context(), ns, "sysctl", "-qw", "net.ipv4.conf.all.send_redirects=0"); err != nil {
					t.Fatal(err)
				}
			}
			c.write("services.yaml", twoNodeYAML(near, far))
			const perPort = 40
			args := []string{"--mode", mode, "--cluster-cidr", "10.244.0.0/16", "--max-connections-per-service-port", fmt.Sprint(perPort)}
			c.start(0, append(args, "--hostname-override", "node1")...)
			base := filepath.Join(c.dir, "..", filepath.Base(c.dir)+"-node2")
			up2, err := c.lab.Start(node2, "uproxy-node2", slices.Concat([]string{c.uproxy, "run", "--manifests", c.dir, "--iptables-min-sync-period", "50ms",
				"--upgrade-socket", base + "-upgrade.sock", "--state-file", base + "-state.json",
				"--healthz-bind-address", "", "--metrics-bind-address", "", "--debug-bind-address", ""}, args, []string{"--hostname-override", "node2"})...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if t.Failed() {
					t.Logf("node2's uproxy output:\n%s", up2.Output())
				}
			})
			c.waitSynced()
			testwait.UntilOK(t, 10*time.Second, "node2's uproxy to sync", func() (bool, string) {
				return strings.Contains(up2.Output(), "\tsynced\t"), up2.Output()
			})

			for _, client := range []*testlab.Pod{c.client, farClient} {
				if r := c.get(client.NS, "http://10.96.0.10/", 10, "--timeout", "3s"); r.Errors > 0 || r.Counts[near.Name] == 0 || r.Counts[far.Name] == 0 {
					t.Errorf("cluster IP from %s: %+v; want both nodes' pods", client.Name, r)
				}
			}
			for _, node := range []string{"198.51.100.1", "198.51.100.2"} {
				if r := c.get(ext.NS, "http://"+node+":30080/", 10, "--timeout", "3s"); r.Errors > 0 || r.Counts[near.Name] == 0 || r.Counts[far.Name] == 0 {
					t.Errorf("node port on %s from outside: %+v; want both nodes' pods", node, r)
				}
			}
			for node, pod := range map[string]string{"198.51.100.1": near.Name, "198.51.100.2": far.Name} {
				if r := c.get(ext.NS, "http://"+node+":30081/", 6, "--timeout", "3s"); r.Errors > 0 || r.Counts[pod] != 6 {
					t.Errorf("externalTrafficPolicy Local node port on %s from outside: %+v; want only %s", node, r, pod)
				}
			}

			// The loops that addresses give away: refused on both nodes.
			for _, p := range []struct{ out, slice string }{{c.up.Output(), "default/loop-x"}, {up2.Output(), "default/loop-x"}, {c.up.Output(), "default/loop-a-x"}, {up2.Output(), "default/loop-b-x"}} {
				if !strings.Contains(p.out, `"object": "`+p.slice+`"`) || !strings.Contains(p.out, "a port of the node-port range on an address outside the pod networks") {
					t.Errorf("a node did not refuse the endpoints of %s at another node's node port", p.slice)
				}
			}
			for _, url := range []string{"http://198.51.100.1:30090/", "http://198.51.100.2:30091/"} {
				if r := c.get(ext.NS, url, 1, "--timeout", "3s"); r.Errors != 1 {
					t.Errorf("%s, a loop's node port: %+v; want it refused", url, r)
				}
			}

			// The loop that addresses do not give away: bounded.
			pids := []int{c.upPID(), up2.Cmd.Process.Pid}
			before := []int{countFDs(t, pids[0]), countFDs(t, pids[1])}
			done := make(chan getResult, 1)
			go func() { done <- c.get(ext.NS, "http://198.51.100.1:30093/", 1, "--timeout", "5s") }()
			var peak [2]int
			var r getResult
		watch:
			for {
				for i, pid := range pids {
					peak[i] = max(peak[i], countFDs(t, pid)-before[i])
				}
				select {
				case r = <-done:
					break watch
				case <-time.After(10 * time.Millisecond):
				}
			}
			if r.Errors != 1 {
				t.Errorf("the bridge-address loop served its client: %+v", r)
			}
			for i, p := range peak {
				// Two descriptors per connection, the bound's worth on
				// each node, and room for the other sockets.
				if p > 2*perPort+50 {
					t.Errorf("node%d's descriptors grew by %d during the loop; the bound of %d connections allows about %d", i+1, p, perPort, 2*perPort)
				}
			}
			for i, pid := range pids {
				testwait.UntilOK(t, 10*time.Second, fmt.Sprintf("node%d's descriptors to return", i+1), func() (bool, string) {
					n := countFDs(t, pid)
					return n <= before[i]+10, fmt.Sprintf("%d descriptors, %d before the loop", n, before[i])
				})
			}
			if !strings.Contains(c.up.Output()+up2.Output(), "the service port is at its connection limit") {
				t.Error("neither node logged the loop's Service at its connection limit")
			}
			c.write("late.yaml", serviceYAML("late", "10.96.0.30", 80, nil, false, near))
			if r := c.get(c.client.NS, "http://10.96.0.30/", 2, "--timeout", "3s"); r.Errors > 0 {
				// The rules may take a sync to appear: wait for them.
				testwait.UntilOK(t, 10*time.Second, "a Service added after the loop to be served on node1", func() (bool, string) {
					r := c.get(c.client.NS, "http://10.96.0.30/", 1, "--timeout", "2s")
					return r.Errors == 0, fmt.Sprintf("%+v", r)
				})
			}
			testwait.UntilOK(t, 10*time.Second, "a Service added after the loop to be served on node2", func() (bool, string) {
				r := c.get(farClient.NS, "http://10.96.0.30/", 1, "--timeout", "2s")
				return r.Errors == 0, fmt.Sprintf("%+v", r)
			})
		})
	}
}
