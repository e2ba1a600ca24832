package redirect

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-iptables/iptables"
	"k8s.io/utils/clock"
)

// Exec runs a command. It is how the Syncer calls iptables-restore,
// iptables-save and ipset; tests inject a fake.
//
// A Syncer calls its Exec only from inside Sync, one call at a time, and
// Cleanup only from inside itself; the caller keeps ownership. OSExec is
// safe for concurrent use.
type Exec interface {
	// Run runs name with args, feeding stdin (may be nil), and returns
	// stdout. A non-zero exit returns an error that includes stderr.
	Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error)
}

// OSExec is the Exec that runs real processes (os/exec). Its errors name
// the command, wrap the *exec.ExitError (or the start error) and carry the
// command's stderr.
type OSExec struct{}

var _ Exec = OSExec{}

// Run implements Exec. The process is killed when ctx is done.
func (OSExec) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(stderr.Bytes()))
	}
	return stdout.Bytes(), nil
}

// JumpRules is the subset of *iptables.IPTables (github.com/coreos/go-iptables)
// that manages the jump rules from the built-in chains, so tests can fake it.
//
// It must act on the family named in the Config it came with. A Syncer
// calls it only from inside Sync (Sync calls are serialized) and Cleanup
// only from inside itself, never concurrently; the caller keeps ownership
// and may share one handle between a Syncer and Cleanup. *iptables.IPTables
// keeps no state between calls and is safe for concurrent use.
//
// An error that has an IsNotExist() bool method reporting true (as
// *iptables.Error does) means the rule or its target chain does not exist.
type JumpRules interface {
	// Exists reports whether the rule exists in table/chain.
	Exists(table, chain string, rulespec ...string) (bool, error)
	// Insert inserts the rule at position pos (1 is first) of table/chain.
	Insert(table, chain string, pos int, rulespec ...string) error
	// Delete deletes the first rule equal to rulespec from table/chain.
	Delete(table, chain string, rulespec ...string) error
}

var _ JumpRules = (*iptables.IPTables)(nil)

// Config configures a Syncer or Cleanup. Zero values are documented
// defaults.
type Config struct {
	// Family selects iptables (IPv4, the zero value) or ip6tables (IPv6).
	Family Family
	// Exec runs iptables-save, iptables-restore and ipset; nil means
	// OSExec, and New and Cleanup then check that the iptables tools are
	// installed, and whether ipset is. ipset is needed only for
	// Listeners, the shared layout and tproxy mode: without it, a Sync
	// whose rules have listeners of Family, or are Shared or in tproxy
	// mode and have intercepts, firewalls or node ports of Family, fails
	// with an error naming ipset, and Cleanup skips the sets.
	Exec Exec
	// Jumps manages the jump rules from the built-in chains; nil means a
	// go-iptables handle for Family, whose creation checks that iptables
	// is installed and recent enough.
	Jumps JumpRules
	// Wait is how long iptables waits for the xtables lock, passed as -w
	// in whole seconds (rounded up); zero means 5s. It must not be
	// negative.
	Wait time.Duration
	// LockAttempts is how many times in all an iptables command is run
	// while it fails because another process holds the xtables lock
	// (iptables gave up after Wait: see ErrXtablesLocked); zero means 5.
	// Each attempt waits up to Wait for the lock itself. It must not be
	// negative.
	LockAttempts int
	// LockBackoff is the pause before the second attempt, doubled before
	// each further one (100ms, 200ms, 400ms, 800ms by default); zero means
	// 100ms. It must not be negative.
	LockBackoff time.Duration
	// Clock times the pauses between attempts; nil means the real clock.
	Clock clock.Clock
	// Commands, when not nil, is called with a command's name
	// ("iptables-restore", "ip6tables-save", "ipset", or "iptables" for a
	// jump rule) before each process that a Syncer or Cleanup runs,
	// attempts after a lock timeout included. It is called from inside
	// Sync or Cleanup, and must be safe for concurrent use when the
	// families' Syncers share it. nil means no one is told.
	Commands func(name string)
}

// Defaults of the Config fields whose zero value means a default.
const (
	defaultWait         = 5 * time.Second
	defaultLockAttempts = 5
	defaultLockBackoff  = 100 * time.Millisecond
)

// minVersion is the oldest iptables uproxy runs with: iptables-restore
// gained --wait in 1.6.2 (plain iptables had -w since 1.4.20 and -C since
// 1.4.11).
var minVersion = [3]int{1, 6, 2}

// ipsetCommand is the name of the tool that manages kernel sets.
const ipsetCommand = "ipset"

// resolved is a checked Config with its defaults filled in.
type resolved struct {
	Config
	// noIpset, when not nil, says why ipset cannot be run: cfg.Exec was
	// nil and ipset is not installed.
	noIpset error
}

// resolve checks cfg and fills in its defaults.
func resolve(cfg Config) (resolved, error) {
	res := resolved{}
	cfg, err := resolveConfig(cfg)
	if err != nil {
		return res, err
	}
	res.Config = cfg
	if _, ok := cfg.Exec.(OSExec); ok {
		if _, err := exec.LookPath(ipsetCommand); err != nil {
			res.noIpset = fmt.Errorf("%s is not installed (Debian package ipset): %w", ipsetCommand, err)
		}
	}
	if cfg.Commands != nil {
		res.Exec = countedExec{Exec: cfg.Exec, count: cfg.Commands}
		res.Jumps = countedJumps{JumpRules: cfg.Jumps, name: cfg.Family.command(""), count: cfg.Commands}
	}
	res.Exec = lockRetryExec{Exec: res.Exec, retry: cfg.lockRetry()}
	return res, nil
}

// resolveConfig checks cfg and fills in its defaults.
func resolveConfig(cfg Config) (Config, error) {
	if !cfg.Family.valid() {
		return cfg, fmt.Errorf("redirect: unknown family %s", cfg.Family)
	}
	if cfg.Wait < 0 {
		return cfg, fmt.Errorf("redirect: negative lock wait %s", cfg.Wait)
	}
	if cfg.Wait == 0 {
		cfg.Wait = defaultWait
	}
	if cfg.LockAttempts < 0 || cfg.LockBackoff < 0 {
		return cfg, fmt.Errorf("redirect: negative xtables lock retries (%d attempts, %s backoff)", cfg.LockAttempts, cfg.LockBackoff)
	}
	if cfg.LockAttempts == 0 {
		cfg.LockAttempts = defaultLockAttempts
	}
	if cfg.LockBackoff == 0 {
		cfg.LockBackoff = defaultLockBackoff
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.Exec == nil {
		for _, name := range []string{cfg.Family.command("-save"), cfg.Family.command("-restore")} {
			if _, err := exec.LookPath(name); err != nil {
				return cfg, fmt.Errorf("redirect: %s: %s is not installed: %w", cfg.Family, name, err)
			}
		}
		cfg.Exec = OSExec{}
	}
	if cfg.Jumps == nil {
		proto := iptables.ProtocolIPv4
		if cfg.Family == IPv6 {
			proto = iptables.ProtocolIPv6
		}
		ipt, err := iptables.New(iptables.IPFamily(proto), iptables.Timeout(waitSeconds(cfg.Wait)))
		if err != nil {
			return cfg, fmt.Errorf("redirect: %s: %s is missing or unusable: %w", cfg.Family, cfg.Family.command(""), err)
		}
		v1, v2, v3 := ipt.GetIptablesVersion()
		if v := [3]int{v1, v2, v3}; compareVersion(v, minVersion) < 0 {
			return cfg, fmt.Errorf("redirect: %s: %s %d.%d.%d is too old: uproxy needs %d.%d.%d or later (iptables-restore --wait)",
				cfg.Family, cfg.Family.command(""), v1, v2, v3, minVersion[0], minVersion[1], minVersion[2])
		}
		cfg.Jumps = ipt
	}
	return cfg, nil
}

// compareVersion compares two version triples like cmp.Compare.
func compareVersion(a, b [3]int) int {
	for i := range a {
		if a[i] != b[i] {
			if a[i] < b[i] {
				return -1
			}
			return 1
		}
	}
	return 0
}

// waitSeconds returns d in whole seconds, rounded up.
func waitSeconds(d time.Duration) int {
	return int((d + time.Second - 1) / time.Second)
}

// Syncer keeps uproxy's chains and sets of one family in the kernel equal
// to the latest Rules. It remembers the last rendering and set content it
// wrote (or verified) so that unchanged rules cost nothing.
//
// A Syncer is safe for concurrent use; Sync calls are serialized. Only one
// Syncer per family should run on a node: two would overwrite each other's
// chains and sets. The Syncers of IPv4 and IPv6 share nothing: each has
// sets of its own (see the set table in sets.go).
type Syncer struct {
	family Family
	exec   Exec // retries xtables lock failures (lockRetryExec)
	jumps  JumpRules
	retry  lockRetry // for jumps
	wait   string
	// noIpset, when not nil, says why ipset cannot be run.
	noIpset error

	mu sync.Mutex
	// last is the rendering known to be in the kernel, and lastSets the
	// content of the family's sets, or both nil when that is unknown:
	// before the first Sync and after a failed one.
	last     []byte
	lastSets setState
	// lastMode is the mode of the last successful Sync, which decides
	// the mangle jumps.
	lastMode jumpMode
}

// Result says what a Sync did.
type Result struct {
	// Wrote reports that Sync wrote uproxy's chains with a successful
	// iptables-restore call.
	Wrote bool
	// Rules is the number of rules the rendering of r puts in uproxy's
	// chains, the jumps from UPROXY-SERVICES to UPROXY-NODEPORTS included
	// (the jumps from built-in chains are not counted).
	Rules int
	// Repaired reports that a full Sync found the kernel different from
	// this Syncer's last successful write: someone else changed or
	// deleted uproxy's chains, jump rules or sets. Sync then restored them.
	Repaired bool
	// WroteSets reports that Sync changed uproxy's sets: an ipset restore
	// call that created sets or added or deleted members, or an ipset
	// destroy of a set that no rule needs any more.
	WroteSets bool
	// SetMembers is the number of members r puts in uproxy's sets of the
	// family: its distinct listener ports of each protocol and, in the
	// shared layout, its service addresses and ports (those no firewall
	// guards) and its node ports.
	SetMembers int
	// SetMembersWritten is the number of set members Sync added or
	// deleted (the add and del lines of its ipset restore): 1 for a Sync
	// that adds one service port in the shared layout, the whole of
	// SetMembers for one that creates the sets. Members of a destroyed
	// set are not counted.
	SetMembersWritten int
	// SetsRepaired reports that the drift Repaired reports was, at least
	// in part, in uproxy's sets: a set destroyed, flushed or recreated,
	// or a member deleted or added, by someone else.
	SetsRepaired bool
}

// New returns a Syncer for cfg. It checks cfg and, when cfg leaves Exec
// or Jumps nil, that the real iptables tools are installed and at least
// version 1.6.2; when Exec is nil and ipset is not installed, the Syncer
// syncs rules without listeners only. It changes nothing in the kernel.
func New(cfg Config) (*Syncer, error) {
	rc, err := resolve(cfg)
	if err != nil {
		return nil, err
	}
	return &Syncer{
		family:  rc.Family,
		exec:    rc.Exec,
		jumps:   rc.Jumps,
		retry:   rc.lockRetry(),
		wait:    strconv.Itoa(waitSeconds(rc.Wait)),
		noIpset: rc.noIpset,
	}, nil
}

// Sync makes the kernel hold exactly r (the part of it of the Syncer's
// family) in uproxy's chains and sets, with the jump rules to the chains.
// When full is false and nothing differs from the last successful write,
// it runs nothing at all. When full is true (the periodic resync), it
// reads the kernel back and repairs what others changed, so a resync of
// an unchanged kernel writes nothing. The first Sync of a Syncer, the
// first after a failed one, and a Sync whose mode (r.TProxy set or not)
// differs from the last successful one's always behave as full; this is
// also how a new process adopts the rules and sets of a previous one.
// "Syncing" in docs/rules.md says which commands run when.
//
// Sync returns an error, and changes nothing, when r has an invalid
// intercept, node port, node port address, firewall or listener, two
// intercepts or two firewalls for the same destination, protocol and
// port, or two node ports for the same family, protocol and port, a
// TProxy whose mark has bits outside its mask, in the shared layout
// intercepts or node ports of one family and protocol with different
// listener ports, or when r needs sets of the family (listeners, or
// the shared layout's members) and ipset is not installed.
//
// In tproxy mode (r.TProxy not nil), Sync writes the rules only: the
// policy routing that delivers marked packets locally is the caller's to
// install, with Routing.Ensure.
func (s *Syncer) Sync(ctx context.Context, r Rules, full bool) (Result, error) {
	if err := r.validate(); err != nil {
		return Result{}, fmt.Errorf("redirect: %s: invalid rules: %w", s.family, err)
	}
	wantSets := wantSets(s.family, r)
	res := Result{SetMembers: wantSets.memberCount()}
	if s.noIpset != nil {
		kinds := wantSets.wanted()
		// The service and node-port sets serve the shared layout, or
		// tproxy mode's gates.
		services, verb := "the shared layout", " needs"
		if gatedTProxy(r) {
			services, verb = "tproxy mode's gates", " need"
		}
		shared := kinds[serviceSet] || kinds[nodePortSet]
		var needs string
		switch {
		case kinds[listenerSet] && shared:
			needs = "the listener guards and " + services + " need"
		case kinds[listenerSet]:
			needs = "the listener guards need"
		case shared:
			needs = services + verb
		}
		if needs != "" {
			res.Rules = parseState(Render(s.family, r)).ruleCount()
			return res, fmt.Errorf("redirect: %s: %s kernel sets, but %w", s.family, needs, s.noIpset)
		}
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	last, lastSets, lastMode := s.last, s.lastSets, s.lastMode
	// Until this Sync succeeds, the kernel's state is unknown.
	s.last, s.lastSets = nil, nil
	mode := modeOf(r)
	// A change of mode changes the jumps, which only the full path does.
	fullPath := last == nil || full || mode != lastMode
	var read *kernelRead
	if fullPath {
		// The full path reads the kernel: the reads wait for processes,
		// the render below for the CPU, so they overlap.
		read = s.startRead(ctx)
		defer read.wait()
	}
	want := Render(s.family, r)
	wantState := parseState(want)
	res.Rules = wantState.ruleCount()

	if !fullPath {
		if bytes.Equal(want, last) && wantSets.equal(lastSets) {
			s.last, s.lastSets = last, lastSets
			return res, nil
		}
		if err := s.write(ctx, &res, !bytes.Equal(want, last), want, lastSets, wantSets); err != nil {
			return res, err
		}
		s.last, s.lastSets = want, wantSets
		return res, nil
	}
	sameMode := last != nil && mode == lastMode

	have, saved, haveSets, err := read.wait()
	if err != nil {
		return res, err
	}
	rulesDiffer := !have.equal(wantState)
	if rulesDiffer && last != nil && !have.equal(parseState(last)) {
		res.Repaired = true
	}
	if !haveSets.equal(wantSets) && lastSets != nil && !haveSets.equal(lastSets) {
		res.Repaired, res.SetsRepaired = true, true
	}
	if err := s.write(ctx, &res, rulesDiffer, want, haveSets, wantSets); err != nil {
		return res, err
	}
	changed, err := s.ensureJumps(ctx, savedJumps(saved), mode)
	if err != nil {
		return res, err
	}
	if changed && sameMode {
		res.Repaired = true
	}
	s.last, s.lastSets, s.lastMode = want, wantSets, mode
	return res, nil
}

// write changes the kernel from haveSets to wantSets and, when rules is
// true, restores the rendering want, in the only order that works: sets
// created and filled, rules restored, sets no rule names destroyed.
func (s *Syncer) write(ctx context.Context, res *Result, rules bool, want []byte, haveSets, wantSets setState) error {
	if update := renderSetUpdate(haveSets, wantSets); len(update.input) > 0 {
		if _, err := s.exec.Run(ctx, ipsetCommand, []string{"restore"}, update.input); err != nil {
			return fmt.Errorf("redirect: %s: writing sets (%s): %w", s.family, strings.Join(update.sets, ","), err)
		}
		res.WroteSets = true
		res.SetMembersWritten = update.members
	}
	if rules {
		if err := s.restore(ctx, want); err != nil {
			return err
		}
		res.Wrote = true
	}
	for _, name := range setsToDestroy(haveSets, wantSets) {
		if err := destroySet(ctx, s.family, s.exec, "", name); err != nil {
			return err
		}
		res.WroteSets = true
	}
	return nil
}

// read returns the state of uproxy's chains in the kernel, and the saved
// tables themselves, from one iptables-save call for every table.
//
// One call, not one per table (-t nat, -t mangle, -t filter): with the
// nf_tables backend, iptables-save fetches the whole ruleset whatever
// table it prints, so each call costs the same, and with many services
// three would make up most of a full resync. The tables that
// uproxy has no chain in (raw, security) are small, and parseState skips
// them.
func (s *Syncer) read(ctx context.Context) (state, []byte, error) {
	out, err := s.exec.Run(ctx, s.family.command("-save"), nil, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("redirect: %s: reading chains (%s): %w", s.family, allChainNames(), err)
	}
	return parseState(out), out, nil
}

// readSets returns the content of the family's sets in the kernel, from
// one ipset save call per set (one call for every set would read the
// sets of other software too, which can be large). Without ipset, which
// Sync then needs only when no set is wanted, it takes every set to be
// missing: none can have been created.
func (s *Syncer) readSets(ctx context.Context) (setState, error) {
	st := setState{}
	for _, set := range setsOf(s.family) {
		if s.noIpset != nil {
			st[set.name] = setContent{}
			continue
		}
		out, err := s.exec.Run(ctx, ipsetCommand, []string{"save", set.name}, nil)
		if isSetNotExist(err) {
			st[set.name] = setContent{}
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("redirect: %s: reading set %s: %w", s.family, set.name, err)
		}
		st[set.name] = parseSetSave(set.name, out)
	}
	return st, nil
}

// destroySet destroys the set name with ipset destroy. A set that does not
// exist counts as success; one that a rule still names cannot be
// destroyed. op prefixes the error.
func destroySet(ctx context.Context, f Family, x Exec, op, name string) error {
	_, err := x.Run(ctx, ipsetCommand, []string{"destroy", name}, nil)
	if err == nil || isSetNotExist(err) {
		return nil
	}
	return fmt.Errorf("redirect: %s: %sdestroying set %s: %w", f, op, name, err)
}

// isSetNotExist reports whether err is ipset's error for a set that does
// not exist. ipset has one exit status for every error, so this looks for
// its message, which the Exec's error carries.
func isSetNotExist(err error) bool {
	return err != nil && strings.Contains(err.Error(), "The set with the given name does not exist")
}

// restore feeds input to iptables-restore --noflush.
func (s *Syncer) restore(ctx context.Context, input []byte) error {
	return restore(ctx, s.family, s.exec, s.wait, "writing", input)
}

// restore feeds input, which changes the chains of every table of the chain
// table, to iptables-restore --noflush with the lock wait in seconds. op
// says what input does, for the error.
func restore(ctx context.Context, f Family, x Exec, wait, op string, input []byte) error {
	if _, err := x.Run(ctx, f.command("-restore"), []string{"--noflush", "-w", wait}, input); err != nil {
		return fmt.Errorf("redirect: %s: %s chains (%s): %w", f, op, allChainNames(), err)
	}
	return nil
}

// ensureJumps inserts each jump rule that saved (savedJumps of the tables
// as this sync read them) lacks at position 1 of its built-in chain,
// deletes every copy that saved has of an earlier version's jumps
// (oldJumpMatches) and of the jumps to chains that mode does not jump to
// (chainSpec.only), and reports whether it changed any. Reading the jumps
// from the tables that a full sync saves anyway spares an iptables -C, a
// process start, per jump: seven per family on every full sync.
func (s *Syncer) ensureJumps(ctx context.Context, saved map[string]int, mode jumpMode) (bool, error) {
	changed := false
	for _, c := range chains {
		wanted := c.only == nil || c.only(mode)
		for _, from := range c.from {
			if err := ctx.Err(); err != nil {
				return changed, fmt.Errorf("redirect: %s: jump from %s/%s to %s: %w", s.family, c.table, from, c.name, err)
			}
			if wanted && saved[c.jumpLine(from, c.jumpMatch)] == 0 {
				if err := s.retry.do(ctx, func() error { return s.jumps.Insert(c.table, from, 1, c.jumpSpec(c.jumpMatch)...) }); err != nil {
					return changed, fmt.Errorf("redirect: %s: inserting jump from %s/%s to %s: %w", s.family, c.table, from, c.name, err)
				}
				changed = true
			}
			// The jumps that must go: an earlier version's, once the
			// current one is in (until then it keeps the chain's rules
			// working), and those to chains of another mode.
			unwanted := c.oldJumpMatches
			if !wanted {
				unwanted = c.jumpMatches()
			}
			for _, m := range unwanted {
				for range saved[c.jumpLine(from, m)] {
					err := s.retry.do(ctx, func() error { return s.jumps.Delete(c.table, from, c.jumpSpec(m)...) })
					if err != nil && !isNotExist(err) {
						return changed, fmt.Errorf("redirect: %s: deleting jump from %s/%s to %s: %w", s.family, c.table, from, c.name, err)
					}
					changed = true
				}
			}
		}
	}
	return changed, nil
}

// Cleanup removes everything uproxy created in cfg's family: every jump
// rule from a built-in chain to one of uproxy's chains (duplicates
// included), then the chains themselves, in every table of the chain
// table, then the family's sets of the set table (the kernel destroys a
// set only once no rule names it). It touches nothing else, not even the
// other family's sets.
// Rules, chains and sets that are already gone count as success, so
// Cleanup is idempotent. When cfg.Exec is nil and ipset is not installed,
// Cleanup leaves the sets alone. It must not run while a Syncer of the
// same family syncs.
//
// Cleanup removes the mangle chains and their jumps like the others, but
// not the policy routing of TProxy and Replies (the fwmark rule and the
// route of its table), which Cleanup neither installs nor knows the
// Routing of: a caller that used either, or may have, also calls
// Routing.Remove for the family, after Cleanup, so that no packet is
// marked any more when the route that delivers marked packets goes.
func Cleanup(ctx context.Context, cfg Config) error {
	rc, err := resolve(cfg)
	if err != nil {
		return err
	}
	cfg = rc.Config
	for _, c := range chains {
		for _, from := range c.from {
			for _, m := range c.jumpMatches() {
				if err := deleteJumps(ctx, cfg, c, from, c.jumpSpec(m)); err != nil {
					return err
				}
			}
		}
	}
	// Declaring a chain creates or flushes it; then -X deletes it. The
	// kernel refuses to delete a chain that still holds rules or that a
	// rule still jumps to (nf_tables: EBUSY), so every chain of a table
	// is flushed before the first is deleted, which also removes the jump
	// from UPROXY-SERVICES to UPROXY-NODEPORTS.
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
				fmt.Fprintf(&b, "-X %s\n", c.name)
			}
		}
		b.WriteString("COMMIT\n")
	}
	if err := restore(ctx, cfg.Family, cfg.Exec, strconv.Itoa(waitSeconds(cfg.Wait)), "cleanup: deleting", b.Bytes()); err != nil {
		return err
	}
	if rc.noIpset != nil {
		return nil
	}
	// The rules naming the sets are gone with the chains; the kernel
	// refuses to destroy a set that a rule still names.
	for _, set := range setsOf(cfg.Family) {
		if err := destroySet(ctx, cfg.Family, cfg.Exec, "cleanup: ", set.name); err != nil {
			return err
		}
	}
	return nil
}

// deleteJumps deletes every jump from table/from to c whose rule spec is
// spec.
func deleteJumps(ctx context.Context, cfg Config, c chainSpec, from string, spec []string) error {
	for {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("redirect: %s: cleanup: jump from %s/%s to %s: %w", cfg.Family, c.table, from, c.name, err)
		}
		var ok bool
		err := cfg.lockRetry().do(ctx, func() (err error) {
			ok, err = cfg.Jumps.Exists(c.table, from, spec...)
			return err
		})
		if isNotExist(err) {
			// The target chain is gone, so no jump to it can exist.
			return nil
		}
		if err != nil {
			return fmt.Errorf("redirect: %s: cleanup: checking jump from %s/%s to %s: %w", cfg.Family, c.table, from, c.name, err)
		}
		if !ok {
			return nil
		}
		if err := cfg.lockRetry().do(ctx, func() error { return cfg.Jumps.Delete(c.table, from, spec...) }); isNotExist(err) {
			return nil // deleted meanwhile by someone else
		} else if err != nil {
			return fmt.Errorf("redirect: %s: cleanup: deleting jump from %s/%s to %s: %w", cfg.Family, c.table, from, c.name, err)
		}
	}
}

// isNotExist reports whether err says that a rule or chain does not exist.
func isNotExist(err error) bool {
	var ne interface{ IsNotExist() bool }
	return errors.As(err, &ne) && ne.IsNotExist()
}

// ErrXtablesLocked is wrapped by the errors of iptables commands that still
// failed, after every attempt (Config.LockAttempts), because another
// process held the xtables lock. The error also wraps the last attempt's,
// which carries iptables' stderr.
var ErrXtablesLocked = errors.New("another process holds the xtables lock")

// lockBusyStatus is iptables' exit status when it cannot take the xtables
// lock: RESOURCE_PROBLEM (xtables_lock_or_exit in iptables' xshared.c).
const lockBusyStatus = 4

// isXtablesLocked reports whether err is an iptables command's failure to
// take the xtables lock in time: exit status 4 with iptables' message
// "Another app is currently holding the xtables lock" (legacy iptables
// 1.8 prints it with -w, "Stopped waiting after Ns.", and without,
// "Perhaps you want to use the -w option?"). The status alone is not
// enough, iptables uses it for other resource problems too; nor is the
// message: older versions print it every few seconds while they wait,
// and may then fail for another reason. iptables-nft takes no lock, so it
// never fails this way.
func isXtablesLocked(err error) bool {
	if err == nil {
		return false
	}
	// go-iptables' *iptables.Error reports its status with ExitStatus
	// (which it may override); OSExec's errors wrap an *exec.ExitError.
	var status interface{ ExitStatus() int }
	var exit interface{ ExitCode() int }
	code := -1
	switch {
	case errors.As(err, &status):
		code = status.ExitStatus()
	case errors.As(err, &exit):
		code = exit.ExitCode()
	}
	return code == lockBusyStatus && strings.Contains(err.Error(), "holding the xtables lock")
}

// lockRetry runs an iptables operation again, with exponential backoff,
// while it fails because another process holds the xtables lock: kubelet,
// a CNI plugin or a firewall daemon may hold it for longer than iptables'
// own -w wait (a large iptables-restore can take seconds).
type lockRetry struct {
	attempts int
	backoff  time.Duration
	clock    clock.Clock
}

// lockRetry returns the retry policy of a resolved Config.
func (c Config) lockRetry() lockRetry {
	return lockRetry{attempts: c.LockAttempts, backoff: c.LockBackoff, clock: c.Clock}
}

// do runs op until it succeeds, fails for another reason than the xtables
// lock, or has run r.attempts times; then it returns op's error, wrapped
// with ErrXtablesLocked when the lock was the cause. It stops waiting when
// ctx is done.
func (r lockRetry) do(ctx context.Context, op func() error) error {
	start := r.clock.Now()
	delay := r.backoff
	for attempt := 1; ; attempt++ {
		err := op()
		if !isXtablesLocked(err) {
			return err
		}
		if attempt >= r.attempts {
			return fmt.Errorf("%w: gave up after %d attempts in %s: %w", ErrXtablesLocked, attempt, r.clock.Since(start).Round(time.Millisecond), err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: stopped retrying after %d attempts: %w: %w", ErrXtablesLocked, attempt, ctx.Err(), err)
		case <-r.clock.After(delay):
		}
		delay *= 2
	}
}

// countedExec is an Exec that tells count the name of every command
// before it runs it.
type countedExec struct {
	Exec
	count func(name string)
}

// Run implements Exec.
func (x countedExec) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	x.count(name)
	return x.Exec.Run(ctx, name, args, stdin)
}

// countedJumps is a JumpRules that tells count name (the family's
// iptables command) before each call, each of which runs one process.
type countedJumps struct {
	JumpRules
	name  string
	count func(name string)
}

var (
	_ Exec      = countedExec{}
	_ JumpRules = countedJumps{}
)

// Exists implements JumpRules.
func (j countedJumps) Exists(table, chain string, rulespec ...string) (bool, error) {
	j.count(j.name)
	return j.JumpRules.Exists(table, chain, rulespec...)
}

// Insert implements JumpRules.
func (j countedJumps) Insert(table, chain string, pos int, rulespec ...string) error {
	j.count(j.name)
	return j.JumpRules.Insert(table, chain, pos, rulespec...)
}

// Delete implements JumpRules.
func (j countedJumps) Delete(table, chain string, rulespec ...string) error {
	j.count(j.name)
	return j.JumpRules.Delete(table, chain, rulespec...)
}

// lockRetryExec is an Exec whose commands are run again while they fail
// because another process holds the xtables lock (see lockRetry).
type lockRetryExec struct {
	Exec
	retry lockRetry
}

// Run implements Exec.
func (x lockRetryExec) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	var out []byte
	err := x.retry.do(ctx, func() (err error) {
		out, err = x.Exec.Run(ctx, name, args, stdin)
		return err
	})
	return out, err
}
