package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testwait"
)

// TestE2ENoEndpointsRefused checks that a service port without endpoints
// refuses new connections in the kernel, as kube-proxy's REJECT does (and
// Kubernetes' e2e spec "should be rejected when no endpoints exist"
// expects): the client's connect fails with "connection refused", where a
// listener would complete the handshake and then reset it. A UDP port's
// queries are refused too (ICMP port unreachable), and their node ports.
// In both modes. Once the service has an endpoint it is served again.
func TestE2ENoEndpointsRefused(t *testing.T) {
	for _, mode := range []string{"redirect", "tproxy"} {
		t.Run(mode, func(t *testing.T) {
			c := newCluster(t, 1)
			pod := c.pods[0]
			empty := `apiVersion: v1
kind: Service
metadata: {name: empty}
spec:
  type: NodePort
  clusterIP: 10.96.0.30
  ports:
  - {name: http, port: 80, targetPort: 8080, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30053}
`
			c.write("empty.yaml", empty)
			// Its port is the refused node port: only the node port is
			// refused, not every connection that was sent to that port.
			c.write("web.yaml", serviceYAML("web", "10.96.0.10", 30080, nil, false, pod))
			c.start(0, "--mode", mode, "--cluster-cidr", "10.244.0.0/16")
			c.waitSynced()

			node := "http://10.244.0.1:30080/" // the node's bridge address

			// One try each: the kernel sends a peer at most a burst of
			// six ICMP errors before it rate-limits them.
			for _, ns := range []string{c.client.NS, c.lab.Node} {
				if r := c.get(ns, "http://10.96.0.10:30080/", 2, "--timeout", "3s"); r.Counts[pod.Name] != 2 {
					t.Errorf("the service with an endpoint, from %s: %+v; want 2 answers", ns, r)
				}
				for _, url := range []string{"http://10.96.0.30/", node} {
					if r := c.get(ns, url, 1, "--timeout", "3s"); r.Errors != 1 || !strings.Contains(r.FirstError, "connection refused") {
						out, _ := c.lab.Exec(t.Context(), c.lab.Node, "iptables-save", "-c")
						t.Errorf("%s without endpoints, from %s: %+v; want every connection refused; the node's rules:\n%s", url, ns, r, out)
					}
				}
				for _, addr := range []string{"10.96.0.30:53", "10.244.0.1:30053"} {
					// The node's own datagram is refused in OUTPUT, so its
					// send fails, as with kube-proxy's REJECT.
					refused := func(err string) bool {
						return strings.Contains(err, "connection refused") || ns == c.lab.Node && strings.Contains(err, "operation not permitted")
					}
					if r := c.query(ns, addr, 1, "--timeout", "3s"); r.Errors != 1 || !refused(r.FirstError) {
						out, _ := c.lab.Exec(t.Context(), c.lab.Node, "iptables-save", "-c")
						t.Errorf("UDP %s without endpoints, from %s: %+v; want every query refused; the node's rules:\n%s", addr, ns, r, out)
					}
				}
			}

			c.write("empty-x.yaml", `apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: empty-x, labels: {kubernetes.io/service-name: empty}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- addresses: [`+fmt.Sprintf("%q", pod.IP)+`]
`)
			testwait.UntilOK(t, 10*time.Second, "the service to serve once it has an endpoint", func() (bool, string) {
				r := c.get(c.client.NS, "http://10.96.0.30/", 1, "--timeout", "3s")
				return r.Counts[pod.Name] == 1, fmt.Sprintf("%+v", r)
			})
			if r := c.get(c.client.NS, node, 2, "--timeout", "3s"); r.Counts[pod.Name] != 2 {
				t.Errorf("the node port once the service has an endpoint: %+v; want 2 answers", r)
			}
		})
	}
}
