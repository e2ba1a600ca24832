package redirect

import (
	"errors"
	"fmt"
	"net/netip"
)

// Protocol is the transport protocol of a rule: "tcp" or "udp".
type Protocol string

// The protocols a rule may name.
const (
	TCP Protocol = "tcp"
	UDP Protocol = "udp"
)

// Family selects the IP family: IPv4 (iptables) or IPv6 (ip6tables).
type Family int

// The families. The zero Family is IPv4.
const (
	IPv4 Family = iota
	IPv6
)

// String returns "IPv4", "IPv6", or "Family(N)" for an unknown value.
func (f Family) String() string {
	switch f {
	case IPv4:
		return "IPv4"
	case IPv6:
		return "IPv6"
	}
	return fmt.Sprintf("Family(%d)", int(f))
}

// valid reports whether f is IPv4 or IPv6.
func (f Family) valid() bool { return f == IPv4 || f == IPv6 }

// command returns the name of the iptables tool with the given suffix
// ("", "-save", "-restore") for f: iptables... for IPv4, ip6tables... for
// IPv6.
func (f Family) command(suffix string) string {
	if f == IPv6 {
		return "ip6tables" + suffix
	}
	return "iptables" + suffix
}

// hostBits is the prefix length of a single address of f.
func (f Family) hostBits() int {
	if f == IPv6 {
		return 128
	}
	return 32
}

// familyOf returns the family of a, which must be unmapped.
func familyOf(a netip.Addr) Family {
	if a.Is4() {
		return IPv4
	}
	return IPv6
}

// InterceptRule is one destination whose traffic the kernel sends to a local
// proxy listener.
type InterceptRule struct {
	// Comment is shown in the rule's comment, e.g. "default/web:http".
	// Render quotes and escapes it as iptables-save does, replaces control
	// characters (newlines included) with spaces and invalid UTF-8 with
	// U+FFFD, and cuts it to 255 bytes, the kernel's limit, so any string
	// is safe.
	Comment string
	// Protocol is TCP or UDP.
	Protocol Protocol
	// Dest is the service VIP. An IPv4-mapped IPv6 address counts as IPv4.
	Dest netip.Addr
	// Port is the service port; it must not be zero.
	Port uint16
	// ToPort is the local listener port (REDIRECT --to-ports); it must not
	// be zero.
	ToPort uint16
	// ToPortEnd, when above ToPort, makes ToPort-ToPortEnd a range of
	// ports that one listener listens on (REDIRECT --to-ports A-B): the
	// kernel's NAT then gives each new connection a port of the range
	// whose reply tuple conntrack does not hold. Zero (or ToPort) means
	// ToPort alone. TPROXY, which keeps the destination, uses ToPort only.
	ToPortEnd uint16
}

// validate reports why i cannot be rendered, or nil.
func (i InterceptRule) validate() error {
	switch {
	case i.Protocol != TCP && i.Protocol != UDP:
		return fmt.Errorf("protocol %q is not %q or %q", i.Protocol, TCP, UDP)
	case !i.Dest.IsValid():
		return errors.New("no destination address")
	case i.Dest.Zone() != "":
		return fmt.Errorf("destination %s has a zone", i.Dest)
	case i.Port == 0:
		return errors.New("port 0")
	case i.ToPort == 0:
		return errors.New("listener port 0")
	case i.ToPortEnd != 0 && i.ToPortEnd < i.ToPort:
		return fmt.Errorf("listener ports %d-%d: the range ends before it starts", i.ToPort, i.ToPortEnd)
	}
	return nil
}

// key identifies the traffic an InterceptRule matches: two intercepts with the
// same key would conflict.
type interceptKey struct {
	dest  netip.Addr
	proto Protocol
	port  uint16
}

func (i InterceptRule) key() interceptKey {
	return interceptKey{dest: i.Dest.Unmap(), proto: i.Protocol, port: i.Port}
}

// NodePort is a port that the kernel redirects to a local proxy listener
// when it is addressed to one of the node's own addresses (a Service's
// nodePort), as far as Rules.NodePortAddresses admits the address.
type NodePort struct {
	// Comment is shown in the rule's comment, e.g. "default/web:http";
	// Render makes any string safe, as for InterceptRule.Comment.
	Comment string
	// Family is the family of the node addresses the port is opened on.
	Family Family
	// Protocol is TCP or UDP.
	Protocol Protocol
	// Port is the node port; it must not be zero.
	Port uint16
	// ToPort is the local listener port (REDIRECT --to-ports); it must not
	// be zero.
	ToPort uint16
	// ToPortEnd, when above ToPort, makes ToPort-ToPortEnd a range of
	// listener ports, as InterceptRule.ToPortEnd does.
	ToPortEnd uint16
}

// validate reports why n cannot be rendered, or nil.
func (n NodePort) validate() error {
	switch {
	case !n.Family.valid():
		return fmt.Errorf("unknown family %s", n.Family)
	case n.Protocol != TCP && n.Protocol != UDP:
		return fmt.Errorf("protocol %q is not %q or %q", n.Protocol, TCP, UDP)
	case n.Port == 0:
		return errors.New("port 0")
	case n.ToPort == 0:
		return errors.New("listener port 0")
	case n.ToPortEnd != 0 && n.ToPortEnd < n.ToPort:
		return fmt.Errorf("listener ports %d-%d: the range ends before it starts", n.ToPort, n.ToPortEnd)
	}
	return nil
}

// portKey identifies a port of the node's own addresses: two node ports
// with the same key would conflict.
type portKey struct {
	family Family
	proto  Protocol
	port   uint16
}

func (n NodePort) key() portKey { return portKey{n.Family, n.Protocol, n.Port} }

// Firewall restricts which sources may reach one destination, like a
// LoadBalancer service's loadBalancerSourceRanges. An InterceptRule with the
// same destination, protocol and port is redirected only for sources
// inside Allow; every other packet to that destination, protocol and port
// is dropped. A Firewall without such an InterceptRule drops all of them.
type Firewall struct {
	// Comment is shown in the rule's comment; Render makes any string
	// safe, as for InterceptRule.Comment.
	Comment string
	// Protocol is TCP or UDP.
	Protocol Protocol
	// Dest is the guarded address, e.g. a LoadBalancer ingress IP. An
	// IPv4-mapped IPv6 address counts as IPv4.
	Dest netip.Addr
	// Port is the guarded port; it must not be zero.
	Port uint16
	// Allow lists the source ranges that may reach Dest:Port. Only those
	// of Dest's family count: an empty Allow, or one whose ranges are all
	// of the other family, lets no source in, as kube-proxy does when a
	// service's source ranges are all of the other family. An
	// IPv4-mapped IPv6 prefix of length 96 or more counts as IPv4.
	Allow []netip.Prefix
}

// Reject is a service port with no endpoint: the kernel refuses its new
// connections and datagrams (ICMP port unreachable, which a TCP client
// sees as ECONNREFUSED on its SYN), as kube-proxy's REJECT rules do, rather
// than a listener accepting them with nothing to send them to.
// UPROXY-FIREWALL refuses them by their original destination, which
// conntrack keeps; the InterceptRule stays, so that REDIRECT or TPROXY makes
// the packet local wherever the node routes the address. A node port,
// local already, is not intercepted and is refused by its own port.
//
// In tproxy mode a packet that TPROXY made local keeps the service's
// address, which is not the node's: an ICMP error from it finds no route
// (the kernel routes ICMP from local source addresses only), and the copy
// of a bridged packet that TEE sends through OUTPUT is refused there,
// where its reset is lost. So tproxy mode does not intercept the address:
// the kernel routes the packet on (FORWARD, or OUTPUT for the node's
// own), as it does for kube-proxy's REJECT, and the ICMP error leaves
// from a node address. A node with no route for the address answers
// "no route to host" instead.
type Reject struct {
	// Comment is shown in the rule's comment, as for InterceptRule.Comment.
	Comment string
	// NodePort, when true, refuses Port on every local address of
	// Family; Dest is then unused. When false, Dest:Port exactly.
	NodePort bool
	Family   Family
	Protocol Protocol
	// Dest is the refused address. An IPv4-mapped IPv6 address counts as
	// IPv4.
	Dest netip.Addr
	// Port is the service port or the node port; it must not be zero.
	Port uint16
}

// validate reports why j cannot be rendered, or nil.
func (j Reject) validate() error {
	switch {
	case j.Protocol != TCP && j.Protocol != UDP:
		return fmt.Errorf("protocol %q is not %q or %q", j.Protocol, TCP, UDP)
	case j.Port == 0:
		return errors.New("port 0")
	case j.NodePort && !j.Family.valid():
		return fmt.Errorf("unknown family %s", j.Family)
	case !j.NodePort && !j.Dest.IsValid():
		return errors.New("no destination")
	case !j.NodePort && j.Dest.Zone() != "":
		return fmt.Errorf("destination %s has a zone", j.Dest)
	}
	return nil
}

// validate reports why w cannot be rendered, or nil.
func (w Firewall) validate() error {
	if err := w.validateDest(); err != nil {
		return err
	}
	var errs []error
	for n, p := range w.Allow {
		if _, err := normPrefix(p); err != nil {
			errs = append(errs, fmt.Errorf("allow %d: %w", n, err))
		}
	}
	return errors.Join(errs...)
}

// validateDest reports why w's DROP rule cannot be rendered, or nil: all of
// w but Allow.
func (w Firewall) validateDest() error {
	switch {
	case w.Protocol != TCP && w.Protocol != UDP:
		return fmt.Errorf("protocol %q is not %q or %q", w.Protocol, TCP, UDP)
	case !w.Dest.IsValid():
		return errors.New("no destination address")
	case w.Dest.Zone() != "":
		return fmt.Errorf("destination %s has a zone", w.Dest)
	case w.Port == 0:
		return errors.New("port 0")
	}
	return nil
}

// key is the key of the intercepts w guards.
func (w Firewall) key() interceptKey {
	return interceptKey{dest: w.Dest.Unmap(), proto: w.Protocol, port: w.Port}
}

// Listener is one of the proxy's own listening ports. The kernel drops
// every packet to it, on any of the node's addresses, whose connection no
// destination NAT (such as uproxy's REDIRECT rules) sent there, so the
// listeners cannot be reached directly, from pods or from the node.
//
// The port is a member of the kernel set of its family and protocol (see
// the set table in sets.go), which needs ipset.
type Listener struct {
	// Family is the family of the listening socket's traffic; a
	// dual-stack socket needs a Listener of each family.
	Family Family
	// Protocol is TCP or UDP.
	Protocol Protocol
	// Port is the listening port; it must not be zero.
	Port uint16
}

// validate reports why l cannot be rendered, or nil.
func (l Listener) validate() error {
	switch {
	case !l.Family.valid():
		return fmt.Errorf("unknown family %s", l.Family)
	case l.Protocol != TCP && l.Protocol != UDP:
		return fmt.Errorf("protocol %q is not %q or %q", l.Protocol, TCP, UDP)
	case l.Port == 0:
		return errors.New("port 0")
	}
	return nil
}

// normPrefix returns p as iptables prints it back: host bits cleared, and
// an IPv4-mapped IPv6 prefix of length 96 or more as the IPv4 prefix it
// covers. It fails for an invalid p and for a mapped prefix shorter than
// 96 bits, which covers more than IPv4 addresses.
func normPrefix(p netip.Prefix) (netip.Prefix, error) {
	if !p.IsValid() {
		return p, errors.New("invalid prefix")
	}
	if a := p.Addr(); a.Is4In6() {
		if p.Bits() < 96 {
			return p, fmt.Errorf("prefix %s covers IPv4-mapped and other IPv6 addresses", p)
		}
		p = netip.PrefixFrom(a.Unmap(), p.Bits()-96)
	}
	return p.Masked(), nil
}

// Rules is everything uproxy wants in the kernel. One Rules value may mix
// families; each Render or Syncer keeps the parts of its own family.
//
// Later kinds of rules become new fields here, rendered into chains of the
// chain table in render.go, as TProxy was.
type Rules struct {
	// Intercepts may be in any order and mix IPv4 and IPv6 destinations.
	// They cover every exact destination of a service: ClusterIPs,
	// externalIPs and LoadBalancer ingress IPs.
	Intercepts []InterceptRule
	// NodePorts are redirected when addressed to a local address of the
	// node that NodePortAddresses admits, unless an InterceptRule matches the
	// packet first.
	NodePorts []NodePort
	// NodePortAddresses limits the local addresses that accept node ports
	// (kube-proxy's --nodeport-addresses, as CIDRs): a family with no
	// prefix here accepts node ports on none of its addresses. Empty
	// means every local address except loopback (127.0.0.0/8, ::1). An
	// IPv4-mapped IPv6 prefix of length 96 or more counts as IPv4.
	NodePortAddresses []netip.Prefix
	// LocalhostNodePorts admits IPv4 loopback addresses (127.0.0.0/8)
	// for node ports where NodePortAddresses covers them, as kube-proxy's
	// iptables mode does with --iptables-localhost-nodeports, its
	// default. False admits no loopback address, nor does IPv6 ever (::1),
	// as in kube-proxy.
	LocalhostNodePorts bool
	// Firewalls restrict who may reach a destination
	// (loadBalancerSourceRanges); see Firewall.
	Firewalls []Firewall
	// Rejects are the intercepted destinations and node ports of service
	// ports with no endpoint, refused in the filter table; see Reject.
	Rejects []Reject
	// Listeners are the proxy's own listener ports; see Listener. They
	// go into kernel sets, not rules: any number of them costs one rule
	// per protocol.
	Listeners []Listener
	// TProxy, when not nil, selects tproxy mode: intercepts and node ports
	// reach their listeners through TPROXY in the mangle table, with their
	// destination unchanged, instead of REDIRECT in nat; see "Tproxy mode"
	// in docs/rules.md. Their destinations are members of the
	// service and node-port sets in both layouts: with per-service rules,
	// the sets gate the rules.
	TProxy *TProxy
	// Replies, when not nil in redirect mode, brings back to the proxy
	// the replies to its sockets that dial backends from a client's own
	// address (UPROXY-REPLIES): without it the node routes them on to
	// the client. Tproxy mode's UPROXY-TPROXY does the same for its own
	// sockets, so there Replies changes nothing.
	Replies *Replies
	// Shared, when true, selects the shared layout, for a proxy with one
	// listener per family and protocol; see "The shared layout" in the
	// docs/rules.md. Intercepts are not rendered as rules: each
	// becomes a member of its family's hash:ip,port set ("uproxy-services4"
	// or "uproxy-services6", members as ipset save prints them, e.g.
	// "10.96.0.10,tcp:80" and "2001:db8::10,udp:53"), and NodePorts become
	// members of a bitmap:port set per family and protocol
	// ("uproxy-nodeports-tcp4", "uproxy-nodeports-udp4",
	// "uproxy-nodeports-tcp6", "uproxy-nodeports-udp6"). Each family and
	// protocol gets one rule per set, in nat (REDIRECT) or, with TProxy, in
	// mangle (TPROXY), that sends what the set matches to the single ToPort
	// all of them share, so the number of rules does not grow with the
	// services. An InterceptRule that a Firewall guards keeps its rules of the
	// per-service layout instead (one per allowed source prefix, before the
	// set's rule). All Intercepts and NodePorts of one family and protocol
	// must have the same ToPort and ToPortEnd. False is the per-service
	// layout: a rule per intercept and node port.
	Shared bool
}

// validate reports every invalid or conflicting part of r, or nil.
func (r Rules) validate() error {
	var errs []error
	seen := make(map[interceptKey]int, len(r.Intercepts))
	for n, i := range r.Intercepts {
		if err := i.validate(); err != nil {
			errs = append(errs, fmt.Errorf("intercept %d (%q): %w", n, i.Comment, err))
			continue
		}
		if prev, dup := seen[i.key()]; dup {
			errs = append(errs, fmt.Errorf("intercept %d (%q) and %d (%q) both match %s %s port %d",
				prev, r.Intercepts[prev].Comment, n, i.Comment, i.Dest.Unmap(), i.Protocol, i.Port))
			continue
		}
		seen[i.key()] = n
	}
	seenNP := make(map[portKey]int, len(r.NodePorts))
	for n, np := range r.NodePorts {
		if err := np.validate(); err != nil {
			errs = append(errs, fmt.Errorf("node port %d (%q): %w", n, np.Comment, err))
			continue
		}
		if prev, dup := seenNP[np.key()]; dup {
			errs = append(errs, fmt.Errorf("node port %d (%q) and %d (%q) both match %s %s port %d",
				prev, r.NodePorts[prev].Comment, n, np.Comment, np.Family, np.Protocol, np.Port))
			continue
		}
		seenNP[np.key()] = n
	}
	for n, p := range r.NodePortAddresses {
		if _, err := normPrefix(p); err != nil {
			errs = append(errs, fmt.Errorf("node port address %d: %w", n, err))
		}
	}
	seenFW := make(map[interceptKey]int, len(r.Firewalls))
	for n, w := range r.Firewalls {
		if err := w.validate(); err != nil {
			errs = append(errs, fmt.Errorf("firewall %d (%q): %w", n, w.Comment, err))
			continue
		}
		if prev, dup := seenFW[w.key()]; dup {
			errs = append(errs, fmt.Errorf("firewall %d (%q) and %d (%q) both guard %s %s port %d",
				prev, r.Firewalls[prev].Comment, n, w.Comment, w.Dest.Unmap(), w.Protocol, w.Port))
			continue
		}
		seenFW[w.key()] = n
	}
	for n, j := range r.Rejects {
		if err := j.validate(); err != nil {
			errs = append(errs, fmt.Errorf("reject %d (%q): %w", n, j.Comment, err))
		}
	}
	// The same listener twice is harmless (its port is one member of its
	// set), so only invalid ones are errors.
	for n, l := range r.Listeners {
		if err := l.validate(); err != nil {
			errs = append(errs, fmt.Errorf("listener %d: %w", n, err))
		}
	}
	if r.TProxy != nil {
		if err := r.TProxy.validate(); err != nil {
			errs = append(errs, fmt.Errorf("tproxy: %w", err))
		}
	}
	if r.Replies != nil {
		if err := r.Replies.Routing.validate(); err != nil {
			errs = append(errs, fmt.Errorf("replies: %w", err))
		}
	}
	if r.Shared {
		errs = append(errs, r.validateShared()...)
	}
	return errors.Join(errs...)
}
