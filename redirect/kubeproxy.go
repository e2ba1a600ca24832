package redirect

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// kube-proxy's iptables mode leaves its chains behind when it stops:
// these are the ones its own cleanup (`kube-proxy --cleanup`,
// pkg/proxy/iptables CleanupLeftovers in v1.37) deletes, by table. The
// chains kubelet creates (KUBE-IPTABLES-HINT, KUBE-KUBELET-CANARY,
// KUBE-FIREWALL) are not among them: kubelet still needs them.
// Its IPVS mode's chains (pkg/proxy/ipvs iptablesCleanupChains) are
// among them too: KUBE-NODE-PORT, KUBE-LOAD-BALANCER and the filters.
var kubeProxyChains = map[string][]string{
	"nat": {"KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ", "KUBE-PROXY-CANARY",
		"KUBE-NODE-PORT", "KUBE-LOAD-BALANCER"},
	"filter": {"KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS", "KUBE-PROXY-FIREWALL", "KUBE-PROXY-CANARY",
		"KUBE-NODE-PORT", "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER"},
	"mangle": {"KUBE-PROXY-CANARY"},
}

// kubeProxyIPVSSets are the ipsets of kube-proxy's IPVS mode
// (pkg/proxy/ipvs ipsetInfo in v1.37), which its cleanup destroys once
// no rule refers to them.
var kubeProxyIPVSSets = []string{
	"KUBE-LOOP-BACK", "KUBE-CLUSTER-IP", "KUBE-EXTERNAL-IP", "KUBE-EXTERNAL-IP-LOCAL",
	"KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER-FW", "KUBE-LOAD-BALANCER-LOCAL",
	"KUBE-LOAD-BALANCER-SOURCE-IP", "KUBE-LOAD-BALANCER-SOURCE-CIDR",
	"KUBE-NODE-PORT-TCP", "KUBE-NODE-PORT-LOCAL-TCP", "KUBE-NODE-PORT-UDP", "KUBE-NODE-PORT-LOCAL-UDP",
	"KUBE-NODE-PORT-SCTP-HASH", "KUBE-NODE-PORT-LOCAL-SCTP-HASH", "KUBE-HEALTH-CHECK-NODE-PORT", "KUBE-IPVS-IPS",
}

// CleanupKubeProxySets destroys the ipsets of kube-proxy's IPVS mode
// that exist, after CleanupKubeProxy has removed the rules that refer to
// them, and returns how many it destroyed. x runs ipset.
func CleanupKubeProxySets(ctx context.Context, x Exec) (int, error) {
	out, err := x.Run(ctx, "ipset", []string{"list", "-n"}, nil)
	if err != nil {
		return 0, fmt.Errorf("redirect: kube-proxy cleanup: listing ipsets: %w", err)
	}
	n := 0
	var errs []error
	for name := range strings.FieldsSeq(string(out)) {
		if !slices.Contains(kubeProxyIPVSSets, name) {
			continue
		}
		if _, err := x.Run(ctx, "ipset", []string{"destroy", name}, nil); err != nil {
			errs = append(errs, fmt.Errorf("redirect: kube-proxy cleanup: destroying ipset %s: %w", name, err))
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// kubeProxyServicePrefixes name kube-proxy's per-service and per-endpoint
// nat chains (isServiceChainName in kube-proxy).
var kubeProxyServicePrefixes = []string{"KUBE-SVC-", "KUBE-SVL-", "KUBE-SEP-", "KUBE-FW-", "KUBE-EXT-"}

// builtinChains are the chains iptables-save lists with a policy.
var builtinChains = []string{"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"}

func isKubeProxyChain(table, chain string) bool {
	if slices.Contains(kubeProxyChains[table], chain) {
		return true
	}
	if table != "nat" {
		return false
	}
	for _, p := range kubeProxyServicePrefixes {
		if strings.HasPrefix(chain, p) {
			return true
		}
	}
	return false
}

// RenderKubeProxyCleanup returns the iptables-restore --noflush input that
// removes, from the tables in saved (iptables-save output), kube-proxy's
// iptables-mode chains and the rules of the built-in chains that jump to
// them, and how many chains it removes; nil and 0 when there are none.
// Every other chain and rule stays. As in kube-proxy's cleanup, a rule of
// another non-built-in chain that still jumps to one of them makes the
// kernel refuse the deletion, and the restore fails.
func RenderKubeProxyCleanup(saved []byte) ([]byte, int) {
	type table struct {
		chains []string // kube-proxy's, in saved's order
		jumps  []string // built-in rules to delete, as -D lines
	}
	var order []string
	tables := map[string]*table{}
	get := func(name string) *table {
		t, ok := tables[name]
		if !ok {
			t = &table{}
			tables[name] = t
			order = append(order, name)
		}
		return t
	}
	for name, line := range tableLines(saved) {
		if chain, ok := strings.CutPrefix(line, ":"); ok {
			chain, _, _ = strings.Cut(chain, " ")
			if isKubeProxyChain(name, chain) {
				get(name).chains = append(get(name).chains, chain)
			}
			continue
		}
		rule, ok := strings.CutPrefix(line, "-A ")
		if !ok {
			continue
		}
		from, _, _ := strings.Cut(rule, " ")
		f := strings.Fields(rule)
		if !slices.Contains(builtinChains, from) || len(f) < 3 {
			continue
		}
		if jump := f[len(f)-2]; (jump == "-j" || jump == "-g") && isKubeProxyChain(name, f[len(f)-1]) {
			get(name).jumps = append(get(name).jumps, "-D "+rule)
		}
	}
	var b bytes.Buffer
	n := 0
	for _, name := range order {
		t := tables[name]
		if len(t.chains) == 0 && len(t.jumps) == 0 {
			continue
		}
		fmt.Fprintf(&b, "*%s\n", name)
		// Declaring a chain flushes it, so that the chains that jump to
		// each other can all be deleted once the built-in jumps are gone.
		for _, c := range t.chains {
			fmt.Fprintf(&b, ":%s - [0:0]\n", c)
		}
		for _, j := range t.jumps {
			fmt.Fprintln(&b, j)
		}
		for _, c := range t.chains {
			fmt.Fprintf(&b, "-X %s\n", c)
		}
		b.WriteString("COMMIT\n")
		n += len(t.chains)
	}
	if b.Len() == 0 {
		return nil, 0
	}
	return b.Bytes(), n
}

// CleanupKubeProxy removes kube-proxy's iptables-mode chains of
// cfg.Family, and the jumps to them, as `kube-proxy --cleanup` does, and
// returns how many chains it removed. uproxy's own rules stay, so it is
// safe while uproxy runs.
func CleanupKubeProxy(ctx context.Context, cfg Config) (int, error) {
	rc, err := resolve(cfg)
	if err != nil {
		return 0, err
	}
	cfg = rc.Config
	saved, err := cfg.Exec.Run(ctx, cfg.Family.command("-save"), nil, nil)
	if err != nil {
		return 0, fmt.Errorf("redirect: %s: kube-proxy cleanup: reading the tables: %w", cfg.Family, err)
	}
	input, n := RenderKubeProxyCleanup(saved)
	if n == 0 && input == nil {
		return 0, nil
	}
	args := []string{"--noflush", "-w", strconv.Itoa(waitSeconds(cfg.Wait))}
	if _, err := cfg.Exec.Run(ctx, cfg.Family.command("-restore"), args, input); err != nil {
		return 0, fmt.Errorf("redirect: %s: kube-proxy cleanup: deleting %d chains: %w", cfg.Family, n, err)
	}
	return n, nil
}
