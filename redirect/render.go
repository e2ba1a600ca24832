package redirect

import (
	"bytes"
	"cmp"
	"fmt"
	"iter"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"unicode/utf8"
)

// chainSpec describes one chain that uproxy owns.
type chainSpec struct {
	// table is the iptables table the chain lives in.
	table string
	// name is the chain's name.
	name string
	// from lists the built-in chains of table that jump to this chain,
	// each through one rule at position 1 carrying jumpComment.
	from []string
	// jumpComment is the comment on the jump rules.
	jumpComment string
	// jumpMatch is what a jump rule matches before its comment, in the
	// form iptables-save prints; empty: every packet jumps.
	jumpMatch []string
	// oldJumpMatches are the jumpMatch of jumps that earlier versions
	// inserted: a full sync replaces them with the current jump, and
	// Cleanup deletes them too.
	oldJumpMatches [][]string
	// only, when set, says in which modes the built-in chains jump to
	// the chain; nil means in all. In the others the chain is declared,
	// empty, and its jumps are deleted: a built-in chain that holds a
	// rule puts its hook on every packet's path, while iptables-nft
	// creates none for a table that holds only chains no rule jumps to.
	only func(jumpMode) bool
	// proto is the protocol of a chain that holds one protocol's rules,
	// and empty for the others.
	proto Protocol
	// rules renders the chain's rules for family f in the canonical form
	// iptables-save prints, each starting with "-A <name> ".
	rules func(c chainSpec, f Family, r Rules) []string
	// memo, set by Render on its copies of the chain table's entries,
	// keeps what the chains of one render derive alike from r (see
	// renderMemo); nil derives it anew for each chain.
	memo *renderMemo
}

// The names of the chains that the built-in chains jump to, which
// operators see first and tests and diagnostics name: the chain table
// (chains) is their only other user. Each is described there.
const (
	ServicesChain     = "UPROXY-SERVICES"
	FirewallChain     = "UPROXY-FIREWALL"
	ListenersChain    = "UPROXY-LISTENERS"
	TProxyChain       = "UPROXY-TPROXY"
	TProxyOutputChain = "UPROXY-TPROXY-OUTPUT"
	RepliesChain      = "UPROXY-REPLIES"
)

// jumpMode is what of Rules decides which of uproxy's chains the
// built-in chains jump to (chainSpec.only).
type jumpMode struct {
	// tproxy: Rules.TProxy is set.
	tproxy bool
	// replies: Rules.Replies is set, in redirect mode.
	replies bool
}

func modeOf(r Rules) jumpMode {
	return jumpMode{tproxy: r.TProxy != nil, replies: r.TProxy == nil && r.Replies != nil}
}

func (m jumpMode) isTProxy() bool   { return m.tproxy }
func (m jumpMode) hasReplies() bool { return m.replies }

// The names of the chains that only uproxy's own chains jump to.
const (
	nodePortsChain    = "UPROXY-NODEPORTS"
	tproxyDivertChain = "UPROXY-TPROXY-DIVERT"
	// tproxyBridgedChain re-sends, from the IP layer, what br_netfilter
	// shows UPROXY-TPROXY on a bridge (tproxyBridgedRules).
	tproxyBridgedChain = "UPROXY-TPROXY-BRIDGED"
	// These hold tproxy mode's per-service rules, one protocol each,
	// behind the gates of UPROXY-TPROXY (see tproxyServicesChain and
	// tproxyNodePortsChain).
	tproxyServicesTCP  = "UPROXY-TPROXY-SERVICES-TCP"
	tproxyServicesUDP  = "UPROXY-TPROXY-SERVICES-UDP"
	tproxyNodePortsTCP = "UPROXY-TPROXY-NODEPORTS-TCP"
	tproxyNodePortsUDP = "UPROXY-TPROXY-NODEPORTS-UDP"
)

// OwnMark is the mark (SO_MARK) that the proxy puts on its own sockets
// to backends: a packet that carries it never jumps to the chains that
// intercept (UPROXY-SERVICES, UPROXY-TPROXY, UPROXY-TPROXY-OUTPUT), so
// the proxy's own connections reach the address they were dialled to
// even when it is one a Service intercepts (a Service whose
// externalIPs held its own pod's address, with port equal to targetPort,
// sent every dial back into the proxy until descriptors ran out). It is
// one bit that kube-proxy (0x4000 masquerade, 0x8000 drop) and
// DefaultRouting (0x200000) leave alone.
const OwnMark uint32 = 0x400000

// notOwnMatch is the jump match that keeps the proxy's own packets
// (OwnMark) out of the intercepting chains, as iptables-save prints it.
var notOwnMatch = []string{"-m", "mark", "!", "--mark", fmt.Sprintf("0x%x/0x%x", OwnMark, OwnMark)}

// chains is every chain uproxy creates, in every table. Render, Sync and
// Cleanup all walk it: a new chain is added here and nowhere else. Chains
// of one table are written in one iptables-restore section; tables appear
// in the order of their first chain.
var chains = []chainSpec{
	{
		table:          "nat",
		name:           ServicesChain,
		from:           []string{"PREROUTING", "OUTPUT"},
		jumpComment:    "uproxy service portals",
		jumpMatch:      notOwnMatch,
		oldJumpMatches: [][]string{nil},
		rules:          serviceRules,
	},
	{
		// Jumped to only from the end of UPROXY-SERVICES.
		table: "nat",
		name:  nodePortsChain,
		rules: nodePortRules,
	},
	{
		// Jumped to in tproxy mode only: in redirect mode the jumps
		// would cost every packet that enters or leaves the node an
		// empty chain's walk.
		// The proxy's own packets stay out of it too: one sent to a
		// local address comes back through lo, and PREROUTING, with
		// its mark.
		table:          "mangle",
		name:           TProxyChain,
		from:           []string{"PREROUTING"},
		jumpComment:    "uproxy tproxy",
		jumpMatch:      notOwnMatch,
		oldJumpMatches: [][]string{nil},
		only:           jumpMode.isTProxy,
		rules:          tproxyRules,
	},
	// Jumped to from UPROXY-TPROXY by what the service set and the
	// node-port sets match, with per-service rules.
	{table: "mangle", name: tproxyServicesTCP, proto: TCP, rules: tproxyServiceRules},
	{table: "mangle", name: tproxyServicesUDP, proto: UDP, rules: tproxyServiceRules},
	{table: "mangle", name: tproxyNodePortsTCP, proto: TCP, rules: tproxyNodePortRules},
	{table: "mangle", name: tproxyNodePortsUDP, proto: UDP, rules: tproxyNodePortRules},
	{
		// Gone to (-g) from UPROXY-TPROXY's first rules, for the packets
		// of the proxy's transparent sockets.
		table: "mangle",
		name:  tproxyDivertChain,
		rules: tproxyDivertRules,
	},
	{
		// Jumped to from UPROXY-TPROXY's gates for bridged packets.
		table: "mangle",
		name:  tproxyBridgedChain,
		rules: tproxyBridgedRules,
	},
	{
		table:          "mangle",
		name:           TProxyOutputChain,
		from:           []string{"OUTPUT"},
		jumpComment:    "uproxy tproxy node traffic",
		jumpMatch:      notOwnMatch,
		oldJumpMatches: [][]string{nil},
		only:           jumpMode.isTProxy,
		rules:          tproxyOutputRules,
	},
	{
		// Jumped to in redirect mode with Rules.Replies only, for the
		// same reason as UPROXY-TPROXY.
		table:       "mangle",
		name:        RepliesChain,
		from:        []string{"PREROUTING"},
		jumpComment: "uproxy replies to transparent dials",
		only:        jumpMode.hasReplies,
		rules:       repliesRules,
	},
	{
		// Only INPUT jumps here: the socket match works in PREROUTING
		// and INPUT only (xt_socket), and the node's own connections to
		// a listener come in through lo and INPUT too. See
		// listenerOwnerRules. It comes before UPROXY-FIREWALL in the
		// table, so that its jump comes after UPROXY-FIREWALL's in INPUT
		// (each is inserted at position 1).
		table:       "filter",
		name:        ListenersChain,
		from:        []string{"INPUT"},
		jumpComment: "uproxy listener owners",
		jumpMatch:   []string{"-m", "conntrack", "--ctstate", "NEW"},
		rules:       listenerOwnerRules,
	},
	{
		// Only a connection's first packet jumps (or an untracked one),
		// since dropping that one stops the connection, so every other
		// packet of the node pays one "ct state" comparison instead of
		// the chain; see "The firewall chain" in docs/rules.md
		// for the hooks and their order.
		table:          "filter",
		name:           FirewallChain,
		from:           []string{"INPUT", "FORWARD", "OUTPUT"},
		jumpComment:    "uproxy firewall",
		jumpMatch:      []string{"-m", "conntrack", "--ctstate", "NEW,UNTRACKED"},
		oldJumpMatches: [][]string{nil},
		rules:          firewallRules,
	},
}

// jumpSpec returns the rule spec of the jump to c that matches match (c's
// jumpMatch, or one of its oldJumpMatches), as go-iptables takes it.
func (c chainSpec) jumpSpec(match []string) []string {
	return slices.Concat(match, []string{"-m", "comment", "--comment", c.jumpComment, "-j", c.name})
}

// jumpLine returns the jump rule from the built-in chain from to c that
// matches match, as iptables-save prints it, after its table: "nat -A
// PREROUTING -m comment --comment "uproxy service portals" -j
// UPROXY-SERVICES".
func (c chainSpec) jumpLine(from string, match []string) string {
	m := ""
	if len(match) > 0 {
		m = " " + strings.Join(match, " ")
	}
	return fmt.Sprintf("%s -A %s%s -m comment --comment %s -j %s", c.table, from, m, quoteComment(c.jumpComment), c.name)
}

// jumpMatches returns c's jumpMatch, then its oldJumpMatches: every form of
// jump to c that Cleanup deletes.
func (c chainSpec) jumpMatches() [][]string {
	return append([][]string{c.jumpMatch}, c.oldJumpMatches...)
}

// savedJumps returns the rules of the built-in chains in text, the
// iptables-save output of the chains' tables, each after its table as
// jumpLine has them, with the number of its copies.
func savedJumps(text []byte) map[string]int {
	builtin := map[string]bool{}
	for _, c := range chains {
		for _, from := range c.from {
			builtin[c.table+" "+from] = true
		}
	}
	jumps := map[string]int{}
	for table, line := range tableLines(text) {
		if strings.HasPrefix(line, "-A ") {
			name, _, _ := strings.Cut(line[len("-A "):], " ")
			if builtin[table+" "+name] {
				jumps[table+" "+line]++
			}
		}
	}
	return jumps
}

// tableLines yields each line of text, iptables-save output, without its
// line end, with the table it is in ("*nat" lines start a table and are
// not yielded).
func tableLines(text []byte) iter.Seq2[string, string] {
	return func(yield func(string, string) bool) {
		table := ""
		for line := range strings.Lines(string(text)) {
			line = strings.TrimRight(line, "\r\n")
			if strings.HasPrefix(line, "*") {
				table = line[1:]
				continue
			}
			if !yield(table, line) {
				return
			}
		}
	}
}

// tables returns the tables of chains, in order of first appearance.
func tables() []string {
	var ts []string
	for _, c := range chains {
		if !slices.Contains(ts, c.table) {
			ts = append(ts, c.table)
		}
	}
	return ts
}

// chainNames returns the names of the chains of table, for error messages.
func chainNames(table string) string {
	var names []string
	for _, c := range chains {
		if c.table == table {
			names = append(names, c.name)
		}
	}
	return strings.Join(names, ",")
}

// allChainNames names uproxy's chains by table, for errors: "nat A,B;
// mangle C; filter D".
func allChainNames() string {
	var names []string
	for _, t := range tables() {
		names = append(names, t+" "+chainNames(t))
	}
	return strings.Join(names, "; ")
}

// Render returns the iptables-restore --noflush input that makes uproxy's
// own chains hold exactly what r asks for family f, and touches nothing
// else.
//
// For each table (nat, mangle, then filter) it declares each of uproxy's
// chains (":NAME - [0:0]", which creates the chain or, under --noflush,
// flushes it), adds the rules and commits. The rules are in the exact form
// iptables-save prints them back, so a Syncer can compare the kernel's
// state with the rendering line by line. Render keeps only the parts of r
// of family f, skips invalid ones (Syncer.Sync rejects those before
// rendering; an invalid prefix in a Firewall's Allow lets nobody more in)
// and sorts what it keeps, so its output depends only on the sets of
// intercepts, node ports, addresses, firewalls and listeners, and on
// r.TProxy, which moves the interception from nat to mangle, and
// r.Shared, which moves the intercepts and node ports into sets (see the
// docs/rules.md). It is a pure function.
//
// The listener guards do not list the listener ports, nor do the shared
// layout's rules list the services: they match uproxy's sets (see
// RenderSetUpdate), which must exist before this input is restored,
// since iptables-restore refuses a rule that names a missing set.
func Render(f Family, r Rules) []byte {
	memo := &renderMemo{}
	var b bytes.Buffer
	for _, t := range tables() {
		fmt.Fprintf(&b, "*%s\n", t)
		for _, c := range chains {
			if c.table == t {
				fmt.Fprintf(&b, ":%s - [0:0]\n", c.name)
			}
		}
		for _, c := range chains {
			if c.table == t {
				c.memo = memo
				for _, rule := range c.rules(c, f, r) {
					b.WriteString(rule)
					b.WriteByte('\n')
				}
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.Bytes()
}

// serviceRules renders UPROXY-SERVICES: one REDIRECT per intercept of f,
// or, for an intercept that a Firewall guards, one per allowed source
// prefix of f; then the jumps to UPROXY-NODEPORTS, last, so that an
// intercept of one of the node's own addresses wins over a node port.
//
// In the shared layout, only the guarded intercepts have rules of their
// own; the others are members of f's service set, and one REDIRECT per
// protocol that has members, after the guarded intercepts' rules and
// before the jumps, matches the set. A guarded intercept's source that
// is not allowed matches none of its rules and, being out of the set,
// not the set's rule either: its packet keeps its destination, which
// UPROXY-FIREWALL drops, as in the per-service layout.
//
// The jumps are rendered only when r has node ports of f, so rules
// without node ports render no jump. With no NodePortAddresses, one jump
// takes every local address except loopback: "-m addrtype --dst-type
// LOCAL" asks the routing table whether the destination is the node's
// own (RTN_LOCAL), which loopback addresses are. Otherwise there is one
// jump per prefix of f, and none when no prefix is of f.
func serviceRules(c chainSpec, f Family, r Rules) []string {
	if r.TProxy != nil {
		return nil
	}
	allowed := firewallAllows(f, r)
	var is []InterceptRule
	for _, i := range r.Intercepts {
		if i.validate() != nil || familyOf(i.Dest.Unmap()) != f {
			continue
		}
		if _, guarded := allowed[i.key()]; r.Shared && !guarded {
			continue // a member of the service set
		}
		is = append(is, i)
	}
	slices.SortFunc(is, func(a, b InterceptRule) int {
		return cmp.Or(
			a.Dest.Unmap().Compare(b.Dest.Unmap()),
			cmp.Compare(a.Protocol, b.Protocol),
			cmp.Compare(a.Port, b.Port),
			cmp.Compare(a.ToPort, b.ToPort),
			cmp.Compare(a.ToPortEnd, b.ToPortEnd),
			cmp.Compare(a.Comment, b.Comment),
		)
	})
	rules := make([]string, 0, len(is))
	for _, i := range is {
		redirect := fmt.Sprintf("-d %s/%d -p %s -m comment --comment %s -m %s --dport %d %s",
			i.Dest.Unmap(), f.hostBits(), i.Protocol, quoteComment(i.Comment), i.Protocol, i.Port, redirectTarget(i.ToPort, i.ToPortEnd))
		sources, guarded := allowed[i.key()]
		if !guarded {
			rules = append(rules, fmt.Sprintf("-A %s %s", c.name, redirect))
			continue
		}
		for _, p := range sources {
			rules = append(rules, fmt.Sprintf("-A %s%s %s", c.name, prefixMatch("-s", p), redirect))
		}
	}
	rules = append(rules, sharedServiceRules(c.name, f, r, redirectTarget)...)
	if !slices.ContainsFunc(r.NodePorts, func(n NodePort) bool { return n.validate() == nil && n.Family == f }) {
		return rules
	}
	for _, d := range nodePortDests(f, r) {
		rules = append(rules, fmt.Sprintf("-A %s%s -m addrtype --dst-type LOCAL -j %s", c.name, d, nodePortsChain))
	}
	return rules
}

// nodePortDests returns the destination matches of f's node ports, each
// with a leading space: every local address but loopback, or those in
// NodePortAddresses (none when no prefix is of f), less loopback unless
// LocalhostNodePorts admits IPv4's. A prefix that covers loopback is
// split around it, as one rule takes one -d; the whole address space,
// the usual case, takes one "! -d".
func nodePortDests(f Family, r Rules) []string {
	lo := loopbackPrefixOf(f)
	if len(r.NodePortAddresses) == 0 {
		return []string{" ! -d " + lo.String()}
	}
	keepLo := f == IPv4 && r.LocalhostNodePorts
	var dsts []string
	for _, p := range prefixesOf(f, r.NodePortAddresses) {
		switch {
		case keepLo || !p.Overlaps(lo):
			dsts = append(dsts, prefixMatch("-d", p))
		case p.Bits() == 0:
			dsts = append(dsts, " ! -d "+lo.String())
		default:
			for _, q := range excludePrefix(p, lo) {
				dsts = append(dsts, prefixMatch("-d", q))
			}
		}
	}
	return dsts
}

// excludePrefix returns the prefixes that cover p less x, fewest first
// split: none when x covers p, p itself when they do not overlap.
func excludePrefix(p, x netip.Prefix) []netip.Prefix {
	switch {
	case !p.Overlaps(x):
		return []netip.Prefix{p}
	case x.Bits() <= p.Bits():
		return nil
	}
	lo := netip.PrefixFrom(p.Addr(), p.Bits()+1)
	b := p.Addr().AsSlice()
	bit := p.Bits()
	b[bit/8] |= 0x80 >> (bit % 8)
	hiAddr, _ := netip.AddrFromSlice(b)
	hi := netip.PrefixFrom(hiAddr, p.Bits()+1)
	return append(excludePrefix(lo, x), excludePrefix(hi, x)...)
}

// firewallAllows returns, for each destination, protocol and port that a
// valid Firewall of f guards, the source prefixes of f it allows (none is
// an empty, non-nil entry). Duplicate firewalls, which Sync rejects,
// allow the union of their prefixes, so the result does not depend on
// their order.
func firewallAllows(f Family, r Rules) map[interceptKey][]netip.Prefix {
	all := map[interceptKey][]netip.Prefix{}
	for _, w := range r.Firewalls {
		if w.validateDest() != nil || familyOf(w.Dest.Unmap()) != f {
			continue
		}
		all[w.key()] = append(all[w.key()], w.Allow...)
	}
	for k, ps := range all {
		all[k] = prefixesOf(f, ps)
	}
	return all
}

// redirectTarget returns the REDIRECT target to the listener port, or to
// the ports port-end when end is above port, as iptables-save prints it.
func redirectTarget(port, end uint16) string {
	if end > port {
		return fmt.Sprintf("-j REDIRECT --to-ports %d-%d", port, end)
	}
	return fmt.Sprintf("-j REDIRECT --to-ports %d", port)
}

// prefixesOf returns the valid prefixes of family f in ps, normalized by
// normPrefix, sorted and without duplicates. The result is never nil.
func prefixesOf(f Family, ps []netip.Prefix) []netip.Prefix {
	out := []netip.Prefix{}
	for _, p := range ps {
		if p, err := normPrefix(p); err == nil && familyOf(p.Addr()) == f {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, netip.Prefix.Compare)
	return slices.Compact(out)
}

// prefixMatch returns the match of flag ("-s" or "-d") for p as
// iptables-save prints it, with a leading space, or "" for a prefix of
// length 0, which iptables-save leaves out because it matches everything.
func prefixMatch(flag string, p netip.Prefix) string {
	if p.Bits() == 0 {
		return ""
	}
	return fmt.Sprintf(" %s %s", flag, p)
}

// nodePortRules renders UPROXY-NODEPORTS: one REDIRECT per node port of f,
// or, in the shared layout, one per protocol that has node ports of f,
// matching the protocol's node-port set. The destination was checked by
// the jump from UPROXY-SERVICES.
func nodePortRules(c chainSpec, f Family, r Rules) []string {
	if r.TProxy != nil {
		return nil
	}
	if r.Shared {
		var rules []string
		for _, t := range sharedNodePortTargets(f, r) {
			rules = append(rules, fmt.Sprintf("-A %s -p %s %s -m comment --comment %s %s",
				c.name, t.proto, nodePortSetMatch(f, t.proto), quoteComment(sharedNodePortComment(t.proto)), redirectTarget(t.toPort, t.toPortEnd)))
		}
		return rules
	}
	var ns []NodePort
	for _, n := range r.NodePorts {
		if n.validate() == nil && n.Family == f {
			ns = append(ns, n)
		}
	}
	slices.SortFunc(ns, func(a, b NodePort) int {
		return cmp.Or(
			cmp.Compare(a.Protocol, b.Protocol),
			cmp.Compare(a.Port, b.Port),
			cmp.Compare(a.ToPort, b.ToPort),
			cmp.Compare(a.ToPortEnd, b.ToPortEnd),
			cmp.Compare(a.Comment, b.Comment),
		)
	})
	rules := make([]string, 0, len(ns))
	for _, n := range ns {
		rules = append(rules, fmt.Sprintf("-A %s -p %s -m comment --comment %s -m %s --dport %d %s",
			c.name, n.Protocol, quoteComment(n.Comment), n.Protocol, n.Port, redirectTarget(n.ToPort, n.ToPortEnd)))
	}
	return rules
}

// firewallRules renders UPROXY-FIREWALL: the REJECTs of service ports
// without endpoints (rejectRules), a DROP per firewall of f, then one
// listener guard per protocol that has listeners of f.
//
// A firewall's DROP matches its own destination, which only the packets
// that no allowed source prefix redirected still carry. The listener
// guard of a protocol drops a packet to a local address whose destination
// port is in the protocol's listener set of f (see the set table in
// sets.go) unless conntrack records a destination NAT (REDIRECT's), so a
// listener is reachable only through its rules. "The firewall chain" in
// docs/rules.md gives the kernel behaviour each match relies
// on, and why the matches stand in this order.
func firewallRules(c chainSpec, f Family, r Rules) []string {
	var ws []Firewall
	for _, w := range r.Firewalls {
		if r.TProxy != nil {
			break // TPROXY keeps the destination: the drops are in UPROXY-TPROXY
		}
		if w.validateDest() == nil && familyOf(w.Dest.Unmap()) == f {
			ws = append(ws, w)
		}
	}
	slices.SortFunc(ws, func(a, b Firewall) int {
		return cmp.Or(
			a.Dest.Unmap().Compare(b.Dest.Unmap()),
			cmp.Compare(a.Protocol, b.Protocol),
			cmp.Compare(a.Port, b.Port),
			cmp.Compare(a.Comment, b.Comment),
		)
	})
	rules := rejectRules(c, f, r)
	for _, w := range ws {
		rules = append(rules, fmt.Sprintf("-A %s -d %s/%d -p %s -m comment --comment %s -m %s --dport %d -j DROP",
			c.name, w.Dest.Unmap(), f.hostBits(), w.Protocol, quoteComment(w.Comment), w.Protocol, w.Port))
	}
	rules = slices.Compact(rules)
	for _, s := range setsOf(f) {
		if s.kind == listenerSet && len(s.members(r)) > 0 {
			rules = append(rules, fmt.Sprintf("-A %s -p %s -m set --match-set %s dst -m addrtype --dst-type LOCAL -m conntrack ! --ctstate DNAT -j DROP",
				c.name, s.proto, s.name))
		}
	}
	return rules
}

// rejectRules renders the REJECTs of f's Rejects, for UPROXY-FIREWALL.
// In redirect mode an exact destination's matches the original destination
// that conntrack recorded: REDIRECT has made the packet local, so it
// reaches the rule from INPUT whatever routes the node has for the
// service's address. In tproxy mode it matches the destination itself:
// the address is not intercepted, and its packets come from FORWARD or
// OUTPUT (see Reject). A node port's matches its own port to a local
// address: it is not intercepted.
func rejectRules(c chainSpec, f Family, r Rules) []string {
	var js []Reject
	for _, j := range r.Rejects {
		if j.validate() == nil && (j.NodePort && j.Family == f || !j.NodePort && familyOf(j.Dest.Unmap()) == f) {
			js = append(js, j)
		}
	}
	slices.SortFunc(js, func(a, b Reject) int {
		return cmp.Or(
			cmp.Compare(btoi(a.NodePort), btoi(b.NodePort)),
			a.Dest.Unmap().Compare(b.Dest.Unmap()),
			cmp.Compare(a.Protocol, b.Protocol),
			cmp.Compare(a.Port, b.Port),
			cmp.Compare(a.Comment, b.Comment),
		)
	})
	reject := "icmp-port-unreachable"
	if f == IPv6 {
		reject = "icmp6-port-unreachable"
	}
	// The proxy's own connections (OwnMark) pass: a refused destination
	// may also be another service's endpoint, which the proxy dials.
	notOwn := strings.Join(notOwnMatch, " ")
	var rules []string
	// In tproxy mode another service's traffic to a node address (an
	// external IP the node holds) keeps its port through TPROXY, which
	// marks it: a refused node port must not catch it.
	notTProxied := ""
	if r.TProxy != nil {
		notTProxied = " -m mark ! --mark " + r.TProxy.Routing.MarkString()
	}
	for _, j := range js {
		if j.NodePort {
			rules = append(rules, fmt.Sprintf("-A %s -p %s -m comment --comment %s -m addrtype --dst-type LOCAL -m %s --dport %d %s%s -j REJECT --reject-with %s",
				c.name, j.Protocol, quoteComment(j.Comment), j.Protocol, j.Port, notOwn, notTProxied, reject))
			continue
		}
		if r.TProxy != nil {
			// Not intercepted: the packet still has its destination.
			rules = append(rules, fmt.Sprintf("-A %s -d %s/%d -p %s -m comment --comment %s -m %s --dport %d %s -j REJECT --reject-with %s",
				c.name, j.Dest.Unmap(), f.hostBits(), j.Protocol, quoteComment(j.Comment), j.Protocol, j.Port, notOwn, reject))
			continue
		}
		rules = append(rules, fmt.Sprintf("-A %s -p %s -m comment --comment %s -m conntrack --ctorigdst %s --ctorigdstport %d %s -j REJECT --reject-with %s",
			c.name, j.Protocol, quoteComment(j.Comment), j.Dest.Unmap(), j.Port, notOwn, reject))
	}
	return slices.Compact(rules)
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// listenerOwnerRules renders UPROXY-LISTENERS: for each protocol that has
// listeners of f, a RETURN for a new connection to a listener port whose
// socket is transparent, then a REJECT for every other one.
//
// The proxy's listeners are transparent (IP_TRANSPARENT, which takes
// CAP_NET_ADMIN or CAP_NET_RAW), and the kernel's socket lookup
// (xt_socket, after REDIRECT has rewritten the destination) finds the
// socket that would receive the packet. So when the proxy has closed a
// listener, or died without a successor (SIGKILL leaves the rules and
// sets in the kernel, and frees every port), a process that binds the
// freed port receives none of the traffic the rules still send there:
// the client is refused instead. "--nowildcard" makes the match
// count the listeners, which are bound to the unspecified address.
func listenerOwnerRules(c chainSpec, f Family, r Rules) []string {
	reject := "icmp-port-unreachable"
	if f == IPv6 {
		reject = "icmp6-port-unreachable"
	}
	var rules []string
	for _, s := range setsOf(f) {
		if s.kind == listenerSet && len(s.members(r)) > 0 {
			rules = append(rules,
				fmt.Sprintf("-A %s -p %s -m set --match-set %s dst -m socket --transparent --nowildcard -j RETURN", c.name, s.proto, s.name),
				fmt.Sprintf("-A %s -p %s -m set --match-set %s dst -j REJECT --reject-with %s", c.name, s.proto, s.name, reject))
		}
	}
	return rules
}

// maxComment is the longest comment the kernel keeps (XT_MAX_COMMENT_LEN
// less the terminating NUL); iptables-nft cuts longer ones silently.
const maxComment = 255

// quoteComment returns s as iptables-save prints a comment: bare when it is
// non-empty and made only of letters, digits, '_' and '-', otherwise in
// double quotes with each double quote, backslash and single quote escaped
// by a backslash (libxtables' xtables_save_string). Control characters,
// which would end or corrupt the restore line, become spaces, invalid
// UTF-8 becomes U+FFFD, and s is cut to maxComment bytes at a rune
// boundary, so the result reads back unchanged.
func quoteComment(s string) string {
	s = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
	if len(s) > maxComment {
		n := maxComment
		for n > 0 && !utf8.RuneStart(s[n]) {
			n--
		}
		s = s[:n]
	}
	bare := s != ""
	for _, r := range s {
		if !(r == '_' || r == '-' || '0' <= r && r <= '9' || 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z') {
			bare = false
			break
		}
	}
	if bare {
		return s
	}
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == '"' || c == '\\' || c == '\'' {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	b.WriteByte('"')
	return b.String()
}

// chainKey names one chain of one table.
type chainKey struct{ table, chain string }

// chainState is what one of uproxy's chains holds.
type chainState struct {
	// exists reports whether the chain is declared.
	exists bool
	// rules are its "-A" lines, in order.
	rules []string
}

// state is the content of every chain in the chain table.
type state map[chainKey]chainState

// parseState extracts the state of uproxy's chains from iptables-save
// output or from Render output; both have the same form. Chains that the
// text does not declare are absent (exists false). Anything that is not one
// of uproxy's chains is ignored.
func parseState(text []byte) state {
	st := make(state, len(chains))
	for _, c := range chains {
		st[chainKey{c.table, c.name}] = chainState{}
	}
	for table, line := range tableLines(text) {
		switch {
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			if cs, ok := st[chainKey{table, name}]; ok {
				cs.exists = true
				st[chainKey{table, name}] = cs
			}
		case strings.HasPrefix(line, "-A "):
			name, _, _ := strings.Cut(line[len("-A "):], " ")
			if cs, ok := st[chainKey{table, name}]; ok {
				cs.rules = append(cs.rules, line)
				st[chainKey{table, name}] = cs
			}
		}
	}
	return st
}

// equal reports whether st and o hold the same chains with the same rules.
func (st state) equal(o state) bool {
	return maps.EqualFunc(st, o, func(a, b chainState) bool {
		return a.exists == b.exists && slices.Equal(a.rules, b.rules)
	})
}

// ruleCount returns the number of rules in st.
func (st state) ruleCount() int {
	n := 0
	for _, cs := range st {
		n += len(cs.rules)
	}
	return n
}
