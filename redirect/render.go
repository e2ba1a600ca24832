package redirect

import (
	"bytes"
	"cmp"
	"fmt"
	"maps"
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
	// rules renders the chain's rules for family f in the canonical form
	// iptables-save prints, each starting with "-A <name> ".
	rules func(c chainSpec, f Family, r Rules) []string
}

// chains is every chain uproxy creates, in every table. Render, Sync and
// Cleanup all walk it: a new chain is added here and nowhere else. Chains
// of one table are written in one iptables-restore section; tables appear
// in the order of their first chain.
var chains = []chainSpec{
	{
		table:       "nat",
		name:        "UPROXY-SERVICES",
		from:        []string{"PREROUTING", "OUTPUT"},
		jumpComment: "uproxy service portals",
		rules:       serviceRules,
	},
}

// jumpSpec returns the rule spec of the jump to c, as go-iptables takes it.
func (c chainSpec) jumpSpec() []string {
	return []string{"-m", "comment", "--comment", c.jumpComment, "-j", c.name}
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

// Render returns the iptables-restore --noflush input that makes uproxy's
// own chains hold exactly what r asks for family f, and touches nothing
// else.
//
// For each table it declares each of uproxy's chains (":NAME - [0:0]",
// which creates the chain or, under --noflush, flushes it), adds the rules
// and commits. The rules are in the exact form iptables-save prints them
// back, so a Syncer can compare the kernel's state with the rendering line
// by line. Render keeps only the intercepts of family f, skips invalid ones
// (Syncer.Sync rejects those before rendering) and sorts them by
// destination, protocol and port, so its output depends only on the set of
// intercepts. It is a pure function.
func Render(f Family, r Rules) []byte {
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

// serviceRules renders UPROXY-SERVICES: one REDIRECT per intercept of f.
func serviceRules(c chainSpec, f Family, r Rules) []string {
	var is []Intercept
	for _, i := range r.Intercepts {
		if i.validate() == nil && familyOf(i.Dest.Unmap()) == f {
			is = append(is, i)
		}
	}
	slices.SortFunc(is, func(a, b Intercept) int {
		return cmp.Or(
			a.Dest.Unmap().Compare(b.Dest.Unmap()),
			cmp.Compare(a.Protocol, b.Protocol),
			cmp.Compare(a.Port, b.Port),
			cmp.Compare(a.ToPort, b.ToPort),
			cmp.Compare(a.Comment, b.Comment),
		)
	})
	rules := make([]string, 0, len(is))
	for _, i := range is {
		rules = append(rules, fmt.Sprintf("-A %s -d %s/%d -p %s -m comment --comment %s -m %s --dport %d -j REDIRECT --to-ports %d",
			c.name, i.Dest.Unmap(), f.hostBits(), i.Protocol, quoteComment(i.Comment), i.Protocol, i.Port, i.ToPort))
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
	table := ""
	for line := range strings.Lines(string(text)) {
		line = strings.TrimRight(line, "\r\n")
		switch {
		case strings.HasPrefix(line, "*"):
			table = line[1:]
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
