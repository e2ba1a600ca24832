package redirect

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
)

// TProxy configures tproxy mode: UPROXY-TPROXY hands each intercepted
// destination by TPROXY to its listener on loopback with the packet's
// destination unchanged, so that the proxy can dial the backend from the
// client's own address and the replies find their way back to it. The
// docs/rules.md ("Tproxy mode") gives the chains and the order
// of their rules, and docs/modes.md when to choose the mode and the
// kernel's limits (br_netfilter).
//
// Tproxy mode needs the policy routing of Routing for each family
// (Routing.Ensure); the caller installs it before the first Sync and
// removes it (Routing.Remove) after Cleanup.
type TProxy struct {
	// Routing gives the mark; its zero value is DefaultRouting.
	Routing Routing
	// NoBridged leaves out the gates for clients behind a Linux bridge
	// (tproxyBridgedGates) and UPROXY-TPROXY-BRIDGED's rules. Their
	// physdev match makes the kernel load br_netfilter when it is not
	// loaded yet (physdev_mt_check, net/netfilter/xt_physdev.c), which
	// then hands every bridged frame of the node to iptables: set it
	// where br_netfilter is not loaded, and no bridged packet meets
	// iptables anyway. False renders them.
	NoBridged bool
}

// validate reports why t cannot be rendered, or nil.
func (t *TProxy) validate() error { return t.Routing.validate() }

// Replies configures UPROXY-REPLIES (Rules.Replies): in redirect mode, the
// packets that come back to a socket of the proxy's that dials a backend
// from a client's address are marked for local delivery, as tproxy mode
// marks those of its own sockets, and so reach the socket instead of
// being routed on to the client. It needs the policy routing of Routing
// for each family, which the caller installs before the first Sync and
// removes after Cleanup, as in tproxy mode.
type Replies struct {
	// Routing gives the mark; its zero value is DefaultRouting.
	Routing Routing
	// NoBridged leaves out the rule that brings back replies bridged
	// straight to the client, which a backend on the client's Linux
	// bridge sends: as TProxy.NoBridged, set it where br_netfilter is
	// not loaded. False renders it.
	NoBridged bool
}

// loopbackOf returns the loopback address of f, where the tproxy-mode
// listeners are.
func loopbackOf(f Family) netip.Addr {
	if f == IPv6 {
		return netip.IPv6Loopback()
	}
	return netip.MustParseAddr("127.0.0.1")
}

// loopbackPrefixOf returns the loopback prefix of f, which is no node-port
// address by default.
func loopbackPrefixOf(f Family) netip.Prefix {
	if f == IPv6 {
		return netip.MustParsePrefix("::1/128")
	}
	return netip.MustParsePrefix("127.0.0.0/8")
}

// target returns the TPROXY target to the listener port of f, with its
// options in the order iptables-save prints them.
func (t *TProxy) target(f Family, port uint16) string {
	return fmt.Sprintf("-j TPROXY --on-port %d --on-ip %s --tproxy-mark %s", port, loopbackOf(f), t.Routing.MarkString())
}

// markTarget returns the MARK target that sets the routing mark, as
// iptables-save prints it (--set-xmark, whatever form set it).
func (t *TProxy) markTarget() string {
	return "-j MARK --set-xmark " + t.Routing.MarkString()
}

// destMatch returns the matches of a destination, protocol and port, as
// iptables-save prints them, without leading space.
func destMatch(f Family, dest netip.Addr, p Protocol, comment string, port uint16) string {
	return fmt.Sprintf("-d %s/%d -p %s -m comment --comment %s -m %s --dport %d",
		dest.Unmap(), f.hostBits(), p, quoteComment(comment), p, port)
}

// tproxyEntry is an intercept or a firewall of UPROXY-TPROXY, for sorting
// them together by destination, protocol and port.
type tproxyEntry struct {
	key interceptKey
	// firewall is true for a firewall's DROP, which follows the
	// intercept's TPROXY rules of the same key.
	firewall bool
	toPort   uint16
	comment  string
}

// compare orders entries by destination, protocol and port, an intercept
// before the firewall of its key, then by listener port and comment. It
// returns at the first difference: cmp.Or would compare every field, the
// comments included, and a render in tproxy mode sorts the entries of
// every service several times (BenchmarkRenderTProxy10k).
func (a tproxyEntry) compare(b tproxyEntry) int {
	if c := a.key.dest.Compare(b.key.dest); c != 0 {
		return c
	}
	if c := cmp.Compare(a.key.proto, b.key.proto); c != 0 {
		return c
	}
	if c := cmp.Compare(a.key.port, b.key.port); c != 0 {
		return c
	}
	if a.firewall != b.firewall {
		if a.firewall {
			return 1
		}
		return -1
	}
	if c := cmp.Compare(a.toPort, b.toPort); c != 0 {
		return c
	}
	return cmp.Compare(a.comment, b.comment)
}

// tproxyEntries returns the valid intercepts and firewalls of f in r,
// sorted. In the shared layout, the intercepts that no firewall guards
// are left out: they are members of f's service set.
func tproxyEntries(f Family, r Rules) []tproxyEntry {
	var guarded map[interceptKey][]netip.Prefix
	if r.Shared {
		guarded = firewallAllows(f, r)
	}
	var es []tproxyEntry
	for _, i := range r.Intercepts {
		if i.validate() != nil || familyOf(i.Dest.Unmap()) != f {
			continue
		}
		if _, ok := guarded[i.key()]; r.Shared && !ok {
			continue
		}
		es = append(es, tproxyEntry{key: i.key(), toPort: i.ToPort, comment: i.Comment})
	}
	for _, w := range r.Firewalls {
		if w.validateDest() == nil && familyOf(w.Dest.Unmap()) == f {
			es = append(es, tproxyEntry{key: w.key(), firewall: true, comment: w.Comment})
		}
	}
	slices.SortFunc(es, tproxyEntry.compare)
	return es
}

// gatedTProxy reports whether r is in tproxy mode with per-service rules,
// where the service and node-port sets gate the chains of
// tproxyServicesChain and tproxyNodePortsChain (see docs/rules.md,
// "Tproxy mode").
func gatedTProxy(r Rules) bool { return r.TProxy != nil && !r.Shared }

// tproxyServicesChain returns the chain that holds the per-service rules
// of protocol p's intercepts and firewalls in tproxy mode.
func tproxyServicesChain(p Protocol) string {
	if p == UDP {
		return tproxyServicesUDP
	}
	return tproxyServicesTCP
}

// tproxyNodePortsChain returns the chain that holds the per-service rules
// of protocol p's node ports in tproxy mode.
func tproxyNodePortsChain(p Protocol) string {
	if p == UDP {
		return tproxyNodePortsUDP
	}
	return tproxyNodePortsTCP
}

// entryProtocols returns the protocols, in order, that es has entries
// of: those whose gate and OUTPUT mark the service set needs.
func entryProtocols(es []tproxyEntry) []Protocol {
	var ps []Protocol
	for _, p := range protocols {
		if slices.ContainsFunc(es, func(e tproxyEntry) bool { return e.key.proto == p }) {
			ps = append(ps, p)
		}
	}
	return ps
}

// tproxyRules renders UPROXY-TPROXY (see "Tproxy mode" in docs/rules.md).
// The transparent sockets' packets go to
// UPROXY-TPROXY-DIVERT by goto, and return from there to PREROUTING: for
// TCP before all the rest, except SYNs; for UDP last.
//
// With per-service rules, what lies between is the gates, per protocol:
// a packet whose destination address, protocol and port are in f's
// service set jumps to its protocol's UPROXY-TPROXY-SERVICES-*, one whose
// destination port is in the node-port set of f and its protocol to its
// protocol's UPROXY-TPROXY-NODEPORTS-*. A gate is rendered only when its
// set has members of its protocol.
//
// In the shared layout, the intercepts that a firewall guards have their
// rules here, as UPROXY-TPROXY-SERVICES-* has them in the per-service
// layout, then the firewalls' DROPs; after those, one TPROXY per
// protocol matches f's service set; and the node ports are one TPROXY
// per protocol and node-port address, matching the protocol's node-port
// set.
func tproxyRules(c chainSpec, f Family, r Rules) []string {
	if r.TProxy == nil {
		return nil
	}
	t := r.TProxy
	rules := bridgedReplyRules(c.name, t.NoBridged)
	rules = append(rules, fmt.Sprintf("-A %s -p tcp -m tcp ! --tcp-flags FIN,SYN,RST,ACK SYN -m socket --transparent -g %s", c.name, tproxyDivertChain))
	rules = append(rules, tproxyBridgedGates(c, f, r)...)
	if !r.Shared {
		ns := tproxyNodePorts(f, r)
		for _, p := range entryProtocols(c.entries(f, r)) {
			rules = append(rules, fmt.Sprintf("-A %s -p %s %s -j %s", c.name, p, serviceSetMatch(f), tproxyServicesChain(p)))
		}
		for _, p := range protocols {
			if slices.ContainsFunc(ns, func(n NodePort) bool { return n.Protocol == p }) {
				rules = append(rules, fmt.Sprintf("-A %s -p %s %s -j %s", c.name, p, nodePortSetMatch(f, p), tproxyNodePortsChain(p)))
			}
		}
		return append(rules, fmt.Sprintf("-A %s -p udp -m socket --transparent -g %s", c.name, tproxyDivertChain))
	}
	rules = append(rules, tproxyEntryRules(c.name, f, r, c.entries(f, r))...)
	rules = append(rules, sharedServiceRules(c.name, f, r, func(port, _ uint16) string { return t.target(f, port) })...)
	for _, st := range sharedNodePortTargets(f, r) {
		for _, d := range nodePortDests(f, r) {
			rules = append(rules, fmt.Sprintf("-A %s%s -p %s -m addrtype --dst-type LOCAL %s -m comment --comment %s %s",
				c.name, d, st.proto, nodePortSetMatch(f, st.proto), quoteComment(sharedNodePortComment(st.proto)), t.target(f, st.toPort)))
		}
	}
	return append(rules, fmt.Sprintf("-A %s -p udp -m socket --transparent -g %s", c.name, tproxyDivertChain))
}

// tproxyBridgedGates renders UPROXY-TPROXY's rules that send what it
// would intercept to UPROXY-TPROXY-BRIDGED while br_netfilter runs
// PREROUTING on a bridge (the physdev match), before the bridge passes
// the frame up: a TPROXY there is lost (see "Bridged clients" in
// docs/rules.md). The gates are those of the intercepts: with
// per-service rules, the service set and the node-port sets, per
// protocol with members; in the shared layout, also each guarded
// destination, protocol and port. Node ports count only to a local
// address: a pod's packet to another host's port goes its way. A
// clone that TEE sent comes back through lo, which no gate matches.
func tproxyBridgedGates(c chainSpec, f Family, r Rules) []string {
	if r.TProxy.NoBridged {
		return nil
	}
	chain := c.name
	var rules []string
	gate := func(p Protocol, match string) {
		rules = append(rules, fmt.Sprintf("-A %s ! -i lo -p %s -m physdev --physdev-is-in %s -j %s", chain, p, match, tproxyBridgedChain))
	}
	nodePorts := func(p Protocol) string {
		return nodePortSetMatch(f, p) + " -m addrtype --dst-type LOCAL"
	}
	if r.Shared {
		var prev interceptKey
		for n, e := range c.entries(f, r) {
			if n > 0 && e.key == prev {
				continue
			}
			prev = e.key
			rules = append(rules, fmt.Sprintf("-A %s -d %s/%d ! -i lo -p %s -m physdev --physdev-is-in -m comment --comment %s -m %s --dport %d -j %s",
				chain, e.key.dest.Unmap(), f.hostBits(), e.key.proto, quoteComment(e.comment), e.key.proto, e.key.port, tproxyBridgedChain))
		}
		for _, t := range sharedServiceTargets(f, r) {
			gate(t.proto, serviceSetMatch(f))
		}
		for _, st := range sharedNodePortTargets(f, r) {
			gate(st.proto, nodePorts(st.proto))
		}
		return rules
	}
	for _, p := range entryProtocols(c.entries(f, r)) {
		gate(p, serviceSetMatch(f))
	}
	ns := tproxyNodePorts(f, r)
	for _, p := range protocols {
		if slices.ContainsFunc(ns, func(n NodePort) bool { return n.Protocol == p }) {
			gate(p, nodePorts(p))
		}
	}
	return rules
}

// bridgedReplyRules renders, unless noBridged, the rule of chain that
// sends to UPROXY-TPROXY-BRIDGED what a Linux bridge carries to one of
// the proxy's transparent sockets in the reply direction of its
// connection: the reply of a backend on the bridge of the client whose
// address the socket dials from, which the bridge would hand straight
// to the client (which knows no such connection and resets it).
// br_netfilter runs PREROUTING on it, where the socket match finds the
// socket. The reply direction keeps out a tproxy-mode client's own
// packets to its listener's transparent socket, which the routing mark
// alone delivers; the clone that TEE sends comes back through lo, which
// the rule leaves alone, and meets the mark rules instead.
func bridgedReplyRules(chain string, noBridged bool) []string {
	if noBridged {
		return nil
	}
	return []string{fmt.Sprintf("-A %s ! -i lo -m physdev --physdev-is-in -m conntrack --ctdir REPLY -m socket --transparent -j %s", chain, tproxyBridgedChain)}
}

// repliesRules renders UPROXY-REPLIES (Replies): in redirect mode, the
// bridged replies to the proxy's transparent sockets go to
// UPROXY-TPROXY-BRIDGED, and the others get the routing mark, as do the
// clones that TEE sends back through lo (which conntrack does not
// track). Only the reply direction is looked up: a transparent socket
// of redirect mode only dials. Tproxy mode leaves the chain empty:
// UPROXY-TPROXY does the same for every transparent socket.
func repliesRules(c chainSpec, _ Family, r Rules) []string {
	if r.Replies == nil || r.TProxy != nil {
		return nil
	}
	mark := "-j MARK --set-xmark " + r.Replies.Routing.MarkString()
	rules := bridgedReplyRules(c.name, r.Replies.NoBridged)
	rules = append(rules, fmt.Sprintf("-A %s -m conntrack --ctdir REPLY -m socket --transparent %s", c.name, mark))
	if !r.Replies.NoBridged {
		rules = append(rules, fmt.Sprintf("-A %s -i lo -m socket --transparent %s", c.name, mark))
	}
	return rules
}

// tproxyBridgedRules renders UPROXY-TPROXY-BRIDGED: a packet from one of
// the node's own addresses is dropped; TEE sends a copy of the others
// from the IP layer, towards loopback, and the packet itself
// is dropped. The copy leaves through OUTPUT, where UPROXY-TPROXY-OUTPUT
// marks it as the node's own traffic to a service is marked, and comes
// back in through lo, where PREROUTING runs at the IP layer and TPROXY
// hands it to its listener, its source the client's. Only a connection's
// first packet and datagrams take this way: the socket match of
// UPROXY-TPROXY's first rule sends the rest of a connection to its
// socket's mark before the gates.
func tproxyBridgedRules(c chainSpec, f Family, r Rules) []string {
	switch {
	case r.TProxy != nil && r.TProxy.NoBridged,
		r.TProxy == nil && (r.Replies == nil || r.Replies.NoBridged):
		return nil
	}
	return []string{
		// The clone re-enters through lo, where neither rp_filter nor the
		// martian-source checks of ip_route_input apply: a pod's frame
		// forged from a node address (127.0.0.1 included) would become a
		// flow whose replies uproxy sends to that address's services.
		fmt.Sprintf("-A %s -m addrtype --src-type LOCAL -j DROP", c.name),
		fmt.Sprintf("-A %s -j TEE --gateway %s", c.name, loopbackOf(f)),
		fmt.Sprintf("-A %s -j DROP", c.name),
	}
}

// tproxyEntryRules renders the rules of chain for es, entries of f in r
// (tproxyEntries): for each destination, protocol and port in order, the
// TPROXY rule of its intercept, or one per allowed source prefix of f
// when a firewall guards it, then the firewall's DROP. Every packet to
// an entry's destination, protocol and port ends at one of them: a
// TPROXY or a DROP.
func tproxyEntryRules(chain string, f Family, r Rules, es []tproxyEntry) []string {
	t := r.TProxy
	allowed := firewallAllows(f, r)
	var rules []string
	for _, e := range es {
		match := destMatch(f, e.key.dest, e.key.proto, e.comment, e.key.port)
		if e.firewall {
			rules = append(rules, fmt.Sprintf("-A %s %s -j DROP", chain, match))
			continue
		}
		sources, guarded := allowed[e.key]
		if !guarded {
			rules = append(rules, fmt.Sprintf("-A %s %s %s", chain, match, t.target(f, e.toPort)))
			continue
		}
		for _, p := range sources {
			rules = append(rules, fmt.Sprintf("-A %s%s %s %s", chain, prefixMatch("-s", p), match, t.target(f, e.toPort)))
		}
	}
	// Duplicate firewalls, which Sync rejects, drop once.
	return slices.Compact(rules)
}

// tproxyServiceRules renders UPROXY-TPROXY-SERVICES-TCP or -UDP (see
// TProxy): with per-service rules, those of every intercept and firewall
// of f and the chain's protocol (tproxyEntryRules); in the shared
// layout, none.
func tproxyServiceRules(c chainSpec, f Family, r Rules) []string {
	if !gatedTProxy(r) {
		return nil
	}
	var es []tproxyEntry
	for _, e := range c.entries(f, r) {
		if e.key.proto == c.proto {
			es = append(es, e)
		}
	}
	return tproxyEntryRules(c.name, f, r, es)
}

// tproxyNodePorts returns, with per-service rules in tproxy mode, the
// valid node ports of f in r, sorted; otherwise none, and none when
// NodePortAddresses admits no address of f.
func tproxyNodePorts(f Family, r Rules) []NodePort {
	if !gatedTProxy(r) || len(nodePortDests(f, r)) == 0 {
		return nil
	}
	var ns []NodePort
	for _, n := range r.NodePorts {
		if n.validate() == nil && n.Family == f {
			ns = append(ns, n)
		}
	}
	slices.SortFunc(ns, func(a, b NodePort) int {
		return cmp.Or(cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.Port, b.Port), cmp.Compare(a.ToPort, b.ToPort), cmp.Compare(a.Comment, b.Comment))
	})
	return ns
}

// tproxyNodePortRules renders UPROXY-TPROXY-NODEPORTS-TCP or -UDP (see
// TProxy): with per-service rules, one TPROXY per node port of f and the
// chain's protocol and node-port address; in the shared layout, none.
func tproxyNodePortRules(c chainSpec, f Family, r Rules) []string {
	var rules []string
	for _, n := range tproxyNodePorts(f, r) {
		if n.Protocol != c.proto {
			continue
		}
		for _, d := range nodePortDests(f, r) {
			rules = append(rules, fmt.Sprintf("-A %s%s -p %s -m addrtype --dst-type LOCAL -m comment --comment %s -m %s --dport %d %s",
				c.name, d, n.Protocol, quoteComment(n.Comment), n.Protocol, n.Port, r.TProxy.target(f, n.ToPort)))
		}
	}
	return rules
}

// tproxyDivertRules renders UPROXY-TPROXY-DIVERT: it marks the packets of
// the transparent sockets, which UPROXY-TPROXY sends here (see
// docs/rules.md).
func tproxyDivertRules(c chainSpec, _ Family, r Rules) []string {
	if r.TProxy == nil {
		return nil
	}
	return []string{fmt.Sprintf("-A %s %s", c.name, r.TProxy.markTarget())}
}

// tproxyOutputRules renders UPROXY-TPROXY-OUTPUT (see docs/rules.md):
// with per-service rules, one MARK per protocol for what f's
// service set matches (every intercept's and firewall's destination,
// protocol and port), when it has members of the protocol; in the shared
// layout, one MARK per firewall's destination, protocol and port, with the
// comment of its intercept if it has one, and then one per protocol that
// matches f's service set.
// Node ports need no rule: the node's packets to its own addresses go
// through lo and PREROUTING anyway.
func tproxyOutputRules(c chainSpec, f Family, r Rules) []string {
	if r.TProxy == nil {
		return nil
	}
	es := c.entries(f, r)
	if !r.Shared {
		var rules []string
		for _, p := range entryProtocols(es) {
			rules = append(rules, fmt.Sprintf("-A %s -p %s %s %s", c.name, p, serviceSetMatch(f), r.TProxy.markTarget()))
		}
		return rules
	}
	var rules []string
	var prev tproxyEntry
	for n, e := range es {
		// The first entry of a key is its intercept's, if it has one.
		if n > 0 && e.key == prev.key {
			continue
		}
		prev = e
		rules = append(rules, fmt.Sprintf("-A %s %s %s", c.name, destMatch(f, e.key.dest, e.key.proto, e.comment, e.key.port), r.TProxy.markTarget()))
	}
	return append(rules, sharedServiceRules(c.name, f, r, func(_, _ uint16) string { return r.TProxy.markTarget() })...)
}
