package main

import (
	"fmt"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/promtest"
	"github.com/uproxy/uproxy/internal/testwait"
)

// TestE2ESelfInterception makes a self-intercepting Service: a tenant's
// externalIPs holds its own pod's address, with port equal to targetPort,
// so that the node intercepts the pod's own address. Before the first
// fix, each connection to it went round the proxy until descriptors ran
// out. Now, in both modes:
//   - a connection to the intercepted address reaches the pod after one
//     hop, as with kube-proxy: the proxy's own connections (marked) are
//     not intercepted, and the pod's address ends at its node;
//   - another Service whose endpoint is that pod reaches it, once per
//     request;
//   - the proxy's descriptors stay bounded.
func TestE2ESelfInterception(t *testing.T) {
	for _, mode := range []string{"redirect", "tproxy"} {
		t.Run(mode, func(t *testing.T) {
			c := newCluster(t, 1)
			pod := c.pods[0]
			c.serveUDP(pod)
			// A client routed through the node: bridged pods reach each
			// other past iptables in tproxy mode (bridge-nf-call off).
			rpod, err := c.lab.AddRoutedPod("rpod")
			if err != nil {
				t.Fatal(err)
			}
			c.write("loop.yaml", fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: loop}
spec:
  clusterIP: 10.96.0.20
  externalIPs: [%[1]q]
  ports:
  - {name: http, port: 8080, targetPort: 8080}
  - {name: dns, port: 5353, protocol: UDP, targetPort: 5353}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: loop-x, labels: {kubernetes.io/service-name: loop}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints:
- addresses: [%[1]q]
---
apiVersion: v1
kind: Service
metadata: {name: via}
spec:
  clusterIP: 10.96.0.21
  ports:
  - {name: http, port: 80, targetPort: 8080}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: via-x, labels: {kubernetes.io/service-name: via}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints:
- addresses: [%[1]q]
`, pod.IP))
			if mode == "tproxy" {
				// As in TestE2EModes: the lab stands for a routed CNI.
				if _, err := c.lab.Exec(t.Context(), c.lab.Node, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0", "net.bridge.bridge-nf-call-ip6tables=0"); err != nil {
					t.Logf("cannot turn bridge-nf-call-iptables off (br_netfilter not loaded?): %v", err)
				}
			}
			c.start(0, "--mode", mode, "--cluster-cidr", "10.244.0.0/16")
			c.waitSynced()
			pid := c.upPID()
			before := countFDs(t, pid)

			clients := []string{c.client.NS, rpod.NS, c.lab.Node}
			for _, ns := range clients {
				if r := c.get(ns, "http://10.96.0.21/", 5, "--timeout", "3s"); r.Errors > 0 || r.Counts[pod.Name] != 5 {
					t.Errorf("the other Service from %s: %+v; want 5 answers from %s", ns, r, pod.Name)
				}
				if r := c.query(ns, "10.96.0.21:53", 5, "--timeout", "2s"); r.Errors > 0 || r.Counts[pod.Name] != 5 {
					t.Errorf("the other Service over UDP from %s: %+v; want 5 answers from %s", ns, r, pod.Name)
				}
			}
			for _, ns := range clients[1:] {
				if r := c.get(ns, fmt.Sprintf("http://%s:8080/", pod.IP), 5, "--timeout", "3s"); r.Errors > 0 || r.Counts[pod.Name] != 5 {
					t.Errorf("the intercepted pod address from %s: %+v; want 5 answers from %s, one hop", ns, r, pod.Name)
				}
				if r := c.query(ns, fmt.Sprintf("%s:5353", pod.IP), 5, "--timeout", "2s"); r.Errors > 0 || r.Counts[pod.Name] != 5 {
					t.Errorf("the intercepted pod address over UDP from %s: %+v; want 5 answers from %s, one hop", ns, r, pod.Name)
				}
			}
			// A loop held two descriptors per hop; the requests above,
			// done, hold none once their sockets are closed.
			testwait.UntilOK(t, 5*time.Second, "uproxy's descriptors to return to their count before the requests", func() (bool, string) {
				after := countFDs(t, pid)
				return after <= before+20, fmt.Sprintf("%d descriptors, %d before the requests", after, before)
			})
			if out := c.up.Output(); strings.Contains(out, "refusing an endpoint") {
				t.Errorf("uproxy refused an endpoint:\n%s", out)
			}
		})
	}
}

// TestE2EListenerPortNotSquatted kills uproxy (SIGKILL: its rules and sets
// stay, its ports come free) and binds its listener port with another
// local process: the Service's clients get no answer from it. In
// redirect mode UPROXY-LISTENERS refuses them; in tproxy mode TPROXY
// drops what no transparent socket takes.
func TestE2EListenerPortNotSquatted(t *testing.T) {
	for _, mode := range []string{"redirect", "tproxy"} {
		t.Run(mode, func(t *testing.T) {
			c := newCluster(t, 1)
			c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
			if mode == "tproxy" {
				if _, err := c.lab.Exec(t.Context(), c.lab.Node, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0", "net.bridge.bridge-nf-call-ip6tables=0"); err != nil {
					t.Logf("cannot turn bridge-nf-call-iptables off (br_netfilter not loaded?): %v", err)
				}
				c.start(0, "--mode", mode)
			} else {
				c.start(1)
			}
			c.waitSynced()
			if r := c.get(c.client.NS, "http://10.96.0.10/", 3); r.Errors > 0 {
				t.Fatalf("before the kill: %+v", r)
			}
			var port string
			if mode == "tproxy" {
				out, err := c.lab.Exec(t.Context(), c.lab.Node, "iptables-save", "-t", "mangle")
				if err != nil {
					t.Fatal(err)
				}
				for line := range strings.Lines(out) {
					if _, rest, ok := strings.Cut(line, "-d 10.96.0.10/32 "); ok {
						if _, p, ok := strings.Cut(rest, "--on-port "); ok {
							port, _, _ = strings.Cut(p, " ")
						}
					}
				}
				if port == "" {
					t.Fatalf("no TPROXY rule for 10.96.0.10:\n%s", out)
				}
			} else {
				port = listenerPort(t, c.natRules(), "10.96.0.10/32")
			}
			if err := c.up.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			c.up.Wait(5 * time.Second)
			squatter, err := c.lab.Start(c.lab.Node, "squatter", c.bench, "serve", "--name", "squatter", "--listen", ":"+port)
			if err != nil {
				t.Fatal(err)
			}
			testwait.UntilOK(t, 5*time.Second, "the squatter to listen on port "+port, func() (bool, string) {
				if squatter.Exited() {
					t.Fatalf("the squatter exited:\n%s", squatter.Output())
				}
				out, err := c.lab.Exec(t.Context(), c.lab.Node, "ss", "-Hltn", "sport = :"+port)
				return err == nil && strings.TrimSpace(out) != "", squatter.Output()
			})
			for _, ns := range []string{c.client.NS, c.lab.Node} {
				if r := c.get(ns, "http://10.96.0.10/", 3, "--timeout", "2s"); r.Errors != 3 || r.Counts["squatter"] > 0 {
					t.Errorf("the Service from %s after the kill: %+v; want 3 failures, none answered by the squatter", ns, r)
				}
			}
		})
	}
}

// TestE2EListenersWithinDescriptorLimit serves 700 Services from a uproxy
// whose open-files limit is 600: more service ports than descriptors.
// Before, listeners took every descriptor, iptables-restore could not
// start, and no rule was written for any Service. Now the listeners stop
// at the budget (--max-listeners' default: 600 less 300 kept free), the
// Services within it are programmed and answer, and the others are
// counted and said in one line.
func TestE2EListenersWithinDescriptorLimit(t *testing.T) {
	prlimit, err := exec.LookPath("prlimit")
	if err != nil {
		t.Skip("skipping: no prlimit to give uproxy a small open-files limit")
	}
	const services, budget = 700, 300
	c := newCluster(t, 1)
	var m strings.Builder
	for i := range services {
		if i > 0 {
			m.WriteString("---\n")
		}
		m.WriteString(serviceYAML(fmt.Sprintf("s%03d", i), fmt.Sprintf("10.96.%d.%d", 1+i/250, 1+i%250), 80, nil, false, c.pods[0]))
	}
	c.write("many.yaml", m.String())
	c.launcher = []string{prlimit, "--nofile=600:600"}
	// Every Service is in one namespace: without a quota for it, which
	// would keep an eighth of the budget for other namespaces, the budget
	// alone stops the listeners.
	c.start(budget, "--metrics-bind-address", metricsAddr, "--max-listeners-per-namespace=-1")
	if !strings.Contains(c.up.Output(), `"limit": 600`) {
		// A process with CAP_SYS_RESOURCE raises its hard limit, and then
		// every listener fits: the budget is not what is tested.
		t.Skipf("skipping: uproxy raised its open-files limit past prlimit's:\n%s", tailLines(c.up.Output(), 5))
	}
	rules := c.natRules()
	vip := regexp.MustCompile(`-d (10\.96\.\d+\.\d+)/32 `).FindStringSubmatch(rules)
	if vip == nil {
		t.Fatalf("no service rule:\n%s", rules)
	}
	if r := c.get(c.client.NS, "http://"+vip[1]+"/", 3); r.Errors > 0 {
		t.Errorf("GET %s: %d errors (%s)", vip[1], r.Errors, r.FirstError)
	}
	without := func() float64 {
		n, _ := promtest.Sum(c.scrapeMetrics()["uproxy_service_ports_without_listener"], map[string]string{"ip_family": "IPv4"})
		return n
	}
	testwait.UntilOK(t, 10*time.Second, fmt.Sprintf("uproxy_service_ports_without_listener = %d", services-budget), func() (bool, string) {
		n := without()
		return n == float64(services-budget), fmt.Sprint(n)
	})
	out := c.up.Output()
	if !strings.Contains(out, "the listener budget is spent") {
		t.Errorf("no line says the listener budget is spent:\n%s", tailLines(out, 20))
	}
	if strings.Contains(out, "syncing rules failed") {
		t.Errorf("a rules write failed:\n%s", tailLines(out, 20))
	}
}
