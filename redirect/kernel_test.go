package redirect

import (
	"context"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/uproxy/uproxy/bench/lab"
)

// The tests in this file run real iptables, each in a network namespace of
// its own (lab.RunInNetns), never in the root namespace.

// nsCommand runs a command inside the test's namespace and returns its
// stdout. It refuses to run outside one.
func nsCommand(t *testing.T, name string, args ...string) string {
	t.Helper()
	if !lab.InNetns() {
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

// savedTables returns iptables-save -t nat and -t filter for f, one after
// the other, without comments and with the chain counters zeroed.
func savedTables(t *testing.T, f Family) string {
	t.Helper()
	var lines []string
	for _, table := range []string{"nat", "filter"} {
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
	Intercepts: []Intercept{
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
}

// unrelatedDest is where the pre-existing rule in nat OUTPUT that uproxy
// must leave alone points; unrelatedSource is the source of the one in
// filter INPUT.
var (
	unrelatedDest   = map[Family]string{IPv4: "10.244.0.0/16", IPv6: "2001:db8:244::/64"}
	unrelatedSource = map[Family]string{IPv4: "192.0.2.0/24", IPv6: "2001:db8:2::/64"}
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
	b.WriteString("*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n")
	if synced {
		b.WriteString(":UPROXY-FIREWALL - [0:0]\n")
		b.WriteString("-A INPUT " + firewallJumpComment + "\n")
	}
	b.WriteString("-A INPUT -s " + unrelatedSource[f] + ` -m comment --comment "someone else" -j ACCEPT` + "\n")
	if synced {
		b.WriteString("-A FORWARD " + firewallJumpComment + "\n")
		b.WriteString("-A OUTPUT " + firewallJumpComment + "\n")
		for _, l := range st[chainKey{"filter", "UPROXY-FIREWALL"}].rules {
			b.WriteString(l + "\n")
		}
	}
	b.WriteString("COMMIT\n")
	return b.String()
}

func TestKernelSync(t *testing.T) {
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			if !lab.RunInNetns(t, f.command(""), f.command("-save"), f.command("-restore")) {
				return
			}
			testKernelSync(t, f)
		})
	}
}

func testKernelSync(t *testing.T, f Family) {
	ctx := context.Background()
	ipt := func(args ...string) { t.Helper(); nsCommand(t, f.command(""), args...) }
	check := func(step string, r Rules, synced bool) {
		t.Helper()
		if diff := cmp.Diff(kernelWant(f, r, synced), savedTables(t, f)); diff != "" {
			t.Fatalf("%s: nat and filter tables (-want +got):\n%s", step, diff)
		}
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
	n := parseState(Render(f, kernelRules)).ruleCount()

	ipt("-t", "nat", "-A", "OUTPUT", "-d", unrelatedDest[f], "-m", "comment", "--comment", "someone else", "-j", "RETURN")
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
	sync("first Sync", s, x, kernelRules, false, Result{Wrote: true, Rules: n}, map[string]int{save: 2, restore: 1})
	check("first Sync", kernelRules, true)

	sync("unchanged Sync", s, x, kernelRules, false, Result{Rules: n}, map[string]int{})
	// Nothing to write proves that the rendering is exactly what
	// iptables-save prints back, quoted comments included.
	sync("unchanged full Sync", s, x, kernelRules, true, Result{Rules: n}, map[string]int{save: 2})

	// Odd comments, and node-port addresses: /0 prints without -d, a
	// prefix with host bits set prints masked.
	comments := Rules{
		Intercepts: []Intercept{
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
	}
	m := parseState(Render(f, comments)).ruleCount()
	sync("changed Sync", s, x, comments, false, Result{Wrote: true, Rules: m}, map[string]int{restore: 1})
	check("changed Sync", comments, true)
	sync("full Sync of odd comments", s, x, comments, true, Result{Rules: m}, map[string]int{save: 2})
	sync("back", s, x, kernelRules, false, Result{Wrote: true, Rules: n}, map[string]int{restore: 1})

	ipt("-t", "nat", "-D", "UPROXY-SERVICES", "2")
	sync("repair a deleted rule", s, x, kernelRules, true, Result{Wrote: true, Rules: n, Repaired: true}, map[string]int{save: 2, restore: 1})
	check("repair a deleted rule", kernelRules, true)

	ipt("-t", "nat", "-A", "UPROXY-SERVICES", "-j", "RETURN")
	sync("repair an added rule", s, x, kernelRules, true, Result{Wrote: true, Rules: n, Repaired: true}, map[string]int{save: 2, restore: 1})
	check("repair an added rule", kernelRules, true)

	ipt("-t", "nat", "-F", "UPROXY-NODEPORTS")
	sync("repair a flushed node-port chain", s, x, kernelRules, true, Result{Wrote: true, Rules: n, Repaired: true}, map[string]int{save: 2, restore: 1})
	check("repair a flushed node-port chain", kernelRules, true)

	ipt("-t", "filter", "-D", "UPROXY-FIREWALL", "1")
	sync("repair a deleted filter rule", s, x, kernelRules, true, Result{Wrote: true, Rules: n, Repaired: true}, map[string]int{save: 2, restore: 1})
	check("repair a deleted filter rule", kernelRules, true)

	jump := []string{"-m", "comment", "--comment", "uproxy service portals", "-j", "UPROXY-SERVICES"}
	fwJump := []string{"-m", "comment", "--comment", "uproxy firewall", "-j", "UPROXY-FIREWALL"}
	ipt(append([]string{"-t", "nat", "-D", "PREROUTING"}, jump...)...)
	ipt(append([]string{"-t", "nat", "-D", "OUTPUT"}, jump...)...)
	ipt("-t", "nat", "-F", "UPROXY-SERVICES")
	ipt("-t", "nat", "-F", "UPROXY-NODEPORTS")
	ipt("-t", "nat", "-X", "UPROXY-SERVICES")
	ipt("-t", "nat", "-X", "UPROXY-NODEPORTS")
	for _, from := range []string{"INPUT", "FORWARD", "OUTPUT"} {
		ipt(append([]string{"-t", "filter", "-D", from}, fwJump...)...)
	}
	ipt("-t", "filter", "-F", "UPROXY-FIREWALL")
	ipt("-t", "filter", "-X", "UPROXY-FIREWALL")
	check("chains deleted", Rules{}, false)
	sync("repair deleted chains", s, x, kernelRules, true, Result{Wrote: true, Rules: n, Repaired: true}, map[string]int{save: 2, restore: 1})
	check("repair deleted chains", kernelRules, true)

	ipt(append([]string{"-t", "filter", "-D", "FORWARD"}, fwJump...)...)
	sync("repair a deleted filter jump", s, x, kernelRules, true, Result{Rules: n, Repaired: true}, map[string]int{save: 2})
	check("repair a deleted filter jump", kernelRules, true)

	// A restarted process adopts the rules as they are.
	x2 := &countingExec{calls: map[string]int{}}
	s2, err := New(Config{Family: f, Exec: x2})
	if err != nil {
		t.Fatal(err)
	}
	sync("restarted, same rules", s2, x2, kernelRules, false, Result{Rules: n}, map[string]int{save: 2})
	check("restarted, same rules", kernelRules, true)
	x3 := &countingExec{calls: map[string]int{}}
	s3, err := New(Config{Family: f, Exec: x3})
	if err != nil {
		t.Fatal(err)
	}
	sync("restarted, new rules", s3, x3, comments, false, Result{Wrote: true, Rules: m}, map[string]int{save: 2, restore: 1})
	check("restarted, new rules", comments, true)

	if err := Cleanup(ctx, Config{Family: f}); err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	check("Cleanup", Rules{}, false)
	if err := Cleanup(ctx, Config{Family: f}); err != nil {
		t.Fatalf("second Cleanup: %v", err)
	}
	check("second Cleanup", Rules{}, false)
}
