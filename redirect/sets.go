package redirect

import (
	"bytes"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// setSpec describes one kernel set (ipset) that uproxy owns.
//
// Every set of the table holds listener ports: the members of the set of
// a family and protocol are the ports of r.Listeners of that family and
// protocol, and UPROXY-FIREWALL guards them all with one rule that
// matches the set (see firewallRules). A later kind of set would add a
// field saying what it holds.
type setSpec struct {
	// name is the set's name, at most 31 bytes (the kernel's
	// IPSET_MAXNAMELEN less the terminating NUL).
	name string
	// family is the family whose Syncer and Cleanup own the set: only
	// that family's rules reference it, only they write or destroy it.
	family Family
	// proto is the protocol of the packets the set's rule matches.
	proto Protocol
}

// setType is the type and options of every set of the set table, as
// ipset save prints them after the name in a set's create line.
//
// A bitmap:port set holds bare port numbers and has no family of its
// own (NFPROTO_UNSPEC), so the set match of iptables and ip6tables alike
// accept it; it matches the destination port ("dst") of a TCP or UDP
// packet of either family, whatever the protocol, so the rule that
// matches it names the protocol. A lookup is one bit test, so the guard
// costs the same for any number of listeners, and the set takes 8 KiB.
const setType = "bitmap:port range 0-65535"

// The names of uproxy's sets.
const (
	listenersTCP4 = "uproxy-listeners-tcp4"
	listenersUDP4 = "uproxy-listeners-udp4"
	listenersTCP6 = "uproxy-listeners-tcp6"
	listenersUDP6 = "uproxy-listeners-udp6"
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
// as it owns its chains.
var sets = []setSpec{
	{name: listenersTCP4, family: IPv4, proto: TCP},
	{name: listenersUDP4, family: IPv4, proto: UDP},
	{name: listenersTCP6, family: IPv6, proto: TCP},
	{name: listenersUDP6, family: IPv6, proto: UDP},
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

// setNames returns the names of the sets of f, for error messages.
func setNames(f Family) string {
	var names []string
	for _, s := range setsOf(f) {
		names = append(names, s.name)
	}
	return strings.Join(names, ",")
}

// members returns the ports of the valid listeners of s's family and
// protocol in r, ascending and without duplicates.
func (s setSpec) members(r Rules) []uint16 {
	var ports []uint16
	for _, l := range r.Listeners {
		if l.validate() == nil && l.Family == s.family && l.Protocol == s.proto {
			ports = append(ports, l.Port)
		}
	}
	slices.Sort(ports)
	return slices.Compact(ports)
}

// setContent is what one of uproxy's sets holds.
type setContent struct {
	// exists reports whether the set exists.
	exists bool
	// header is the set's type and options as ipset save prints them
	// after the name in the create line; setType for uproxy's own.
	header string
	// members are the set's ports, ascending and without duplicates.
	members []uint16
}

// setState is the content of every set of one family, by name. A set of
// the family that is missing from the map does not exist.
type setState map[string]setContent

// wantSets returns the sets of family f that r asks for: a set exists,
// holding its members, when it has any, and does not exist otherwise, so
// that rules without listeners need no set (and no ipset).
func wantSets(f Family, r Rules) setState {
	st := setState{}
	for _, s := range setsOf(f) {
		if m := s.members(r); len(m) > 0 {
			st[s.name] = setContent{exists: true, header: setType, members: m}
		} else {
			st[s.name] = setContent{}
		}
	}
	return st
}

// wanted reports whether st has a set that exists.
func (st setState) wanted() bool {
	for _, c := range st {
		if c.exists {
			return true
		}
	}
	return false
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
// only the valid listeners of f in old and r.
//
// A set that r needs and old did not is created ("create NAME
// bitmap:port range 0-65535 -exist") before its members are added; a set
// that both need gets "del NAME PORT -exist" for each port that only old
// has, then "add NAME PORT -exist" for each that only r has, in set-table
// order and ascending port order. A set that r no longer needs is not
// destroyed here: Render's rules stop referencing it only when
// iptables-restore has run, so a Syncer destroys it with ipset destroy
// after that.
func RenderSetUpdate(f Family, old, r Rules) []byte {
	return renderSetUpdate(wantSets(f, old), wantSets(f, r))
}

// renderSetUpdate returns the ipset restore input that turns the sets in
// have into those in want, except for sets that want does not have, which
// the caller destroys after the rules referencing them are gone. A set
// that exists with another type or options than want's is destroyed and
// created anew (which fails while a rule references it).
func renderSetUpdate(have, want setState) []byte {
	var b bytes.Buffer
	for _, s := range sets {
		w, ok := want[s.name]
		if !ok || !w.exists {
			continue
		}
		h := have[s.name]
		if h.exists && h.header != w.header {
			fmt.Fprintf(&b, "destroy %s\n", s.name)
			h = setContent{}
		}
		if !h.exists {
			fmt.Fprintf(&b, "create %s %s -exist\n", s.name, w.header)
		}
		for _, p := range minus(h.members, w.members) {
			fmt.Fprintf(&b, "del %s %d -exist\n", s.name, p)
		}
		for _, p := range minus(w.members, h.members) {
			fmt.Fprintf(&b, "add %s %d -exist\n", s.name, p)
		}
	}
	return b.Bytes()
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

// minus returns the elements of a that b lacks; both are ascending.
func minus(a, b []uint16) []uint16 {
	var out []uint16
	j := 0
	for _, x := range a {
		for j < len(b) && b[j] < x {
			j++
		}
		if j == len(b) || b[j] != x {
			out = append(out, x)
		}
	}
	return out
}

// parseSetSave returns the content of set name from the output of ipset
// save (one set or all of them). Lines of other sets, and members that
// are not ports, are ignored.
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
			c.header = strings.Join(f[2:], " ")
		case "add":
			if len(f) == 3 {
				if p, err := strconv.ParseUint(f[2], 10, 16); err == nil {
					c.members = append(c.members, uint16(p))
				}
			}
		}
	}
	slices.Sort(c.members)
	c.members = slices.Compact(c.members)
	return c
}
