package redirect

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// fakeKernel is a fake nat, mangle and filter table and a fake set of ipsets
// behind both Exec (iptables-save, iptables-restore and ipset) and
// JumpRules, so tests see every command a Syncer runs and the state it
// leaves. It is safe for concurrent use.
type fakeKernel struct {
	family Family

	mu sync.Mutex
	// order lists each table's chains in creation order, built-in ones
	// first.
	order map[string][]string
	// rules maps each table's chains to their rules, as "-A CHAIN ..."
	// lines.
	rules map[string]map[string][]string
	// calls records every command and JumpRules call, in order.
	calls []string
	// restored records the stdin of every iptables-restore call.
	restored []string
	// sets are the ipsets, by name.
	sets map[string]*fakeSet
	// setRestored records the stdin of every ipset restore call.
	setRestored []string
	// failRestore, failSave and failExists, when set, make the next such
	// call fail with the error; failIpset the next ipset call with
	// failIpsetOp ("restore", "save" or "destroy") as its first argument.
	failRestore, failSave, failExists, failInsert, failIpset error
	failIpsetOp                                              string
}

// fakeSet is an ipset of the fake kernel.
type fakeSet struct {
	// header is the type and options.
	header  string
	members map[setMember]bool
}

// ipset's error messages, as OSExec's errors carry them.
const (
	errSetMissing = "ipset v7.17: The set with the given name does not exist"
	errSetInUse   = "ipset v7.17: Set cannot be destroyed: it is in use by a kernel component"
	errSetExists  = "ipset v7.17: Error in line %d: Set cannot be created: set with the same name already exists"
)

var (
	_ Exec      = (*fakeKernel)(nil)
	_ JumpRules = (*fakeKernel)(nil)
)

// errExit stands for the *exec.ExitError of a failed command.
var errExit = errors.New("exit status 1")

// notExistError is what the fake returns for a missing rule or chain; like
// *iptables.Error it has IsNotExist.
type notExistError struct{ msg string }

func (e *notExistError) Error() string    { return e.msg }
func (e *notExistError) IsNotExist() bool { return true }

// fakeTables are the tables the fake kernel has, in iptables-save's
// order of the Syncer's reads, and builtin their built-in chains.
var (
	fakeTables = []string{"nat", "mangle", "filter"}
	builtin    = map[string][]string{
		"nat":    {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"},
		"mangle": {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"},
		"filter": {"INPUT", "FORWARD", "OUTPUT"},
	}
)

// unrelated, unrelatedMangle and unrelatedFilter are rules someone else
// put in nat OUTPUT, mangle PREROUTING and filter INPUT.
const (
	unrelated       = `-A OUTPUT -d 10.244.0.0/16 -m comment --comment "someone else" -j RETURN`
	unrelatedMangle = `-A PREROUTING -d 203.0.113.0/24 -m comment --comment "someone else" -j RETURN`
	unrelatedFilter = `-A INPUT -s 192.0.2.0/24 -m comment --comment "someone else" -j ACCEPT`
)

func newFakeKernel(f Family) *fakeKernel {
	k := &fakeKernel{family: f, order: map[string][]string{}, rules: map[string]map[string][]string{}}
	for _, t := range fakeTables {
		k.order[t] = slices.Clone(builtin[t])
		k.rules[t] = map[string][]string{}
	}
	k.rules["nat"]["OUTPUT"] = []string{unrelated}
	k.rules["mangle"]["PREROUTING"] = []string{unrelatedMangle}
	k.rules["filter"]["INPUT"] = []string{unrelatedFilter}
	// Someone else's set, which uproxy must leave alone.
	k.sets = map[string]*fakeSet{"someone-else": {header: "hash:ip family inet hashsize 1024 maxelem 65536", members: map[setMember]bool{}}}
	return k
}

// Run implements Exec for iptables-save -t TABLE and iptables-restore.
func (k *fakeKernel) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, strings.Join(append([]string{name}, args...), " "))
	switch name {
	case k.family.command("-save"):
		if err := k.failSave; err != nil {
			k.failSave = nil
			return nil, err
		}
		if len(args) == 0 {
			return []byte(k.saveAllLocked()), nil
		}
		if len(args) != 2 || args[0] != "-t" || !slices.Contains(fakeTables, args[1]) {
			return nil, fmt.Errorf("fake: unexpected args %q", args)
		}
		return []byte(k.saveLocked(args[1])), nil
	case k.family.command("-restore"):
		k.restored = append(k.restored, string(stdin))
		if err := k.failRestore; err != nil {
			k.failRestore = nil
			return nil, err
		}
		return nil, k.restoreLocked(string(stdin))
	case "ipset":
		if err := k.failIpset; err != nil && len(args) > 0 && args[0] == k.failIpsetOp {
			k.failIpset = nil
			if args[0] == "restore" {
				k.setRestored = append(k.setRestored, string(stdin))
			}
			return nil, err
		}
		return k.ipsetLocked(args, stdin)
	}
	return nil, fmt.Errorf("fake: unexpected command %s", name)
}

// ipsetLocked runs ipset restore, save NAME, test NAME MEMBER or destroy
// NAME.
func (k *fakeKernel) ipsetLocked(args []string, stdin []byte) ([]byte, error) {
	fail := func(format string, a ...any) error {
		return fmt.Errorf("ipset %s: %w: %s", strings.Join(args, " "), errExit, fmt.Sprintf(format, a...))
	}
	switch {
	case len(args) == 1 && args[0] == "restore":
		k.setRestored = append(k.setRestored, string(stdin))
		// Not transactional: the lines before a failing one stay applied.
		for n, line := range strings.Split(strings.TrimSuffix(string(stdin), "\n"), "\n") {
			f := strings.Fields(line)
			if len(f) < 2 {
				return nil, fail("Error in line %d: syntax error", n+1)
			}
			exist := f[len(f)-1] == "-exist"
			if exist {
				f = f[:len(f)-1]
			}
			set := k.sets[f[1]]
			switch f[0] {
			case "create":
				header := kernelHeader(strings.Join(f[2:], " "))
				if set != nil && (!exist || set.header != header) {
					return nil, fail(errSetExists, n+1)
				}
				if set == nil {
					k.sets[f[1]] = &fakeSet{header: header, members: map[setMember]bool{}}
				}
			case "add", "del":
				if set == nil {
					return nil, fail("Error in line %d: The set with the given name does not exist", n+1)
				}
				m, ok := parseMember(f[2])
				if !ok || (m.addr.IsValid() != strings.HasPrefix(set.header, "hash:ip,port ")) {
					return nil, fail("Error in line %d: Syntax error: cannot parse %s", n+1, f[2])
				}
				if f[0] == "add" {
					if set.members[m] && !exist {
						return nil, fail("Error in line %d: Element cannot be added to the set: it's already added", n+1)
					}
					set.members[m] = true
				} else {
					if !set.members[m] && !exist {
						return nil, fail("Error in line %d: Element cannot be deleted from the set: it's not added", n+1)
					}
					delete(set.members, m)
				}
			case "destroy":
				if err := k.destroySetLocked(f[1]); err != "" {
					return nil, fail("Error in line %d: %s", n+1, strings.TrimPrefix(err, "ipset v7.17: "))
				}
			default:
				return nil, fail("Error in line %d: unknown command %s", n+1, f[0])
			}
		}
		return nil, nil
	case len(args) == 2 && args[0] == "save":
		set := k.sets[args[1]]
		if set == nil {
			return nil, fail(errSetMissing)
		}
		return []byte(saveSet(args[1], set)), nil
	case len(args) == 3 && args[0] == "test":
		set := k.sets[args[1]]
		if set == nil {
			return nil, fail(errSetMissing)
		}
		m, ok := parseMember(args[2])
		if !ok || (m.addr.IsValid() != strings.HasPrefix(set.header, "hash:ip,port ")) {
			return nil, fail("Syntax error: cannot parse %s", args[2])
		}
		if !set.members[m] {
			return nil, fail("Warning: %s is NOT in set %s.", args[2], args[1])
		}
		return nil, nil
	case len(args) == 2 && args[0] == "destroy":
		if err := k.destroySetLocked(args[1]); err != "" {
			return nil, fail("%s", err)
		}
		return nil, nil
	}
	return nil, fmt.Errorf("fake: unexpected ipset args %q", args)
}

// kernelHeader returns the header of a set created with header as ipset
// save prints it: for a hash type, with the hashsize, bucketsize and
// initval that the kernel picked.
func kernelHeader(header string) string {
	typ, opts, _ := strings.Cut(header, " ")
	if !strings.HasPrefix(typ, "hash:") || strings.Contains(header, " hashsize ") {
		return header
	}
	family, rest, _ := strings.Cut(strings.TrimPrefix(opts, "family "), " ")
	return strings.TrimSpace(fmt.Sprintf("%s family %s hashsize 1024 %s bucketsize 12 initval 0x6b1e5c3a", typ, family, rest))
}

// saveSet prints set like ipset save NAME.
func saveSet(name string, set *fakeSet) string {
	var b strings.Builder
	fmt.Fprintf(&b, "create %s %s\n", name, set.header)
	for _, m := range slices.SortedFunc(maps.Keys(set.members), setMember.compare) {
		fmt.Fprintf(&b, "add %s %s\n", name, m)
	}
	return b.String()
}

// destroySetLocked destroys the set name, or returns ipset's error.
func (k *fakeKernel) destroySetLocked(name string) string {
	if k.sets[name] == nil {
		return errSetMissing
	}
	for _, t := range k.rules {
		for _, rs := range t {
			for _, r := range rs {
				if strings.Contains(r, " --match-set "+name+" ") {
					return errSetInUse
				}
			}
		}
	}
	delete(k.sets, name)
	return ""
}

// saveSets returns every set, sorted by name, as ipset save prints them.
func (k *fakeKernel) saveSets() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var b strings.Builder
	for _, name := range slices.Sorted(maps.Keys(k.sets)) {
		b.WriteString(saveSet(name, k.sets[name]))
	}
	return b.String()
}

// editSets changes the sets behind the Syncer's back.
func (k *fakeKernel) editSets(f func(sets map[string]*fakeSet)) {
	k.mu.Lock()
	defer k.mu.Unlock()
	f(k.sets)
}

// saveLocked prints table like iptables-save -t table.
func (k *fakeKernel) saveLocked(table string) string {
	var b strings.Builder
	b.WriteString("# Generated by iptables-save v1.8.9 (nf_tables) on Sun Nov 29 14:42:56 2026\n*" + table + "\n")
	for _, c := range k.order[table] {
		if slices.Contains(builtin[table], c) {
			fmt.Fprintf(&b, ":%s ACCEPT [7:420]\n", c)
		} else {
			fmt.Fprintf(&b, ":%s - [0:0]\n", c)
		}
	}
	for _, c := range k.order[table] {
		for _, r := range k.rules[table][c] {
			b.WriteString(r + "\n")
		}
	}
	b.WriteString("COMMIT\n# Completed on Sun Nov 29 14:42:56 2026\n")
	return b.String()
}

// save returns every table, as iptables-save prints them.
func (k *fakeKernel) save() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.saveAllLocked()
}

func (k *fakeKernel) saveAllLocked() string {
	var b strings.Builder
	for _, t := range fakeTables {
		b.WriteString(k.saveLocked(t))
	}
	return b.String()
}

// restoreLocked applies iptables-restore --noflush input, all or nothing.
func (k *fakeKernel) restoreLocked(input string) error {
	order, rules := map[string][]string{}, map[string]map[string][]string{}
	for t := range k.order {
		order[t] = slices.Clone(k.order[t])
		rules[t] = map[string][]string{}
		for c, rs := range k.rules[t] {
			rules[t][c] = slices.Clone(rs)
		}
	}
	table := ""
	for n, line := range strings.Split(strings.TrimSuffix(input, "\n"), "\n") {
		fail := func(msg string) error {
			return fmt.Errorf("iptables-restore: %w: line %d failed: %s", errExit, n+1, msg)
		}
		f := strings.Fields(line)
		switch {
		case strings.HasPrefix(line, "*"):
			table = line[1:]
			if !slices.Contains(fakeTables, table) {
				return fail("no table " + table)
			}
		case table == "":
			return fail("no table selected")
		case line == "COMMIT":
			table = ""
		case strings.HasPrefix(line, ":"):
			c := strings.TrimPrefix(f[0], ":")
			if !slices.Contains(order[table], c) {
				order[table] = append(order[table], c)
			}
			rules[table][c] = nil
		case f[0] == "-A":
			if !slices.Contains(order[table], f[1]) {
				return fail("no chain " + f[1])
			}
			if i := slices.Index(f, "-j"); i >= 0 && strings.HasPrefix(f[i+1], "UPROXY-") && !slices.Contains(order[table], f[i+1]) {
				return fail("no chain " + f[i+1])
			}
			if i := slices.Index(f, "--match-set"); i >= 0 && k.sets[f[i+1]] == nil {
				return fail("Set " + f[i+1] + " doesn't exist.")
			}
			rules[table][f[1]] = append(rules[table][f[1]], line)
		case f[0] == "-X":
			for _, rs := range rules[table] {
				for _, r := range rs {
					if strings.HasSuffix(r, " -j "+f[1]) {
						return fail("chain " + f[1] + " is referenced")
					}
				}
			}
			order[table] = slices.DeleteFunc(order[table], func(c string) bool { return c == f[1] })
			delete(rules[table], f[1])
		default:
			return fail("unknown line " + line)
		}
	}
	if table != "" {
		return fmt.Errorf("iptables-restore: %w: no COMMIT", errExit)
	}
	k.order, k.rules = order, rules
	return nil
}

// specLine formats a go-iptables rule spec as iptables-save would.
func specLine(chain string, spec []string) string {
	parts := []string{"-A", chain}
	for i, s := range spec {
		if i > 0 && spec[i-1] == "--comment" {
			s = quoteComment(s) // iptables-save quotes comments only
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, " ")
}

// checkTarget returns a not-exist error when spec jumps to a chain missing
// from table, as iptables does.
func (k *fakeKernel) checkTarget(table string, spec []string) error {
	if i := slices.Index(spec, "-j"); i >= 0 && i+1 < len(spec) {
		if t := spec[i+1]; strings.HasPrefix(t, "UPROXY-") && !slices.Contains(k.order[table], t) {
			return &notExistError{fmt.Sprintf("iptables v1.8.9 (nf_tables): Chain '%s' does not exist", t)}
		}
	}
	return nil
}

// Exists implements JumpRules.
func (k *fakeKernel) Exists(table, chain string, spec ...string) (bool, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, "Exists "+table+" "+chain)
	if err := k.failExists; err != nil {
		k.failExists = nil
		return false, err
	}
	if err := k.checkTarget(table, spec); err != nil {
		return false, err
	}
	return slices.Contains(k.rules[table][chain], specLine(chain, spec)), nil
}

// Insert implements JumpRules.
func (k *fakeKernel) Insert(table, chain string, pos int, spec ...string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, fmt.Sprintf("Insert %s %s %d", table, chain, pos))
	if err := k.failInsert; err != nil {
		k.failInsert = nil
		return err
	}
	if err := k.checkTarget(table, spec); err != nil {
		return err
	}
	k.rules[table][chain] = slices.Insert(k.rules[table][chain], pos-1, specLine(chain, spec))
	return nil
}

// Delete implements JumpRules.
func (k *fakeKernel) Delete(table, chain string, spec ...string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, "Delete "+table+" "+chain)
	if err := k.checkTarget(table, spec); err != nil {
		return err
	}
	i := slices.Index(k.rules[table][chain], specLine(chain, spec))
	if i < 0 {
		return &notExistError{"iptables: Bad rule (does a matching rule exist in that chain?)."}
	}
	k.rules[table][chain] = slices.Delete(k.rules[table][chain], i, i+1)
	return nil
}

// takeCalls returns and forgets the calls so far.
func (k *fakeKernel) takeCalls() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	c := k.calls
	k.calls = nil
	return c
}

// edit changes table in the fake kernel behind the Syncer's back: f gets
// the table's chain order and rules and returns the new order.
func (k *fakeKernel) edit(table string, f func(order []string, rules map[string][]string) []string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.order[table] = f(k.order[table], k.rules[table])
}

func newFakeSyncer(t *testing.T, k *fakeKernel) *Syncer {
	t.Helper()
	s, err := New(Config{Family: k.family, Exec: k, Jumps: k})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

var (
	// rulesA has every kind of rule. For IPv4 it renders 8 rules: 4 in
	// UPROXY-SERVICES (two for the firewalled intercept, one for the
	// other, the jump to node ports), 1 in UPROXY-NODEPORTS and 3 in
	// UPROXY-FIREWALL (a drop, two listener guards); for IPv6, 2.
	rulesA = Rules{
		Intercepts: []InterceptRule{
			svc("default/web:http", TCP, "10.96.0.10", 80, 40001),
			svc("kube-system/kube-dns:dns", UDP, "10.96.0.2", 53, 40002),
			svc("default/web:http", TCP, "2001:db8::10", 80, 40003),
		},
		NodePorts: []NodePort{{Comment: "default/web:http", Family: IPv4, Protocol: TCP, Port: 30080, ToPort: 40001}},
		Firewalls: []Firewall{{Comment: "default/web:http", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.10"), Port: 80,
			Allow: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24"), netip.MustParsePrefix("10.244.0.0/24"), netip.MustParsePrefix("2001:db8:244::/64")}}},
		Listeners: []Listener{{IPv4, TCP, 40001}, {IPv4, UDP, 40002}, {IPv6, TCP, 40003}},
	}
	// rulesB has only intercepts: 2 rules.
	rulesB = Rules{Intercepts: []InterceptRule{
		svc("default/web:http", TCP, "10.96.0.10", 80, 40001),
		svc("default/web:https", TCP, "10.96.0.10", 443, 40004),
	}}
)

const (
	jumpComment             = `-m mark ! --mark 0x400000/0x400000 -m comment --comment "uproxy service portals" -j UPROXY-SERVICES`
	tproxyJumpComment       = `-m mark ! --mark 0x400000/0x400000 -m comment --comment "uproxy tproxy" -j UPROXY-TPROXY`
	tproxyOutputJumpComment = `-m mark ! --mark 0x400000/0x400000 -m comment --comment "uproxy tproxy node traffic" -j UPROXY-TPROXY-OUTPUT`
	repliesJumpComment      = `-m comment --comment "uproxy replies to transparent dials" -j UPROXY-REPLIES`
	firewallJumpComment     = `-m conntrack --ctstate NEW,UNTRACKED -m comment --comment "uproxy firewall" -j UPROXY-FIREWALL`
	listenersJumpComment    = `-m conntrack --ctstate NEW -m comment --comment "uproxy listener owners" -j UPROXY-LISTENERS`
	// oldJumpComment is the service jump of earlier versions, which the
	// proxy's own packets took too.
	oldJumpComment = `-m comment --comment "uproxy service portals" -j UPROXY-SERVICES`
	// oldFirewallJumpComment is the firewall jump of earlier versions,
	// which every packet took.
	oldFirewallJumpComment = `-m comment --comment "uproxy firewall" -j UPROXY-FIREWALL`
)

// wantSave is what the fake kernel should hold after syncing r for family
// f: the unrelated rules, the jumps and the rendered rules.
func wantSave(f Family, r Rules) string {
	st := parseState(Render(f, r))
	var b strings.Builder
	b.WriteString("# Generated by iptables-save v1.8.9 (nf_tables) on Sun Nov 29 14:42:56 2026\n*nat\n")
	for _, c := range builtin["nat"] {
		fmt.Fprintf(&b, ":%s ACCEPT [7:420]\n", c)
	}
	b.WriteString(":UPROXY-SERVICES - [0:0]\n:UPROXY-NODEPORTS - [0:0]\n")
	b.WriteString("-A PREROUTING " + jumpComment + "\n")
	b.WriteString("-A OUTPUT " + jumpComment + "\n")
	b.WriteString(unrelated + "\n")
	for _, c := range []string{"UPROXY-SERVICES", "UPROXY-NODEPORTS"} {
		for _, l := range st[chainKey{"nat", c}].rules {
			b.WriteString(l + "\n")
		}
	}
	b.WriteString("COMMIT\n# Completed on Sun Nov 29 14:42:56 2026\n")
	b.WriteString("# Generated by iptables-save v1.8.9 (nf_tables) on Sun Nov 29 14:42:56 2026\n*mangle\n")
	for _, c := range builtin["mangle"] {
		fmt.Fprintf(&b, ":%s ACCEPT [7:420]\n", c)
	}
	b.WriteString(":UPROXY-TPROXY - [0:0]\n:UPROXY-TPROXY-SERVICES-TCP - [0:0]\n:UPROXY-TPROXY-SERVICES-UDP - [0:0]\n:UPROXY-TPROXY-NODEPORTS-TCP - [0:0]\n:UPROXY-TPROXY-NODEPORTS-UDP - [0:0]\n:UPROXY-TPROXY-DIVERT - [0:0]\n:UPROXY-TPROXY-BRIDGED - [0:0]\n:UPROXY-TPROXY-OUTPUT - [0:0]\n:UPROXY-REPLIES - [0:0]\n")
	// Only tproxy mode, and redirect mode with Replies, jump to the
	// mangle chains.
	if m := modeOf(r); m.tproxy {
		b.WriteString("-A PREROUTING " + tproxyJumpComment + "\n")
	} else if m.replies {
		b.WriteString("-A PREROUTING " + repliesJumpComment + "\n")
	}
	b.WriteString(unrelatedMangle + "\n")
	if r.TProxy != nil {
		b.WriteString("-A OUTPUT " + tproxyOutputJumpComment + "\n")
	}
	for _, c := range []string{"UPROXY-TPROXY", "UPROXY-TPROXY-SERVICES-TCP", "UPROXY-TPROXY-SERVICES-UDP", "UPROXY-TPROXY-NODEPORTS-TCP", "UPROXY-TPROXY-NODEPORTS-UDP", "UPROXY-TPROXY-DIVERT", "UPROXY-TPROXY-BRIDGED", "UPROXY-TPROXY-OUTPUT", "UPROXY-REPLIES"} {
		for _, l := range st[chainKey{"mangle", c}].rules {
			b.WriteString(l + "\n")
		}
	}
	b.WriteString("COMMIT\n# Completed on Sun Nov 29 14:42:56 2026\n")
	b.WriteString("# Generated by iptables-save v1.8.9 (nf_tables) on Sun Nov 29 14:42:56 2026\n*filter\n")
	for _, c := range builtin["filter"] {
		fmt.Fprintf(&b, ":%s ACCEPT [7:420]\n", c)
	}
	b.WriteString(":UPROXY-LISTENERS - [0:0]\n:UPROXY-FIREWALL - [0:0]\n")
	b.WriteString("-A INPUT " + firewallJumpComment + "\n")
	b.WriteString("-A INPUT " + listenersJumpComment + "\n")
	b.WriteString(unrelatedFilter + "\n")
	b.WriteString("-A FORWARD " + firewallJumpComment + "\n")
	b.WriteString("-A OUTPUT " + firewallJumpComment + "\n")
	for _, c := range []string{"UPROXY-LISTENERS", "UPROXY-FIREWALL"} {
		for _, l := range st[chainKey{"filter", c}].rules {
			b.WriteString(l + "\n")
		}
	}
	b.WriteString("COMMIT\n# Completed on Sun Nov 29 14:42:56 2026\n")
	return b.String()
}

var (
	callsSave   = []string{"iptables-save"}
	callRestore = "iptables-restore --noflush -w 5"
	// callsRead is a full read: rules, then sets.
	callsRead = concat(callsSave, "ipset save uproxy-listeners-tcp4", "ipset save uproxy-listeners-udp4",
		"ipset save uproxy-services4", "ipset save uproxy-nodeports-tcp4", "ipset save uproxy-nodeports-udp4")
	callSetRestore = "ipset restore"
	callsDestroy   = []string{"ipset destroy uproxy-listeners-tcp4", "ipset destroy uproxy-listeners-udp4"}
	// callsJumps are the jump calls of a full sync that finds every jump in
	// the saved tables: none.
	callsJumps []string
	// callsInsertJumps are the calls that find no jump and insert them all,
	// in redirect mode: no mangle jumps.
	callsInsertJumps = []string{
		"Insert nat PREROUTING 1", "Insert nat OUTPUT 1",
		"Insert filter INPUT 1", "Insert filter INPUT 1", "Insert filter FORWARD 1", "Insert filter OUTPUT 1",
	}
	// callsInsertJumpsTProxy are those of tproxy mode.
	callsInsertJumpsTProxy = []string{
		"Insert nat PREROUTING 1", "Insert nat OUTPUT 1", "Insert mangle PREROUTING 1", "Insert mangle OUTPUT 1",
		"Insert filter INPUT 1", "Insert filter INPUT 1", "Insert filter FORWARD 1", "Insert filter OUTPUT 1",
	}
)

// concat returns its arguments, single calls and lists of calls, as one
// list.
func concat(parts ...any) []string {
	var out []string
	for _, p := range parts {
		switch p := p.(type) {
		case string:
			out = append(out, p)
		case []string:
			out = append(out, p...)
		default:
			panic(fmt.Sprintf("concat: %T", p))
		}
	}
	return out
}

func TestSyncFirstWritesAndInsertsJumps(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	res, err := s.Sync(ctx, rulesA, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Wrote: true, Rules: 12, WroteSets: true, SetMembers: 2, SetMembersWritten: 2}); res != want {
		t.Errorf("first Sync = %+v, want %+v", res, want)
	}
	// The sets first: the rules name them.
	if diff := cmp.Diff(concat(callsRead, callSetRestore, callRestore, callsInsertJumps), k.takeCalls()); diff != "" {
		t.Errorf("first Sync calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{string(RenderSetUpdate(IPv4, Rules{}, rulesA))}, k.setRestored); diff != "" {
		t.Errorf("ipset restore input (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{string(Render(IPv4, rulesA))}, k.restored); diff != "" {
		t.Errorf("restore input (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
		t.Errorf("kernel after first Sync (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSetsSave(IPv4, rulesA), k.saveSets()); diff != "" {
		t.Errorf("sets after first Sync (-want +got):\n%s", diff)
	}
}

// TestSyncReplacesEarlierJumps: the firewall jumps of an earlier version,
// which every packet took, are replaced by the current ones, which only a
// connection's first packet takes: by the first sync of a new process,
// and again by a full sync if they come back.
func TestSyncReplacesEarlierJumps(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	if _, err := newFakeSyncer(t, k).Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	// What an earlier version left: its jumps, where the current ones are.
	earlier := func() {
		k.edit("filter", func(order []string, rules map[string][]string) []string {
			for _, from := range []string{"INPUT", "FORWARD", "OUTPUT"} {
				i := slices.Index(rules[from], "-A "+from+" "+firewallJumpComment)
				if i < 0 {
					t.Fatalf("no firewall jump in %s: %q", from, rules[from])
				}
				rules[from][i] = "-A " + from + " " + oldFirewallJumpComment
			}
			return order
		})
	}
	earlier()
	k.takeCalls()
	s := newFakeSyncer(t, k)
	res, err := s.Sync(ctx, rulesA, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Rules: 12, SetMembers: 2}); res != want {
		t.Errorf("first Sync of a new process = %+v, want %+v", res, want)
	}
	replace := []string{
		"Insert filter INPUT 1", "Delete filter INPUT",
		"Insert filter FORWARD 1", "Delete filter FORWARD",
		"Insert filter OUTPUT 1", "Delete filter OUTPUT",
	}
	if diff := cmp.Diff(concat(callsRead, replace), k.takeCalls()); diff != "" {
		t.Errorf("first Sync of a new process, calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
		t.Errorf("kernel after the first Sync of a new process (-want +got):\n%s", diff)
	}

	// Again, with a second copy in INPUT: every copy goes.
	earlier()
	k.edit("filter", func(order []string, rules map[string][]string) []string {
		rules["INPUT"] = append(rules["INPUT"], "-A INPUT "+oldFirewallJumpComment)
		return order
	})
	res, err = s.Sync(ctx, rulesA, true)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Rules: 12, SetMembers: 2, Repaired: true}); res != want {
		t.Errorf("full Sync = %+v, want %+v", res, want)
	}
	replace = slices.Insert(replace, 2, "Delete filter INPUT")
	if diff := cmp.Diff(concat(callsRead, replace), k.takeCalls()); diff != "" {
		t.Errorf("full Sync calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
		t.Errorf("kernel after the full Sync (-want +got):\n%s", diff)
	}
}

// wantSetsSave is what the fake kernel's sets should be after syncing r
// for f: someone else's and the wanted ones.
func wantSetsSave(f Family, r Rules) string {
	k := newFakeKernel(f)
	for name, c := range wantSets(f, r) {
		if c.exists {
			set := &fakeSet{header: kernelHeader(c.header), members: map[setMember]bool{}}
			for _, m := range c.members {
				set.members[m] = true
			}
			k.sets[name] = set
		}
	}
	return k.saveSets()
}

// reversed returns r with every list in reverse order.
func reversed(r Rules) Rules {
	r = Rules{
		Intercepts:        slices.Clone(r.Intercepts),
		NodePorts:         slices.Clone(r.NodePorts),
		NodePortAddresses: slices.Clone(r.NodePortAddresses),
		Firewalls:         slices.Clone(r.Firewalls),
		Rejects:           slices.Clone(r.Rejects),
		Listeners:         slices.Clone(r.Listeners),
		TProxy:            r.TProxy,
		Shared:            r.Shared,
	}
	slices.Reverse(r.Intercepts)
	slices.Reverse(r.NodePorts)
	slices.Reverse(r.NodePortAddresses)
	slices.Reverse(r.Listeners)
	for i := range r.Firewalls {
		r.Firewalls[i].Allow = slices.Clone(r.Firewalls[i].Allow)
		slices.Reverse(r.Firewalls[i].Allow)
	}
	slices.Reverse(r.Firewalls)
	slices.Reverse(r.Rejects)
	return r
}

func TestSyncUnchangedRunsNothing(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	if _, err := s.Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	k.takeCalls()
	for _, r := range []Rules{rulesA, reversed(rulesA)} {
		res, err := s.Sync(ctx, r, false)
		if err != nil {
			t.Fatal(err)
		}
		if want := (Result{Rules: 12, SetMembers: 2}); res != want {
			t.Errorf("unchanged Sync = %+v, want %+v", res, want)
		}
		if calls := k.takeCalls(); len(calls) != 0 {
			t.Errorf("unchanged non-full Sync ran %q, want nothing", calls)
		}
	}
}

func TestSyncChangedWritesOnce(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	if _, err := s.Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	k.takeCalls()
	// rulesB empties UPROXY-NODEPORTS and UPROXY-FIREWALL, and needs no
	// set: they are destroyed once no rule names them.
	res, err := s.Sync(ctx, rulesB, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Wrote: true, Rules: 2, WroteSets: true}); res != want {
		t.Errorf("changed Sync = %+v, want %+v", res, want)
	}
	if diff := cmp.Diff(concat(callRestore, callsDestroy), k.takeCalls()); diff != "" {
		t.Errorf("changed Sync calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesB), k.save()); diff != "" {
		t.Errorf("kernel (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSetsSave(IPv4, rulesB), k.saveSets()); diff != "" {
		t.Errorf("sets (-want +got):\n%s", diff)
	}
	if _, err := s.Sync(ctx, rulesB, false); err != nil {
		t.Fatal(err)
	}
	if calls := k.takeCalls(); len(calls) != 0 {
		t.Errorf("Sync after the change ran %q, want nothing", calls)
	}
}

func TestSyncFullUnchangedWritesNothing(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	if _, err := s.Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	k.takeCalls()
	res, err := s.Sync(ctx, rulesA, true)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Rules: 12, SetMembers: 2}); res != want {
		t.Errorf("full Sync = %+v, want %+v", res, want)
	}
	if diff := cmp.Diff(concat(callsRead, callsJumps), k.takeCalls()); diff != "" {
		t.Errorf("full Sync calls (-want +got):\n%s", diff)
	}
}

func TestSyncFullRepairsDrift(t *testing.T) {
	tests := []struct {
		name  string
		table string
		drift func(order []string, rules map[string][]string) []string
		// calls after the saves and the restore
		jumpCalls []string
	}{
		{"rule deleted", "nat", func(order []string, rules map[string][]string) []string {
			rules["UPROXY-SERVICES"] = rules["UPROXY-SERVICES"][1:]
			return order
		}, callsJumps},
		{"rule added", "nat", func(order []string, rules map[string][]string) []string {
			rules["UPROXY-SERVICES"] = append(rules["UPROXY-SERVICES"], "-A UPROXY-SERVICES -j ACCEPT")
			return order
		}, callsJumps},
		{"rule changed", "nat", func(order []string, rules map[string][]string) []string {
			rules["UPROXY-SERVICES"][0] = strings.Replace(rules["UPROXY-SERVICES"][0], "40002", "40009", 1)
			return order
		}, callsJumps},
		{"node-port jump deleted", "nat", func(order []string, rules map[string][]string) []string {
			rules["UPROXY-SERVICES"] = slices.DeleteFunc(rules["UPROXY-SERVICES"], func(r string) bool {
				return strings.HasSuffix(r, "-j UPROXY-NODEPORTS")
			})
			return order
		}, callsJumps},
		{"node-port rule deleted", "nat", func(order []string, rules map[string][]string) []string {
			rules["UPROXY-NODEPORTS"] = nil
			return order
		}, callsJumps},
		{"jumps and chain deleted", "nat", func(order []string, rules map[string][]string) []string {
			rules["PREROUTING"] = nil
			rules["OUTPUT"] = []string{unrelated}
			delete(rules, "UPROXY-SERVICES")
			delete(rules, "UPROXY-NODEPORTS")
			return slices.Clone(builtin["nat"])
		}, []string{"Insert nat PREROUTING 1", "Insert nat OUTPUT 1"}},
		// In redirect mode the mangle chains are there, empty, and
		// nothing jumps to them.
		{"mangle chains deleted", "mangle", func(order []string, rules map[string][]string) []string {
			delete(rules, "UPROXY-TPROXY")
			for _, c := range []string{tproxyServicesTCP, tproxyServicesUDP, tproxyNodePortsTCP, tproxyNodePortsUDP} {
				delete(rules, c)
			}
			delete(rules, "UPROXY-TPROXY-DIVERT")
			delete(rules, "UPROXY-TPROXY-OUTPUT")
			return slices.Clone(builtin["mangle"])
		}, callsJumps},
		{"mangle chains deleted, jumps to them added", "mangle", func(order []string, rules map[string][]string) []string {
			rules["PREROUTING"] = []string{"-A PREROUTING " + tproxyJumpComment, unrelatedMangle}
			rules["OUTPUT"] = []string{"-A OUTPUT " + tproxyOutputJumpComment}
			delete(rules, "UPROXY-TPROXY")
			for _, c := range []string{tproxyServicesTCP, tproxyServicesUDP, tproxyNodePortsTCP, tproxyNodePortsUDP} {
				delete(rules, c)
			}
			delete(rules, "UPROXY-TPROXY-DIVERT")
			delete(rules, "UPROXY-TPROXY-OUTPUT")
			return slices.Clone(builtin["mangle"])
		}, []string{"Delete mangle PREROUTING", "Delete mangle OUTPUT"}},
		{"firewall rule deleted", "filter", func(order []string, rules map[string][]string) []string {
			rules["UPROXY-FIREWALL"] = rules["UPROXY-FIREWALL"][1:]
			return order
		}, callsJumps},
		{"listener guard changed", "filter", func(order []string, rules map[string][]string) []string {
			n := len(rules["UPROXY-FIREWALL"]) - 1
			rules["UPROXY-FIREWALL"][n] = strings.Replace(rules["UPROXY-FIREWALL"][n], "! --ctstate DNAT", "--ctstate NEW", 1)
			return order
		}, callsJumps},
		{"filter jumps and chain deleted", "filter", func(order []string, rules map[string][]string) []string {
			rules["INPUT"] = []string{unrelatedFilter}
			rules["FORWARD"] = nil
			rules["OUTPUT"] = nil
			delete(rules, "UPROXY-FIREWALL")
			return slices.Clone(builtin["filter"])
		}, []string{"Insert filter INPUT 1", "Insert filter INPUT 1", "Insert filter FORWARD 1", "Insert filter OUTPUT 1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			k := newFakeKernel(IPv4)
			s := newFakeSyncer(t, k)
			if _, err := s.Sync(ctx, rulesA, false); err != nil {
				t.Fatal(err)
			}
			k.edit(tt.table, tt.drift)
			k.takeCalls()
			res, err := s.Sync(ctx, rulesA, true)
			if err != nil {
				t.Fatal(err)
			}
			if want := (Result{Wrote: true, Rules: 12, Repaired: true, SetMembers: 2}); res != want {
				t.Errorf("full Sync after drift = %+v, want %+v", res, want)
			}
			if diff := cmp.Diff(concat(callsRead, callRestore, tt.jumpCalls), k.takeCalls()); diff != "" {
				t.Errorf("full Sync calls (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
				t.Errorf("kernel after repair (-want +got):\n%s", diff)
			}
		})
	}
}

func TestSyncFullRepairsMissingJump(t *testing.T) {
	tp := tproxied(rulesA, Routing{})
	for _, tt := range []struct {
		table, chain string
		left         []string
		r            Rules
		rules        int
		members      int
	}{
		{"nat", "OUTPUT", []string{unrelated}, rulesA, 12, 2},
		{"mangle", "PREROUTING", []string{unrelatedMangle}, tp, 26, 5},
		{"filter", "FORWARD", nil, rulesA, 12, 2},
	} {
		t.Run(tt.table+"/"+tt.chain, func(t *testing.T) {
			ctx := context.Background()
			k := newFakeKernel(IPv4)
			s := newFakeSyncer(t, k)
			if _, err := s.Sync(ctx, tt.r, false); err != nil {
				t.Fatal(err)
			}
			k.edit(tt.table, func(order []string, rules map[string][]string) []string {
				rules[tt.chain] = tt.left
				return order
			})
			k.takeCalls()
			res, err := s.Sync(ctx, tt.r, true)
			if err != nil {
				t.Fatal(err)
			}
			if want := (Result{Rules: tt.rules, Repaired: true, SetMembers: tt.members}); res != want {
				t.Errorf("full Sync = %+v, want %+v", res, want)
			}
			// The saved tables lack the one jump: it alone is inserted.
			want := []string{"Insert " + tt.table + " " + tt.chain + " 1"}
			if diff := cmp.Diff(concat(callsRead, want), k.takeCalls()); diff != "" {
				t.Errorf("full Sync calls (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(wantSave(IPv4, tt.r), k.save()); diff != "" {
				t.Errorf("kernel after repair (-want +got):\n%s", diff)
			}
		})
	}
}

// TestSyncFullWithNewRulesIsNotDrift checks that a full Sync that also
// carries a change writes it without calling it a repair.
func TestSyncFullWithNewRulesIsNotDrift(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	if _, err := s.Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	res, err := s.Sync(ctx, rulesB, true)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Wrote: true, Rules: 2, WroteSets: true}); res != want {
		t.Errorf("full Sync with new rules = %+v, want %+v", res, want)
	}
}

func TestSyncRestoreFailure(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	if _, err := s.Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	stderr := "iptables-restore: line 3 failed"
	k.failRestore = fmt.Errorf("iptables-restore --noflush -w 5: %w: %s", errExit, stderr)
	res, err := s.Sync(ctx, rulesB, false)
	if err == nil {
		t.Fatal("Sync with a failing restore succeeded")
	}
	if !errors.Is(err, errExit) {
		t.Errorf("error %v does not wrap the exec error", err)
	}
	for _, s := range []string{"IPv4", "writing", "nat UPROXY-SERVICES,UPROXY-NODEPORTS; mangle UPROXY-TPROXY,UPROXY-TPROXY-SERVICES-TCP,UPROXY-TPROXY-SERVICES-UDP,UPROXY-TPROXY-NODEPORTS-TCP,UPROXY-TPROXY-NODEPORTS-UDP,UPROXY-TPROXY-DIVERT,UPROXY-TPROXY-BRIDGED,UPROXY-TPROXY-OUTPUT,UPROXY-REPLIES; filter UPROXY-LISTENERS,UPROXY-FIREWALL", stderr} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not mention %q", err, s)
		}
	}
	if res.Wrote {
		t.Errorf("failed Sync = %+v, want Wrote false", res)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
		t.Errorf("kernel after failed restore (-want +got):\n%s", diff)
	}

	// The failed write is not remembered: the same rules are written again,
	// after a read-back as the first Sync does, and the sets no longer
	// needed destroyed after them.
	k.takeCalls()
	res, err = s.Sync(ctx, rulesB, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Wrote: true, Rules: 2, WroteSets: true}); res != want {
		t.Errorf("Sync after failure = %+v, want %+v", res, want)
	}
	if diff := cmp.Diff(concat(callsRead, callRestore, callsDestroy, callsJumps), k.takeCalls()); diff != "" {
		t.Errorf("Sync after failure calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesB), k.save()); diff != "" {
		t.Errorf("kernel (-want +got):\n%s", diff)
	}
}

func TestSyncFirstRestoreFailure(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	k.failRestore = fmt.Errorf("iptables-restore: %w: boom", errExit)
	if _, err := s.Sync(ctx, rulesA, false); !errors.Is(err, errExit) {
		t.Fatalf("first Sync error = %v, want one wrapping %v", err, errExit)
	}
	if res, err := s.Sync(ctx, rulesA, false); err != nil || !res.Wrote {
		t.Fatalf("retry = %+v, %v; want a write", res, err)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
		t.Errorf("kernel (-want +got):\n%s", diff)
	}
}

func TestSyncReadAndJumpFailures(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)

	k.failSave = fmt.Errorf("iptables-save: %w: no nat table", errExit)
	_, err := s.Sync(ctx, rulesA, false)
	if !errors.Is(err, errExit) || !strings.Contains(err.Error(), "reading chains (nat UPROXY-SERVICES,UPROXY-NODEPORTS; mangle") || !strings.Contains(err.Error(), "no nat table") {
		t.Errorf("Sync with failing save: %v", err)
	}

	k.failInsert = fmt.Errorf("iptables -I: %w: no such table", errExit)
	_, err = s.Sync(ctx, rulesA, false)
	if !errors.Is(err, errExit) || !strings.Contains(err.Error(), "inserting jump from nat/PREROUTING to UPROXY-SERVICES") {
		t.Errorf("Sync with failing Insert: %v", err)
	}

	// The jumps were not all inserted, so the next Sync is full again,
	// and inserts the ones the saved tables lack.
	k.takeCalls()
	if _, err := s.Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(concat(callsRead, callsInsertJumps), k.takeCalls()); diff != "" {
		t.Errorf("Sync after failures calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
		t.Errorf("kernel (-want +got):\n%s", diff)
	}
}

func TestSyncInsertsOnlyMissingJumps(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	k.edit("nat", func(order []string, rules map[string][]string) []string {
		rules["PREROUTING"] = []string{"-A PREROUTING " + jumpComment}
		return append(order, "UPROXY-SERVICES")
	})
	k.edit("filter", func(order []string, rules map[string][]string) []string {
		rules["FORWARD"] = []string{"-A FORWARD " + firewallJumpComment}
		return append(order, "UPROXY-LISTENERS", "UPROXY-FIREWALL")
	})
	s := newFakeSyncer(t, k)
	if _, err := s.Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	want := concat(callsRead, callSetRestore, callRestore, "Insert nat OUTPUT 1",
		"Insert filter INPUT 1", "Insert filter INPUT 1", "Insert filter OUTPUT 1")
	if diff := cmp.Diff(want, k.takeCalls()); diff != "" {
		t.Errorf("Sync calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
		t.Errorf("kernel (-want +got):\n%s", diff)
	}
}

// TestSyncAdoptsPreviousProcess checks that a new Syncer finding the rules
// of an earlier one in place changes nothing.
func TestSyncAdoptsPreviousProcess(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	if _, err := newFakeSyncer(t, k).Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	k.takeCalls()
	res, err := newFakeSyncer(t, k).Sync(ctx, rulesA, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Rules: 12, SetMembers: 2}); res != want {
		t.Errorf("adopting Sync = %+v, want %+v", res, want)
	}
	if diff := cmp.Diff(concat(callsRead, callsJumps), k.takeCalls()); diff != "" {
		t.Errorf("adopting Sync calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
		t.Errorf("kernel (-want +got):\n%s", diff)
	}
}

func TestSyncInvalidRulesRunsNothing(t *testing.T) {
	for _, bad := range []Rules{
		{Intercepts: []InterceptRule{svc("x", TCP, "10.96.0.1", 80, 0)}},
		{NodePorts: []NodePort{{Family: IPv4, Protocol: TCP, Port: 30080, ToPort: 0}}},
		{Firewalls: []Firewall{{Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.1"), Port: 80, Allow: []netip.Prefix{{}}}}},
		{Listeners: []Listener{{IPv4, TCP, 0}}},
		{NodePortAddresses: []netip.Prefix{{}}},
	} {
		k := newFakeKernel(IPv4)
		s := newFakeSyncer(t, k)
		if _, err := s.Sync(context.Background(), bad, true); err == nil || !strings.Contains(err.Error(), "invalid rules") {
			t.Errorf("Sync(%+v) error = %v", bad, err)
		}
		if calls := k.takeCalls(); len(calls) != 0 {
			t.Errorf("Sync(%+v) ran %q", bad, calls)
		}
	}
}

func TestSyncIPv6(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv6)
	s := newFakeSyncer(t, k)
	res, err := s.Sync(ctx, rulesA, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Wrote: true, Rules: 4, WroteSets: true, SetMembers: 1, SetMembersWritten: 1}); res != want {
		t.Errorf("Sync = %+v, want %+v", res, want)
	}
	calls := k.takeCalls()
	if want := []string{"ip6tables-save", "ipset save uproxy-listeners-tcp6", "ipset save uproxy-listeners-udp6",
		"ipset save uproxy-services6", "ipset save uproxy-nodeports-tcp6", "ipset save uproxy-nodeports-udp6",
		"ipset restore", "ip6tables-restore --noflush -w 5"}; !slices.Equal(calls[:len(want)], want) {
		t.Errorf("IPv6 Sync calls %q, want %q first", calls, want)
	}
	if diff := cmp.Diff([]string{string(Render(IPv6, rulesA))}, k.restored); diff != "" {
		t.Errorf("restore input (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"create uproxy-listeners-tcp6 bitmap:port range 0-65535 -exist\nadd uproxy-listeners-tcp6 40003 -exist\n"}, k.setRestored); diff != "" {
		t.Errorf("ipset restore input (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv6, rulesA), k.save()); diff != "" {
		t.Errorf("kernel (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSetsSave(IPv6, rulesA), k.saveSets()); diff != "" {
		t.Errorf("sets (-want +got):\n%s", diff)
	}
}

func TestNewConfig(t *testing.T) {
	k := newFakeKernel(IPv4)
	for _, tt := range []struct {
		wait time.Duration
		arg  string
	}{{0, "5"}, {time.Second, "1"}, {1500 * time.Millisecond, "2"}, {time.Millisecond, "1"}} {
		s, err := New(Config{Exec: k, Jumps: k, Wait: tt.wait})
		if err != nil {
			t.Fatal(err)
		}
		if s.wait != tt.arg {
			t.Errorf("Wait %s: -w %s, want %s", tt.wait, s.wait, tt.arg)
		}
	}
	if _, err := New(Config{Exec: k, Jumps: k, Wait: -time.Second}); err == nil {
		t.Error("New accepted a negative Wait")
	}
	if _, err := New(Config{Family: Family(2), Exec: k, Jumps: k}); err == nil || !strings.Contains(err.Error(), "Family(2)") {
		t.Errorf("New(Family(2)) error = %v", err)
	}
}

func TestCleanup(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	if _, err := newFakeSyncer(t, k).Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	// Duplicate jumps, as a buggy older version might have left.
	k.edit("nat", func(order []string, rules map[string][]string) []string {
		rules["OUTPUT"] = append(rules["OUTPUT"], "-A OUTPUT "+jumpComment)
		return order
	})
	k.edit("mangle", func(order []string, rules map[string][]string) []string {
		rules["OUTPUT"] = append(rules["OUTPUT"], "-A OUTPUT "+tproxyOutputJumpComment)
		return order
	})
	k.edit("filter", func(order []string, rules map[string][]string) []string {
		rules["INPUT"] = append(rules["INPUT"], "-A INPUT "+firewallJumpComment)
		// An earlier version's jump, beside the current one.
		rules["FORWARD"] = append(rules["FORWARD"], "-A FORWARD "+oldFirewallJumpComment)
		return order
	})
	k.takeCalls()
	cfg := Config{Exec: k, Jumps: k}
	if err := Cleanup(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	want, wantSets := newFakeKernel(IPv4).save(), newFakeKernel(IPv4).saveSets()
	if diff := cmp.Diff(want, k.save()); diff != "" {
		t.Errorf("kernel after Cleanup (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSets, k.saveSets()); diff != "" {
		t.Errorf("sets after Cleanup (-want +got):\n%s", diff)
	}
	// UPROXY-SERVICES jumps to UPROXY-NODEPORTS: both are flushed before
	// either is deleted.
	wantInput := "*nat\n:UPROXY-SERVICES - [0:0]\n:UPROXY-NODEPORTS - [0:0]\n-X UPROXY-SERVICES\n-X UPROXY-NODEPORTS\nCOMMIT\n" +
		"*mangle\n:UPROXY-TPROXY - [0:0]\n:UPROXY-TPROXY-SERVICES-TCP - [0:0]\n:UPROXY-TPROXY-SERVICES-UDP - [0:0]\n:UPROXY-TPROXY-NODEPORTS-TCP - [0:0]\n:UPROXY-TPROXY-NODEPORTS-UDP - [0:0]\n:UPROXY-TPROXY-DIVERT - [0:0]\n:UPROXY-TPROXY-BRIDGED - [0:0]\n:UPROXY-TPROXY-OUTPUT - [0:0]\n:UPROXY-REPLIES - [0:0]\n-X UPROXY-TPROXY\n-X UPROXY-TPROXY-SERVICES-TCP\n-X UPROXY-TPROXY-SERVICES-UDP\n-X UPROXY-TPROXY-NODEPORTS-TCP\n-X UPROXY-TPROXY-NODEPORTS-UDP\n-X UPROXY-TPROXY-DIVERT\n-X UPROXY-TPROXY-BRIDGED\n-X UPROXY-TPROXY-OUTPUT\n-X UPROXY-REPLIES\nCOMMIT\n" +
		"*filter\n:UPROXY-LISTENERS - [0:0]\n:UPROXY-FIREWALL - [0:0]\n-X UPROXY-LISTENERS\n-X UPROXY-FIREWALL\nCOMMIT\n"
	if got := k.restored[len(k.restored)-1]; got != wantInput {
		t.Errorf("Cleanup restore input = %q, want %q", got, wantInput)
	}
	wantCalls := []string{
		// Each chain's current jump, then an earlier version's.
		"Exists nat PREROUTING", "Delete nat PREROUTING", "Exists nat PREROUTING", "Exists nat PREROUTING",
		"Exists nat OUTPUT", "Delete nat OUTPUT", "Exists nat OUTPUT", "Delete nat OUTPUT", "Exists nat OUTPUT", "Exists nat OUTPUT",
		// Redirect mode has no mangle jumps but UPROXY-REPLIES's: only
		// the one added above.
		"Exists mangle PREROUTING", "Exists mangle PREROUTING",
		"Exists mangle OUTPUT", "Delete mangle OUTPUT", "Exists mangle OUTPUT", "Exists mangle OUTPUT",
		"Exists mangle PREROUTING",
		"Exists filter INPUT", "Delete filter INPUT", "Exists filter INPUT",
		"Exists filter INPUT", "Delete filter INPUT", "Exists filter INPUT", "Delete filter INPUT", "Exists filter INPUT",
		"Exists filter INPUT",
		"Exists filter FORWARD", "Delete filter FORWARD", "Exists filter FORWARD",
		"Exists filter FORWARD", "Delete filter FORWARD", "Exists filter FORWARD",
		"Exists filter OUTPUT", "Delete filter OUTPUT", "Exists filter OUTPUT",
		"Exists filter OUTPUT",
		callRestore,
		// Once no rule names them.
		"ipset destroy uproxy-listeners-tcp4", "ipset destroy uproxy-listeners-udp4",
		"ipset destroy uproxy-services4", "ipset destroy uproxy-nodeports-tcp4", "ipset destroy uproxy-nodeports-udp4",
	}
	if diff := cmp.Diff(wantCalls, k.takeCalls()); diff != "" {
		t.Errorf("Cleanup calls (-want +got):\n%s", diff)
	}
	// Nothing left: the jump checks find the chains missing, and the
	// restore creates and deletes them again.
	if err := Cleanup(ctx, cfg); err != nil {
		t.Fatalf("second Cleanup: %v", err)
	}
	if diff := cmp.Diff(want, k.save()); diff != "" {
		t.Errorf("kernel after second Cleanup (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSets, k.saveSets()); diff != "" {
		t.Errorf("sets after second Cleanup (-want +got):\n%s", diff)
	}

	// From tproxy mode: the filled mangle chains go the same way.
	if _, err := newFakeSyncer(t, k).Sync(ctx, tproxied(rulesA, Routing{}), false); err != nil {
		t.Fatal(err)
	}
	if st := parseState([]byte(k.save())); len(st[chainKey{"mangle", TProxyChain}].rules) == 0 {
		t.Fatal("tproxy mode left UPROXY-TPROXY empty")
	}
	if err := Cleanup(ctx, cfg); err != nil {
		t.Fatalf("Cleanup from tproxy mode: %v", err)
	}
	if diff := cmp.Diff(want, k.save()); diff != "" {
		t.Errorf("kernel after Cleanup from tproxy mode (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSets, k.saveSets()); diff != "" {
		t.Errorf("sets after Cleanup from tproxy mode (-want +got):\n%s", diff)
	}
}

func TestCleanupErrors(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	k.failExists = fmt.Errorf("iptables -C: %w: locked", errExit)
	err := Cleanup(ctx, Config{Exec: k, Jumps: k})
	if !errors.Is(err, errExit) || !strings.Contains(err.Error(), "cleanup") {
		t.Errorf("Cleanup with failing Exists = %v", err)
	}
	k.failRestore = fmt.Errorf("iptables-restore: %w: referenced", errExit)
	err = Cleanup(ctx, Config{Exec: k, Jumps: k})
	if !errors.Is(err, errExit) || !strings.Contains(err.Error(), "deleting chains (nat UPROXY-SERVICES,UPROXY-NODEPORTS; mangle UPROXY-TPROXY,UPROXY-TPROXY-SERVICES-TCP,UPROXY-TPROXY-SERVICES-UDP,UPROXY-TPROXY-NODEPORTS-TCP,UPROXY-TPROXY-NODEPORTS-UDP,UPROXY-TPROXY-DIVERT,UPROXY-TPROXY-BRIDGED,UPROXY-TPROXY-OUTPUT,UPROXY-REPLIES; filter UPROXY-LISTENERS,UPROXY-FIREWALL)") || !strings.Contains(err.Error(), "referenced") {
		t.Errorf("Cleanup with failing restore = %v", err)
	}
}

func TestSyncConcurrent(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			r := rulesA
			if i%2 == 1 {
				r = rulesB
			}
			if _, err := s.Sync(ctx, r, i%3 == 0); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if _, err := s.Sync(ctx, rulesB, true); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesB), k.save()); diff != "" {
		t.Errorf("kernel (-want +got):\n%s", diff)
	}
}

func TestNewMissingIptables(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	k := newFakeKernel(IPv6)
	_, err := New(Config{Family: IPv6, Jumps: k})
	if !errors.Is(err, exec.ErrNotFound) || !strings.Contains(err.Error(), "ip6tables-save is not installed") {
		t.Errorf("New without ip6tables-save: %v", err)
	}
	_, err = New(Config{Family: IPv6, Exec: k})
	if !errors.Is(err, exec.ErrNotFound) || !strings.Contains(err.Error(), "ip6tables is missing") {
		t.Errorf("New without ip6tables: %v", err)
	}
	if err := Cleanup(context.Background(), Config{}); !errors.Is(err, exec.ErrNotFound) {
		t.Errorf("Cleanup without iptables: %v", err)
	}
}

func TestCompareVersion(t *testing.T) {
	for _, tt := range []struct {
		v    [3]int
		want int
	}{{[3]int{1, 8, 9}, 1}, {[3]int{1, 6, 2}, 0}, {[3]int{1, 6, 1}, -1}, {[3]int{1, 4, 21}, -1}, {[3]int{2, 0, 0}, 1}} {
		if got := compareVersion(tt.v, minVersion); got != tt.want {
			t.Errorf("compareVersion(%v, %v) = %d, want %d", tt.v, minVersion, got, tt.want)
		}
	}
}

// listeners returns rules with a TCP listener of f on each port of tcp and
// a UDP one on each port of udp, plus rulesB's intercepts.
func listeners(f Family, tcp, udp []uint16) Rules {
	r := Rules{Intercepts: rulesB.Intercepts}
	for _, p := range tcp {
		r.Listeners = append(r.Listeners, Listener{f, TCP, p})
	}
	for _, p := range udp {
		r.Listeners = append(r.Listeners, Listener{f, UDP, p})
	}
	return r
}

// TestSyncListenersIncremental checks that a change of listeners runs
// exactly the ipset adds and deletes, and iptables-restore only when a
// protocol gains its first or loses its last listener, in the order that
// keeps every named set in existence.
func TestSyncListenersIncremental(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	step := func(name string, r Rules, want Result, wantCalls []string, wantSetInput ...string) {
		t.Helper()
		k.mu.Lock()
		k.setRestored = nil
		k.mu.Unlock()
		res, err := s.Sync(ctx, r, false)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if res != want {
			t.Errorf("%s: Sync = %+v, want %+v", name, res, want)
		}
		if diff := cmp.Diff(wantCalls, k.takeCalls()); diff != "" {
			t.Errorf("%s: calls (-want +got):\n%s", name, diff)
		}
		if diff := cmp.Diff(wantSetInput, k.setRestored); diff != "" {
			t.Errorf("%s: ipset restore input (-want +got):\n%s", name, diff)
		}
		if diff := cmp.Diff(wantSave(IPv4, r), k.save()); diff != "" {
			t.Errorf("%s: kernel (-want +got):\n%s", name, diff)
		}
		if diff := cmp.Diff(wantSetsSave(IPv4, r), k.saveSets()); diff != "" {
			t.Errorf("%s: sets (-want +got):\n%s", name, diff)
		}
	}
	const tcp, udp = "uproxy-listeners-tcp4", "uproxy-listeners-udp4"

	step("first", listeners(IPv4, []uint16{40001, 40002, 40003}, nil),
		Result{Wrote: true, Rules: 5, WroteSets: true, SetMembers: 3, SetMembersWritten: 3},
		concat(callsRead, callSetRestore, callRestore, callsInsertJumps),
		"create "+tcp+" bitmap:port range 0-65535 -exist\nadd "+tcp+" 40001 -exist\nadd "+tcp+" 40002 -exist\nadd "+tcp+" 40003 -exist\n")
	step("unchanged", listeners(IPv4, []uint16{40003, 40002, 40001, 40001}, nil),
		Result{Rules: 5, SetMembers: 3}, nil)
	step("one added, one removed", listeners(IPv4, []uint16{40001, 40003, 40004}, nil),
		Result{Rules: 5, WroteSets: true, SetMembers: 3, SetMembersWritten: 2},
		[]string{callSetRestore},
		"del "+tcp+" 40002 -exist\nadd "+tcp+" 40004 -exist\n")
	step("unchanged again", listeners(IPv4, []uint16{40001, 40003, 40004}, nil),
		Result{Rules: 5, SetMembers: 3}, nil)
	// The UDP set is created and filled before the rule that names it.
	step("first UDP listener", listeners(IPv4, []uint16{40001, 40003, 40004}, []uint16{40005}),
		Result{Wrote: true, Rules: 8, WroteSets: true, SetMembers: 4, SetMembersWritten: 1},
		[]string{callSetRestore, callRestore},
		"create "+udp+" bitmap:port range 0-65535 -exist\nadd "+udp+" 40005 -exist\n")
	step("changes in both sets", listeners(IPv4, []uint16{40001}, []uint16{40005, 40006}),
		Result{Rules: 8, WroteSets: true, SetMembers: 3, SetMembersWritten: 3},
		[]string{callSetRestore},
		"del "+tcp+" 40003 -exist\ndel "+tcp+" 40004 -exist\nadd "+udp+" 40006 -exist\n")
	// The UDP set is destroyed after the rule that names it is gone.
	step("last UDP listener gone", listeners(IPv4, []uint16{40001, 40002}, nil),
		Result{Wrote: true, Rules: 5, WroteSets: true, SetMembers: 2, SetMembersWritten: 1},
		[]string{callSetRestore, callRestore, "ipset destroy " + udp},
		"add "+tcp+" 40002 -exist\n")
	step("no listeners", rulesB,
		Result{Wrote: true, Rules: 2, WroteSets: true},
		[]string{callRestore, "ipset destroy " + tcp})
	step("no listeners, unchanged", rulesB, Result{Rules: 2}, nil)
	// A full Sync without listeners still looks for sets to destroy.
	res, err := s.Sync(ctx, rulesB, true)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Rules: 2}); res != want {
		t.Errorf("full Sync without listeners = %+v, want %+v", res, want)
	}
	if diff := cmp.Diff(concat(callsRead, callsJumps), k.takeCalls()); diff != "" {
		t.Errorf("full Sync without listeners calls (-want +got):\n%s", diff)
	}
}

// TestSyncFullRepairsSetDrift checks that a full Sync finds a set that
// someone destroyed, flushed or changed, repairs it, and says so.
func TestSyncFullRepairsSetDrift(t *testing.T) {
	const tcp = "uproxy-listeners-tcp4"
	r := listeners(IPv4, []uint16{40001, 40002}, []uint16{40005})
	tests := []struct {
		name  string
		drift func(k *fakeKernel)
		// wantSetInput is the ipset restore input; rules reports that
		// the chains needed an iptables-restore too.
		wantSetInput string
		rules        bool
	}{
		{"set flushed", func(k *fakeKernel) {
			k.editSets(func(sets map[string]*fakeSet) { clear(sets[tcp].members) })
		}, "add " + tcp + " 40001 -exist\nadd " + tcp + " 40002 -exist\n", false},
		{"member deleted and member added", func(k *fakeKernel) {
			k.editSets(func(sets map[string]*fakeSet) {
				delete(sets[tcp].members, portMember(40002))
				sets[tcp].members[portMember(22)] = true
			})
		}, "del " + tcp + " 22 -exist\nadd " + tcp + " 40002 -exist\n", false},
		// A set that a rule names cannot be destroyed: whoever destroyed
		// it flushed the chain first. The set is created again before
		// the rules are restored, or iptables-restore would fail.
		{"chain flushed and set destroyed", func(k *fakeKernel) {
			k.edit("filter", func(order []string, rules map[string][]string) []string {
				rules[FirewallChain] = nil
				rules[ListenersChain] = nil
				return order
			})
			k.editSets(func(sets map[string]*fakeSet) { delete(sets, tcp) })
		}, "create " + tcp + " bitmap:port range 0-65535 -exist\nadd " + tcp + " 40001 -exist\nadd " + tcp + " 40002 -exist\n", true},
		{"set replaced by one of another type", func(k *fakeKernel) {
			k.edit("filter", func(order []string, rules map[string][]string) []string {
				rules[FirewallChain] = nil
				rules[ListenersChain] = nil
				return order
			})
			k.editSets(func(sets map[string]*fakeSet) {
				sets[tcp] = &fakeSet{header: "bitmap:port range 1-1024", members: map[setMember]bool{portMember(22): true}}
			})
		}, "destroy " + tcp + "\ncreate " + tcp + " bitmap:port range 0-65535 -exist\nadd " + tcp + " 40001 -exist\nadd " + tcp + " 40002 -exist\n", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			k := newFakeKernel(IPv4)
			s := newFakeSyncer(t, k)
			if _, err := s.Sync(ctx, r, false); err != nil {
				t.Fatal(err)
			}
			tt.drift(k)
			k.takeCalls()
			k.setRestored = nil
			res, err := s.Sync(ctx, r, true)
			if err != nil {
				t.Fatal(err)
			}
			want := Result{Wrote: tt.rules, Rules: 8, Repaired: true, WroteSets: true, SetMembers: 3, SetMembersWritten: 2, SetsRepaired: true}
			if res != want {
				t.Errorf("full Sync after drift = %+v, want %+v", res, want)
			}
			wantCalls := concat(callsRead, callSetRestore)
			if tt.rules {
				wantCalls = append(wantCalls, callRestore)
			}
			if diff := cmp.Diff(concat(wantCalls, callsJumps), k.takeCalls()); diff != "" {
				t.Errorf("full Sync calls (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff([]string{tt.wantSetInput}, k.setRestored); diff != "" {
				t.Errorf("ipset restore input (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(wantSave(IPv4, r), k.save()); diff != "" {
				t.Errorf("kernel after repair (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(wantSetsSave(IPv4, r), k.saveSets()); diff != "" {
				t.Errorf("sets after repair (-want +got):\n%s", diff)
			}
			// Repaired: the next full Sync finds nothing to do.
			if res, err := s.Sync(ctx, r, true); err != nil || res != (Result{Rules: 8, SetMembers: 3}) {
				t.Errorf("full Sync after repair = %+v, %v", res, err)
			}
		})
	}
}

// TestSyncAdoptsStaleSets checks that a new Syncer destroys the sets that
// a previous process left and its rules do not need, after its rules stop
// naming them, and fills those it needs without recreating them.
func TestSyncAdoptsStaleSets(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	if _, err := newFakeSyncer(t, k).Sync(ctx, listeners(IPv4, []uint16{40001}, []uint16{40002}), false); err != nil {
		t.Fatal(err)
	}
	k.takeCalls()
	k.setRestored = nil
	r := listeners(IPv4, []uint16{40001, 40003}, nil)
	res, err := newFakeSyncer(t, k).Sync(ctx, r, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Wrote: true, Rules: 5, WroteSets: true, SetMembers: 2, SetMembersWritten: 1}); res != want {
		t.Errorf("adopting Sync = %+v, want %+v", res, want)
	}
	if diff := cmp.Diff(concat(callsRead, callSetRestore, callRestore, "ipset destroy uproxy-listeners-udp4", callsJumps), k.takeCalls()); diff != "" {
		t.Errorf("adopting Sync calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"add uproxy-listeners-tcp4 40003 -exist\n"}, k.setRestored); diff != "" {
		t.Errorf("ipset restore input (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSetsSave(IPv4, r), k.saveSets()); diff != "" {
		t.Errorf("sets (-want +got):\n%s", diff)
	}
}

// TestSyncSetFailures checks that a failed ipset call fails the Sync with
// an error that says what failed, is not remembered as applied, and that
// the next Sync reads the kernel back and finishes the job.
func TestSyncSetFailures(t *testing.T) {
	ctx := context.Background()
	r1 := listeners(IPv4, []uint16{40001, 40002}, nil)
	r2 := listeners(IPv4, []uint16{40001, 40003}, []uint16{40004})

	t.Run("restore", func(t *testing.T) {
		k := newFakeKernel(IPv4)
		s := newFakeSyncer(t, k)
		if _, err := s.Sync(ctx, r1, false); err != nil {
			t.Fatal(err)
		}
		k.takeCalls()
		k.failIpset, k.failIpsetOp = fmt.Errorf("ipset restore: %w: ipset v7.17: Error in line 1: Kernel error", errExit), "restore"
		res, err := s.Sync(ctx, r2, false)
		if !errors.Is(err, errExit) || !strings.Contains(err.Error(), "IPv4: writing sets (uproxy-listeners-tcp4,uproxy-listeners-udp4)") ||
			!strings.Contains(err.Error(), "Kernel error") {
			t.Errorf("Sync with a failing ipset restore: %v", err)
		}
		if res.WroteSets || res.Wrote {
			t.Errorf("failed Sync = %+v, want nothing written", res)
		}
		// The rules that would name the new set were not restored.
		if diff := cmp.Diff([]string{callSetRestore}, k.takeCalls()); diff != "" {
			t.Errorf("failed Sync calls (-want +got):\n%s", diff)
		}
		if diff := cmp.Diff(wantSave(IPv4, r1), k.save()); diff != "" {
			t.Errorf("kernel after failure (-want +got):\n%s", diff)
		}
		// Not remembered: the same Rules again read the kernel back.
		res, err = s.Sync(ctx, r2, false)
		if err != nil {
			t.Fatal(err)
		}
		if want := (Result{Wrote: true, Rules: 8, WroteSets: true, SetMembers: 3, SetMembersWritten: 3}); res != want {
			t.Errorf("Sync after failure = %+v, want %+v", res, want)
		}
		if diff := cmp.Diff(concat(callsRead, callSetRestore, callRestore, callsJumps), k.takeCalls()); diff != "" {
			t.Errorf("Sync after failure calls (-want +got):\n%s", diff)
		}
		if diff := cmp.Diff(wantSetsSave(IPv4, r2), k.saveSets()); diff != "" {
			t.Errorf("sets (-want +got):\n%s", diff)
		}
	})

	t.Run("first restore", func(t *testing.T) {
		k := newFakeKernel(IPv4)
		s := newFakeSyncer(t, k)
		k.failIpset, k.failIpsetOp = fmt.Errorf("ipset restore: %w: boom", errExit), "restore"
		if _, err := s.Sync(ctx, r1, false); !errors.Is(err, errExit) {
			t.Fatalf("first Sync error = %v, want one wrapping %v", err, errExit)
		}
		if diff := cmp.Diff(concat(callsRead, callSetRestore), k.takeCalls()); diff != "" {
			t.Errorf("failed first Sync calls (-want +got):\n%s", diff)
		}
		if res, err := s.Sync(ctx, r1, false); err != nil || !res.Wrote || !res.WroteSets {
			t.Fatalf("retry = %+v, %v; want a write", res, err)
		}
		if diff := cmp.Diff(wantSetsSave(IPv4, r1), k.saveSets()); diff != "" {
			t.Errorf("sets (-want +got):\n%s", diff)
		}
	})

	t.Run("save", func(t *testing.T) {
		k := newFakeKernel(IPv4)
		s := newFakeSyncer(t, k)
		k.failIpset, k.failIpsetOp = fmt.Errorf("ipset save: %w: ipset v7.17: Kernel error received: Operation not permitted", errExit), "save"
		_, err := s.Sync(ctx, r1, false)
		if !errors.Is(err, errExit) || !strings.Contains(err.Error(), "IPv4: reading set uproxy-listeners-tcp4") {
			t.Errorf("Sync with a failing ipset save: %v", err)
		}
		if diff := cmp.Diff(concat(callsSave, "ipset save uproxy-listeners-tcp4"), k.takeCalls()); diff != "" {
			t.Errorf("calls (-want +got):\n%s", diff)
		}
	})

	t.Run("destroy", func(t *testing.T) {
		k := newFakeKernel(IPv4)
		s := newFakeSyncer(t, k)
		if _, err := s.Sync(ctx, r2, false); err != nil {
			t.Fatal(err)
		}
		// Someone else's rule names uproxy's UDP set.
		foreign := "-A INPUT -p udp -m set --match-set uproxy-listeners-udp4 dst -j ACCEPT"
		k.edit("filter", func(order []string, rules map[string][]string) []string {
			rules["INPUT"] = append(rules["INPUT"], foreign)
			return order
		})
		k.takeCalls()
		_, err := s.Sync(ctx, r1, false)
		if !errors.Is(err, errExit) || !strings.Contains(err.Error(), "IPv4: destroying set uproxy-listeners-udp4") || !strings.Contains(err.Error(), "in use") {
			t.Errorf("Sync with a failing ipset destroy: %v", err)
		}
		if diff := cmp.Diff([]string{callSetRestore, callRestore, "ipset destroy uproxy-listeners-udp4"}, k.takeCalls()); diff != "" {
			t.Errorf("calls (-want +got):\n%s", diff)
		}
		// Not remembered: the next Sync reads back and tries again.
		k.edit("filter", func(order []string, rules map[string][]string) []string {
			rules["INPUT"] = slices.DeleteFunc(rules["INPUT"], func(r string) bool { return r == foreign })
			return order
		})
		res, err := s.Sync(ctx, r1, false)
		if err != nil {
			t.Fatal(err)
		}
		if want := (Result{Rules: 5, WroteSets: true, SetMembers: 2}); res != want {
			t.Errorf("Sync after failure = %+v, want %+v", res, want)
		}
		if diff := cmp.Diff(concat(callsRead, "ipset destroy uproxy-listeners-udp4", callsJumps), k.takeCalls()); diff != "" {
			t.Errorf("Sync after failure calls (-want +got):\n%s", diff)
		}
		if diff := cmp.Diff(wantSetsSave(IPv4, r1), k.saveSets()); diff != "" {
			t.Errorf("sets (-want +got):\n%s", diff)
		}
	})
}

// pathWithoutIpset makes PATH, for the rest of the test, a folder that
// holds iptables-save and iptables-restore (which do nothing) and no
// ipset, so that New finds iptables usable and ipset missing.
func pathWithoutIpset(t *testing.T) {
	t.Helper()
	dir := t.TempDir()
	for _, name := range []string{"iptables-save", "iptables-restore"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", dir)
}

// TestSyncWithoutIpset checks that without ipset a Syncer syncs rules
// without listeners, refuses rules with listeners of its family naming
// ipset, and that Cleanup leaves sets alone.
func TestSyncWithoutIpset(t *testing.T) {
	pathWithoutIpset(t)
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s, err := New(Config{Jumps: k})
	if err != nil {
		t.Fatalf("New without ipset: %v", err)
	}
	s.exec = k // the fake kernel behind the real tools' names
	_, err = s.Sync(ctx, rulesA, false)
	if !errors.Is(err, exec.ErrNotFound) || !strings.Contains(err.Error(), "IPv4: the listener guards need kernel sets, but ipset is not installed") {
		t.Errorf("Sync with listeners without ipset: %v", err)
	}
	if calls := k.takeCalls(); len(calls) != 0 {
		t.Errorf("Sync with listeners without ipset ran %q", calls)
	}
	// Listeners of the other family only: fine.
	r := rulesB
	r.Listeners = []Listener{{IPv6, TCP, 40001}}
	res, err := s.Sync(ctx, r, false)
	if err != nil {
		t.Fatalf("Sync without listeners without ipset: %v", err)
	}
	if want := (Result{Wrote: true, Rules: 2}); res != want {
		t.Errorf("Sync = %+v, want %+v", res, want)
	}
	if diff := cmp.Diff(concat(callsSave, callRestore, callsInsertJumps), k.takeCalls()); diff != "" {
		t.Errorf("calls (-want +got):\n%s", diff)
	}
	if err := Cleanup(ctx, Config{Jumps: k}); err != nil {
		t.Errorf("Cleanup without ipset: %v", err)
	}
}

// TestCleanupSetErrors checks that Cleanup fails, naming the set, when a
// set of uproxy's cannot be destroyed, and leaves the other family's sets
// alone.
func TestCleanupSetErrors(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	if _, err := newFakeSyncer(t, k).Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	k.editSets(func(sets map[string]*fakeSet) {
		sets["uproxy-listeners-tcp6"] = &fakeSet{header: setType, members: map[setMember]bool{portMember(41001): true}}
	})
	foreign := "-A INPUT -p tcp -m set --match-set uproxy-listeners-tcp4 dst -j ACCEPT"
	k.edit("filter", func(order []string, rules map[string][]string) []string {
		rules["INPUT"] = append(rules["INPUT"], foreign)
		return order
	})
	err := Cleanup(ctx, Config{Exec: k, Jumps: k})
	if !errors.Is(err, errExit) || !strings.Contains(err.Error(), "IPv4: cleanup: destroying set uproxy-listeners-tcp4") || !strings.Contains(err.Error(), "in use") {
		t.Errorf("Cleanup with a set in use = %v", err)
	}
	k.edit("filter", func(order []string, rules map[string][]string) []string {
		rules["INPUT"] = slices.DeleteFunc(rules["INPUT"], func(r string) bool { return r == foreign })
		return order
	})
	if err := Cleanup(ctx, Config{Exec: k, Jumps: k}); err != nil {
		t.Fatal(err)
	}
	if got, want := k.saveSets(), "create someone-else hash:ip family inet hashsize 1024 maxelem 65536\n"+
		"create uproxy-listeners-tcp6 bitmap:port range 0-65535\nadd uproxy-listeners-tcp6 41001\n"; got != want {
		t.Errorf("sets after IPv4 Cleanup = %q, want %q", got, want)
	}
}

// TestSyncTProxy checks tproxy mode: the mangle chains hold the rules and
// the nat chains none; an unchanged full Sync writes nothing; drift in
// the mangle table is repaired; switching modes is one iptables-restore,
// the chains and jumps being the same in both; a mark outside its mask is
// refused before anything runs.
func TestSyncTProxy(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	// For IPv4, 25 rules: 9 in UPROXY-TPROXY (the bridged replies', the
	// TCP socket match, the bridged clients' and the others' gates of the service set for TCP
	// and UDP and of the TCP node-port set, the UDP socket match), 2 in
	// UPROXY-TPROXY-BRIDGED (TEE and DROP), 4 in UPROXY-TPROXY-SERVICES-TCP and
	// -UDP (the UDP intercept, two allowed prefixes and the DROP of the
	// firewalled one), 1 in UPROXY-TPROXY-NODEPORTS-TCP, 1 in
	// UPROXY-TPROXY-DIVERT, 2 in
	// UPROXY-TPROXY-OUTPUT (the service set, for TCP and UDP), 2
	// listener guards. 5 set
	// members: 2 listener ports, the 2 destinations of the service set
	// (the intercept's and the firewall's) and the node port.
	tp := tproxied(rulesA, Routing{})
	res, err := s.Sync(ctx, tp, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Wrote: true, Rules: 26, WroteSets: true, SetMembers: 5, SetMembersWritten: 5}); res != want {
		t.Errorf("first Sync = %+v, want %+v", res, want)
	}
	if diff := cmp.Diff(concat(callsRead, callSetRestore, callRestore, callsInsertJumpsTProxy), k.takeCalls()); diff != "" {
		t.Errorf("first Sync calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv4, tp), k.save()); diff != "" {
		t.Errorf("kernel after first Sync (-want +got):\n%s", diff)
	}
	st := parseState([]byte(k.save()))
	for _, c := range []struct {
		table, chain string
		rules        int
	}{{"nat", ServicesChain, 0}, {"nat", nodePortsChain, 0}, {"mangle", TProxyChain, 9}, {"mangle", tproxyServicesTCP, 3}, {"mangle", tproxyServicesUDP, 1}, {"mangle", tproxyNodePortsTCP, 1}, {"mangle", tproxyNodePortsUDP, 0}, {"mangle", TProxyOutputChain, 2}, {"filter", FirewallChain, 2}} {
		if n := len(st[chainKey{c.table, c.chain}].rules); n != c.rules {
			t.Errorf("%s %s holds %d rules, want %d", c.table, c.chain, n, c.rules)
		}
	}

	res, err = s.Sync(ctx, tp, true)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Rules: 26, SetMembers: 5}); res != want {
		t.Errorf("unchanged full Sync = %+v, want %+v", res, want)
	}
	if diff := cmp.Diff(concat(callsRead, callsJumps), k.takeCalls()); diff != "" {
		t.Errorf("unchanged full Sync calls (-want +got):\n%s", diff)
	}

	k.edit("mangle", func(order []string, rules map[string][]string) []string {
		rules[TProxyChain] = slices.Delete(rules[TProxyChain], 1, 2)
		rules[TProxyOutputChain] = nil
		return order
	})
	res, err = s.Sync(ctx, tp, true)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Wrote: true, Rules: 26, Repaired: true, SetMembers: 5}); res != want {
		t.Errorf("full Sync after drift = %+v, want %+v", res, want)
	}
	if diff := cmp.Diff(concat(callsRead, callRestore, callsJumps), k.takeCalls()); diff != "" {
		t.Errorf("full Sync after drift calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv4, tp), k.save()); diff != "" {
		t.Errorf("kernel after repair (-want +got):\n%s", diff)
	}

	withReplies := rulesA
	withReplies.Replies = &Replies{}
	// A change of mode reads the tables, as a full Sync does, to insert
	// or delete the mangle jumps; it repairs nothing. The gates' sets are
	// filled before the rules that name them are restored, and
	// destroyed after the rules that named them are gone.
	for _, step := range []struct {
		name  string
		r     Rules
		want  Result
		calls []string
	}{
		{"redirect mode", rulesA, Result{Wrote: true, Rules: 12, WroteSets: true, SetMembers: 2},
			concat(callsRead, callRestore, []string{"ipset destroy uproxy-services4", "ipset destroy uproxy-nodeports-tcp4", "Delete mangle PREROUTING", "Delete mangle OUTPUT"})},
		{"tproxy mode again", tp, Result{Wrote: true, Rules: 26, WroteSets: true, SetMembers: 5, SetMembersWritten: 3},
			concat(callsRead, callSetRestore, callRestore, []string{"Insert mangle PREROUTING 1", "Insert mangle OUTPUT 1"})},
		// Redirect mode with the replies to transparent dials brought
		// back: tproxy's jumps go, UPROXY-REPLIES's comes, with its
		// rules (the bridged replies', two marks) and UPROXY-TPROXY-BRIDGED's.
		{"redirect mode with replies", withReplies, Result{Wrote: true, Rules: 18, WroteSets: true, SetMembers: 2},
			concat(callsRead, callRestore, []string{"ipset destroy uproxy-services4", "ipset destroy uproxy-nodeports-tcp4", "Delete mangle PREROUTING", "Delete mangle OUTPUT", "Insert mangle PREROUTING 1"})},
		{"tproxy mode from redirect mode with replies", tp, Result{Wrote: true, Rules: 26, WroteSets: true, SetMembers: 5, SetMembersWritten: 3},
			concat(callsRead, callSetRestore, callRestore, []string{"Insert mangle PREROUTING 1", "Insert mangle OUTPUT 1", "Delete mangle PREROUTING"})},
	} {
		res, err := s.Sync(ctx, step.r, false)
		if err != nil {
			t.Fatal(err)
		}
		if res != step.want {
			t.Errorf("%s: Sync = %+v, want %+v", step.name, res, step.want)
		}
		if diff := cmp.Diff(step.calls, k.takeCalls()); diff != "" {
			t.Errorf("%s: calls (-want +got):\n%s", step.name, diff)
		}
		if diff := cmp.Diff(wantSave(IPv4, step.r), k.save()); diff != "" {
			t.Errorf("%s: kernel (-want +got):\n%s", step.name, diff)
		}
	}

	_, err = s.Sync(ctx, tproxied(rulesA, Routing{Mark: 0x3, Mask: 0x1}), true)
	if err == nil || !strings.Contains(err.Error(), "invalid rules") || !strings.Contains(err.Error(), "mark 0x3 has bits outside its mask 0x1") {
		t.Errorf("Sync with a mark outside its mask: %v", err)
	}
	if calls := k.takeCalls(); len(calls) != 0 {
		t.Errorf("Sync with a mark outside its mask ran %q", calls)
	}
}

// commandNames maps the fake kernel's call records to the command names
// that Config.Commands is told: the process for an Exec call, the
// family's iptables for a JumpRules call.
func commandNames(f Family, calls []string) []string {
	var out []string
	for _, c := range calls {
		name, _, _ := strings.Cut(c, " ")
		switch name {
		case "Exists", "Insert", "Delete":
			name = f.command("")
		}
		out = append(out, name)
	}
	return out
}

// TestCommandsCounted checks Config.Commands: it is told of every process
// a Syncer and Cleanup run, jump rules included, and of none when a sync
// has nothing to write (an endpoint change, to the rules).
func TestCommandsCounted(t *testing.T) {
	ctx := context.Background()
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			k := newFakeKernel(f)
			var mu sync.Mutex
			var told []string
			take := func() []string {
				mu.Lock()
				defer mu.Unlock()
				out := told
				told = nil
				return out
			}
			cfg := Config{Family: f, Exec: k, Jumps: k, Commands: func(name string) {
				mu.Lock()
				defer mu.Unlock()
				told = append(told, name)
			}}
			s, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			r := rulesA // it has IPv6 rules too
			for _, step := range []struct {
				name string
				run  func() error
			}{
				{"first sync", func() error { _, err := s.Sync(ctx, r, false); return err }},
				{"unchanged sync", func() error { _, err := s.Sync(ctx, r, false); return err }},
				{"full sync", func() error { _, err := s.Sync(ctx, r, true); return err }},
				{"cleanup", func() error { return Cleanup(ctx, cfg) }},
			} {
				if err := step.run(); err != nil {
					t.Fatalf("%s: %v", step.name, err)
				}
				want := commandNames(f, k.takeCalls())
				if diff := cmp.Diff(want, take()); diff != "" {
					t.Errorf("%s: commands told (-want +got):\n%s", step.name, diff)
				}
				if step.name == "unchanged sync" && len(want) != 0 {
					t.Errorf("unchanged sync ran %q, want nothing", want)
				}
				if step.name != "unchanged sync" && len(want) == 0 {
					t.Errorf("%s ran nothing: the test checks nothing", step.name)
				}
			}
		})
	}
}

// TestSyncReplacesUnmarkedServiceJumps: the jumps to UPROXY-SERVICES of
// an earlier version, which the proxy's own packets took too, are
// replaced by the current ones, which skip packets with OwnMark, by the
// first sync of a new process.
func TestSyncReplacesUnmarkedServiceJumps(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(IPv4)
	if _, err := newFakeSyncer(t, k).Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	k.edit("nat", func(order []string, rules map[string][]string) []string {
		for _, from := range []string{"PREROUTING", "OUTPUT"} {
			i := slices.Index(rules[from], "-A "+from+" "+jumpComment)
			if i < 0 {
				t.Fatalf("no service jump in %s: %q", from, rules[from])
			}
			rules[from][i] = "-A " + from + " " + oldJumpComment
		}
		return order
	})
	k.takeCalls()
	if _, err := newFakeSyncer(t, k).Sync(ctx, rulesA, false); err != nil {
		t.Fatal(err)
	}
	want := concat(callsRead, "Insert nat PREROUTING 1", "Delete nat PREROUTING", "Insert nat OUTPUT 1", "Delete nat OUTPUT")
	if diff := cmp.Diff(want, k.takeCalls()); diff != "" {
		t.Errorf("first Sync of a new process, calls (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
		t.Errorf("kernel after the first Sync of a new process (-want +got):\n%s", diff)
	}
}
