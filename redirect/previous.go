package redirect

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
)

// PreviousListener identifies a listener in the rules a previous uproxy
// left in the kernel: the comment of its rules (the service port, as the
// proxier names it) and its protocol.
type PreviousListener struct {
	Comment  string
	Protocol Protocol
}

// PreviousListenerPorts reads, from iptables-save output, the listener
// port each of uproxy's REDIRECT or TPROXY rules sends its traffic to. A
// uproxy restarted after a crash binds these ports again where it can, so
// the rules left behind are valid as soon as its listeners are open,
// before its first sync. A comment whose rules name different ports (none
// should) is left out.
func PreviousListenerPorts(saved []byte) map[PreviousListener]uint16 {
	out := map[PreviousListener]uint16{}
	conflict := map[PreviousListener]bool{}
	for line := range bytes.Lines(saved) {
		s := strings.TrimSpace(string(line))
		if !strings.HasPrefix(s, "-A UPROXY-") {
			continue
		}
		f := ruleFields(s)
		var key PreviousListener
		var port uint16
		for i := 0; i+1 < len(f); i++ {
			switch f[i] {
			case "-p":
				switch f[i+1] {
				case "tcp":
					key.Protocol = TCP
				case "udp":
					key.Protocol = UDP
				}
			case "--comment":
				key.Comment = f[i+1]
			case "--to-ports", "--on-port":
				// A range's first port: a shared listener's ports
				// follow it (InterceptRule.ToPortEnd).
				first, _, _ := strings.Cut(f[i+1], "-")
				if n, err := strconv.ParseUint(first, 10, 16); err == nil {
					port = uint16(n)
				}
			}
		}
		if key.Comment == "" || port == 0 || conflict[key] {
			continue
		}
		if p, ok := out[key]; ok && p != port {
			delete(out, key)
			conflict[key] = true
			continue
		}
		out[key] = port
	}
	return out
}

// SavedRules returns iptables-save's (or ip6tables-save's) output for the
// table where mode's intercepts live: nat for REDIRECT, mangle for TPROXY.
func SavedRules(ctx context.Context, f Family, tproxy bool) ([]byte, error) {
	table := "nat"
	if tproxy {
		table = "mangle"
	}
	cmd := exec.CommandContext(ctx, f.command("-save"), "-t", table)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s -t %s: %w: %s", f.command("-save"), table, err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// ruleFields splits a rule as iptables-save prints it into its words,
// keeping a double-quoted word (a comment with spaces, such as the
// shared layout's) whole and unquoted: iptables-save escapes '"' and '\'
// inside it with a backslash.
func ruleFields(s string) []string {
	var out []string
	for i := 0; i < len(s); {
		for i < len(s) && s[i] == ' ' {
			i++
		}
		if i == len(s) {
			break
		}
		if s[i] != '"' {
			j := strings.IndexByte(s[i:], ' ')
			if j < 0 {
				j = len(s) - i
			}
			out = append(out, s[i:i+j])
			i += j
			continue
		}
		var w strings.Builder
		for i++; i < len(s) && s[i] != '"'; i++ {
			if s[i] == '\\' && i+1 < len(s) {
				i++
			}
			w.WriteByte(s[i])
		}
		out = append(out, w.String())
		i++ // the closing quote
	}
	return out
}
