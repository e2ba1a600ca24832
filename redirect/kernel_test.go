package redirect

import (
	"context"
	"maps"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/uproxy/uproxy/internal/testlab"
)

// The tests in this file run real iptables and ipset, each in a network
// namespace of its own (testlab.RunInNetns), never in the root namespace: ipsets
// are per network namespace too.

// nsCommand runs a command inside the test's namespace and returns its
// stdout. It refuses to run outside one.
func nsCommand(t *testing.T, name string, args ...string) string {
	t.Helper()
	if !testlab.InNetns() {
		t.Fatalf("refusing to run %s outside a test network namespace", name)
	}
	out, err := exec.Command(name, args...).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, stderr)
	}
	return string(out)
}

// countingExec is OSExec that counts the commands it runs, by name.
type countingExec struct {
	mu    sync.Mutex
	calls map[string]int
}

var _ Exec = (*countingExec)(nil)

func (c *countingExec) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	c.mu.Lock()
	c.calls[name]++
	c.mu.Unlock()
	return OSExec{}.Run(ctx, name, args, stdin)
}

// take returns and resets the counts.
func (c *countingExec) take() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	calls := c.calls
	c.calls = map[string]int{}
	return calls
}

var counters = regexp.MustCompile(`\[\d+:\d+\]`)

// savedTables returns iptables-save -t nat, -t mangle and -t filter for
// f, one after the other, without comments and with the chain counters
// zeroed.
func savedTables(t *testing.T, f Family) string {
	t.Helper()
	var lines []string
	for _, table := range []string{"nat", "mangle", "filter"} {
		for line := range strings.Lines(nsCommand(t, f.command("-save"), "-t", table)) {
			if !strings.HasPrefix(line, "#") {
				lines = append(lines, counters.ReplaceAllString(line, "[0:0]"))
			}
		}
	}
	return strings.Join(lines, "")
}

// kernelRules is the test's rule set, with every kind of rule of both
// families and protocols, and comments that need quoting and escaping.
var kernelRules = Rules{
	Intercepts: []InterceptRule{
		svc("default/web:http", TCP, "10.96.0.10", 80, 40001),
		svc("kube-system/kube-dns:dns", UDP, "10.96.0.2", 53, 40002),
		svc("kube-system/kube-dns:dns-tcp", TCP, "10.96.0.2", 53, 40003),
		svc(`odd "svc" it's a \ back`, TCP, "10.96.1.1", 8080, 40004),
		svc("plain", TCP, "10.96.1.2", 9000, 40005),
		svc("", UDP, "10.96.1.3", 9001, 40006),
		svc("default/lb:https", TCP, "10.96.200.1", 443, 40007),
		svc("default/lb:quic", UDP, "10.96.200.1", 443, 40008),
		svc("default/web:http", TCP, "2001:db8::10", 80, 41001),
		svc("kube-system/kube-dns:dns", UDP, "2001:db8::a", 53, 41002),
		svc(`odd "svc" it's a \ back`, TCP, "2001:db8:1::1", 8080, 41004),
		svc("plain", TCP, "2001:db8:1::2", 9000, 41005),
		svc("default/lb:https", TCP, "2001:db8:96::c8:1", 443, 41007),
		svc("default/lb:quic", UDP, "2001:db8:96::c8:1", 443, 41008),
	},
	NodePorts: []NodePort{
		np("default/web:http", IPv4, TCP, 30080, 40001),
		np("kube-system/kube-dns:dns", IPv4, UDP, 30053, 40002),
		np("default/web:http", IPv6, TCP, 30080, 41001),
		np(`odd "svc" it's a \ back`, IPv6, UDP, 30053, 41002),
	},
	Firewalls: []Firewall{
		fw("default/lb:https", TCP, "10.96.200.1", 443, "10.244.0.10/32", "192.0.2.0/24", "2001:db8:244::/64"),
		fw("default/lb:quic", UDP, "10.96.200.1", 443, "0.0.0.0/0"),
		fw("default/lb:https", TCP, "2001:db8:96::c8:1", 443, "2001:db8:244::a/128", "2001:db8:1::/48", "10.0.0.0/8"),
		fw("default/lb:quic", UDP, "2001:db8:96::c8:1", 443, "10.0.0.0/8"),
	},
	Listeners: []Listener{
		{IPv4, TCP, 40001}, {IPv4, UDP, 40002}, {IPv4, TCP, 40003},
		{IPv6, TCP, 41001}, {IPv6, UDP, 41002},
	},
	Replies: &Replies{},
}

// unrelatedDest is where the pre-existing rule in nat OUTPUT that uproxy
// must leave alone points, unrelatedMangleDest where the one in mangle
// PREROUTING does; unrelatedSource is the source of the one in filter
// INPUT.
var (
	unrelatedDest       = map[Family]string{IPv4: "10.244.0.0/16", IPv6: "2001:db8:244::/64"}
	unrelatedMangleDest = map[Family]string{IPv4: "203.0.113.0/24", IPv6: "2001:db8:3::/64"}
	unrelatedSource     = map[Family]string{IPv4: "192.0.2.0/24", IPv6: "2001:db8:2::/64"}
)

// kernelWant is what savedTables returns after syncing r for f, or before
// any Sync (and after Cleanup) when synced is false. iptables-nft prints
// the built-in chains first, then the others sorted by name.
func kernelWant(f Family, r Rules, synced bool) string {
	st := parseState(Render(f, r))
	var b strings.Builder
	b.WriteString("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n")
	if synced {
		b.WriteString(":UPROXY-NODEPORTS - [0:0]\n:UPROXY-SERVICES - [0:0]\n")
		b.WriteString("-A PREROUTING " + jumpComment + "\n")
		b.WriteString("-A OUTPUT " + jumpComment + "\n")
	}
	b.WriteString("-A OUTPUT -d " + unrelatedDest[f] + ` -m comment --comment "someone else" -j RETURN` + "\n")
	if synced {
		for _, c := range []string{"UPROXY-NODEPORTS", "UPROXY-SERVICES"} {
			for _, l := range st[chainKey{"nat", c}].rules {
				b.WriteString(l + "\n")
			}
		}
	}
	b.WriteString("COMMIT\n")
	b.WriteString("*mangle\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n")
	// Only tproxy mode, and redirect mode with Replies, jump to the
	// mangle chains.
	if synced {
		b.WriteString(":UPROXY-REPLIES - [0:0]\n:UPROXY-TPROXY - [0:0]\n:UPROXY-TPROXY-BRIDGED - [0:0]\n:UPROXY-TPROXY-DIVERT - [0:0]\n:UPROXY-TPROXY-NODEPORTS-TCP - [0:0]\n:UPROXY-TPROXY-NODEPORTS-UDP - [0:0]\n:UPROXY-TPROXY-OUTPUT - [0:0]\n:UPROXY-TPROXY-SERVICES-TCP - [0:0]\n:UPROXY-TPROXY-SERVICES-UDP - [0:0]\n")
		if m := modeOf(r); m.tproxy {
			b.WriteString("-A PREROUTING " + tproxyJumpComment + "\n")
		} else if m.replies {
			b.WriteString("-A PREROUTING " + repliesJumpComment + "\n")
		}
	}
	b.WriteString("-A PREROUTING -d " + unrelatedMangleDest[f] + ` -m comment --comment "someone else" -j RETURN` + "\n")
	if synced {
		if r.TProxy != nil {
			b.WriteString("-A OUTPUT " + tproxyOutputJumpComment + "\n")
		}
		for _, c := range []string{"UPROXY-REPLIES", "UPROXY-TPROXY", "UPROXY-TPROXY-BRIDGED", "UPROXY-TPROXY-DIVERT", "UPROXY-TPROXY-NODEPORTS-TCP", "UPROXY-TPROXY-NODEPORTS-UDP", "UPROXY-TPROXY-OUTPUT", "UPROXY-TPROXY-SERVICES-TCP", "UPROXY-TPROXY-SERVICES-UDP"} {
			for _, l := range st[chainKey{"mangle", c}].rules {
				b.WriteString(l + "\n")
			}
		}
	}
	b.WriteString("COMMIT\n")
	b.WriteString("*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n")
	if synced {
		b.WriteString(":UPROXY-FIREWALL - [0:0]\n:UPROXY-LISTENERS - [0:0]\n")
		b.WriteString("-A INPUT " + firewallJumpComment + "\n")
		b.WriteString("-A INPUT " + listenersJumpComment + "\n")
	}
	b.WriteString("-A INPUT -s " + unrelatedSource[f] + ` -m comment --comment "someone else" -j ACCEPT` + "\n")
	if synced {
		b.WriteString("-A FORWARD " + firewallJumpComment + "\n")
		b.WriteString("-A OUTPUT " + firewallJumpComment + "\n")
		for _, c := range []string{"UPROXY-FIREWALL", "UPROXY-LISTENERS"} {
			for _, l := range st[chainKey{"filter", c}].rules {
				b.WriteString(l + "\n")
			}
		}
	}
	b.WriteString("COMMIT\n")
	return b.String()
}

// checkSets fails the test unless the namespace's sets are exactly those
// that r asks for of f, with their members, and the sets in others.
func checkSets(t *testing.T, step string, f Family, r Rules, others ...string) {
	t.Helper()
	want := slices.Clone(others)
	for _, s := range setsOf(f) {
		if len(s.members(r)) > 0 {
			want = append(want, s.name)
		}
	}
	slices.Sort(want)
	got := strings.Fields(nsCommand(t, "ipset", "list", "-n"))
	slices.Sort(got)
	if diff := cmp.Diff(want, got, cmpopts.EquateEmpty()); diff != "" {
		t.Fatalf("%s: sets (-want +got):\n%s", step, diff)
	}
	for name, c := range wantSets(f, r) {
		if !c.exists {
			continue
		}
		if diff := cmp.Diff(c, parseSetSave(name, []byte(nsCommand(t, "ipset", "save", name))), cmp.AllowUnexported(setContent{})); diff != "" {
			t.Fatalf("%s: set %s (-want +got):\n%s", step, name, diff)
		}
	}
}

// inEachFamilyNetns runs test once per family, each as a subtest inside
// a network namespace of its own (testlab.RunInNetns) with the family's
// iptables tools and ipset; it skips, saying why, where they are missing
// or the test is not root.
func inEachFamilyNetns(t *testing.T, test func(t *testing.T, f Family)) {
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			if testlab.RunInNetns(t, f.command(""), f.command("-save"), f.command("-restore"), "ipset") {
				test(t, f)
			}
		})
	}
}

func TestKernelSync(t *testing.T) {
	inEachFamilyNetns(t, func(t *testing.T, f Family) {
		testKernelSync(t, f)
	})
}

func testKernelSync(t *testing.T, f Family) {
	ctx := context.Background()
	ipt := func(args ...string) { t.Helper(); nsCommand(t, f.command(""), args...) }
	check := func(step string, r Rules, synced bool) {
		t.Helper()
		if diff := cmp.Diff(kernelWant(f, r, synced), savedTables(t, f)); diff != "" {
			t.Fatalf("%s: nat, mangle and filter tables (-want +got):\n%s", step, diff)
		}
		if !synced {
			r = Rules{}
		}
		checkSets(t, step, f, r)
	}
	sync := func(step string, s *Syncer, x *countingExec, r Rules, full bool, want Result, wantCalls map[string]int) {
		t.Helper()
		res, err := s.Sync(ctx, r, full)
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		if res != want {
			t.Errorf("%s: Sync = %+v, want %+v", step, res, want)
		}
		if diff := cmp.Diff(wantCalls, x.take()); diff != "" {
			t.Errorf("%s: commands run (-want +got):\n%s", step, diff)
		}
	}
	save, restore := f.command("-save"), f.command("-restore")
	// A full read runs one ipset save per set of the family.
	reads := len(setsOf(f))
	n := parseState(Render(f, kernelRules)).ruleCount()
	// kernelRules has TCP and UDP listeners of both families: two sets.
	members := wantSets(f, kernelRules).memberCount()

	ipt("-t", "nat", "-A", "OUTPUT", "-d", unrelatedDest[f], "-m", "comment", "--comment", "someone else", "-j", "RETURN")
	ipt("-t", "mangle", "-A", "PREROUTING", "-d", unrelatedMangleDest[f], "-m", "comment", "--comment", "someone else", "-j", "RETURN")
	ipt("-t", "filter", "-A", "INPUT", "-s", unrelatedSource[f], "-m", "comment", "--comment", "someone else", "-j", "ACCEPT")
	check("before", Rules{}, false)
	if err := Cleanup(ctx, Config{Family: f}); err != nil {
		t.Fatalf("Cleanup of a clean table: %v", err)
	}
	check("Cleanup of a clean table", Rules{}, false)

	x := &countingExec{calls: map[string]int{}}
	s, err := New(Config{Family: f, Exec: x})
	if err != nil {
		t.Fatal(err)
	}
	// An ipset save per set of the family, finding nothing, and one
	// ipset restore that creates and fills the two listener sets.
	sync("first Sync", s, x, kernelRules, false, Result{Wrote: true, Rules: n, WroteSets: true, SetMembers: members, SetMembersWritten: members},
		map[string]int{save: 1, "ipset": reads + 1, restore: 1})
	check("first Sync", kernelRules, true)

	sync("unchanged Sync", s, x, kernelRules, false, Result{Rules: n, SetMembers: members}, map[string]int{})
	// Nothing to write proves that the rendering is exactly what
	// iptables-save prints back, quoted comments and set matches
	// included, and the set contents what ipset save prints.
	sync("unchanged full Sync", s, x, kernelRules, true, Result{Rules: n, SetMembers: members}, map[string]int{save: 1, "ipset": reads})
	// The jumps were found in what iptables-save printed: none doubled.
	check("unchanged full Sync", kernelRules, true)

	// Odd comments, and node-port addresses: /0 prints without -d, a
	// prefix with host bits set prints masked.
	comments := Rules{
		Intercepts: []InterceptRule{
			svc("new\nline", TCP, "10.96.2.1", 1, 40101),
			svc("tab\there ünïcödé/名前", TCP, "10.96.2.1", 2, 40102),
			svc(strings.Repeat("x", 300), TCP, "10.96.2.1", 3, 40103),
			svc("new\nline", TCP, "2001:db8:2::1", 1, 41101),
			svc(strings.Repeat("y", 254)+"é", TCP, "2001:db8:2::1", 2, 41102),
		},
		NodePorts: []NodePort{
			np("new\nline", IPv4, TCP, 30001, 40101),
			np(strings.Repeat("y", 254)+"é", IPv6, UDP, 30001, 41102),
		},
		NodePortAddresses: pfx("0.0.0.0/0", "10.1.2.3/8", "::/0", "2001:db8:3::1/64", "::ffff:172.16.0.0/108"),
		Firewalls: []Firewall{
			fw("tab\there", TCP, "10.96.2.1", 1, "10.1.2.3/8", "0.0.0.0/0"),
			fw("tab\there", TCP, "2001:db8:2::1", 1, "::/0"),
		},
		Replies: kernelRules.Replies,
	}
	m := parseState(Render(f, comments)).ruleCount()
	// No listeners: the rules stop naming the sets, which are destroyed.
	sync("changed Sync", s, x, comments, false, Result{Wrote: true, Rules: m, WroteSets: true}, map[string]int{restore: 1, "ipset": 2})
	check("changed Sync", comments, true)
	sync("full Sync of odd comments", s, x, comments, true, Result{Rules: m}, map[string]int{save: 1, "ipset": reads})
	sync("back", s, x, kernelRules, false, Result{Wrote: true, Rules: n, WroteSets: true, SetMembers: members, SetMembersWritten: members}, map[string]int{"ipset": 1, restore: 1})
	check("back", kernelRules, true)

	// Listeners change: one ipset restore, no iptables-restore.
	moved := kernelRules
	moved.Listeners = append(slices.Clone(kernelRules.Listeners[1:]), Listener{f, TCP, 40009}, Listener{f, UDP, 40010})
	sync("listeners changed", s, x, moved, false, Result{Rules: n, WroteSets: true, SetMembers: wantSets(f, moved).memberCount(),
		SetMembersWritten: map[Family]int{IPv4: 3, IPv6: 2}[f]}, map[string]int{"ipset": 1})
	check("listeners changed", moved, true)
	sync("listeners changed back", s, x, kernelRules, true, Result{Rules: n, WroteSets: true, SetMembers: members, SetMembersWritten: map[Family]int{IPv4: 3, IPv6: 2}[f]}, map[string]int{save: 1, "ipset": reads + 1})
	check("listeners changed back", kernelRules, true)

	ipt("-t", "nat", "-D", "UPROXY-SERVICES", "2")
	sync("repair a deleted rule", s, x, kernelRules, true, Result{Wrote: true, Rules: n, Repaired: true, SetMembers: members}, map[string]int{save: 1, "ipset": reads, restore: 1})
	check("repair a deleted rule", kernelRules, true)

	ipt("-t", "nat", "-A", "UPROXY-SERVICES", "-j", "RETURN")
	sync("repair an added rule", s, x, kernelRules, true, Result{Wrote: true, Rules: n, Repaired: true, SetMembers: members}, map[string]int{save: 1, "ipset": reads, restore: 1})
	check("repair an added rule", kernelRules, true)

	ipt("-t", "nat", "-F", "UPROXY-NODEPORTS")
	sync("repair a flushed node-port chain", s, x, kernelRules, true, Result{Wrote: true, Rules: n, Repaired: true, SetMembers: members}, map[string]int{save: 1, "ipset": reads, restore: 1})
	check("repair a flushed node-port chain", kernelRules, true)

	ipt("-t", "filter", "-D", "UPROXY-FIREWALL", "1")
	sync("repair a deleted filter rule", s, x, kernelRules, true, Result{Wrote: true, Rules: n, Repaired: true, SetMembers: members}, map[string]int{save: 1, "ipset": reads, restore: 1})
	check("repair a deleted filter rule", kernelRules, true)

	tcpSet := setsOf(f)[0].name
	nsCommand(t, "ipset", "flush", tcpSet)
	sync("repair a flushed set", s, x, kernelRules, true, Result{Rules: n, Repaired: true, WroteSets: true, SetMembers: members, SetMembersWritten: map[Family]int{IPv4: 2, IPv6: 1}[f], SetsRepaired: true},
		map[string]int{save: 1, "ipset": reads + 1})
	check("repair a flushed set", kernelRules, true)

	jump := slices.Concat(notOwnMatch, []string{"-m", "comment", "--comment", "uproxy service portals", "-j", "UPROXY-SERVICES"})
	fwJump := []string{"-m", "conntrack", "--ctstate", "NEW,UNTRACKED", "-m", "comment", "--comment", "uproxy firewall", "-j", "UPROXY-FIREWALL"}
	ipt(append([]string{"-t", "nat", "-D", "PREROUTING"}, jump...)...)
	ipt(append([]string{"-t", "nat", "-D", "OUTPUT"}, jump...)...)
	ipt("-t", "nat", "-F", "UPROXY-SERVICES")
	ipt("-t", "nat", "-F", "UPROXY-NODEPORTS")
	ipt("-t", "nat", "-X", "UPROXY-SERVICES")
	ipt("-t", "nat", "-X", "UPROXY-NODEPORTS")
	for _, from := range []string{"INPUT", "FORWARD", "OUTPUT"} {
		ipt(append([]string{"-t", "filter", "-D", from}, fwJump...)...)
	}
	ipt("-t", "filter", "-D", "INPUT", "-m", "conntrack", "--ctstate", "NEW", "-m", "comment", "--comment", "uproxy listener owners", "-j", ListenersChain)
	ipt("-t", "filter", "-F", "UPROXY-FIREWALL")
	ipt("-t", "filter", "-X", "UPROXY-FIREWALL")
	ipt("-t", "filter", "-F", ListenersChain)
	ipt("-t", "filter", "-X", ListenersChain)
	// Redirect mode: only PREROUTING jumps to UPROXY-REPLIES.
	ipt("-t", "mangle", "-D", "PREROUTING", "-m", "comment", "--comment", "uproxy replies to transparent dials", "-j", RepliesChain)
	ipt("-t", "mangle", "-F", RepliesChain)
	ipt("-t", "mangle", "-X", RepliesChain)
	ipt("-t", "mangle", "-F", tproxyBridgedChain)
	ipt("-t", "mangle", "-X", "UPROXY-TPROXY")
	for _, c := range []string{tproxyServicesTCP, tproxyServicesUDP, tproxyNodePortsTCP, tproxyNodePortsUDP} {
		ipt("-t", "mangle", "-X", c)
	}
	ipt("-t", "mangle", "-X", "UPROXY-TPROXY-DIVERT")
	ipt("-t", "mangle", "-X", tproxyBridgedChain)
	ipt("-t", "mangle", "-X", "UPROXY-TPROXY-OUTPUT")
	// Only now, with no rule naming them, can the sets be destroyed.
	for name, c := range wantSets(f, kernelRules) {
		if c.exists {
			nsCommand(t, "ipset", "destroy", name)
		}
	}
	check("chains and sets deleted", Rules{}, false)
	// The sets are created again before iptables-restore, which would
	// fail on a rule naming a missing set.
	sync("repair deleted chains and sets", s, x, kernelRules, true,
		Result{Wrote: true, Rules: n, Repaired: true, WroteSets: true, SetMembers: members, SetMembersWritten: members, SetsRepaired: true},
		map[string]int{save: 1, "ipset": reads + 1, restore: 1})
	check("repair deleted chains and sets", kernelRules, true)

	ipt(append([]string{"-t", "filter", "-D", "FORWARD"}, fwJump...)...)
	sync("repair a deleted filter jump", s, x, kernelRules, true, Result{Rules: n, Repaired: true, SetMembers: members}, map[string]int{save: 1, "ipset": reads})
	check("repair a deleted filter jump", kernelRules, true)

	// An earlier version's jump, which every packet took, is replaced by
	// the current one, which only a connection's first packet takes.
	oldFwJump := []string{"-m", "comment", "--comment", "uproxy firewall", "-j", "UPROXY-FIREWALL"}
	for _, from := range []string{"INPUT", "OUTPUT"} {
		ipt(append([]string{"-t", "filter", "-D", from}, fwJump...)...)
		ipt(append([]string{"-t", "filter", "-I", from, "1"}, oldFwJump...)...)
	}
	sync("replace an earlier version's jumps", s, x, kernelRules, true, Result{Rules: n, Repaired: true, SetMembers: members}, map[string]int{save: 1, "ipset": reads})
	check("replace an earlier version's jumps", kernelRules, true)

	// A restarted process adopts the rules as they are.
	x2 := &countingExec{calls: map[string]int{}}
	s2, err := New(Config{Family: f, Exec: x2})
	if err != nil {
		t.Fatal(err)
	}
	sync("restarted, same rules", s2, x2, kernelRules, false, Result{Rules: n, SetMembers: members}, map[string]int{save: 1, "ipset": reads})
	check("restarted, same rules", kernelRules, true)
	x3 := &countingExec{calls: map[string]int{}}
	s3, err := New(Config{Family: f, Exec: x3})
	if err != nil {
		t.Fatal(err)
	}
	sync("restarted, new rules", s3, x3, comments, false, Result{Wrote: true, Rules: m, WroteSets: true}, map[string]int{save: 1, "ipset": reads + 2, restore: 1})
	check("restarted, new rules", comments, true)
	sync("restarted, listeners again", s3, x3, kernelRules, false, Result{Wrote: true, Rules: n, WroteSets: true, SetMembers: members, SetMembersWritten: members}, map[string]int{"ipset": 1, restore: 1})
	check("restarted, listeners again", kernelRules, true)

	// Tproxy mode, as uproxy runs it: no listener sets (the listeners
	// are on loopback), but the service and node-port sets that gate
	// the per-service rules. The chains are the same, so switching modes
	// is one iptables-restore: the nat chains empty, the mangle ones
	// filled. Only tproxy mode jumps to the mangle chains: a switch
	// reads the tables, as a full Sync does, and the jumps follow. The
	// gates' sets are created and filled by one ipset restore before it,
	// and the two listener sets destroyed after it.
	tp := tproxied(kernelRules, Routing{})
	tp.Listeners = nil
	k := parseState(Render(f, tp)).ruleCount()
	tm := wantSets(f, tp).memberCount()
	if tm == 0 {
		t.Fatal("tproxy mode's rules fill no set")
	}
	sync("tproxy mode", s3, x3, tp, false, Result{Wrote: true, Rules: k, WroteSets: true, SetMembers: tm, SetMembersWritten: tm}, map[string]int{save: 1, restore: 1, "ipset": reads + 3})
	check("tproxy mode", tp, true)
	if st := parseState(Render(f, tp)); len(st[chainKey{"nat", ServicesChain}].rules) != 0 || len(st[chainKey{"mangle", TProxyChain}].rules) == 0 {
		t.Fatalf("tproxy mode renders %+v", st)
	}
	// Nothing to write: TPROXY, MARK, socket, addrtype and comment
	// are rendered exactly as iptables-save prints them.
	sync("tproxy mode, unchanged full Sync", s3, x3, tp, true, Result{Rules: k, SetMembers: tm}, map[string]int{save: 1, "ipset": reads})
	ipt("-t", "mangle", "-D", TProxyChain, "1")
	sync("tproxy mode, repair a deleted rule", s3, x3, tp, true, Result{Wrote: true, Rules: k, Repaired: true, SetMembers: tm}, map[string]int{save: 1, "ipset": reads, restore: 1})
	check("tproxy mode, repair a deleted rule", tp, true)
	ipt(slices.Concat([]string{"-t", "mangle", "-D", "OUTPUT"}, notOwnMatch, []string{"-m", "comment", "--comment", "uproxy tproxy node traffic", "-j", TProxyOutputChain})...)
	ipt("-t", "mangle", "-F", TProxyOutputChain)
	sync("tproxy mode, repair a deleted jump and a flushed chain", s3, x3, tp, true, Result{Wrote: true, Rules: k, Repaired: true, SetMembers: tm},
		map[string]int{save: 1, "ipset": reads, restore: 1})
	check("tproxy mode, repair a deleted jump and a flushed chain", tp, true)
	tpComments := tproxied(comments, Routing{Mark: 0x10, Mask: 0xf0})
	kc := parseState(Render(f, tpComments)).ruleCount()
	// The gates' members change with the services: one ipset restore,
	// and a destroy for each set left without members.
	kcm := wantSets(f, tpComments).memberCount()
	upd := renderSetUpdate(wantSets(f, tp), wantSets(f, tpComments))
	gone := len(setsToDestroy(wantSets(f, tp), wantSets(f, tpComments)))
	sync("tproxy mode, odd comments, node-port addresses and mark", s3, x3, tpComments, false,
		Result{Wrote: true, Rules: kc, WroteSets: true, SetMembers: kcm, SetMembersWritten: upd.members}, map[string]int{restore: 1, "ipset": 1 + gone})
	check("tproxy mode, odd comments, node-port addresses and mark", tpComments, true)
	sync("tproxy mode, odd comments, unchanged full Sync", s3, x3, tpComments, true, Result{Rules: kc, SetMembers: kcm}, map[string]int{save: 1, "ipset": reads})
	gone = len(setsToDestroy(wantSets(f, tpComments), wantSets(f, kernelRules)))
	sync("back to redirect mode", s3, x3, kernelRules, false, Result{Wrote: true, Rules: n, WroteSets: true, SetMembers: members, SetMembersWritten: members}, map[string]int{save: 1, "ipset": reads + 1 + gone, restore: 1})
	check("back to redirect mode", kernelRules, true)
	sync("tproxy mode again", s3, x3, tp, false, Result{Wrote: true, Rules: k, WroteSets: true, SetMembers: tm, SetMembersWritten: tm}, map[string]int{save: 1, restore: 1, "ipset": reads + 3})
	check("tproxy mode again", tp, true)

	// Cleanup from tproxy mode: the mangle chains and jumps go too.
	if err := Cleanup(ctx, Config{Family: f}); err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	check("Cleanup", Rules{}, false)
	if err := Cleanup(ctx, Config{Family: f}); err != nil {
		t.Fatalf("second Cleanup: %v", err)
	}
	check("second Cleanup", Rules{}, false)
}

// manyListeners returns rules with n TCP listeners of f from port 20000
// on, one UDP listener, and one intercept.
func manyListeners(f Family, n int) Rules {
	dest := map[Family]string{IPv4: "10.96.0.10", IPv6: "2001:db8::10"}[f]
	r := Rules{Intercepts: []InterceptRule{svc("default/web:http", TCP, dest, 80, 20000)}}
	for i := range n {
		r.Listeners = append(r.Listeners, Listener{f, TCP, uint16(20000 + i)})
	}
	r.Listeners = append(r.Listeners, Listener{f, UDP, 19999})
	return r
}

// firewallRuleCount returns the number of rules in UPROXY-FIREWALL.
func firewallRuleCount(t *testing.T, f Family) int {
	t.Helper()
	return strings.Count(nsCommand(t, f.command("-save"), "-t", "filter"), "\n-A "+FirewallChain+" ")
}

// setEntries returns the number of members of set name, as ipset list says.
func setEntries(t *testing.T, name string) int {
	t.Helper()
	for line := range strings.Lines(nsCommand(t, "ipset", "list", name)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "Number of entries: "); ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("ipset list %s: no entry count", name)
	return 0
}

// TestKernelManyListeners checks that 5,000 listeners cost the filter
// chain that every packet walks one rule, not 5,000; that a change of
// listeners is one ipset restore; that drift of the set is repaired; and
// that Cleanup removes rules and sets, idempotently.
func TestKernelManyListeners(t *testing.T) {
	inEachFamilyNetns(t, func(t *testing.T, f Family) {
		testKernelManyListeners(t, f)
	})
}

func testKernelManyListeners(t *testing.T, f Family) {
	ctx := context.Background()
	save, restore := f.command("-save"), f.command("-restore")
	tcpSet := setsOf(f)[0].name
	// A full read runs one ipset save per set of the family, and Cleanup
	// one ipset destroy.
	reads := len(setsOf(f))
	x := &countingExec{calls: map[string]int{}}
	s, err := New(Config{Family: f, Exec: x})
	if err != nil {
		t.Fatal(err)
	}
	sync := func(step string, r Rules, full bool, want Result, wantCalls map[string]int) {
		t.Helper()
		start := time.Now()
		res, err := s.Sync(ctx, r, full)
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		t.Logf("%s: %v", step, time.Since(start))
		if res != want {
			t.Errorf("%s: Sync = %+v, want %+v", step, res, want)
		}
		if diff := cmp.Diff(wantCalls, x.take()); diff != "" {
			t.Errorf("%s: commands run (-want +got):\n%s", step, diff)
		}
		if n := firewallRuleCount(t, f); n != 2 {
			t.Errorf("%s: %d rules in %s, want 2", step, n, FirewallChain)
		}
		checkSets(t, step, f, r)
	}

	// From an empty kernel: ipset saves that find nothing, one ipset
	// restore of 5,000 adds, one iptables-restore of three rules.
	const n = 5000
	r := manyListeners(f, n)
	sync("5,000 listeners", r, false, Result{Wrote: true, Rules: 7, WroteSets: true, SetMembers: n + 1, SetMembersWritten: n + 1},
		map[string]int{save: 1, "ipset": reads + 1, restore: 1})
	many := savedTables(t, f)
	if got := setEntries(t, tcpSet); got != n {
		t.Errorf("ipset list %s: %d entries, want %d", tcpSet, got, n)
	}
	sync("unchanged", r, false, Result{Rules: 7, SetMembers: n + 1}, map[string]int{})
	sync("unchanged full", r, true, Result{Rules: 7, SetMembers: n + 1}, map[string]int{save: 1, "ipset": reads})

	// One listener per protocol: the same rules, 4,999 deletes.
	sync("one listener per protocol", manyListeners(f, 1), false, Result{Rules: 7, WroteSets: true, SetMembers: 2, SetMembersWritten: n - 1}, map[string]int{"ipset": 1})
	if got := savedTables(t, f); got != many {
		t.Errorf("the rules for one listener differ from those for 5,000 (-many +one):\n%s", cmp.Diff(many, got))
	}
	sync("5,000 listeners again", r, false, Result{Rules: 7, WroteSets: true, SetMembers: n + 1, SetMembersWritten: n - 1}, map[string]int{"ipset": 1})

	moved := manyListeners(f, n)
	for i := range 100 {
		moved.Listeners[i].Port = uint16(30000 + i)
	}
	sync("100 moved", moved, false, Result{Rules: 7, WroteSets: true, SetMembers: n + 1, SetMembersWritten: 100 * 2}, map[string]int{"ipset": 1})

	// Drift of the set alone: no iptables-restore needed.
	nsCommand(t, "ipset", "flush", tcpSet)
	sync("set flushed", moved, true, Result{Rules: 7, Repaired: true, WroteSets: true, SetMembers: n + 1, SetMembersWritten: n, SetsRepaired: true},
		map[string]int{save: 1, "ipset": reads + 1})
	nsCommand(t, "ipset", "del", tcpSet, "30000")
	nsCommand(t, "ipset", "add", tcpSet, "22")
	sync("member deleted, stray member added", moved, true, Result{Rules: 7, Repaired: true, WroteSets: true, SetMembers: n + 1, SetMembersWritten: 2, SetsRepaired: true},
		map[string]int{save: 1, "ipset": reads + 1})

	// The kernel refuses to destroy a set that a rule names.
	if out, err := exec.Command("ipset", "destroy", tcpSet).CombinedOutput(); err == nil || !strings.Contains(string(out), "in use") {
		t.Errorf("ipset destroy of a set in use: %v: %s", err, out)
	}
	nsCommand(t, f.command(""), "-t", "filter", "-F", FirewallChain)
	nsCommand(t, f.command(""), "-t", "filter", "-F", ListenersChain)
	nsCommand(t, "ipset", "destroy", tcpSet)
	sync("chain flushed, set destroyed", moved, true,
		Result{Wrote: true, Rules: 7, Repaired: true, WroteSets: true, SetMembers: n + 1, SetMembersWritten: n, SetsRepaired: true},
		map[string]int{save: 1, "ipset": reads + 1, restore: 1})
	if got := setEntries(t, tcpSet); got != n {
		t.Errorf("ipset list %s after repair: %d entries, want %d", tcpSet, got, n)
	}

	s2, err := New(Config{Family: f, Exec: x})
	if err != nil {
		t.Fatal(err)
	}
	s = s2
	sync("restarted", moved, false, Result{Rules: 7, SetMembers: n + 1}, map[string]int{save: 1, "ipset": reads})

	for i := range 2 {
		if err := Cleanup(ctx, Config{Family: f, Exec: x}); err != nil {
			t.Fatalf("Cleanup %d: %v", i+1, err)
		}
		// The jumps go through go-iptables, not x.
		if diff := cmp.Diff(map[string]int{restore: 1, "ipset": reads}, x.take()); diff != "" {
			t.Errorf("Cleanup %d: commands run (-want +got):\n%s", i+1, diff)
		}
		if saved := nsCommand(t, f.command("-save")); strings.Contains(saved, "UPROXY") || strings.Contains(saved, "uproxy") {
			t.Errorf("Cleanup %d left rules:\n%s", i+1, saved)
		}
		if names := nsCommand(t, "ipset", "list", "-n"); names != "" {
			t.Errorf("Cleanup %d left sets: %q", i+1, names)
		}
	}
}

// TestKernelFamiliesShareNothing checks that the IPv4 and IPv6 Syncers of
// one namespace, with the same listener ports, each own their sets: one
// family's Sync and Cleanup leave the other's sets and rules alone.
func TestKernelFamiliesShareNothing(t *testing.T) {
	if !testlab.RunInNetns(t, "iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore", "ipset") {
		return
	}
	ctx := context.Background()
	r := Rules{}
	for _, f := range []Family{IPv4, IPv6} {
		r.Listeners = append(r.Listeners, Listener{f, TCP, 40001}, Listener{f, UDP, 40002})
	}
	r6 := r
	r6.Listeners = append(slices.Clone(r.Listeners), Listener{IPv6, TCP, 40003})
	syncers := map[Family]*Syncer{}
	for _, f := range []Family{IPv4, IPv6} {
		s, err := New(Config{Family: f})
		if err != nil {
			t.Fatal(err)
		}
		syncers[f] = s
		if _, err := s.Sync(ctx, r, true); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := syncers[IPv6].Sync(ctx, r6, true); err != nil {
		t.Fatal(err)
	}
	// The IPv4 Syncer finds its sets as it left them: no drift.
	if res, err := syncers[IPv4].Sync(ctx, r, true); err != nil || res.Repaired || res.WroteSets {
		t.Errorf("IPv4 full Sync after the IPv6 one = %+v, %v; want no change", res, err)
	}
	checkSets(t, "both", IPv4, r, listenersTCP6, listenersUDP6)
	checkSets(t, "both", IPv6, r6, listenersTCP4, listenersUDP4)

	if err := Cleanup(ctx, Config{Family: IPv4}); err != nil {
		t.Fatal(err)
	}
	checkSets(t, "IPv4 cleaned up", IPv6, r6)
	if res, err := syncers[IPv6].Sync(ctx, r6, true); err != nil || res.Repaired || res.Wrote || res.WroteSets {
		t.Errorf("IPv6 full Sync after IPv4 Cleanup = %+v, %v; want no change", res, err)
	}
	if err := Cleanup(ctx, Config{Family: IPv6}); err != nil {
		t.Fatal(err)
	}
	checkSets(t, "both cleaned up", IPv6, Rules{})
}

// TestKernelTProxyRoundTrip checks, for the rules of the tproxy golden
// files, that what Render writes is what iptables-save prints back: after
// a first Sync, a full Sync finds nothing to write.
func TestKernelTProxyRoundTrip(t *testing.T) {
	nodePorts := Rules{
		NodePorts: []NodePort{
			np("default/web:http", IPv4, TCP, 30080, 40001), np("kube-system/dns:dns", IPv4, UDP, 30053, 40002),
			np("default/web:http", IPv6, TCP, 30080, 41001), np("default/web:quic", IPv6, UDP, 30443, 41002),
		},
	}
	withAddrs := nodePorts
	withAddrs.NodePortAddresses = pfx("192.168.1.7/24", "2001:db8::/64", "10.0.0.0/8", "fd00::/8")
	withAll := nodePorts
	withAll.NodePortAddresses = pfx("0.0.0.0/0", "::/0")
	cases := map[string]Rules{
		"empty":                    {},
		"all":                      all,
		"mixed":                    mixed,
		"firewall":                 firewalled,
		"firewall_v6":              firewalled6,
		"rejects":                  rejecting,
		"nodeports":                nodePorts,
		"nodeport_addresses":       withAddrs,
		"nodeport_addresses_all":   withAll,
		"kernelRules, no listener": {Intercepts: kernelRules.Intercepts, NodePorts: kernelRules.NodePorts, Firewalls: kernelRules.Firewalls},
	}
	inEachFamilyNetns(t, func(t *testing.T, f Family) {
		ctx := context.Background()
		// Redirect mode's REJECTs read back as rendered too.
		s, err := New(Config{Family: f})
		if err != nil {
			t.Fatal(err)
		}
		for range 2 {
			res, err := s.Sync(ctx, rejecting, true)
			if err != nil {
				t.Fatalf("rejects: %v", err)
			}
			if res.Wrote && res.Repaired {
				t.Errorf("rejects: full Sync of an unchanged kernel = %+v; rendered:\n%s\niptables-save:\n%s",
					res, Render(f, rejecting), nsCommand(t, f.command("-save"), "-t", "filter"))
			}
		}
		if err := Cleanup(ctx, Config{Family: f}); err != nil {
			t.Fatal(err)
		}
		for _, name := range slices.Sorted(maps.Keys(cases)) {
			routings := []Routing{{}}
			if name == "all" {
				routings = append(routings, Routing{Mark: 0x10, Mask: 0xf0})
			}
			for _, rt := range routings {
				r := tproxied(cases[name], rt)
				s, err := New(Config{Family: f})
				if err != nil {
					t.Fatal(err)
				}
				if _, err := s.Sync(ctx, r, true); err != nil {
					t.Fatalf("%s, mark %s: %v", name, rt.MarkString(), err)
				}
				res, err := s.Sync(ctx, r, true)
				if err != nil {
					t.Fatalf("%s, mark %s: %v", name, rt.MarkString(), err)
				}
				if res.Wrote || res.Repaired {
					saved := nsCommand(t, f.command("-save"), "-t", "mangle")
					t.Errorf("%s, mark %s: full Sync of an unchanged kernel = %+v; rendered:\n%s\niptables-save:\n%s",
						name, rt.MarkString(), res, Render(f, r), saved)
				}
				if err := Cleanup(ctx, Config{Family: f}); err != nil {
					t.Fatal(err)
				}
			}
		}
	})
}
