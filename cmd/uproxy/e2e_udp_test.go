package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/redirect"
)

type udpResult struct {
	Counts     map[string]int `json:"counts"`
	Peers      map[string]int `json:"peers"`
	Errors     int            `json:"errors"`
	FirstError string         `json:"firstError"`
}

func (c *cluster) query(ns, addr string, n int, extra ...string) udpResult {
	c.t.Helper()
	out, err := c.lab.Exec(context.Background(), ns, append([]string{c.bench, "udp-query", "-n", fmt.Sprint(n), addr}, extra...)...)
	if err != nil {
		c.t.Fatal(err)
	}
	var r udpResult
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		c.t.Fatalf("decoding %q: %v", out, err)
	}
	return r
}

// serveUDP starts the UDP echo the dns service points at (bench
// udp-serve, on :5353) in each of pods.
func (c *cluster) serveUDP(pods ...*testlab.Pod) {
	c.t.Helper()
	for _, p := range pods {
		if _, err := c.lab.Start(p.NS, p.Name+"-udp", c.bench, "udp-serve", "--name", p.Name, "--listen", ":5353"); err != nil {
			c.t.Fatal(err)
		}
	}
}

// dnsService returns the manifests of the dns service, 10.96.0.53:53/UDP,
// over port 5353 of pods, with node port nodePort unless it is zero.
func dnsService(nodePort int, pods ...*testlab.Pod) string {
	typ, np := "", ""
	if nodePort != 0 {
		typ, np = "\n  type: NodePort", fmt.Sprintf(", nodePort: %d", nodePort)
	}
	var eps strings.Builder
	for _, p := range pods {
		fmt.Fprintf(&eps, "- addresses: [%q]\n", p.IP)
	}
	return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: dns}
spec:%s
  clusterIP: 10.96.0.53
  ports: [{name: dns, port: 53, protocol: UDP, targetPort: 5353%s}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dns-1, labels: {kubernetes.io/service-name: dns}}
addressType: IPv4
ports: [{name: dns, port: 5353, protocol: UDP}]
endpoints:
%s`, typ, np, eps.String())
}

// TestE2EUDP sends DNS-like queries through a UDP service from a pod, the
// node and an external host, each from a connected socket that accepts
// only answers coming from the VIP.
func TestE2EUDP(t *testing.T) {
	c := newCluster(t, 3)
	ext, err := c.lab.AddExternal("ext")
	if err != nil {
		t.Fatal(err)
	}
	c.serveUDP(c.pods...)
	c.write("dns.yaml", dnsService(30053, c.pods...))
	c.start(2, "--udp-timeout", "5s")
	for _, from := range []struct{ name, ns, addr string }{
		{"pod", c.client.NS, "10.96.0.53:53"},
		{"node", c.lab.Node, "10.96.0.53:53"},
		{"external host via the node port", ext.NS, "192.0.2.1:30053"},
	} {
		t.Run(from.name, func(t *testing.T) {
			r := c.query(from.ns, from.addr, 30)
			if r.Errors > 0 || len(r.Counts) != 3 {
				t.Errorf("spread %v, %d errors (%s); want all three backends, no errors", r.Counts, r.Errors, r.FirstError)
			}
			// A large datagram arrives whole.
			if r := c.query(from.ns, from.addr, 2, "--size", "60000"); r.Errors > 0 {
				t.Errorf("60000-byte query: %d errors (%s)", r.Errors, r.FirstError)
			}
		})
	}
	// A backend that goes away: its clients move on, at most one query lost.
	c.lab.Exec(context.Background(), c.pods[0].NS, "iptables", "-A", "INPUT", "-p", "udp", "--dport", "5353", "-j", "REJECT")
	c.query(c.client.NS, "10.96.0.53:53", 6, "--timeout", "500ms")
	if r := c.query(c.client.NS, "10.96.0.53:53", 20); r.Errors > 0 || r.Counts["web-0"] > 0 {
		t.Errorf("after web-0 started refusing: spread %v, %d errors (%s)", r.Counts, r.Errors, r.FirstError)
	}
}

// TestE2EUDPFlowsWithinDescriptorLimit sends DNS-like queries, each from a
// new port and so each a new flow, through a uproxy whose open-files limit
// is 512: more flows than descriptors. Each flow holds a socket for
// --udp-timeout, so a flow table bounded only at 65,536 ran out of
// descriptors and failed every query after that (EMFILE). Bounded at half
// the limit, it ends its oldest flows instead, and every query is
// answered.
func TestE2EUDPFlowsWithinDescriptorLimit(t *testing.T) {
	prlimit, err := exec.LookPath("prlimit")
	if err != nil {
		t.Skip("skipping: no prlimit to give uproxy a small open-files limit")
	}
	c := newCluster(t, 1)
	c.serveUDP(c.pods...)
	c.write("dns.yaml", dnsService(0, c.pods...))
	c.launcher = []string{prlimit, "--nofile=512:512"}
	c.start(1, "--udp-timeout", "60s")
	if strings.Contains(c.up.Output(), `"limit": 1048576`) {
		// A process with CAP_SYS_RESOURCE raises its hard limit: then
		// 1,200 flows fit, and the bound is not what is tested.
		t.Log("uproxy raised its open-files limit past prlimit's; the queries test no bound")
	}
	if r := c.query(c.client.NS, "10.96.0.53:53", 1200, "--timeout", "300ms"); r.Errors > 0 {
		t.Errorf("%d of 1200 queries failed (%s); want none", r.Errors, r.FirstError)
	}
	if out := c.up.Output(); strings.Contains(out, "too many open files") {
		t.Errorf("uproxy ran out of descriptors:\n%s", out[max(0, len(out)-2000):])
	}
}

// TestE2EUDPListenerPortNotReachable sends datagrams from an external
// host and from a pod straight to the UDP listener's port, in both
// listener layouts: the kernel's listener guard drops them (its counter
// says so, and uproxy counts none). Before, a per-service listener
// forwarded them: a cluster DNS service answered anyone outside the node
// who found its listener's port. With the guard's set flushed, as
// before the first rules write holds a new listener's port, uproxy itself
// drops them, since conntrack gives them no service's original
// destination: always on a shared listener, and on a per-service one with
// --udp-check-every-flow. By default a per-service listener trusts the
// guard once a rules write put its port in the set, and asks conntrack
// nothing for new flows; the flushed set is then noticed by the next
// full sync only.
func TestE2EUDPListenerPortNotReachable(t *testing.T) {
	for _, tc := range []struct {
		name, layout string
		extra        []string
		// flush: the guard's set is flushed, and uproxy must drop the
		// datagrams itself.
		flush bool
	}{
		{name: "per-service", layout: "per-service"},
		{name: "per-service checking every flow", layout: "per-service", extra: []string{"--udp-check-every-flow"}, flush: true},
		{name: "shared", layout: "shared", flush: true},
	} {
		layout := tc.layout
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, 1)
			ext, err := c.lab.AddExternal("ext")
			if err != nil {
				t.Fatal(err)
			}
			c.serveUDP(c.pods...)
			c.write("dns.yaml", dnsService(30053, c.pods...))
			c.start(0, append([]string{"--listener", layout, "--metrics-bind-address", metricsAddr}, tc.extra...)...)
			c.waitSynced()
			if r := c.query(ext.NS, "192.0.2.1:30053", 3); r.Errors > 0 {
				t.Fatalf("through the node port: %d errors (%s)", r.Errors, r.FirstError)
			}
			port := c.listenerPorts("udp")
			if len(port) != 1 {
				t.Fatalf("UDP listener ports %v; want one", port)
			}
			direct := []struct{ name, ns, addr string }{
				{"external host", ext.NS, "192.0.2.1:" + port[0]},
				{"pod", c.client.NS, "10.244.0.1:" + port[0]},
			}
			before, refused := c.guardDrops("udp"), c.refusedDestinations()
			for _, d := range direct {
				if r := c.query(d.ns, d.addr, 2, "--timeout", "500ms"); r.Errors != 2 {
					t.Errorf("guarded: %s sent straight to %s: %d of 2 answered", d.name, d.addr, 2-r.Errors)
				}
			}
			if after := c.guardDrops("udp"); after < before+4 {
				t.Errorf("the listener guard dropped %d datagrams of 4 sent straight to the listener", after-before)
			}
			if got := c.refusedDestinations(); got != refused {
				t.Errorf("uproxy refused %v datagrams that the listener guard should have dropped", got-refused)
			}
			if !tc.flush {
				if r := c.query(ext.NS, "192.0.2.1:30053", 3); r.Errors > 0 {
					t.Errorf("through the node port, after: %d errors (%s)", r.Errors, r.FirstError)
				}
				return
			}
			if _, err := c.lab.Exec(t.Context(), c.lab.Node, "ipset", "flush", redirect.ListenerSet(redirect.IPv4, redirect.UDP)); err != nil {
				t.Fatal(err)
			}
			for _, d := range direct {
				if r := c.query(d.ns, d.addr, 2, "--timeout", "500ms"); r.Errors != 2 {
					t.Errorf("unguarded: %s sent straight to %s: %d of 2 answered", d.name, d.addr, 2-r.Errors)
				}
			}
			if got := c.refusedDestinations(); layout == "per-service" && got < refused+4 {
				t.Errorf("uproxy counted %v refused destinations of the 4 datagrams that reached it", got-refused)
			}
			if r := c.query(ext.NS, "192.0.2.1:30053", 3); r.Errors > 0 {
				t.Errorf("through the node port, after: %d errors (%s)", r.Errors, r.FirstError)
			}
		})
	}
}

// refusedDestinations returns uproxy's count of connections and flows
// refused for a destination that is not their service's.
func (c *cluster) refusedDestinations() float64 {
	c.t.Helper()
	var n float64
	if mf := c.scrapeMetrics()["uproxy_connections_total"]; mf != nil {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" && l.GetValue() == "refused_destination" {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}

// listenerPorts returns the listener ports of proto ("tcp" or "udp") in
// the node's IPv4 listener guard set.
func (c *cluster) listenerPorts(proto string) []string {
	c.t.Helper()
	out, err := c.lab.Exec(context.Background(), c.lab.Node, "ipset", "list", redirect.ListenerSet(redirect.IPv4, redirect.Protocol(proto)))
	if err != nil {
		c.t.Fatal(err)
	}
	_, members, _ := strings.Cut(out, "Members:")
	return strings.Fields(members)
}

// guardDrops returns the packets that the IPv4 listener guard of proto
// ("tcp" or "udp") has dropped: the counter of its rule in
// UPROXY-FIREWALL.
func (c *cluster) guardDrops(proto string) int {
	c.t.Helper()
	out, err := c.lab.Exec(context.Background(), c.lab.Node, "iptables", "-w", "-t", "filter", "-L", redirect.FirewallChain, "-n", "-v", "-x")
	if err != nil {
		c.t.Fatal(err)
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "match-set "+redirect.ListenerSet(redirect.IPv4, redirect.Protocol(proto))+" ") {
			if f := strings.Fields(line); len(f) > 0 {
				if n, err := strconv.Atoi(f[0]); err == nil {
					return n
				}
			}
		}
	}
	c.t.Fatalf("no listener guard for %s in %s:\n%s", proto, redirect.FirewallChain, out)
	return 0
}
