package redirect

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"
)

// FamiliesConfig configures NewFamilies. The zero value syncs redirect
// mode in the per-service layout with the real iptables tools, IPv6 when
// ip6tables is usable, and logs nothing.
type FamiliesConfig struct {
	// IPv4 and IPv6 configure the families' Syncers; NewFamilies sets
	// their Family and Commands. IPv6's Syncer is made only when
	// IPv6.Exec or IPv6.Jumps is set (a test's fakes) or ip6tables is
	// installed; one that New refuses is logged, and IPv6 is then not
	// synced.
	IPv4, IPv6 Config
	// Services are the choices ServiceRules copies into the rules.
	// Services.TProxy selects tproxy mode, in which Sync also installs,
	// and repairs, its Routing for each family; so does Services.Replies
	// in redirect mode.
	Services ServiceOptions
	// EnsureRouting installs or repairs a family's policy routing,
	// reporting whether it had to; nil means the Ensure of the Routing of
	// Services.TProxy, or else of Services.Replies. It is called only when
	// one of them is set, from Sync, for both families side by side.
	EnsureRouting func(Family) (repaired bool, err error)
	// Commands, when not nil, is called with each command's name, as
	// Config.Commands is, from both families' Syncs side by side.
	Commands func(name string)
	// Logger logs drift repairs and an IPv6 that cannot be synced; nil
	// logs nothing.
	Logger *zap.Logger
}

// Families keeps the rules of a list of claims in the kernel, in both IP
// families: the proxier's rule syncer. IPv4 is required; IPv6 is
// optional (a node without ip6tables serves IPv4 only, and says so once
// when an IPv6 claim shows up).
//
// Sync must not be called concurrently: it is the proxier's sync
// goroutine's. Within it, the families sync side by side.
type Families struct {
	cfg    FamiliesConfig
	v4, v6 *Syncer // v6 is nil when ip6tables is unavailable
	log    *zap.Logger
	// routed records, per family, that the policy routing was ensured
	// once; warned that the missing IPv6 was logged. Sync's only.
	routed [2]bool
	warned bool
	// ran counts the commands of both families' Syncers, which add to it
	// side by side.
	ran atomic.Int64
}

// FamiliesResult is what one Families.Sync did, over both families.
type FamiliesResult struct {
	// Rules is the number of rules the claims render to.
	Rules int
	// Written is the number of rules written by this Sync: a family's
	// Rules count when it rewrote its chains.
	Written int
	// Commands is the number of processes this Sync ran.
	Commands int
	// Skipped, by family (index 0 IPv4, 1 IPv6), is true when the
	// claims have addresses of the family and its rules were not
	// written because its tool is missing (ip6tables): no error, but no
	// rule, and no listener guard, for them.
	Skipped [2]bool
}

// NewFamilies returns the Families for cfg. It checks that the iptables
// tools are usable, as New does, and changes nothing in the kernel.
func NewFamilies(cfg FamiliesConfig) (*Families, error) {
	f := &Families{cfg: cfg, log: cfg.Logger}
	if f.log == nil {
		f.log = zap.NewNop()
	}
	if f.cfg.EnsureRouting == nil {
		switch {
		case cfg.Services.TProxy != nil:
			f.cfg.EnsureRouting = cfg.Services.TProxy.Routing.Ensure
		case cfg.Services.Replies != nil:
			f.cfg.EnsureRouting = cfg.Services.Replies.Routing.Ensure
		}
	}
	v4 := cfg.IPv4
	v4.Family, v4.Commands = IPv4, f.countCommand
	var err error
	if f.v4, err = New(v4); err != nil {
		return nil, fmt.Errorf("iptables: %w", err)
	}
	v6 := cfg.IPv6
	v6.Family, v6.Commands = IPv6, f.countCommand
	if _, err := exec.LookPath("ip6tables"); err == nil || v6.Exec != nil || v6.Jumps != nil {
		if f.v6, err = New(v6); err != nil {
			f.log.Warn("ip6tables is not usable; IPv6 service addresses will not be proxied", zap.Error(err))
		}
	}
	return f, nil
}

// countCommand is both Syncers' Config.Commands.
func (f *Families) countCommand(name string) {
	f.ran.Add(1)
	if f.cfg.Commands != nil {
		f.cfg.Commands(name)
	}
}

// Available returns the families whose rules f syncs: IPv4, and IPv6 when
// ip6tables is usable.
func (f *Families) Available() []Family {
	if f.v6 == nil {
		return []Family{IPv4}
	}
	return []Family{IPv4, IPv6}
}

// Sync makes both families' kernel rules those of claims (see
// ServiceRules: the first of two conflicting claims wins), after tproxy
// mode's policy routing. full is Syncer.Sync's: verify the kernel rather
// than trust the last write. A family's error does not keep the other
// from syncing; the result counts the families that synced.
func (f *Families) Sync(ctx context.Context, claims []Intercept, full bool) (FamiliesResult, error) {
	var out FamiliesResult
	commandsBefore := f.ran.Load()
	rules := ServiceRules(claims, f.cfg.Services)
	// The families sync side by side: each has its own tables and sets,
	// and a sync mostly waits for iptables and ipset processes, IPv6's
	// too when it has nothing to write, so the two waits overlap. The
	// goroutines end when their Sync returns, before this one does.
	var (
		results [2]Result
		errs    [2]error
		ran     [2]bool
		wg      sync.WaitGroup
	)
	for fam, s := range []*Syncer{f.v4, f.v6} {
		if s == nil {
			if hasIPv6(claims) {
				out.Skipped[fam] = true
				if !f.warned {
					f.log.Error("IPv6 services present but ip6tables is unavailable; their IPv6 addresses are not proxied, and uproxy's IPv6 UDP listeners check every datagram's destination with conntrack")
					f.warned = true
				}
			}
			continue
		}
		ran[fam] = true
		wg.Go(func() { results[fam], errs[fam] = f.syncFamily(ctx, Family(fam), s, rules, full) })
	}
	wg.Wait()
	for fam := range ran {
		if !ran[fam] || errs[fam] != nil {
			continue
		}
		res := results[fam]
		out.Rules += res.Rules
		if res.Wrote {
			out.Written += res.Rules
		}
		if res.Repaired {
			f.log.Warn("iptables rules had drifted (changed or deleted by someone else); repaired", zap.Stringer("family", Family(fam)), zap.Int("rules", res.Rules))
		} else if res.Wrote {
			f.log.Debug("iptables rules written", zap.Stringer("family", Family(fam)), zap.Int("rules", res.Rules))
		}
	}
	out.Commands = int(f.ran.Load() - commandsBefore)
	return out, errors.Join(errs[:]...)
}

// syncFamily syncs rules into family fam's tables with s, after the
// policy routing that TPROXY and the replies to transparent dials need. It runs on a goroutine of
// Sync, beside the other family's, and touches only fam's routed.
func (f *Families) syncFamily(ctx context.Context, fam Family, s *Syncer, rules Rules, full bool) (Result, error) {
	if routed := f.cfg.Services.TProxy != nil || f.cfg.Services.Replies != nil; routed && (full || !f.routed[fam]) {
		// TPROXY and the replies to transparent dials need the policy
		// routing that delivers marked packets locally; check it, and
		// repair it, as often as the rules.
		repaired, err := f.cfg.EnsureRouting(fam)
		if err != nil {
			return Result{}, err
		}
		if repaired && f.routed[fam] {
			f.log.Warn("the policy routing of marked packets had been removed; repaired", zap.Stringer("family", fam))
		}
		f.routed[fam] = true
	}
	return s.Sync(ctx, rules, full)
}

// hasIPv6 reports whether a claim is of IPv6 (an IPv4-mapped address
// counts, as the proxier's intercepts count it).
func hasIPv6(claims []Intercept) bool {
	for _, c := range claims {
		if c.Dest.Is6() {
			return true
		}
	}
	return false
}
