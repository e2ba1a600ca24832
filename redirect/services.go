package redirect

import (
	"cmp"
	"net/netip"
	"slices"
)

// Intercept is one destination whose traffic a service port claims: the
// kernel is to send it to one of the proxy's listeners. It is the
// proxier's Intercept in this package's terms; ServiceRules turns a list
// of them into Rules, whose InterceptRules are what the kernel is told.
type Intercept struct {
	// Comment names the service port, e.g. "default/web:http"; it becomes
	// the comment of the claim's rules.
	Comment string
	// NodePort, when true, claims Port on the node's own addresses of
	// Dest's family, as far as ServiceOptions.NodePortAddresses admits
	// them; only Dest's family counts (the proxier passes the family's
	// unspecified address). When false, the claim is Dest:Port exactly: a
	// ClusterIP, an external IP or a load-balancer IP.
	NodePort bool
	// Protocol is TCP or UDP.
	Protocol Protocol
	// Dest is the destination address. An IPv4-mapped IPv6 address
	// counts as IPv4.
	Dest netip.Addr
	// Port is the service port, or the node port.
	Port uint16
	// ToPort and ToPortEnd are the listener's port or ports, as in
	// InterceptRule.
	ToPort, ToPortEnd uint16
	// Reject, when true, refuses the claim's new connections: the service
	// port has no endpoint (see Reject).
	Reject bool
	// SourceRanges, when not empty, are the only sources that may reach
	// Dest:Port (a load balancer's loadBalancerSourceRanges): the claim
	// gets a Firewall. Empty lets every source in. A node port ignores
	// them.
	SourceRanges []netip.Prefix
}

// ServiceOptions are the choices that ServiceRules copies into the
// Rules it returns. The zero value is redirect mode in the per-service
// layout, with node ports on every local address but loopback.
type ServiceOptions struct {
	// NodePortAddresses is Rules.NodePortAddresses.
	NodePortAddresses []netip.Prefix
	// LocalhostNodePorts is Rules.LocalhostNodePorts.
	LocalhostNodePorts bool
	// Shared is Rules.Shared: the claims of one family and protocol all
	// name one listener.
	Shared bool
	// TProxy is Rules.TProxy; nil selects redirect mode.
	TProxy *TProxy
	// Replies is Rules.Replies.
	Replies *Replies
}

// claimKey identifies the traffic an Intercept catches: two claims with the
// same key conflict. An exact destination and a node port never share a
// key (a node port's addr is its family's unspecified address), but
// exact destinations conflict whatever kind of address each service
// gives them (one's ClusterIP, another's external IP).
type claimKey struct {
	nodePort bool
	addr     netip.Addr
	proto    Protocol
	port     uint16
}

func (c Intercept) key() claimKey {
	k := claimKey{nodePort: c.NodePort, addr: c.Dest.Unmap(), proto: c.Protocol, port: c.Port}
	if c.NodePort {
		k.addr = netip.IPv4Unspecified()
		if familyOf(c.Dest.Unmap()) == IPv6 {
			k.addr = netip.IPv6Unspecified()
		}
	}
	return k
}

// ServiceRules returns the Rules that send the traffic of each claim to
// its listener: an InterceptRule per exact destination, with a Firewall when
// it has source ranges; a NodePort per node port, of the claim's family;
// a Reject besides either for a claim that Reject marks; and a Listener for every port of every listener, of the claim's
// family, sorted by family, protocol and port. In tproxy mode the
// listeners get no Listener guard: they listen on loopback, which no
// other host can reach.
//
// Two claims may catch the same traffic: the same address (whatever its
// kind), protocol and port, or the same node port of one family and
// protocol. The API server lets two services claim one external or
// load-balancer IP and port, but the kernel can send that traffic to
// one listener only. The first of them in claims wins; the others are
// left out, their listener ports too, rather than making the Rules
// invalid and failing the sync of every service. The proxier orders its
// intercepts so that its shared listeners route to the same winner.
//
// ServiceRules neither keeps nor changes claims, and the Rules share no
// memory with them but the SourceRanges slices.
func ServiceRules(claims []Intercept, opts ServiceOptions) Rules {
	r := Rules{NodePortAddresses: opts.NodePortAddresses, LocalhostNodePorts: opts.LocalhostNodePorts, Shared: opts.Shared, TProxy: opts.TProxy, Replies: opts.Replies}
	listeners := map[Listener]bool{}
	seen := make(map[claimKey]bool, len(claims))
	for _, c := range claims {
		k := c.key()
		if seen[k] {
			continue
		}
		seen[k] = true
		family := familyOf(c.Dest.Unmap())
		for port := int(c.ToPort); port <= int(max(c.ToPort, c.ToPortEnd)); port++ {
			listeners[Listener{Family: family, Protocol: c.Protocol, Port: uint16(port)}] = true
		}
		intercept := true
		if c.Reject {
			r.Rejects = append(r.Rejects, Reject{Comment: c.Comment, NodePort: c.NodePort, Family: family, Protocol: c.Protocol, Dest: c.Dest, Port: c.Port})
			// A node port is refused by its own port: a REDIRECT would
			// leave only the original port to match, which other
			// services' redirected connections may share. In tproxy
			// mode a packet made local to the service's address could
			// not be refused (see Reject), so it is left to the
			// routing that reaches the REJECT.
			intercept = !c.NodePort && opts.TProxy == nil
		}
		if c.NodePort {
			if intercept {
				r.NodePorts = append(r.NodePorts, NodePort{Comment: c.Comment, Family: family, Protocol: c.Protocol, Port: c.Port, ToPort: c.ToPort, ToPortEnd: c.ToPortEnd})
			}
			continue
		}
		if intercept {
			r.Intercepts = append(r.Intercepts, InterceptRule{Comment: c.Comment, Protocol: c.Protocol, Dest: c.Dest, Port: c.Port, ToPort: c.ToPort, ToPortEnd: c.ToPortEnd})
		}
		// A refused destination refuses every source, as kube-proxy's
		// REJECT does: in redirect mode the REJECT comes before the
		// firewall's DROP; in tproxy mode the firewall's rules would drop
		// the packets before they reach the REJECT, so there is none.
		if len(c.SourceRanges) > 0 && (intercept || opts.TProxy == nil) {
			r.Firewalls = append(r.Firewalls, Firewall{Comment: c.Comment, Protocol: c.Protocol, Dest: c.Dest, Port: c.Port, Allow: c.SourceRanges})
		}
	}
	if opts.TProxy != nil {
		return r
	}
	for l := range listeners {
		r.Listeners = append(r.Listeners, l)
	}
	slices.SortFunc(r.Listeners, func(a, b Listener) int {
		return cmp.Or(cmp.Compare(a.Family, b.Family), cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.Port, b.Port))
	})
	return r
}
