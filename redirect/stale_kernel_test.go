package redirect

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testlab"
	"golang.org/x/sys/unix"
)

// The tests in this file leave a UDP flow that kube-proxy's DNAT sent to
// a pod in the node's conntrack table, as a swap from kube-proxy does,
// then install the proxy's rules and check that the flow reaches the
// listener once StaleConntrack has cleaned, and not before.

// The ports of the stale-entry tests.
const (
	staleClientPort  = 33053 // the client's, the same for every datagram
	stalePodPort     = 5353  // the backend pod's, kube-proxy's DNAT target
	staleRedirectUDP = 40000 // the listener's in redirect mode
)

// udpFromPort sends one datagram from port src of namespace ns to dst and
// returns the answer, or noReply. Each call binds the same port, so that
// conntrack sees one flow.
func udpFromPort(t *testing.T, ns string, f Family, src uint16, dst netip.AddrPort) string {
	t.Helper()
	var c *net.UDPConn
	if err := testlab.DoInNetns(ns, func() (err error) {
		c, err = net.DialUDP(network(UDP, f), &net.UDPAddr{Port: int(src)}, net.UDPAddrFromAddrPort(dst))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		t.Fatalf("UDP from %s port %d to %s: %v", ns, src, dst, err)
	}
	b := make([]byte, 1500)
	n, err := c.Read(b)
	var ne net.Error
	switch {
	case err == nil:
		return strings.TrimSpace(string(b[:n]))
	case errors.Is(err, syscall.ECONNREFUSED), errors.As(err, &ne) && ne.Timeout():
		return noReply
	}
	t.Fatalf("UDP from %s port %d to %s: %v", ns, src, dst, err)
	return ""
}

// expectFromPort is udpFromPort, which it tries once more after no
// reply (a datagram may be lost on a busy machine), checked against want.
func expectFromPort(t *testing.T, what, ns string, f Family, dst netip.AddrPort, want string) {
	t.Helper()
	got := udpFromPort(t, ns, f, staleClientPort, dst)
	if got == noReply && want != noReply {
		t.Logf("%s: no answer; trying once more", what)
		got = udpFromPort(t, ns, f, staleClientPort, dst)
	}
	if got != want {
		t.Errorf("%s: UDP from %s port %d to %s: got %q, want %q", what, ns, staleClientPort, dst, got, want)
	}
}

// kubeProxyDNAT adds to the node's nat PREROUTING the DNAT that
// kube-proxy's iptables mode renders for a UDP service: vip to pod.
func kubeProxyDNAT(tl *trafficLab, f Family, vip, pod netip.AddrPort) {
	tl.t.Helper()
	tl.exec(tl.lab.Node, f.command(""), "-t", "nat", "-A", "PREROUTING", "-d", vip.Addr().String(), "-p", "udp", "--dport", fmt.Sprint(vip.Port()),
		"-m", "comment", "--comment", "kube-proxy's DNAT", "-j", "DNAT", "--to-destination", pod.String())
}

// newNodeStaleConntrack returns a StaleConntrack of the node
// namespace's conntrack table.
func newNodeStaleConntrack(t *testing.T, node string, nodePortAddresses []netip.Prefix) *StaleConntrack {
	t.Helper()
	var table *NetlinkConntrack
	if err := testlab.DoInNetns(node, func() (err error) {
		table, err = NewNetlinkConntrack()
		return err
	}); errors.Is(err, unix.EPROTONOSUPPORT) {
		t.Skipf("skipping: the kernel has no NETLINK_NETFILTER: %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(table.Close)
	s, err := NewStaleConntrack(StaleConntrackConfig{Table: table, NodePortAddresses: nodePortAddresses})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestKernelStaleConntrackRedirect checks redirect mode: a UDP flow that
// kube-proxy's DNAT sent to a pod keeps going there after the proxy's
// REDIRECT is installed, until StaleConntrack deletes its entry; the next
// datagram from the same client port then reaches the listener, and a
// second clean deletes nothing: neither the listener's flow nor the
// pod's own flows.
func TestKernelStaleConntrackRedirect(t *testing.T) {
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			tl := newTrafficLab(t, 2)
			client, backend, node := tl.pods[0], tl.pods[1], tl.lab.Node
			vip := ap(tproxyDNS[f], 53)
			pod := ap(podAddr(backend, f), stalePodPort)
			tl.serve(backend.NS, f, UDP, stalePodPort, "pod")
			tl.serve(node, f, UDP, staleRedirectUDP, "uproxy")
			kubeProxyDNAT(tl, f, vip, pod)
			expectFromPort(t, "kube-proxy's DNAT", client.NS, f, vip, "pod")
			// A flow that is no service's: a clean leaves it alone.
			if got := udpFromPort(t, client.NS, f, staleClientPort+1, pod); got != "pod" {
				t.Fatalf("UDP straight to the pod: got %q, want %q", got, "pod")
			}

			claims := []Intercept{{Comment: "kube-system/dns:dns", Protocol: UDP, Dest: vip.Addr(), Port: vip.Port(), ToPort: staleRedirectUDP}}
			tl.apply(f, ServiceRules(claims, ServiceOptions{}))
			expectFromPort(t, "the proxy's rules, before the clean: the flow's entry keeps the DNAT", client.NS, f, vip, "pod")

			s := newNodeStaleConntrack(t, node, nil)
			s.Trigger(claims, []Family{f}, false)
			if n := s.cleanPending(); n != 1 {
				t.Errorf("the clean deleted %d entries, want 1 (kube-proxy's)", n)
			}
			expectFromPort(t, "after the clean", client.NS, f, vip, "uproxy")
			s.Trigger(claims, []Family{f}, true)
			if n := s.cleanPending(); n != 0 {
				t.Errorf("a second clean deleted %d entries, want none: the flow is the listener's now", n)
			}
			expectFromPort(t, "after the second clean", client.NS, f, vip, "uproxy")
			if got := udpFromPort(t, client.NS, f, staleClientPort+1, pod); got != "pod" {
				t.Errorf("UDP straight to the pod, after the cleans: got %q, want %q", got, "pod")
			}

			// The service is removed: its flow's entry, the REDIRECT to
			// the listener, goes with it, and the next datagram meets
			// the rules as they are (kube-proxy's DNAT, here).
			tl.apply(f, ServiceRules(nil, ServiceOptions{}))
			s.Trigger(nil, []Family{f}, false)
			if n := s.cleanPending(); n != 1 {
				t.Errorf("the clean after the service's removal deleted %d entries, want 1 (the listener's)", n)
			}
			expectFromPort(t, "after the service's removal", client.NS, f, vip, "pod")
		})
	}
}

// TestKernelStaleConntrackTProxy is TestKernelStaleConntrackRedirect in
// tproxy mode, where the listener's flows have no destination NAT. TPROXY
// in mangle PREROUTING does not keep nat PREROUTING from running for a
// new flow, so kube-proxy's DNAT is removed first, as `uproxy cleanup
// --kube-proxy` does; its flow's entry stays. The backend is the external
// host, which the node routes to: the tproxy lab's bridge does not show
// the node a pod's replies to another pod, which the DNAT needs to see.
func TestKernelStaleConntrackTProxy(t *testing.T) {
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			tl := newTProxyLab(t, f, 1, false)
			client, backend, node := tl.pods[0], tl.external, tl.lab.Node
			vip := ap(tproxyDNS[f], 53)
			pod := ap(podAddr(backend, f), stalePodPort)
			tl.serve(backend.NS, f, UDP, stalePodPort, "pod")
			kubeProxyDNAT(tl.trafficLab, f, vip, pod)
			expectFromPort(t, "kube-proxy's DNAT", client.NS, f, vip, "pod")
			tl.exec(node, f.command(""), "-t", "nat", "-D", "PREROUTING", "-d", vip.Addr().String(), "-p", "udp", "--dport", fmt.Sprint(vip.Port()),
				"-m", "comment", "--comment", "kube-proxy's DNAT", "-j", "DNAT", "--to-destination", pod.String())

			claims := []Intercept{{Comment: "kube-system/dns:dns", Protocol: UDP, Dest: vip.Addr(), Port: vip.Port(), ToPort: tproxyUDPPort}}
			tl.syncTProxy(ServiceRules(claims, ServiceOptions{TProxy: &TProxy{}}))
			listener := wantUDP(vip, podAddr(client, f))
			if got := udpFromPort(t, client.NS, f, staleClientPort, vip); got == listener {
				t.Fatalf("the proxy's rules, before the clean: the flow reached the listener already (%q); the test shows nothing", got)
			} else {
				t.Logf("the proxy's rules, before the clean: got %q", got)
			}

			s := newNodeStaleConntrack(t, node, nil)
			s.Trigger(claims, []Family{f}, false)
			if n := s.cleanPending(); n != 1 {
				t.Errorf("the clean deleted %d entries, want 1 (kube-proxy's)", n)
			}
			expectFromPort(t, "after the clean", client.NS, f, vip, listener)
			s.Trigger(claims, []Family{f}, true)
			if n := s.cleanPending(); n != 0 {
				t.Errorf("a second clean deleted %d entries, want none: the flow is the listener's now", n)
			}
			expectFromPort(t, "after the second clean", client.NS, f, vip, listener)
		})
	}
}
