package main

import (
	"context"

	"github.com/uproxy/uproxy/proxy/routing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/proxy"
	"github.com/uproxy/uproxy/proxy/service"
	"github.com/uproxy/uproxy/redirect"
)

// newRuleCommands registers uproxy_rule_commands_total with reg.
func newRuleCommands(reg prometheus.Registerer) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "uproxy_rule_commands_total",
		Help: "Processes run to read or write uproxy's kernel rules and sets, by command: iptables-restore, iptables-save, ipset, and iptables for a jump rule (ip6tables-* for IPv6).",
	}, []string{"command"})
	reg.MustRegister(c)
	return c
}

// syncRules is the proxier's RuleSyncer: it hands the intercepts to k,
// which syncs them into both families' tables, and then, once the rules
// are in place, to stale (when not nil), which deletes the conntrack
// entries that would keep flows from them.
func syncRules(ctx context.Context, k *redirect.Families, stale *redirect.StaleConntrack, in []routing.Intercept, full bool) (proxy.RuleStats, error) {
	cl := claims(in)
	res, err := k.Sync(ctx, cl, full)
	if err == nil && stale != nil {
		// A failed sync is retried in full, which cleans: until then the
		// old entries may be the flows' only way through.
		stale.Trigger(cl, k.Available(), full)
	}
	return proxy.RuleStats{Rules: res.Rules, Written: res.Written, Commands: res.Commands, Unguarded: res.Skipped}, err
}

// ipFamilies returns the families k syncs, as health and metrics report
// them (kube-proxy reports the families of the proxiers it runs).
func ipFamilies(k *redirect.Families) []v1.IPFamily {
	var out []v1.IPFamily
	for _, f := range k.Available() {
		out = append(out, map[redirect.Family]v1.IPFamily{redirect.IPv4: v1.IPv4Protocol, redirect.IPv6: v1.IPv6Protocol}[f])
	}
	return out
}

// claims translates the proxier's intercepts into the redirect package's
// claims, in the same order: the first of two that conflict wins (see
// redirect.ServiceRules).
func claims(in []routing.Intercept) []redirect.Intercept {
	out := make([]redirect.Intercept, len(in))
	for n, i := range in {
		proto := redirect.TCP
		if i.Protocol == v1.ProtocolUDP {
			proto = redirect.UDP
		}
		out[n] = redirect.Intercept{Comment: i.Service.String(), NodePort: i.Kind == routing.NodePort, Protocol: proto,
			Dest: i.VIP, Port: i.Port, ToPort: i.ListenPort, ToPortEnd: i.ListenPortEnd, Reject: i.Reject}
		if i.Kind == routing.LoadBalancerIP {
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
func previousPorts(ctx context.Context, tproxy bool, log *zap.Logger) func(service.PortName, string) uint16 {
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
	return func(name service.PortName, network string) uint16 {
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
