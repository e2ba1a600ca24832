package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/promtest"
)

// TestE2EPreserveSourceIPSameBridge checks the same-segment fallback in tproxy
// mode: a client pod and a backend pod on the node's bridge, where a dial
// from the client's address would time out (the backend answers the
// client directly, over the bridge), get a working connection from the
// node's address, counted and logged once; a backend behind the node's
// routing (a routed pod) still sees the client's own address. Both for
// TCP and for UDP flows.
func TestE2EPreserveSourceIPSameBridge(t *testing.T) {
	c := newCluster(t, 1)
	bridged := c.pods[0]
	routed, err := c.lab.AddRoutedPod("rweb")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.lab.Start(routed.NS, routed.Name, c.bench, "serve", "--name", routed.Name, "--listen", ":8080"); err != nil {
		t.Fatal(err)
	}
	c.serveUDP(bridged, routed)
	svc := func(name, vip, backend string) string {
		return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata:
  name: %[1]s
  annotations: {uproxy.io/preserve-source-ip: "true"}
spec:
  clusterIP: %[2]s
  ports:
  - {name: http, port: 80, targetPort: 8080}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-1, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints:
- addresses: [%[3]q]
`, name, vip, backend)
	}
	c.write("same.yaml", svc("same", "10.96.0.21", bridged.IP.String()))
	c.write("routed.yaml", svc("routed", "10.96.0.22", routed.IP.String()))
	// A pod's traffic to a VIP reaches tproxy's rules only with
	// br_netfilter's bridge-nf-call-iptables off (see docs/modes.md); the
	// same-bridge backend's replies are what this test is about, and
	// they bypass the node either way.
	if _, err := c.lab.Exec(t.Context(), c.lab.Node, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"); err != nil {
		t.Logf("cannot turn bridge-nf-call-iptables off (br_netfilter not loaded?): %v", err)
	}
	c.start(0, "--mode", "tproxy", "--cluster-cidr", "10.244.0.0/16", "--metrics-bind-address", metricsAddr)
	c.waitSynced()

	const node, n = "10.244.0.1", 4
	client := c.client.IP.String()
	for _, tt := range []struct {
		name, vip, sees string
	}{
		{"same bridge", "10.96.0.21", node},
		{"routed backend", "10.96.0.22", client},
	} {
		start := time.Now()
		r := c.get(c.client.NS, "http://"+tt.vip+"/", n)
		took := time.Since(start)
		if r.Errors > 0 || r.Peers[tt.sees] != n {
			t.Errorf("%s, TCP: backends saw %v, %d errors (%s); want %d connections seen from %s", tt.name, r.Peers, r.Errors, r.FirstError, n, tt.sees)
		}
		// The default dial timeout is 1s: a connection that waited for it
		// took the slow way.
		if took > time.Second {
			t.Errorf("%s, TCP: %d requests took %v: a dial waited for its timeout", tt.name, n, took)
		}
		u := c.query(c.client.NS, tt.vip+":53", n)
		if u.Errors > 0 || u.Peers[tt.sees] != n {
			t.Errorf("%s, UDP: backends saw %v, %d errors (%s); want %d queries seen from %s", tt.name, u.Peers, u.Errors, u.FirstError, n, tt.sees)
		}
	}

	mfs := c.scrapeMetrics()
	for _, tt := range []struct {
		service, port, reason string
		want                  float64
	}{
		{"default/same", "http", "same_segment", n},
		{"default/same", "dns", "same_segment", n}, // a flow per query
		{"default/same", "http", "no_reply", 0},
		{"default/routed", "http", "", 0},
		{"default/routed", "dns", "", 0},
	} {
		labels := map[string]string{"service": tt.service, "port": tt.port}
		if tt.reason != "" {
			labels["reason"] = tt.reason
		}
		if got, _ := promtest.Sum(mfs["uproxy_source_ip_fallbacks_total"], labels); got != tt.want {
			t.Errorf("uproxy_source_ip_fallbacks_total%v = %v, want %v", labels, got, tt.want)
		}
	}
	if got := strings.Count(c.up.Output(), "the client's address cannot be kept for this backend"); got != 1 {
		t.Errorf("the fallback was logged %d times, want once for the service:\n%s", got, c.up.Output())
	}
}
