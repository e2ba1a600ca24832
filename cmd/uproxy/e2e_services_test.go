package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/redirect"
)

// slice renders an EndpointSlice of one family for service svc, port
// "http" 8080, with each endpoint on the given node (empty for none).
func sliceYAML(name, svc, family string, eps ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: %s\n  labels: {kubernetes.io/service-name: %s}\naddressType: %s\nports: [{name: http, port: 8080}]\nendpoints:\n", name, svc, family)
	for _, e := range eps {
		fmt.Fprintf(&b, "- %s\n", e)
	}
	return b.String()
}

// epOn renders one endpoint of sliceYAML on a node, with extra fields.
func epOn(p *testlab.Pod, node string, extra ...string) string {
	s := fmt.Sprintf("addresses: [%q]", p.IP)
	if node != "" {
		s += ", nodeName: " + node
	}
	for _, e := range extra {
		s += ", " + e
	}
	return "{" + s + "}"
}

// TestE2EServiceSemantics checks, with the real binary and kernel, every
// kind of service address and traffic policy from the three kinds of
// clients: a pod, the node itself, and hosts outside the cluster.
func TestE2EServiceSemantics(t *testing.T) {
	c := newCluster(t, 3)
	p0, p1, p2 := c.pods[0], c.pods[1], c.pods[2]
	ext1, err := c.lab.AddExternal("ext1")
	if err != nil {
		t.Fatal(err)
	}
	ext2, err := c.lab.AddExternal("ext2")
	if err != nil {
		t.Fatal(err)
	}
	all := func(node string) []string { return []string{epOn(p0, node), epOn(p1, node), epOn(p2, node)} }

	c.write("nodeport.yaml", `apiVersion: v1
kind: Service
metadata: {name: np}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, targetPort: http, nodePort: 30080}]
`+sliceYAML("np-1", "np", "IPv4", all("")...))
	c.write("external.yaml", `apiVersion: v1
kind: Service
metadata: {name: ext}
spec:
  clusterIP: 10.96.0.11
  externalIPs: [10.96.200.100]
  ports: [{name: http, port: 80}]
`+sliceYAML("ext-1", "ext", "IPv4", all("")...))
	c.write("lb.yaml", `apiVersion: v1
kind: Service
metadata: {name: lb}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.12
  loadBalancerSourceRanges: ["`+ext1.IP.String()+`/32", "2001:db8:ffff::/48"]
  ports: [{name: http, port: 80, nodePort: 30082}]
status:
  loadBalancer:
    ingress: [{ip: 10.96.200.200}, {ip: 10.96.200.201, ipMode: Proxy}]
`+sliceYAML("lb-1", "lb", "IPv4", all("")...))
	// externalTrafficPolicy Local: web-0 is on this node (node-a), the
	// others are not.
	c.write("local.yaml", `apiVersion: v1
kind: Service
metadata: {name: local}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.13
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  ports: [{name: http, port: 80, nodePort: 30083}]
status:
  loadBalancer:
    ingress: [{ip: 10.96.200.210}]
`+sliceYAML("local-1", "local", "IPv4", epOn(p0, "node-a"), epOn(p1, "node-b"), epOn(p2, "node-b")))
	c.write("itp.yaml", `apiVersion: v1
kind: Service
metadata: {name: itp}
spec:
  clusterIP: 10.96.0.14
  internalTrafficPolicy: Local
  ports: [{name: http, port: 80}]
`+sliceYAML("itp-1", "itp", "IPv4", epOn(p0, "node-b"), epOn(p1, "node-a"), epOn(p2, "node-b")))
	c.write("hints.yaml", `apiVersion: v1
kind: Service
metadata: {name: hints}
spec:
  clusterIP: 10.96.0.15
  trafficDistribution: PreferSameNode
  ports: [{name: http, port: 80}]
`+sliceYAML("hints-1", "hints", "IPv4",
		epOn(p0, "node-b", "hints: {forZones: [{name: z1}], forNodes: [{name: node-b}]}"),
		epOn(p1, "node-a", "hints: {forZones: [{name: z1}], forNodes: [{name: node-a}]}"),
		epOn(p2, "node-a", "hints: {forZones: [{name: z1}], forNodes: [{name: node-a}]}")))
	v6 := func(p *testlab.Pod) string { return fmt.Sprintf("{addresses: [%q]}", p.IP6) }
	c.write("dualstack.yaml", `apiVersion: v1
kind: Service
metadata: {name: ds}
spec:
  clusterIP: 10.96.0.16
  clusterIPs: [10.96.0.16, "2001:db8:96::16"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: RequireDualStack
  ports: [{name: http, port: 80}]
`+sliceYAML("ds-4", "ds", "IPv4", epOn(p0, ""))+sliceYAML("ds-6", "ds", "IPv6", v6(p1), v6(p2)))

	c.start(13, "--hostname-override", "node-a", "--cluster-cidr", "10.244.0.0/16")
	node := c.lab.Node
	want := func(t *testing.T, from, url string, n int, ok func(map[string]int) bool, extra ...string) {
		t.Helper()
		r := c.get(from, url, n, extra...)
		if r.Errors > 0 || !ok(r.Counts) {
			t.Errorf("GET %s from %s: spread %v, %d errors (%s)", url, from, r.Counts, r.Errors, r.FirstError)
		}
	}
	spread := func(got map[string]int) bool { return len(got) == 3 }
	only := func(names ...string) func(map[string]int) bool {
		return func(got map[string]int) bool {
			if len(got) != len(names) {
				return false
			}
			for _, n := range names {
				if got[n] == 0 {
					return false
				}
			}
			return true
		}
	}
	refused := func(t *testing.T, from, url string) {
		t.Helper()
		if r := c.get(from, url, 1, "--timeout", "1s"); r.Errors != 1 {
			t.Errorf("GET %s from %s answered %v; want no answer", url, from, r.Counts)
		}
	}

	t.Run("NodePort from every kind of client", func(t *testing.T) {
		want(t, ext1.NS, "http://192.0.2.1:30080/", 9, spread)
		want(t, c.client.NS, "http://10.244.0.1:30080/", 9, spread)
		want(t, node, "http://10.244.0.1:30080/", 9, spread)
		want(t, node, "http://192.0.2.1:30080/", 9, spread)
	})
	t.Run("externalIPs", func(t *testing.T) {
		want(t, ext1.NS, "http://10.96.200.100/", 9, spread)
		want(t, c.client.NS, "http://10.96.200.100/", 9, spread)
	})
	t.Run("LoadBalancer IP with source ranges", func(t *testing.T) {
		want(t, ext1.NS, "http://10.96.200.200/", 9, spread)
		refused(t, ext2.NS, "http://10.96.200.200/")
		refused(t, ext1.NS, "http://10.96.200.201/")           // ipMode Proxy: not intercepted
		want(t, ext2.NS, "http://192.0.2.1:30082/", 3, spread) // the node port has no source ranges
	})
	t.Run("externalTrafficPolicy Local", func(t *testing.T) {
		want(t, ext1.NS, "http://10.96.200.210/", 9, only("web-0"))
		want(t, ext2.NS, "http://192.0.2.1:30083/", 9, only("web-0"))
		// Pods and the node itself short-circuit to every endpoint.
		want(t, c.client.NS, "http://10.96.200.210/", 9, spread)
		want(t, node, "http://10.244.0.1:30083/", 9, spread)
		// The cluster IP is not external traffic.
		want(t, ext1.NS, "http://10.96.0.13/", 9, spread)
	})
	t.Run("healthCheckNodePort", func(t *testing.T) {
		out, err := c.lab.Exec(context.Background(), ext1.NS, "curl", "-sS", "-i", "--max-time", "5", "http://192.0.2.1:32000/")
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range []string{"HTTP/1.1 200 OK", "X-Load-Balancing-Endpoint-Weight: 1", `"localEndpoints": 1`, `"name": "local"`} {
			if !strings.Contains(out, w) {
				t.Errorf("health check answer lacks %q:\n%s", w, out)
			}
		}
	})
	t.Run("internalTrafficPolicy Local", func(t *testing.T) {
		want(t, c.client.NS, "http://10.96.0.14/", 6, only("web-1"))
		want(t, node, "http://10.96.0.14/", 6, only("web-1"))
	})
	t.Run("topology hints", func(t *testing.T) {
		want(t, c.client.NS, "http://10.96.0.15/", 10, only("web-1", "web-2"))
	})
	t.Run("dual-stack", func(t *testing.T) {
		want(t, c.client.NS, "http://10.96.0.16/", 4, only("web-0"))
		want(t, c.client.NS, "http://[2001:db8:96::16]/", 10, only("web-1", "web-2"))
		want(t, node, "http://[2001:db8:96::16]/", 10, only("web-1", "web-2"))
		s, err := c.lab.Exec(context.Background(), node, "ip6tables-save", "-t", "nat")
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(s, "-d 2001:db8:96::16/128") {
			t.Errorf("no IPv6 rule:\n%s", s)
		}
	})
	t.Run("listener ports are not reachable directly", func(t *testing.T) {
		port := listenerPort(t, c.natRules(), "10.96.0.10/32")
		direct := []struct{ ns, url string }{
			{ext1.NS, fmt.Sprintf("http://192.0.2.1:%s/", port)},
			{c.client.NS, fmt.Sprintf("http://10.244.0.1:%s/", port)},
		}
		// The kernel's listener guard drops the SYN, so the connection
		// is never made: curl times out connecting (exit status 28).
		// uproxy's own check (admitTCP) would accept the connection and
		// close it at once, which curl reports otherwise.
		before := c.guardDrops("tcp")
		for _, d := range direct {
			if code := curlExit(t, c, d.ns, d.url); code != 28 {
				t.Errorf("guarded: GET %s from %s: curl exit status %d; want 28, the connect timing out", d.url, d.ns, code)
			}
		}
		if after := c.guardDrops("tcp"); after <= before {
			t.Errorf("the listener guard dropped nothing of the connections to the listener port")
		}
		// Without the guard (its set flushed), uproxy refuses them
		// itself: the connection is made and closed with no answer.
		if _, err := c.lab.Exec(context.Background(), node, "ipset", "flush", redirect.ListenerSet(redirect.IPv4, redirect.TCP)); err != nil {
			t.Fatal(err)
		}
		for _, d := range direct {
			if code := curlExit(t, c, d.ns, d.url); code == 0 || code == 28 {
				t.Errorf("unguarded: GET %s from %s: curl exit status %d; want uproxy to close the connection unanswered", d.url, d.ns, code)
			}
		}
	})
	t.Run("healthz", func(t *testing.T) {
		out, err := c.lab.Exec(context.Background(), node, "curl", "-sS", "--max-time", "5", "http://127.0.0.1:10256/healthz")
		if err != nil {
			t.Fatal(err)
		}
		var body map[string]any
		if err := json.Unmarshal([]byte(out), &body); err != nil || body["lastUpdated"] == nil {
			t.Errorf("healthz body %q: %v", out, err)
		}
	})
}

// curlExit runs curl for url in namespace ns, with a one-second connect
// timeout, and returns its exit status.
func curlExit(t *testing.T, c *cluster, ns, url string) int {
	t.Helper()
	_, err := c.lab.Exec(context.Background(), ns, "curl", "-sS", "--connect-timeout", "1", "--max-time", "3", url)
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &exit):
		return exit.ExitCode()
	}
	t.Fatal(err)
	return -1
}

// listenerPort finds the REDIRECT target port of the rule for dst.
func listenerPort(t *testing.T, rules, dst string) string {
	t.Helper()
	for _, line := range strings.Split(rules, "\n") {
		if strings.Contains(line, "-d "+dst) {
			if _, port, ok := strings.Cut(line, "--to-ports "); ok {
				return strings.TrimSpace(port)
			}
		}
	}
	t.Fatalf("no rule for %s in:\n%s", dst, rules)
	return ""
}

func TestE2ENodePortAddresses(t *testing.T) {
	c := newCluster(t, 1)
	ext, err := c.lab.AddExternal("ext")
	if err != nil {
		t.Fatal(err)
	}
	c.write("np.yaml", `apiVersion: v1
kind: Service
metadata: {name: np}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, nodePort: 30080}]
`+sliceYAML("np-1", "np", "IPv4", epOn(c.pods[0], "")))
	c.start(2, "--nodeport-addresses", "192.0.2.0/24")
	if r := c.get(ext.NS, "http://192.0.2.1:30080/", 3); r.Errors > 0 {
		t.Errorf("node port on an admitted address: %+v", r)
	}
	if r := c.get(c.client.NS, "http://10.244.0.1:30080/", 1, "--timeout", "1s"); r.Errors != 1 {
		t.Errorf("node port answered on 10.244.0.1, outside --nodeport-addresses: %v", r.Counts)
	}
}
