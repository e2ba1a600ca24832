package main

import (
	"context"
	"errors"
	"fmt"
	"os/exec"

	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/proxy"
	"github.com/uproxy/uproxy/redirect"
)

// kernelRules connects the proxier's sync hook to the redirect package:
// one Syncer per IP family. It is called only from the proxier's sync
// goroutine.
type kernelRules struct {
	v4, v6 *redirect.Syncer // v6 is nil when ip6tables is unavailable
	log    *zap.Logger
	warned bool
}

var _ proxy.RuleSyncer = (*kernelRules)(nil)

// init checks that the iptables tools are usable. IPv4 is required; IPv6
// is optional (a node without ip6tables serves IPv4 only, and says so once
// if an IPv6 service shows up).
func (k *kernelRules) init(cfg redirect.Config) error {
	cfg.Family = redirect.IPv4
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

func (k *kernelRules) SyncRules(ctx context.Context, in []proxy.Intercept, full bool) error {
	var rules redirect.Rules
	hasV6 := false
	for _, i := range in {
		proto := redirect.TCP
		if i.Protocol == v1.ProtocolUDP {
			proto = redirect.UDP
		}
		hasV6 = hasV6 || i.VIP.Is6()
		rules.Intercepts = append(rules.Intercepts, redirect.Intercept{
			Comment:  i.Service.String(),
			Protocol: proto,
			Dest:     i.VIP,
			Port:     i.Port,
			ToPort:   i.ListenPort,
		})
	}
	var errs []error
	for _, s := range []*redirect.Syncer{k.v4, k.v6} {
		if s == nil {
			if hasV6 && !k.warned {
				k.log.Error("IPv6 services present but ip6tables is unavailable; their IPv6 addresses are not proxied")
				k.warned = true
			}
			continue
		}
		res, err := s.Sync(ctx, rules, full)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if res.Repaired {
			k.log.Warn("iptables rules had drifted (changed or deleted by someone else); repaired", zap.Int("rules", res.Rules))
		} else if res.Wrote {
			k.log.Debug("iptables rules written", zap.Int("rules", res.Rules))
		}
	}
	return errors.Join(errs...)
}
