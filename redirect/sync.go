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
)

// Exec runs a command. It is how the Syncer calls iptables-restore and
// iptables-save; tests inject a fake.
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
	// Exec runs iptables-save and iptables-restore; nil means OSExec.
	Exec Exec
	// Jumps manages the jump rules from the built-in chains; nil means a
	// go-iptables handle for Family, whose creation checks that iptables
	// is installed and recent enough.
	Jumps JumpRules
	// Wait is how long iptables waits for the xtables lock, passed as -w
	// in whole seconds (rounded up); zero means 5s. It must not be
	// negative.
	Wait time.Duration
}

// defaultWait is the xtables lock wait when Config.Wait is zero.
const defaultWait = 5 * time.Second

// minVersion is the oldest iptables uproxy runs with: iptables-restore
// gained --wait in 1.6.2 (plain iptables had -w since 1.4.20 and -C since
// 1.4.11).
var minVersion = [3]int{1, 6, 2}

// resolve checks cfg and fills in its defaults.
func resolve(cfg Config) (Config, error) {
	if !cfg.Family.valid() {
		return cfg, fmt.Errorf("redirect: unknown family %s", cfg.Family)
	}
	if cfg.Wait < 0 {
		return cfg, fmt.Errorf("redirect: negative lock wait %s", cfg.Wait)
	}
	if cfg.Wait == 0 {
		cfg.Wait = defaultWait
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

// Syncer keeps uproxy's chains of one family in the kernel equal to the
// latest Rules. It remembers the last rendering it wrote (or verified) so
// that unchanged rules cost nothing.
//
// A Syncer is safe for concurrent use; Sync calls are serialized. Only one
// Syncer per family should run on a node: two would overwrite each other's
// chains.
type Syncer struct {
	family Family
	exec   Exec
	jumps  JumpRules
	wait   string

	mu sync.Mutex
	// last is the rendering known to be in the kernel, or nil when that is
	// unknown: before the first Sync and after a failed one.
	last []byte
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
	// deleted uproxy's chains or jump rules. Sync then restored them.
	Repaired bool
}

// New returns a Syncer for cfg. It checks cfg and, when cfg leaves Exec
// or Jumps nil, that the real iptables tools are installed and at least
// version 1.6.2. It changes nothing in the kernel.
func New(cfg Config) (*Syncer, error) {
	cfg, err := resolve(cfg)
	if err != nil {
		return nil, err
	}
	return &Syncer{
		family: cfg.Family,
		exec:   cfg.Exec,
		jumps:  cfg.Jumps,
		wait:   strconv.Itoa(waitSeconds(cfg.Wait)),
	}, nil
}

// Sync makes the kernel hold exactly r (the part of it of the Syncer's
// family) in uproxy's chains, with the jump rules to them.
//
// When full is false and the rendering of r equals the last successful
// write, Sync runs nothing at all; when it differs, Sync writes it with one
// iptables-restore --noflush call and nothing else.
//
// When full is true (the periodic resync), Sync reads uproxy's chains back
// with iptables-save and writes only if they differ from the rendering, so
// a resync of an unchanged kernel writes nothing; then it inserts any
// missing jump rule at position 1 of its built-in chain (never a second
// copy). The first Sync of a Syncer, and the first after a failed one,
// always behaves as full; this is also how a new process adopts the rules
// of a previous one.
//
// Sync returns an error, and changes nothing, when r has an invalid
// intercept, node port, node port address, firewall or listener, two
// intercepts or two firewalls for the same destination, protocol and
// port, or two node ports for the same family, protocol and port.
func (s *Syncer) Sync(ctx context.Context, r Rules, full bool) (Result, error) {
	if err := r.validate(); err != nil {
		return Result{}, fmt.Errorf("redirect: %s: invalid rules: %w", s.family, err)
	}
	want := Render(s.family, r)
	wantState := parseState(want)
	res := Result{Rules: wantState.ruleCount()}

	s.mu.Lock()
	defer s.mu.Unlock()
	last := s.last
	// Until this Sync succeeds, the kernel's state is unknown.
	s.last = nil

	if last != nil && !full {
		if bytes.Equal(want, last) {
			s.last = last
			return res, nil
		}
		if err := s.restore(ctx, want); err != nil {
			return res, err
		}
		res.Wrote = true
		s.last = want
		return res, nil
	}

	have, err := s.read(ctx)
	if err != nil {
		return res, err
	}
	if !have.equal(wantState) {
		if last != nil && !have.equal(parseState(last)) {
			res.Repaired = true
		}
		if err := s.restore(ctx, want); err != nil {
			return res, err
		}
		res.Wrote = true
	}
	inserted, err := s.ensureJumps(ctx)
	if err != nil {
		return res, err
	}
	if inserted && last != nil {
		res.Repaired = true
	}
	s.last = want
	return res, nil
}

// read returns the state of uproxy's chains in the kernel, from one
// iptables-save call per table.
func (s *Syncer) read(ctx context.Context) (state, error) {
	var text []byte
	for _, t := range tables() {
		out, err := s.exec.Run(ctx, s.family.command("-save"), []string{"-t", t}, nil)
		if err != nil {
			return nil, fmt.Errorf("redirect: %s: reading %s chains %s: %w", s.family, t, chainNames(t), err)
		}
		text = append(text, out...)
	}
	return parseState(text), nil
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
		var names []string
		for _, t := range tables() {
			names = append(names, t+" "+chainNames(t))
		}
		return fmt.Errorf("redirect: %s: %s chains (%s): %w", f, op, strings.Join(names, "; "), err)
	}
	return nil
}

// ensureJumps inserts each missing jump rule at position 1 of its built-in
// chain and reports whether it inserted any.
func (s *Syncer) ensureJumps(ctx context.Context) (bool, error) {
	inserted := false
	for _, c := range chains {
		for _, from := range c.from {
			if err := ctx.Err(); err != nil {
				return inserted, fmt.Errorf("redirect: %s: jump from %s/%s to %s: %w", s.family, c.table, from, c.name, err)
			}
			ok, err := s.jumps.Exists(c.table, from, c.jumpSpec()...)
			if err != nil {
				return inserted, fmt.Errorf("redirect: %s: checking jump from %s/%s to %s: %w", s.family, c.table, from, c.name, err)
			}
			if ok {
				continue
			}
			if err := s.jumps.Insert(c.table, from, 1, c.jumpSpec()...); err != nil {
				return inserted, fmt.Errorf("redirect: %s: inserting jump from %s/%s to %s: %w", s.family, c.table, from, c.name, err)
			}
			inserted = true
		}
	}
	return inserted, nil
}

// Cleanup removes everything uproxy created in cfg's family: every jump
// rule from a built-in chain to one of uproxy's chains (duplicates
// included), then the chains themselves, in every table of the chain
// table. It touches nothing else.
// Rules and chains that are already gone count as success, so Cleanup is
// idempotent. It must not run while a Syncer of the same family syncs.
func Cleanup(ctx context.Context, cfg Config) error {
	cfg, err := resolve(cfg)
	if err != nil {
		return err
	}
	for _, c := range chains {
		for _, from := range c.from {
			if err := deleteJumps(ctx, cfg, c, from); err != nil {
				return err
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
	return restore(ctx, cfg.Family, cfg.Exec, strconv.Itoa(waitSeconds(cfg.Wait)), "cleanup: deleting", b.Bytes())
}

// deleteJumps deletes every jump from table/from to c.
func deleteJumps(ctx context.Context, cfg Config, c chainSpec, from string) error {
	for {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("redirect: %s: cleanup: jump from %s/%s to %s: %w", cfg.Family, c.table, from, c.name, err)
		}
		ok, err := cfg.Jumps.Exists(c.table, from, c.jumpSpec()...)
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
		if err := cfg.Jumps.Delete(c.table, from, c.jumpSpec()...); isNotExist(err) {
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
