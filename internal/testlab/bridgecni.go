package testlab

import (
	"fmt"
	"net/netip"
)

// BridgeCNI makes the node one that a bridge CNI (flannel, k3s's default,
// the bridge plugin, kubenet) has set up: br_netfilter
// hands the bridge's frames to iptables and ip6tables (both
// net.bridge.bridge-nf-call-* sysctls at 1, which NetworkPolicy engines
// and kube-proxy's hairpin need), the filter table's FORWARD chain drops
// by default and accepts the cluster's traffic, as flannel's FLANNEL-FWD
// rules do for a policy engine that lets pods talk, and pods' traffic to
// anything but pods is masqueraded, as flannel's FLANNEL-POSTRTG does.
// Use it with Options.Bridge "cni0". It fails when br_netfilter is not
// available in the kernel.
func (l *Lab) BridgeCNI() error {
	cmds := [][]string{
		{"ip", "netns", "exec", l.Node, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1", "net.bridge.bridge-nf-call-ip6tables=1"},
	}
	for _, ipt := range []struct{ cmd, pods string }{{"iptables", "10.244.0.0/16"}, {"ip6tables", "2001:db8:244::/48"}} {
		cmds = append(cmds,
			[]string{"ip", "netns", "exec", l.Node, ipt.cmd, "-P", "FORWARD", "DROP"},
			[]string{"ip", "netns", "exec", l.Node, ipt.cmd, "-A", "FORWARD", "-s", ipt.pods, "-m", "comment", "--comment", "network policy stand-in", "-j", "ACCEPT"},
			[]string{"ip", "netns", "exec", l.Node, ipt.cmd, "-A", "FORWARD", "-d", ipt.pods, "-m", "comment", "--comment", "network policy stand-in", "-j", "ACCEPT"},
			[]string{"ip", "netns", "exec", l.Node, ipt.cmd, "-t", "nat", "-A", "POSTROUTING", "-s", ipt.pods, "!", "-d", ipt.pods, "-m", "comment", "--comment", "flannel masq stand-in", "-j", "MASQUERADE"},
		)
	}
	if err := l.run(cmds...); err != nil {
		return fmt.Errorf("making the node a bridge CNI's: %w", err)
	}
	return nil
}

// AddRemotePod creates a pod on a second node: the first call creates
// that node's namespace, linked to this node by a veth (198.51.100.1/30
// here, .2 there; 2001:db8:51::1 and ::2) with its own pod bridge
// (10.244.2.1/24, 2001:db8:244:2::1/64), a route to it here and a default
// route back. Its pods get 10.244.2.10, .11, … and 2001:db8:244:2::a, …,
// with the second node as gateway: their traffic to this node's pods and
// services is routed to this node over the link, as between two nodes of
// a flannel cluster (host-gw).
func (l *Lab) AddRemotePod(name string) (*Pod, error) {
	if l.node2 == "" {
		ns := "uplab-node2-" + l.id
		if err := l.addNS(ns); err != nil {
			return nil, err
		}
		err := l.run(
			[]string{"ip", "-n", l.Node, "link", "add", "vn2", "type", "veth", "peer", "name", "eth0", "netns", ns},
			[]string{"ip", "-n", l.Node, "addr", "add", "198.51.100.1/30", "dev", "vn2"},
			[]string{"ip", "-n", l.Node, "addr", "add", "2001:db8:51::1/64", "dev", "vn2", "nodad"},
			[]string{"ip", "-n", l.Node, "link", "set", "vn2", "up"},
			[]string{"ip", "-n", ns, "addr", "add", "198.51.100.2/30", "dev", "eth0"},
			[]string{"ip", "-n", ns, "addr", "add", "2001:db8:51::2/64", "dev", "eth0", "nodad"},
			[]string{"ip", "-n", ns, "link", "set", "eth0", "up"},
			[]string{"ip", "-n", ns, "link", "add", "cni0", "type", "bridge"},
			[]string{"ip", "-n", ns, "addr", "add", "10.244.2.1/24", "dev", "cni0"},
			[]string{"ip", "-n", ns, "addr", "add", "2001:db8:244:2::1/64", "dev", "cni0", "nodad"},
			[]string{"ip", "-n", ns, "link", "set", "cni0", "up"},
			[]string{"ip", "-n", ns, "route", "add", "default", "via", "198.51.100.1"},
			[]string{"ip", "-n", ns, "-6", "route", "add", "default", "via", "2001:db8:51::1"},
			[]string{"ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"},
			[]string{"ip", "-n", l.Node, "route", "add", "10.244.2.0/24", "via", "198.51.100.2"},
			[]string{"ip", "-n", l.Node, "-6", "route", "add", "2001:db8:244:2::/64", "via", "2001:db8:51::2"},
		)
		if err != nil {
			return nil, fmt.Errorf("adding the second node: %w", err)
		}
		l.node2 = ns
	}
	n := l.nextNode + 10
	l.nextNode++
	p := &Pod{
		Name: name,
		NS:   fmt.Sprintf("uplab-%s-%s", name, l.id),
		IP:   netip.AddrFrom4([4]byte{10, 244, 2, byte(n)}),
		IP6:  netip.MustParseAddr(fmt.Sprintf("2001:db8:244:2::%x", n)),
	}
	if err := l.addNS(p.NS); err != nil {
		return nil, err
	}
	host := fmt.Sprintf("vq%d", n)
	err := l.run(
		[]string{"ip", "-n", l.node2, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", p.NS},
		[]string{"ip", "-n", l.node2, "link", "set", host, "master", "cni0", "up"},
		[]string{"ip", "-n", p.NS, "addr", "add", p.IP.String() + "/24", "dev", "eth0"},
		[]string{"ip", "-n", p.NS, "addr", "add", p.IP6.String() + "/64", "dev", "eth0", "nodad"},
		[]string{"ip", "-n", p.NS, "link", "set", "eth0", "up"},
		[]string{"ip", "-n", p.NS, "route", "add", "default", "via", "10.244.2.1"},
		[]string{"ip", "-n", p.NS, "-6", "route", "add", "default", "via", "2001:db8:244:2::1"},
	)
	if err != nil {
		return nil, fmt.Errorf("adding remote pod %s: %w", name, err)
	}
	l.pods[name] = p
	return p, nil
}

// Node2 is the second node's namespace (AddRemotePod creates it), or
// empty. Its addresses are 198.51.100.2 on the link to this node and
// 10.244.2.1 on its pod bridge.
func (l *Lab) Node2() string { return l.node2 }
