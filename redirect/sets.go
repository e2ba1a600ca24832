package redirect

import (
	"bytes"
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// setKind says what a set of the set table holds.
type setKind int

// The kinds of sets.
const (
	// listenerSet holds the ports of r.Listeners of the set's family and
	// protocol; UPROXY-FIREWALL guards them all with one rule that
	// matches the set (see firewallRules).
	listenerSet setKind = iota
	// serviceSet holds, in the shared layout (Rules.Shared), the
	// address, protocol and port of every intercept of the set's family
	// that no Firewall guards; one rule per protocol sends what it
	// matches to the protocol's shared listener. In tproxy mode with
	// per-service rules, it holds those of every intercept and Firewall
	// of the family, and gates the per-service rules. The package
	// documentation describes both.
	serviceSet
	// nodePortSet holds, in the shared layout, the ports of the node
	// ports of the set's family and protocol; one rule sends what it
	// matches to the protocol's shared listener. In tproxy mode with
	// per-service rules, it holds the same ports and gates the node
	// ports' rules.
	nodePortSet
)

// setSpec describes one kernel set (ipset) that uproxy owns.
type setSpec struct {
	// name is the set's name, at most 31 bytes (the kernel's
	// IPSET_MAXNAMELEN less the terminating NUL).
	name string
	// family is the family whose Syncer and Cleanup own the set: only
	// that family's rules reference it, only they write or destroy it.
	family Family
	// proto is the protocol of the packets the set's rule matches, or
	// empty for a service set, whose members carry their protocol and
	// which the rules of both protocols match.
	proto Protocol
	// kind says what the set holds.
	kind setKind
}

// setType is the type and options of every bitmap:port set of the set
// table (listener and node-port sets), as ipset save prints them after
// the name in a set's create line.
//
// A bitmap:port set holds bare port numbers and has no family of its
// own (NFPROTO_UNSPEC), so the set match of iptables and ip6tables alike
// accept it; it matches the destination port ("dst") of a TCP or UDP
// packet of either family, whatever the protocol, so the rule that
// matches it names the protocol. A lookup is one bit test, so the guard
// costs the same for any number of listeners, and the set is one bit per
// port.
const setType = "bitmap:port range 0-65535"

// serviceSetMax is the most members a service set holds (ipset's
// maxelem; the default, 65536, is less than the service addresses and
// ports of a large cluster). A hash set allocates per member, not up to
// this bound.
const serviceSetMax = 1 << 20

// serviceSetType returns the type and options of the service set of f, as
// ipset save prints them after the name, less the options that the
// kernel chooses and changes as the set grows (see normHeader).
//
// A hash:ip,port set of family inet or inet6 matches, with "dst,dst", a
// packet's destination address together with its protocol and
// destination port: one hash lookup for any number of services, where
// the per-service layout walks one rule per service port.
func serviceSetType(f Family) string {
	family := "inet"
	if f == IPv6 {
		family = "inet6"
	}
	return fmt.Sprintf("hash:ip,port family %s maxelem %d", family, serviceSetMax)
}

// The names of uproxy's sets.
const (
	listenersTCP4 = "uproxy-listeners-tcp4"
	listenersUDP4 = "uproxy-listeners-udp4"
	listenersTCP6 = "uproxy-listeners-tcp6"
	listenersUDP6 = "uproxy-listeners-udp6"
	services4     = "uproxy-services4"
	services6     = "uproxy-services6"
	nodePortsTCP4 = "uproxy-nodeports-tcp4"
	nodePortsUDP4 = "uproxy-nodeports-udp4"
	nodePortsTCP6 = "uproxy-nodeports-tcp6"
	nodePortsUDP6 = "uproxy-nodeports-udp6"
)

// sets is every set uproxy creates. Render, Sync and Cleanup all walk it:
// a new set is added here and nowhere else.
//
// The sets are per family although a bitmap:port set would serve both: a
// set shared by the IPv4 and the IPv6 Syncer would hold the listener
// ports of both, and each Syncer would take the other's ports for drift
// (and delete them) or need to know them; and Cleanup of one family
// could not destroy a set that the other family's rule still references.
// With a set per family and protocol, each Syncer owns its sets outright,
// as it owns its chains. (A hash:ip,port set has a family anyway.)
var sets = []setSpec{
	{name: listenersTCP4, family: IPv4, proto: TCP, kind: listenerSet},
	{name: listenersUDP4, family: IPv4, proto: UDP, kind: listenerSet},
	{name: listenersTCP6, family: IPv6, proto: TCP, kind: listenerSet},
	{name: listenersUDP6, family: IPv6, proto: UDP, kind: listenerSet},
	{name: services4, family: IPv4, kind: serviceSet},
	{name: nodePortsTCP4, family: IPv4, proto: TCP, kind: nodePortSet},
	{name: nodePortsUDP4, family: IPv4, proto: UDP, kind: nodePortSet},
	{name: services6, family: IPv6, kind: serviceSet},
	{name: nodePortsTCP6, family: IPv6, proto: TCP, kind: nodePortSet},
	{name: nodePortsUDP6, family: IPv6, proto: UDP, kind: nodePortSet},
}

// setsOf returns the sets of family f, in table order.
func setsOf(f Family) []setSpec {
	var out []setSpec
	for _, s := range sets {
		if s.family == f {
			out = append(out, s)
		}
	}
	return out
}

// setOf returns the set of kind k, family f and protocol p (empty for a
// service set). It panics when the set table has none: that is a bug.
func setOf(k setKind, f Family, p Protocol) setSpec {
	for _, s := range sets {
		if s.kind == k && s.family == f && s.proto == p {
			return s
		}
	}
	panic(fmt.Sprintf("redirect: no set of kind %d for %s %q", k, f, p))
}

// ListenerSet returns the name of the set that holds the listener ports
// of family f and protocol p (see Listener).
func ListenerSet(f Family, p Protocol) string { return setOf(listenerSet, f, p).name }

// ServiceSet returns the name of the hash:ip,port set that holds the
// service addresses of family f (see Rules.Shared). It panics for an
// unknown family.
func ServiceSet(f Family) string { return setOf(serviceSet, f, "").name }

// NodePortSet returns the name of the set that holds the node ports of
// family f and protocol p (see Rules.Shared). It panics for an unknown
// family or protocol.
func NodePortSet(f Family, p Protocol) string { return setOf(nodePortSet, f, p).name }

// header returns the type and options s is created with, as ipset save
// prints them (less what normHeader drops).
func (s setSpec) header() string {
	if s.kind == serviceSet {
		return serviceSetType(s.family)
	}
	return setType
}

// setMember is one member of a set: a port, for a bitmap:port set, or an
// address, protocol and port, for a hash:ip,port set.
type setMember struct {
	// addr is the address of a hash:ip,port member (unmapped), invalid
	// for a port.
	addr netip.Addr
	// proto is the protocol of a hash:ip,port member, empty for a port.
	proto Protocol
	port  uint16
}

// String returns m as ipset save prints it and ipset restore takes it:
// "40001", or "10.96.0.10,tcp:80" and "2001:db8::10,udp:53".
func (m setMember) String() string { return string(m.appendTo(nil)) }

// appendTo appends m as String returns it to b.
func (m setMember) appendTo(b []byte) []byte {
	if m.addr.IsValid() {
		b = m.addr.AppendTo(b)
		b = append(b, ',')
		b = append(b, m.proto...)
		b = append(b, ':')
	}
	return strconv.AppendUint(b, uint64(m.port), 10)
}

// Equal reports whether m and o are the same member.
func (m setMember) Equal(o setMember) bool { return m == o }

// compare orders members by address, protocol and port: bare ports
// ascending, as ipset save prints a bitmap:port set, and hash:ip,port
// members in a deterministic order (ipset save prints those in hash
// order).
func (m setMember) compare(o setMember) int {
	return cmp.Or(m.addr.Compare(o.addr), cmp.Compare(m.proto, o.proto), cmp.Compare(m.port, o.port))
}

// parseMember parses a member as ipset save prints it; ok is false for
// anything else (another set type's members).
func parseMember(s string) (m setMember, ok bool) {
	addr, protoPort, isHash := strings.Cut(s, ",")
	if !isHash {
		p, err := strconv.ParseUint(s, 10, 16)
		return setMember{port: uint16(p)}, err == nil
	}
	proto, port, found := strings.Cut(protoPort, ":")
	a, err := netip.ParseAddr(addr)
	if !found || err != nil || a.Zone() != "" || (Protocol(proto) != TCP && Protocol(proto) != UDP) {
		return m, false
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return m, false
	}
	return setMember{addr: a.Unmap(), proto: Protocol(proto), port: uint16(p)}, true
}

// portMember returns the member of a bitmap:port set for port.
func portMember(port uint16) setMember { return setMember{port: port} }

// sortMembers sorts ms and removes duplicates.
func sortMembers(ms []setMember) []setMember {
	slices.SortFunc(ms, setMember.compare)
	return slices.Compact(ms)
}

// members returns what s holds for r: sorted by setMember.compare,
// without duplicates. Only valid parts of r of s's family count, and the
// service and node-port sets have members only in the shared layout and
// in tproxy mode.
func (s setSpec) members(r Rules) []setMember {
	var ms []setMember
	switch s.kind {
	case listenerSet:
		for _, l := range r.Listeners {
			if l.validate() == nil && l.Family == s.family && l.Protocol == s.proto {
				ms = append(ms, portMember(l.Port))
			}
		}
	case serviceSet:
		if gatedTProxy(r) {
			for _, e := range tproxyEntries(s.family, r) {
				ms = append(ms, setMember{addr: e.key.dest, proto: e.key.proto, port: e.key.port})
			}
			break
		}
		ms = make([]setMember, 0, len(r.Intercepts))
		for i := range sharedIntercepts(s.family, r) {
			ms = append(ms, setMember{addr: i.Dest.Unmap(), proto: i.Protocol, port: i.Port})
		}
	case nodePortSet:
		var ns []NodePort
		if gatedTProxy(r) {
			ns = tproxyNodePorts(s.family, r)
		} else {
			ns = slices.Collect(sharedNodePorts(s.family, r))
		}
		for _, n := range ns {
			if n.Protocol == s.proto {
				ms = append(ms, portMember(n.Port))
			}
		}
	}
	return sortMembers(ms)
}

// setContent is what one of uproxy's sets holds.
type setContent struct {
	// exists reports whether the set exists.
	exists bool
	// header is the set's type and options as ipset save prints them
	// after the name in the create line, less what normHeader drops;
	// setSpec.header for uproxy's own.
	header string
	// members are the set's members, sorted by setMember.compare,
	// without duplicates.
	members []setMember
}

// setState is the content of every set of one family, by name. A set of
// the family that is missing from the map does not exist.
type setState map[string]setContent

// wantSets returns the sets of family f that r asks for: a set exists,
// holding its members, when it has any, and does not exist otherwise, so
// that rules without listeners or the shared layout need no set (and no
// ipset).
func wantSets(f Family, r Rules) setState {
	st := setState{}
	for _, s := range setsOf(f) {
		if m := s.members(r); len(m) > 0 {
			st[s.name] = setContent{exists: true, header: s.header(), members: m}
		} else {
			st[s.name] = setContent{}
		}
	}
	return st
}

// wanted returns the kinds of the sets of st that exist.
func (st setState) wanted() map[setKind]bool {
	kinds := map[setKind]bool{}
	for _, s := range sets {
		if st[s.name].exists {
			kinds[s.kind] = true
		}
	}
	return kinds
}

// equal reports whether st and o hold the same sets with the same members.
func (st setState) equal(o setState) bool {
	for _, s := range sets {
		a, b := st[s.name], o[s.name]
		if a.exists != b.exists || a.exists && (a.header != b.header || !slices.Equal(a.members, b.members)) {
			return false
		}
	}
	return true
}

// memberCount returns the number of members of the sets of st.
func (st setState) memberCount() int {
	n := 0
	for _, c := range st {
		n += len(c.members)
	}
	return n
}

// RenderSetUpdate returns the ipset restore input that turns uproxy's sets
// of family f from what old asks for into what r asks for, or nothing
// when they are the same. It is a pure function, like Render, and sees
// only the valid listeners of f in old and r and, in the shared layout
// and in tproxy mode, their valid intercepts and node ports of f (and, in
// tproxy mode with per-service rules, their firewalls).
//
// A set that r needs and old did not is created ("create NAME
// bitmap:port range 0-65535 -exist", or "create NAME hash:ip,port family
// inet maxelem 1048576 -exist" for a service set) before its members are
// added; a set that both need gets "del NAME MEMBER -exist" for each
// member that only old has, then "add NAME MEMBER -exist" for each that
// only r has, in set-table order and member order (ascending ports; for
// a service set, by address, protocol and port). A set that r no longer
// needs is not destroyed here: Render's rules stop referencing it only
// when iptables-restore has run, so a Syncer destroys it with ipset
// destroy after that.
func RenderSetUpdate(f Family, old, r Rules) []byte {
	return renderSetUpdate(wantSets(f, old), wantSets(f, r)).input
}

// setUpdate is the ipset restore input that turns some sets into others.
type setUpdate struct {
	// input is the ipset restore input, empty when nothing changes.
	input []byte
	// sets are the names of the sets input changes, in set-table order.
	sets []string
	// members is the number of members input adds or deletes.
	members int
}

// renderSetUpdate returns the ipset restore input that turns the sets in
// have into those in want, except for sets that want does not have, which
// the caller destroys after the rules referencing them are gone. A set
// that exists with another type or options than want's is destroyed and
// created anew (which fails while a rule references it).
func renderSetUpdate(have, want setState) setUpdate {
	var u setUpdate
	var b bytes.Buffer
	var buf [64]byte // one member
	for _, s := range sets {
		w, ok := want[s.name]
		if !ok || !w.exists {
			continue
		}
		start := b.Len()
		h := have[s.name]
		if h.exists && h.header != w.header {
			fmt.Fprintf(&b, "destroy %s\n", s.name)
			h = setContent{}
		}
		if !h.exists {
			fmt.Fprintf(&b, "create %s %s -exist\n", s.name, w.header)
		}
		line := func(op string, m setMember) {
			b.WriteString(op)
			b.WriteByte(' ')
			b.WriteString(s.name)
			b.WriteByte(' ')
			b.Write(m.appendTo(buf[:0]))
			b.WriteString(" -exist\n")
			u.members++
		}
		for _, m := range minus(h.members, w.members) {
			line("del", m)
		}
		for _, m := range minus(w.members, h.members) {
			line("add", m)
		}
		if b.Len() > start {
			u.sets = append(u.sets, s.name)
		}
	}
	u.input = b.Bytes()
	return u
}

// setsToDestroy returns the names of the sets that exist in have but not
// in want, in set-table order.
func setsToDestroy(have, want setState) []string {
	var names []string
	for _, s := range sets {
		if _, ok := want[s.name]; ok && have[s.name].exists && !want[s.name].exists {
			names = append(names, s.name)
		}
	}
	return names
}

// minus returns the elements of a that b lacks; both are sorted by
// setMember.compare. The result may share a's storage.
func minus(a, b []setMember) []setMember {
	if len(b) == 0 {
		return a // a set created or filled anew: every member
	}
	var out []setMember
	j := 0
	for _, x := range a {
		for j < len(b) && b[j].compare(x) < 0 {
			j++
		}
		if j == len(b) || b[j] != x {
			out = append(out, x)
		}
	}
	return out
}

// kernelChosen are the create options that ipset save prints but the
// kernel chooses: a hash set's hashsize grows with its members, and
// bucketsize and initval (ipset 7.x, Linux 5.11 on) are picked at
// creation. normHeader drops them, so that a set is compared by what
// uproxy asks for.
var kernelChosen = []string{"hashsize", "bucketsize", "initval"}

// normHeader returns the type and options of a create line of ipset save
// without the options in kernelChosen and their values.
func normHeader(fields []string) string {
	var out []string
	for i := 0; i < len(fields); i++ {
		if i > 0 && slices.Contains(kernelChosen, fields[i]) && i+1 < len(fields) {
			i++
			continue
		}
		out = append(out, fields[i])
	}
	return strings.Join(out, " ")
}

// parseSetSave returns the content of set name from the output of ipset
// save (one set or all of them). Lines of other sets, and members that
// are neither ports nor "address,protocol:port" of TCP or UDP (or carry
// options, such as a timeout), are ignored.
func parseSetSave(name string, text []byte) setContent {
	var c setContent
	for line := range strings.Lines(string(text)) {
		f := strings.Fields(line)
		if len(f) < 2 || f[1] != name {
			continue
		}
		switch f[0] {
		case "create":
			c.exists = true
			c.header = normHeader(f[2:])
		case "add":
			if len(f) == 3 {
				if m, ok := parseMember(f[2]); ok {
					c.members = append(c.members, m)
				}
			}
		}
	}
	c.members = sortMembers(c.members)
	return c
}
