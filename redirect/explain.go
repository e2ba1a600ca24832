package redirect

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// MatchingRules returns uproxy's rules in the kernel that catch traffic
// to dst over proto from client (an invalid client: any client), as
// iptables-save (ip6tables-save for an IPv6 dst) prints them, each after
// its table in brackets: "[nat] -A UPROXY-SERVICES -d 10.96.0.10/32 ...".
// They are the intercepts (in nat, or in mangle in tproxy mode) and the
// firewall's drops, in the order of the tables and then of
// iptables-save. A table that cannot be read gives a line that starts
// with "#" and says why, and the other table is still read.
//
// A rule of the shared layout, or a gate of tproxy mode, names a service
// or node-port set instead of an address and port: it catches dst when
// dst is a member of the set, which ipset test answers (a non-zero exit,
// or any other failure, counts as not a member), once per set.
//
// x runs iptables-save and ipset, one call at a time; nil means OSExec.
// MatchingRules changes nothing in the kernel.
func MatchingRules(ctx context.Context, x Exec, dst netip.AddrPort, proto Protocol, client netip.Addr, tproxy bool) []string {
	if x == nil {
		x = OSExec{}
	}
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	f := familyOf(dst.Addr())
	save := f.command("-save")
	tables := []string{"nat", "filter"}
	if tproxy {
		tables = []string{"mangle", "filter"}
	}
	port := strconv.Itoa(int(dst.Port()))
	dstMatch := "-d " + netip.PrefixFrom(dst.Addr(), f.hostBits()).String() + " "
	inSet := map[string]bool{}
	member := func(set setSpec) bool {
		m := portMember(dst.Port())
		if set.kind == serviceSet {
			m = setMember{addr: dst.Addr(), proto: proto, port: dst.Port()}
		}
		key := set.name + " " + m.String()
		if v, ok := inSet[key]; ok {
			return v
		}
		_, err := x.Run(ctx, ipsetCommand, []string{"test", set.name, m.String()}, nil)
		inSet[key] = err == nil
		return err == nil
	}
	var out []string
	for _, table := range tables {
		text, err := x.Run(ctx, save, []string{"-t", table}, nil)
		if err != nil {
			out = append(out, fmt.Sprintf("# table %s: %v", table, err))
			continue
		}
		for _, line := range strings.Split(string(text), "\n") {
			if !ownRule(table, line) || !strings.Contains(line, "-p "+string(proto)+" ") {
				continue
			}
			if orig, ok := flagValue(line, "--ctorigdstport"); ok {
				// A REJECT of a service port without endpoints, by the
				// destination the client chose.
				if orig != port {
					continue
				}
				if d, ok := flagValue(line, "--ctorigdst"); ok && d != dst.Addr().Unmap().String() {
					continue
				}
			} else if !strings.Contains(line, "--dport "+port+" ") {
				name, ok := flagValue(line, "--match-set")
				if !ok {
					continue
				}
				set, ok := setNamed(name)
				if !ok || set.kind != serviceSet && set.kind != nodePortSet || !member(set) {
					continue
				}
			}
			// Address rules name the address; node-port rules name none.
			if !strings.Contains(line, dstMatch) && strings.Contains(line, "-d ") {
				continue
			}
			if src, ok := flagValue(line, "-s"); ok && client.IsValid() {
				if pfx, err := netip.ParsePrefix(src); err == nil && !pfx.Contains(client) {
					continue
				}
			}
			out = append(out, "["+table+"] "+line)
		}
	}
	return out
}

// ownRule reports whether line, from iptables-save -t table, appends a
// rule to one of uproxy's chains of that table.
func ownRule(table, line string) bool {
	rest, ok := strings.CutPrefix(line, "-A ")
	if !ok {
		return false
	}
	name, _, _ := strings.Cut(rest, " ")
	for _, c := range chains {
		if c.table == table && c.name == name {
			return true
		}
	}
	return false
}

// setNamed returns the set of the set table named name.
func setNamed(name string) (setSpec, bool) {
	for _, s := range sets {
		if s.name == name {
			return s, true
		}
	}
	return setSpec{}, false
}

// flagValue returns the value following flag, not negated, in a rule as
// iptables-save prints it.
func flagValue(line, flag string) (string, bool) {
	f := ruleFields(line)
	for i := 0; i+1 < len(f); i++ {
		if f[i] == flag && (i == 0 || f[i-1] != "!") {
			return f[i+1], true
		}
	}
	return "", false
}
