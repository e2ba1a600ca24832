package testlab

import (
	"fmt"
	"net/netip"
)

// AddRoutedPod creates a pod namespace on its own veth to the node instead
// of the bridge, as a routed CNI (Calico, for one) attaches pods: the pod
// gets 10.244.K.2/24 and the node 10.244.K.1/24 on that veth, with K = 1
// for the first routed pod, 2 for the next, and so on (so at most 254 of
// them). The pod's default gateway is the node.
//
// Every packet between a routed pod and the bridged pods crosses the
// node's IP stack in both directions. Kernel NAT data paths need that: on
// a shared bridge, a DNATed connection's replies would go from the
// endpoint straight to the client, past the node's conntrack, and the
// client would drop them. The address stays inside the usual cluster CIDR
// (10.244.0.0/16), so proxies configured with it treat the pod as local.
//
// The pod has no IPv6 address (Pod.IP6 is the zero Addr).
func (l *Lab) AddRoutedPod(name string) (*Pod, error) {
	k := 1
	for _, p := range l.pods {
		if b := p.IP.As4(); p.IP.Is4() && b[0] == 10 && b[1] == 244 && b[2] >= byte(k) {
			k = int(b[2]) + 1
		}
	}
	if k > 254 {
		return nil, fmt.Errorf("adding routed pod %s: no free 10.244.K.0/24 subnet", name)
	}
	p := &Pod{
		Name: name,
		NS:   fmt.Sprintf("uplab-%s-%s", name, l.id),
		IP:   netip.AddrFrom4([4]byte{10, 244, byte(k), 2}),
	}
	gw := netip.AddrFrom4([4]byte{10, 244, byte(k), 1})
	if err := l.addNS(p.NS); err != nil {
		return nil, err
	}
	host := fmt.Sprintf("vr%d", k)
	err := l.run(
		[]string{"ip", "-n", l.Node, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", p.NS},
		[]string{"ip", "-n", l.Node, "addr", "add", gw.String() + "/24", "dev", host},
		[]string{"ip", "-n", l.Node, "link", "set", host, "up"},
		[]string{"ip", "-n", p.NS, "addr", "add", p.IP.String() + "/24", "dev", "eth0"},
		[]string{"ip", "-n", p.NS, "link", "set", "eth0", "up"},
		[]string{"ip", "-n", p.NS, "route", "add", "default", "via", gw.String()},
	)
	if err != nil {
		return nil, fmt.Errorf("adding routed pod %s: %w", name, err)
	}
	l.pods[name] = p
	return p, nil
}
