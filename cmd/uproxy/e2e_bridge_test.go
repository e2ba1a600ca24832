package main

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testlab"
)

// TestE2EBridgeCNI runs the Service tests on a node that a bridge CNI set
// up: pods on cni0 with br_netfilter handing its frames to iptables
// (testlab's BridgeCNI), pods on a second node behind a route, and an
// external host, in both modes and both listener layouts. Every client
// kind reaches cluster IPs, node ports and external IPs over TCP and UDP,
// and each backend sees the address kube-proxy's DNAT would show it
// (docs/modes.md, "Source addresses"), in both modes: the client's own
// wherever kube-proxy does not masquerade, or the Service asks for it,
// whether the backend is on the client's bridge or on another node.
func TestE2EBridgeCNI(t *testing.T) {
	for _, variant := range []string{"redirect", "tproxy", "redirect/shared", "tproxy/shared"} {
		mode, layout, _ := strings.Cut(variant, "/")
		if layout == "" {
			layout = "per-service"
		}
		t.Run(variant, func(t *testing.T) {
			c := newClusterWith(t, 2, testlab.Options{Bridge: "cni0"})
			if err := c.lab.BridgeCNI(); err != nil {
				t.Skipf("skipping: %v", err)
			}
			var far []*testlab.Pod
			for i := range 2 {
				p, err := c.lab.AddRemotePod(fmt.Sprintf("far-%d", i))
				if err != nil {
					t.Fatal(err)
				}
				if _, err := c.lab.Start(p.NS, p.Name, c.bench, "serve", "--name", p.Name, "--listen", ":8080"); err != nil {
					t.Fatal(err)
				}
				far = append(far, p)
			}
			remote, err := c.lab.AddRemotePod("rclient")
			if err != nil {
				t.Fatal(err)
			}
			ext, err := c.lab.AddExternal("ext")
			if err != nil {
				t.Fatal(err)
			}
			c.serveUDP(c.pods...)
			c.serveUDP(far...)
			svc := func(name, suffix string, preserve bool, pods []*testlab.Pod) string {
				ann := ""
				if preserve {
					ann = "\n  annotations: {uproxy.io/preserve-source-ip: \"true\"}"
				}
				var eps strings.Builder
				for _, p := range pods {
					fmt.Fprintf(&eps, "- addresses: [%q]\n", p.IP)
				}
				return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata:
  name: %[1]s%[3]s
spec:
  type: NodePort
  clusterIP: 10.96.0.%[2]s
  externalIPs: [10.96.200.%[2]s]
  ports:
  - {name: http, port: 80, targetPort: 8080, nodePort: 3%[2]s80}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 3%[2]s53}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-1, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints:
%[4]s`, name, suffix, ann, eps.String())
			}
			// near: backends on this node's bridge; far: on the second
			// node; plain: near's backends, without preserve-source-ip.
			c.write("near.yaml", svc("near", "21", true, c.pods))
			c.write("far.yaml", svc("far", "22", true, far))
			c.write("plain.yaml", svc("plain", "23", false, c.pods))
			// six: IPv6 only, preserving, on the second node's pods.
			c.write("six.yaml", fmt.Sprintf(`apiVersion: v1
kind: Service
metadata:
  name: six
  annotations: {uproxy.io/preserve-source-ip: "true"}
spec:
  clusterIP: "2001:db8:96::24"
  clusterIPs: ["2001:db8:96::24"]
  ipFamilies: [IPv6]
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: six-1, labels: {kubernetes.io/service-name: six}}
addressType: IPv6
ports: [{name: http, port: 8080}]
endpoints:
- addresses: [%q]
- addresses: [%q]
`, far[0].IP6, far[1].IP6))
			c.start(0, "--mode", mode, "--listener", layout, "--cluster-cidr", "10.244.0.0/16")
			c.waitSynced()

			// The node's address on the way to each group of backends.
			nodeNear, nodeFar := "10.244.0.1", "198.51.100.1"
			// dest is a destination of a client, and whether it is the
			// service's cluster IP (else a node port or external IP).
			type dest struct {
				addr      string
				clusterIP bool
			}
			type target struct{ tcp, udp []dest }
			clients := []struct {
				name, ns, ip string
				// pod: the client is in --cluster-cidr.
				pod   bool
				addrs func(s string) target
			}{
				{"node", c.lab.Node, nodeNear, false, func(s string) target {
					return target{[]dest{{"http://10.96.0." + s + "/", true}}, []dest{{"10.96.0." + s + ":53", true}}}
				}},
				{"bridged pod", c.client.NS, c.client.IP.String(), true, func(s string) target {
					return target{
						[]dest{{"http://10.96.0." + s + "/", true}, {"http://10.244.0.1:3" + s + "80/", false}, {"http://10.96.200." + s + "/", false}},
						[]dest{{"10.96.0." + s + ":53", true}, {"10.244.0.1:3" + s + "53", false}},
					}
				}},
				{"second node's pod", remote.NS, remote.IP.String(), true, func(s string) target {
					return target{
						[]dest{{"http://10.96.0." + s + "/", true}, {"http://198.51.100.1:3" + s + "80/", false}},
						[]dest{{"10.96.0." + s + ":53", true}, {"198.51.100.1:3" + s + "53", false}},
					}
				}},
				{"external", ext.NS, ext.IP.String(), false, func(s string) target {
					return target{
						[]dest{{"http://192.0.2.1:3" + s + "80/", false}, {"http://10.96.200." + s + "/", false}},
						[]dest{{"192.0.2.1:3" + s + "53", false}, {"10.96.200." + s + ":53", false}},
					}
				}},
			}
			for _, cl := range clients {
				for _, s := range []struct {
					name, suffix string
					preserve     bool
					node         string // the node's address towards the backends
					farBackends  bool
				}{{"near", "21", true, nodeNear, false}, {"far", "22", true, nodeFar, true}, {"plain", "23", false, nodeNear, false}} {
					if s.farBackends && cl.name == "second node's pod" {
						// Client and backends share the second node's bridge,
						// whose own proxy serves them on a real cluster.
						continue
					}
					t.Run(cl.name+"/"+s.name, func(t *testing.T) {
						// What kube-proxy's DNAT would show the backend, in
						// both modes: the client's own address, unless the
						// node is the client, or kube-proxy would masquerade
						// (an external destination under
						// externalTrafficPolicy Cluster); the annotation
						// keeps it there too. A backend on the client's
						// bridge is no exception: its replies are taken off
						// the bridge.
						want := func(d dest) string {
							if cl.name == "node" || !s.preserve && !(d.clusterIP && cl.pod) {
								return s.node
							}
							return cl.ip
						}
						tg := cl.addrs(s.suffix)
						for _, d := range tg.tcp {
							r := c.get(cl.ns, d.addr, 4)
							if w := want(d); r.Errors > 0 || len(r.Counts) != 2 || len(r.Peers) != 1 || r.Peers[w] == 0 {
								t.Errorf("%s → %s: spread %v, backends saw %v, %d errors (%s); want both backends, seeing %s",
									cl.name, d.addr, r.Counts, r.Peers, r.Errors, r.FirstError, w)
							}
						}
						for _, d := range tg.udp {
							r := c.query(cl.ns, d.addr, 4)
							if w := want(d); r.Errors > 0 || len(r.Counts) != 2 || len(r.Peers) != 1 || r.Peers[w] == 0 {
								t.Errorf("%s → udp %s: spread %v, backends saw %v, %d errors (%s); want both backends, seeing %s",
									cl.name, d.addr, r.Counts, r.Peers, r.Errors, r.FirstError, w)
							}
						}
					})
				}
			}
			t.Run("IPv6", func(t *testing.T) {
				for _, cl := range []struct {
					name, ns string
					ip       netip.Addr
				}{{"bridged pod", c.client.NS, c.client.IP6}, {"external", ext.NS, ext.IP6}} {
					// A preserving service: the client's own address.
					want := cl.ip.String()
					r := c.get(cl.ns, "http://[2001:db8:96::24]/", 4)
					if r.Errors > 0 || len(r.Counts) != 2 || len(r.Peers) != 1 || r.Peers[want] == 0 {
						t.Errorf("%s → http://[2001:db8:96::24]/: spread %v, backends saw %v, %d errors (%s); want both backends, seeing %s",
							cl.name, r.Counts, r.Peers, r.Errors, r.FirstError, want)
					}
				}
			})
			if t.Failed() {
				for _, cmd := range [][]string{{"iptables-save", "-c", "-t", "mangle"}, {"ip", "rule"}} {
					out, _ := c.lab.Exec(context.Background(), c.lab.Node, cmd...)
					t.Logf("%v:\n%s", cmd, out)
				}
			}
			// uproxy cleanup removes the bridge loop with the rest.
			if err := c.up.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			if err := c.up.Wait(10 * time.Second); err != nil {
				t.Errorf("uproxy did not stop cleanly: %v", err)
			}
			if out, err := c.lab.Exec(t.Context(), c.lab.Node, c.uproxy, "cleanup"); err != nil {
				t.Errorf("cleanup: %v\n%s", err, out)
			}
			for _, cmd := range [][]string{{"iptables-save"}, {"ip6tables-save"}, {"ip", "rule"}, {"ip", "-6", "rule"}, {"ip", "link"}} {
				out, err := c.lab.Exec(t.Context(), c.lab.Node, cmd...)
				if err != nil || strings.Contains(strings.ToLower(out), "uproxy") || strings.Contains(out, "lookup 117") {
					t.Errorf("after cleanup, %v shows: %v\n%s", cmd, err, out)
				}
			}
		})
	}
}
