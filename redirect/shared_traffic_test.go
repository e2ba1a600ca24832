package redirect

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// TestTrafficShared checks the shared layout end to end: connections from
// a pod and from the node to every service address and port in the set,
// and to a node port, reach the one listener of their family and
// protocol; a port of a service address that is not in the set does
// not; a service added by an incremental Sync (a set member, no rule) is
// reached at once, a removed one no longer; a LoadBalancer address with
// source ranges lets the allowed pod in and drops the other; and the
// listener cannot be reached directly.
func TestTrafficShared(t *testing.T) {
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			tl := newTrafficLab(t, 2)
			allowed, denied, node := tl.pods[0], tl.pods[1], tl.lab.Node
			addr := func(s4, s6 string) netip.Addr {
				if f == IPv6 {
					return netip.MustParseAddr(s6)
				}
				return netip.MustParseAddr(s4)
			}
			web, api, added := addr("10.96.0.10", "2001:db8:96::10"), addr("10.96.0.11", "2001:db8:96::11"), addr("10.96.0.12", "2001:db8:96::12")
			lbIP := addr("10.96.200.1", "2001:db8:96::c8:1")
			tcp, udp := sharedPort(f, TCP), sharedPort(f, UDP)
			tl.serve(node, f, TCP, tcp, "shared")
			r := Rules{
				Shared: true,
				Intercepts: []InterceptRule{
					{Comment: "default/web:http", Protocol: TCP, Dest: web, Port: 80, ToPort: tcp},
					{Comment: "default/api:grpc", Protocol: TCP, Dest: api, Port: 9000, ToPort: tcp},
					{Comment: "default/lb:https", Protocol: TCP, Dest: lbIP, Port: 443, ToPort: tcp},
				},
				NodePorts: []NodePort{np("default/web:http", f, TCP, 30080, tcp)},
				Firewalls: []Firewall{{Comment: "default/lb:https", Protocol: TCP, Dest: lbIP, Port: 443,
					Allow: []netip.Prefix{netip.PrefixFrom(podAddr(allowed, f), f.hostBits())}}},
				Listeners: []Listener{{f, TCP, tcp}},
			}
			if f == IPv4 {
				tl.serve(node, f, UDP, udp, "shared-udp")
				r.Intercepts = append(r.Intercepts, InterceptRule{Comment: "kube-system/kube-dns:dns", Protocol: UDP, Dest: web, Port: 53, ToPort: udp})
				r.Listeners = append(r.Listeners, Listener{f, UDP, udp})
			}
			tl.apply(f, r)

			tl.expect("service from a pod", allowed.NS, TCP, ap(web, 80), "shared")
			tl.expect("another service from a pod", allowed.NS, TCP, ap(api, 9000), "shared")
			tl.expect("service from the node", node, TCP, ap(api, 9000), "shared")
			tl.expect("node port from a pod", allowed.NS, TCP, ap(nodeAddr[f], 30080), "shared")
			if f == IPv4 {
				tl.expect("UDP service from a pod", allowed.NS, UDP, ap(web, 53), "shared-udp")
			}
			// The set matches address, protocol and port together.
			if got := tl.dial(allowed.NS, TCP, ap(web, 9000)); got == "shared" {
				t.Errorf("a port of a service address that is not in the set was redirected")
			}
			tl.expect("listener directly from a pod", allowed.NS, TCP, ap(nodeAddr[f], tcp), timedOut)
			tl.expect("LoadBalancer from an allowed pod", allowed.NS, TCP, ap(lbIP, 443), "shared")
			tl.expect("LoadBalancer from another pod", denied.NS, TCP, ap(lbIP, 443), timedOut)

			// A service added and one removed: set members only.
			changed := r
			changed.Intercepts = append(slices.Clone(r.Intercepts[1:]), InterceptRule{Comment: "default/new:http", Protocol: TCP, Dest: added, Port: 8080, ToPort: tcp})
			res, err := tl.sync[f].Sync(context.Background(), changed, false)
			if err != nil {
				t.Fatal(err)
			}
			if res.Wrote || res.SetMembersWritten != 2 {
				t.Errorf("a service added and one removed: Sync = %+v, want set members only, 2 written", res)
			}
			tl.expect("added service from a pod", denied.NS, TCP, ap(added, 8080), "shared")
			if got := tl.dial(allowed.NS, TCP, ap(web, 80)); got == "shared" {
				t.Errorf("a removed service is still redirected")
			}
			tl.expect("unchanged service from a pod", denied.NS, TCP, ap(api, 9000), "shared")
		})
	}
}

// TestTrafficTProxyShared checks the shared layout in tproxy mode: pods'
// and the node's connections and datagrams to the services in the set,
// and to node ports, reach the loopback listener of their protocol with
// their original destination; the LoadBalancer address lets only its
// allowed source in.
func TestTrafficTProxyShared(t *testing.T) {
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			tl := newTProxyLab(t, f, 2, false)
			pod, other, node := tl.pods[0], tl.pods[1], tl.lab.Node
			podIP, otherIP, nodeIP := podAddr(pod, f), podAddr(other, f), nodeAddr[f]
			vip, dns, lb := ap(tproxyVIP[f], 80), ap(tproxyDNS[f], 53), ap(tproxyLB[f], 443)
			api := ap(tproxyVIP[f], 9000)
			r := Rules{
				Shared: true,
				Intercepts: []InterceptRule{
					{Comment: "default/web:http", Protocol: TCP, Dest: vip.Addr(), Port: 80, ToPort: tproxyTCPPort},
					{Comment: "default/web:grpc", Protocol: TCP, Dest: api.Addr(), Port: 9000, ToPort: tproxyTCPPort},
					{Comment: "kube-system/dns:dns", Protocol: UDP, Dest: dns.Addr(), Port: 53, ToPort: tproxyUDPPort},
					{Comment: "default/lb:https", Protocol: TCP, Dest: lb.Addr(), Port: 443, ToPort: tproxyTCPPort},
				},
				NodePorts: []NodePort{
					np("default/web:http", f, TCP, 30080, tproxyTCPPort),
					np("kube-system/dns:dns", f, UDP, 30053, tproxyUDPPort),
				},
				Firewalls: []Firewall{{Comment: "default/lb:https", Protocol: TCP, Dest: lb.Addr(), Port: 443,
					Allow: []netip.Prefix{netip.PrefixFrom(podIP, f.hostBits())}}},
			}
			tl.syncTProxy(r)

			tl.expect("VIP from a pod", pod.NS, TCP, vip, wantTCP(vip, podIP))
			tl.expect("another port of the VIP from another pod", other.NS, TCP, api, wantTCP(api, otherIP))
			tl.expect("VIP from the node", node, TCP, api, wantTCP(api, nodeIP))
			tl.expectUDP("UDP VIP from a pod", pod.NS, dns, wantUDP(dns, podIP))
			tl.expectUDP("UDP VIP from the node", node, dns, wantUDP(dns, nodeIP))
			tl.expect("node port from a pod", pod.NS, TCP, ap(nodeIP, 30080), wantTCP(ap(nodeIP, 30080), podIP))
			tl.expectUDP("UDP node port from a pod", pod.NS, ap(nodeIP, 30053), wantUDP(ap(nodeIP, 30053), podIP))
			tl.expectNotHandedOver("a port of the VIP that is not in the set", pod.NS, ap(tproxyVIP[f], 81))
			tl.expect("LB from the allowed pod", pod.NS, TCP, lb, wantTCP(lb, podIP))
			tl.expect("LB from a pod outside the source ranges", other.NS, TCP, lb, timedOut)

			if err := Cleanup(context.Background(), tl.cfg[f]); err != nil {
				t.Fatal(err)
			}
			tl.node(func() error { return DefaultRouting.Remove(f) })
			if sets := tl.exec(node, "ipset", "list", "-n"); sets != "" {
				t.Errorf("Cleanup left sets: %q", sets)
			}
			tl.expectNotHandedOver("VIP after Cleanup", pod.NS, vip)
		})
	}
}

// TestTrafficSharedRangeSparesTimeWait checks why the shared TCP listener
// has a range of ports in redirect mode (uproxy's sharedRedirectPorts): a
// pod connects to one service after another from the same source port,
// and the server closes each connection first, so the node holds each
// one's tuple in TIME_WAIT. With one listener port all of them would have
// the same tuple on the node, and the pod's next SYN would meet the last
// one's TIME_WAIT socket (or have its source port rewritten). With a
// range, the NAT gives each connection a listener port whose tuple is
// free: the node holds one TIME_WAIT socket per connection, each on its
// own listener port, all with the pod's own source port.
func TestTrafficSharedRangeSparesTimeWait(t *testing.T) {
	const services = 16
	tl := newTrafficLab(t, 1)
	pod, node := tl.pods[0], tl.lab.Node
	tcp := sharedPort(IPv4, TCP)
	r := Rules{Shared: true}
	for i := range uint16(services) {
		tl.serve(node, IPv4, TCP, tcp+i, "shared")
		r.Listeners = append(r.Listeners, Listener{IPv4, TCP, tcp + i})
		r.Intercepts = append(r.Intercepts, InterceptRule{Comment: fmt.Sprintf("default/s%d:http", i), Protocol: TCP,
			Dest: netip.AddrFrom4([4]byte{10, 96, 1, byte(i + 1)}), Port: 80, ToPort: tcp, ToPortEnd: tcp + services - 1})
	}
	tl.apply(IPv4, r)
	for _, i := range r.Intercepts {
		dest := netip.AddrPortFrom(i.Dest, i.Port)
		// Reading only (-u), the pod closes after the server.
		out := tl.exec(pod.NS, "socat", "-u", "-T3", fmt.Sprintf("TCP:%s,sourceport=40999,reuseaddr,connect-timeout=2", dest), "-")
		if strings.TrimSpace(out) != "shared" {
			t.Fatalf("%s from source port 40999: got %q", dest, out)
		}
	}
	// The node's TIME_WAIT sockets with the pod: listener port by the
	// pod's port.
	ports := map[uint16]int{}
	for line := range strings.Lines(tl.exec(node, "ss", "-tanH", "state", "time-wait")) {
		f := strings.Fields(line)
		if len(f) < 4 {
			continue
		}
		local, err1 := netip.ParseAddrPort(f[2])
		peer, err2 := netip.ParseAddrPort(f[3])
		if err1 != nil || err2 != nil {
			t.Fatalf("ss: %q", line)
		}
		if peer.Port() != 40999 {
			t.Errorf("a connection from source port 40999 reached the listener from port %d: the NAT rewrote it to spare a tuple in use", peer.Port())
			continue
		}
		ports[local.Port()]++
	}
	if len(ports) != services {
		t.Errorf("TIME_WAIT sockets with the pod's port 40999, by listener port: %v; want one on each of %d ports", ports, services)
	}
}
