package main

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/proxy"
	"github.com/uproxy/uproxy/redirect"
)

// kernelRules connects the proxier's sync hook to the redirect package:
// one Syncer per IP family. It is called only from the proxier's sync
// goroutine.
type kernelRules struct {
	v4, v6            *redirect.Syncer // v6 is nil when ip6tables is unavailable
	nodePortAddresses []netip.Prefix
	tproxy            bool // TPROXY in mangle instead of REDIRECT in nat
	shared            bool // the shared listener layout: service addresses in kernel sets
	routed            [2]bool
	log               *zap.Logger
	warned            bool
	// commands counts the processes the Syncers run, by command; nil
	// counts none. ran counts them for SyncRules' stats: the two
	// families' Syncers add to it side by side.
	commands *prometheus.CounterVec
	ran      atomic.Int64
}

// newRuleCommands registers uproxy_rule_commands_total with reg.
func newRuleCommands(reg prometheus.Registerer) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_rule_commands_total",
		Help: "Processes run to read or write uproxy's kernel rules and sets, by command: iptables-restore, iptables-save, ipset, and iptables for a jump rule (ip6tables-* for IPv6).",
	}, []string{"command"})
	reg.MustRegister(c)
	return c
}

// countCommand is the Syncers' redirect.Config.Commands.
func (k *kernelRules) countCommand(name string) {
	k.ran.Add(1)
	if k.commands != nil {
		k.commands.WithLabelValues(name).Inc()
	}
}

var _ proxy.RuleSyncer = (*kernelRules)(nil)

// init checks that the iptables tools are usable. IPv4 is required; IPv6
// is optional (a node without ip6tables serves IPv4 only, and says so once
// if an IPv6 service shows up).
func (k *kernelRules) init(cfg redirect.Config) error {
	cfg.Family = redirect.IPv4
	cfg.Commands = k.countCommand
	var err error
	if k.v4, err = redirect.New(cfg); err != nil {
		return fmt.Errorf("iptables: %w", err)
	}
	if _, err := exec.LookPath("ip6tables"); err == nil {
		cfg.Family = redirect.IPv6
		if k.v6, err = redirect.New(cfg); err != nil {
			k.log.Warn("ip6tables is not usable; IPv6 service addresses will not be proxied", zap.Error(err))
		}
	}
	return nil
}

func (k *kernelRules) SyncRules(ctx context.Context, in []proxy.Intercept, full bool) (proxy.RuleStats, error) {
	var stats proxy.RuleStats
	commandsBefore := k.ran.Load()
	opts := redirect.ServiceOptions{NodePortAddresses: k.nodePortAddresses, Shared: k.shared}
	if k.tproxy {
		opts.TProxy = &redirect.TProxy{Routing: redirect.DefaultRouting}
	}
	rules := redirect.ServiceRules(claims(in), opts)
	hasV6 := slices.ContainsFunc(in, func(i proxy.Intercept) bool { return i.VIP.Is6() })
	// The families sync side by side: each has its own tables and sets,
	// and a sync mostly waits for iptables and ipset processes, IPv6's
	// too when it has nothing to write, so the two waits overlap. The
	// goroutines end when their Sync returns, before SyncRules does.
	var (
		results [2]redirect.Result
		errs    [2]error
		ran     [2]bool
		wg      sync.WaitGroup
	)
	for f, s := range []*redirect.Syncer{k.v4, k.v6} {
		if s == nil {
			if hasV6 && !k.warned {
				k.log.Error("IPv6 services present but ip6tables is unavailable; their IPv6 addresses are not proxied")
				k.warned = true
			}
			continue
		}
		ran[f] = true
		wg.Go(func() { results[f], errs[f] = k.syncFamily(ctx, redirect.Family(f), s, rules, full) })
	}
	wg.Wait()
	for f := range ran {
		if !ran[f] || errs[f] != nil {
			continue
		}
		res := results[f]
		stats.Rules += res.Rules
		if res.Wrote {
			stats.Written += res.Rules
		}
		if res.Repaired {
			k.log.Warn("iptables rules had drifted (changed or deleted by someone else); repaired", zap.Stringer("family", redirect.Family(f)), zap.Int("rules", res.Rules))
		} else if res.Wrote {
			k.log.Debug("iptables rules written", zap.Stringer("family", redirect.Family(f)), zap.Int("rules", res.Rules))
		}
	}
	stats.Commands = int(k.ran.Load() - commandsBefore)
	return stats, errors.Join(errs[:]...)
}

// syncFamily syncs rules into family f's tables with s, after the TPROXY
// policy routing that tproxy mode needs. It runs on a goroutine of
// SyncRules, beside the other family's.
func (k *kernelRules) syncFamily(ctx context.Context, f redirect.Family, s *redirect.Syncer, rules redirect.Rules, full bool) (redirect.Result, error) {
	if k.tproxy && (full || !k.routed[f]) {
		// TPROXY needs the policy routing that delivers marked packets
		// locally; check it, and repair it, as often as the rules.
		repaired, err := redirect.DefaultRouting.Ensure(f)
		if err != nil {
			return redirect.Result{}, err
		}
		if repaired && k.routed[f] {
			k.log.Warn("TPROXY policy routing had been removed; repaired", zap.Stringer("family", f))
		}
		k.routed[f] = true
	}
	return s.Sync(ctx, rules, full)
}

// claims translates the proxier's intercepts into the redirect package's
// claims, in the same order: the first of two that conflict wins (see
// redirect.ServiceRules).
func claims(in []proxy.Intercept) []redirect.Claim {
	out := make([]redirect.Claim, len(in))
	for n, i := range in {
		proto := redirect.TCP
		if i.Protocol == v1.ProtocolUDP {
			proto = redirect.UDP
		}
		out[n] = redirect.Claim{Comment: i.Service.String(), NodePort: i.Kind == proxy.NodePort, Protocol: proto,
			Dest: i.VIP, Port: i.Port, ToPort: i.ListenPort, ToPortEnd: i.ListenPortEnd}
		if i.Kind == proxy.LoadBalancerIP {
			out[n].SourceRanges = i.SourceRanges
		}
	}
	return out
}

// previousPorts reads the listener ports that the rules of a previous
// uproxy (killed, so it could not hand its sockets over) send each service
// port to, so the new listeners can bind them again: those rules then
// work as soon as a listener is open, before the first sync. Families
// whose rules cannot be read contribute nothing.
func previousPorts(ctx context.Context, tproxy bool, log *zap.Logger) func(proxy.ServicePortName, string) uint16 {
	ports := map[string]uint16{} // by network and comment: "tcp4 default/web:http"
	for _, f := range []redirect.Family{redirect.IPv4, redirect.IPv6} {
		saved, err := redirect.SavedRules(ctx, f, tproxy)
		if err != nil {
			log.Debug("no previous rules to read", zap.Stringer("family", f), zap.Error(err))
			continue
		}
		suffix := map[redirect.Family]string{redirect.IPv4: "4", redirect.IPv6: "6"}[f]
		for k, port := range redirect.PreviousListenerPorts(saved) {
			proto := map[redirect.Protocol]string{redirect.TCP: "tcp", redirect.UDP: "udp"}[k.Protocol]
			ports[proto+suffix+" "+k.Comment] = port
		}
	}
	if len(ports) == 0 {
		return nil
	}
	log.Info("found the rules of a previous instance; rebinding its listener ports where possible", zap.Int("listeners", len(ports)))
	return func(name proxy.ServicePortName, network string) uint16 {
		if name.IsShared() {
			// The shared rules carry no service's name.
			proto := redirect.TCP
			if name.Protocol == v1.ProtocolUDP {
				proto = redirect.UDP
			}
			return ports[network+" "+redirect.SharedComment(proto)]
		}
		return ports[network+" "+name.String()]
	}
}
