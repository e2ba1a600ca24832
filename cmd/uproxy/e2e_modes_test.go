package main

import (
	"fmt"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/redirect"
)

// TestE2EModes runs every combination the modes must serve: redirect and
// tproxy mode; TCP and UDP; clients on the node itself, in a pod routed
// through the node, and on an external host reaching a node port and an
// external IP. In both modes backends see the client's own address where
// kube-proxy would keep it, or the service asks for it, and the node's
// elsewhere. Each
// mode runs with a listener per service port and with shared listeners
// (--listener=shared), where no rule names a service: the service
// addresses are kernel set members.
// ioLogged matches the startup line's data path under io_uring, in the
// console format and in JSON.
var ioLogged = regexp.MustCompile(`"io": ?"io_uring"`)

func TestE2EModes(t *testing.T) {
	// A third part names a data path flag: tproxy mode's transparent
	// dials on the io_uring loops, asked for, and on the epoll loops,
	// which the default (--io-uring=auto) leaves to kernels without
	// io_uring.
	for _, variant := range []string{"redirect", "tproxy", "redirect/shared", "tproxy/shared", "tproxy/per-service/io-uring", "tproxy/per-service/io-uring=false"} {
		mode, layout, _ := strings.Cut(variant, "/")
		layout, dataPath, _ := strings.Cut(layout, "/")
		if layout == "" {
			layout = "per-service"
		}
		t.Run(variant, func(t *testing.T) {
			if dataPath == "io-uring" {
				if err := datapath.IOURingSupported(); err != nil {
					t.Skipf("skipping: the event loops cannot use io_uring here: %v", err)
				}
			}
			c := newCluster(t, 2)
			ext, err := c.lab.AddExternal("ext")
			if err != nil {
				t.Fatal(err)
			}
			pod, err := c.lab.AddRoutedPod("rpod")
			if err != nil {
				t.Fatal(err)
			}
			var eps strings.Builder
			c.serveUDP(c.pods...)
			for _, p := range c.pods {
				fmt.Fprintf(&eps, "- addresses: [%q]\n", p.IP)
			}
			svc := func(name, ip string, preserve bool) string {
				ann := ""
				if preserve {
					ann = "\n  annotations: {uproxy.io/preserve-source-ip: \"true\"}"
				}
				return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata:
  name: %[1]s%[3]s
spec:
  type: NodePort
  clusterIP: %[2]s
  externalIPs: [10.96.200.%[4]s]
  ports:
  - {name: http, port: 80, targetPort: 8080, nodePort: 3%[4]s80}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 3%[4]s53}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-1, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints:
%[5]s`, name, ip, ann, ip[len(ip)-2:], eps.String())
			}
			c.write("kept.yaml", svc("kept", "10.96.0.11", true))
			c.write("plain.yaml", svc("plain", "10.96.0.12", false))
			if mode == "tproxy" {
				// This lab stands for a routed CNI: with br_netfilter off,
				// bridged frames skip iptables as a routed pod's would meet
				// TPROXY. TestE2EBridgeCNI runs the same matrix with it on.
				if _, err := c.lab.Exec(t.Context(), c.lab.Node, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0", "net.bridge.bridge-nf-call-ip6tables=0"); err != nil {
					t.Logf("cannot turn bridge-nf-call-iptables off (br_netfilter not loaded?): %v", err)
				}
			}
			args := []string{"--mode", mode, "--listener", layout, "--cluster-cidr", "10.244.0.0/16"}
			if dataPath != "" {
				args = append(args, "--"+dataPath)
			}
			c.start(0, args...)
			c.waitSynced()
			if layout == "shared" {
				// Two services of two ports each: one rule per protocol,
				// the addresses in the set (2 services × (cluster IP +
				// external IP) × 2 protocols).
				save, err := c.lab.Exec(t.Context(), c.lab.Node, "iptables-save")
				if err != nil {
					t.Fatal(err)
				}
				if strings.Contains(save, "default/kept") || strings.Contains(save, "default/plain") {
					t.Errorf("--listener=shared: a rule names a service:\n%s", save)
				}
				members, err := c.lab.Exec(t.Context(), c.lab.Node, "ipset", "list", redirect.ServiceSet(redirect.IPv4))
				if err != nil {
					t.Fatal(err)
				}
				for _, m := range []string{"10.96.0.11,tcp:80", "10.96.0.11,udp:53", "10.96.200.11,tcp:80", "10.96.0.12,udp:53", "10.96.200.12,udp:53"} {
					if !strings.Contains(members, m+"\n") {
						t.Errorf("the service set lacks %s:\n%s", m, members)
					}
				}
			}

			node := "10.244.0.1"
			clients := []struct {
				name, ns, sees string // sees: the source a preserving backend sees
				addrs          func(svc string) (tcp, udp []string)
			}{
				{"node", c.lab.Node, node, func(s string) ([]string, []string) {
					return []string{"http://10.96.0." + s + "/"}, []string{"10.96.0." + s + ":53"}
				}},
				{"pod", pod.NS, pod.IP.String(), func(s string) ([]string, []string) {
					return []string{"http://10.96.0." + s + "/", "http://10.244.0.1:3" + s + "80/"}, []string{"10.96.0." + s + ":53"}
				}},
				{"external", ext.NS, ext.IP.String(), func(s string) ([]string, []string) {
					return []string{"http://192.0.2.1:3" + s + "80/", "http://10.96.200." + s + "/"}, []string{"192.0.2.1:3" + s + "53", "10.96.200." + s + ":53"}
				}},
			}
			for _, cl := range clients {
				for _, s := range []struct {
					name, suffix string
					preserve     bool
				}{{"kept", "11", true}, {"plain", "12", false}} {
					// Both modes: the client's own address where kube-proxy
					// would keep it (a pod to the cluster IP) or the service
					// asks for it, else the node's, on the bridge.
					want := func(dest string) string {
						clusterIP := strings.HasPrefix(strings.TrimPrefix(dest, "http://"), "10.96.0.")
						if cl.name != "node" && (s.preserve || clusterIP && cl.name == "pod") {
							return cl.sees
						}
						return node
					}
					tcp, udp := cl.addrs(s.suffix)
					for _, url := range tcp {
						r := c.get(cl.ns, url, 4)
						if want := want(url); r.Errors > 0 || len(r.Counts) != 2 || len(r.Peers) != 1 || r.Peers[want] == 0 {
							t.Errorf("%s → %s (%s): spread %v, backends saw %v, %d errors (%s); want both backends, seeing %s",
								cl.name, url, s.name, r.Counts, r.Peers, r.Errors, r.FirstError, want)
						}
					}
					for _, addr := range udp {
						r := c.query(cl.ns, addr, 4)
						if want := want(addr); r.Errors > 0 || len(r.Counts) != 2 || len(r.Peers) != 1 || r.Peers[want] == 0 {
							t.Errorf("%s → udp %s (%s): spread %v, backends saw %v, %d errors (%s); want both backends, seeing %s",
								cl.name, addr, s.name, r.Counts, r.Peers, r.Errors, r.FirstError, want)
						}
					}
				}
			}
			// uproxy cleanup removes everything of both modes: rules, sets,
			// and tproxy's policy routing.
			if err := c.up.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			if err := c.up.Wait(10 * time.Second); err != nil {
				t.Errorf("uproxy did not stop cleanly: %v", err)
			}
			if out := c.up.Output(); dataPath == "io-uring" && (strings.Contains(out, "epoll only") || !ioLogged.MatchString(out)) {
				t.Errorf("uproxy --io-uring fell back to epoll, or did not say it uses io_uring:\n%s", out)
			}
			if out, err := c.lab.Exec(t.Context(), c.lab.Node, c.uproxy, "cleanup"); err != nil {
				t.Errorf("cleanup: %v\n%s", err, out)
			}
			for _, cmd := range [][]string{{"iptables-save"}, {"ip6tables-save"}, {"ip", "rule"}, {"ip", "-6", "rule"}, {"ipset", "list", "-n"}} {
				out, err := c.lab.Exec(t.Context(), c.lab.Node, cmd...)
				if err != nil || strings.Contains(strings.ToLower(out), "uproxy") || strings.Contains(out, "lookup 117") {
					t.Errorf("after cleanup, %v shows: %v\n%s", cmd, err, out)
				}
			}
			if t.Failed() {
				for _, cmd := range [][]string{{"iptables-save", "-c", "-t", "mangle"}, {"ip", "rule"}, {"ip", "route", "show", "table", "117"}, {"ip", "addr"}} {
					out, _ := c.lab.Exec(t.Context(), c.lab.Node, cmd...)
					t.Logf("%v:\n%s", cmd, out)
				}
			}
		})
	}
}
