package controlplane

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/uproxy/uproxy/bench/internal/harness"

	"github.com/uproxy/uproxy/bench/internal/report"

	"github.com/uproxy/uproxy/bench/internal/results"

	"github.com/uproxy/uproxy/bench/internal/load"

	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/internal/testkube"
	"github.com/uproxy/uproxy/internal/testlab"
)

// scaleSet is one scale's objects, as the proxies see them.
type scaleSet struct {
	gen       []testkube.Generated
	endpoints []netip.Addr // every service's endpoints
	changes   []netip.Addr // the last service's endpoint, change after change
	targets   string       // file of every service's VIP:port, for the sweep
}

func (s *scaleSet) last() testkube.Generated { return s.gen[len(s.gen)-1] }

func (s *scaleSet) dnatPorts() []harness.DNATPort {
	ports := make([]harness.DNATPort, len(s.gen))
	for i, g := range s.gen {
		ports[i] = harness.DNATPort{Name: "default/" + g.Name + ":http", ClusterIP: g.ClusterIP, Port: g.Port, Protocol: "tcp", Endpoints: withPort(s.endpoints, harness.RRTarget)}
	}
	return ports
}

func withPort(addrs []netip.Addr, port uint16) []netip.AddrPort {
	out := make([]netip.AddrPort, len(addrs))
	for i, a := range addrs {
		out[i] = netip.AddrPortFrom(a, port)
	}
	return out
}

// cpProxy is one way of programming the node from the API server's
// services.
type cpProxy struct {
	results.Subject
	// na says why the proxy cannot run here, or nil.
	na func(e *harness.Env, k *harness.KubeEnv) error
	// start begins programming every service of s in t and returns the
	// proxy process (nil when the harness programs the kernel itself).
	start func(ctx context.Context, e *harness.Env, t *harness.Topo, k *harness.KubeEnv, s *scaleSet) (*testlab.Proc, error)
	// change moves the last service to the single endpoint to, from the
	// endpoints from.
	change func(ctx context.Context, t *harness.Topo, k *harness.KubeEnv, s *scaleSet, from []netip.Addr, to netip.Addr) error
	// rules counts the kernel's rule lines in t's node.
	rules func(ctx context.Context, t *harness.Topo) (int, error)
}

var cpProxies = []cpProxy{
	{
		Subject: results.Subject{ID: "dnat", Title: "kernel DNAT (iptables-restore)", How: "The harness renders kube-proxy's iptables-mode rules for every service and loads them with one iptables-restore; an endpoint change is one iptables-restore --noflush of the service's chains. The floor of what programming iptables costs, without a control loop."},
		na: func(*harness.Env, *harness.KubeEnv) error {
			if _, err := exec.LookPath("iptables-restore"); err != nil {
				return results.NA("iptables-restore is not installed (Debian package iptables)")
			}
			return nil
		},
		start: func(ctx context.Context, _ *harness.Env, t *harness.Topo, _ *harness.KubeEnv, s *scaleSet) (*testlab.Proc, error) {
			return nil, harness.Restore(ctx, t.Lab, t.Lab.Node, harness.RenderDNAT(s.dnatPorts(), harness.ClusterCIDR), false)
		},
		change: func(ctx context.Context, t *harness.Topo, _ *harness.KubeEnv, s *scaleSet, from []netip.Addr, to netip.Addr) error {
			p := s.dnatPorts()[len(s.gen)-1]
			p.Endpoints = withPort([]netip.Addr{to}, harness.RRTarget)
			return harness.Restore(ctx, t.Lab, t.Lab.Node, harness.RenderDNATChange(p, withPort(from, harness.RRTarget), harness.ClusterCIDR), true)
		},
		rules: iptablesRules,
	},
	{
		Subject: results.Subject{ID: "uproxy", Title: "uproxy redirect", How: "uproxy run --kubeconfig … --hostname-override … --cluster-cidr 10.244.0.0/16, defaults otherwise (--iptables-min-sync-period 1s)."},
		na: func(e *harness.Env, k *harness.KubeEnv) error {
			if e.UproxyErr != nil {
				return fmt.Errorf("uproxy does not build: %w", e.UproxyErr)
			}
			return harness.KubeProxyNA(k, "iptables")
		},
		start:  startUproxy(),
		change: apiChange,
		rules:  iptablesRules,
	},
	{
		Subject: results.Subject{ID: "uproxy-shared", Title: "uproxy redirect, shared listener", How: "As uproxy redirect, with --listener=shared: one listener per protocol, every service address in one ipset behind one rule per protocol."},
		na:      uproxyWithIpsetNA,
		start:   startUproxy("--listener=shared"),
		change:  apiChange,
		rules:   iptablesRules,
	},
	{
		Subject: results.Subject{ID: "uproxy-tproxy", Title: "uproxy tproxy", How: "As uproxy redirect, with --mode=tproxy: TPROXY rules in mangle, one chain of per-service rules per protocol behind lookups in the service and node-port ipsets."},
		na:      uproxyWithIpsetNA,
		start:   startUproxy("--mode=tproxy"),
		change:  apiChange,
		rules:   iptablesRules,
	},
	{
		Subject: results.Subject{ID: "kp-iptables", Title: "kube-proxy iptables", How: "kube-proxy --proxy-mode iptables, defaults otherwise (--iptables-min-sync-period 1s)."},
		na:      func(_ *harness.Env, k *harness.KubeEnv) error { return harness.KubeProxyNA(k, "iptables") },
		start:   startKubeProxy("iptables"),
		change:  apiChange,
		rules:   iptablesRules,
	},
	{
		Subject: results.Subject{ID: "kp-nftables", Title: "kube-proxy nftables", How: "kube-proxy --proxy-mode nftables, defaults otherwise."},
		na:      func(_ *harness.Env, k *harness.KubeEnv) error { return harness.KubeProxyNA(k, "nftables") },
		start:   startKubeProxy("nftables"),
		change:  apiChange,
		rules: func(ctx context.Context, t *harness.Topo) (int, error) {
			return harness.CountLines(ctx, t.Lab, t.Lab.Node, "nft", "list", "ruleset")
		},
	},
}

// uproxyWithIpsetNA says why uproxy cannot run in a mode that needs
// ipset, or nil.
func uproxyWithIpsetNA(e *harness.Env, k *harness.KubeEnv) error {
	if e.UproxyErr != nil {
		return fmt.Errorf("uproxy does not build: %w", e.UproxyErr)
	}
	if _, err := exec.LookPath("ipset"); err != nil {
		return results.NA("ipset is not installed (Debian package ipset)")
	}
	return harness.KubeProxyNA(k, "iptables")
}

// cpProxies returns the control-plane proxies that c selects (all by
// default), in table order.
func selectedProxies(c harness.Config) []cpProxy {
	var out []cpProxy
	for _, p := range cpProxies {
		if len(c.Proxies) == 0 || slices.Contains(c.Proxies, p.ID) {
			out = append(out, p)
		}
	}
	return out
}

// ProxyIDs lists the control-plane proxies' ids, for --proxies.
func ProxyIDs() []string {
	var ids []string
	for _, p := range cpProxies {
		ids = append(ids, p.ID)
	}
	return ids
}

// startUproxy runs uproxy against the lab's API server with extra flags.
func startUproxy(extra ...string) func(ctx context.Context, e *harness.Env, t *harness.Topo, k *harness.KubeEnv, _ *scaleSet) (*testlab.Proc, error) {
	return func(ctx context.Context, e *harness.Env, t *harness.Topo, k *harness.KubeEnv, _ *scaleSet) (*testlab.Proc, error) {
		args := append([]string{e.UproxyBin, "run", "--kubeconfig", k.CP.Kubeconfig,
			"--hostname-override", harness.BenchNode, "--cluster-cidr", harness.ClusterCIDR,
			"--upgrade-socket", filepath.Join(t.Dir, "upgrade.sock"), "--state-file", filepath.Join(t.Dir, "state.json"),
			// For the heap profile at the largest scale (heapProfile).
			"--profiling"}, extra...)
		return t.Lab.Start(t.Lab.Node, "uproxy", args...)
	}
}

func startKubeProxy(mode string) func(ctx context.Context, e *harness.Env, t *harness.Topo, k *harness.KubeEnv, _ *scaleSet) (*testlab.Proc, error) {
	return func(ctx context.Context, _ *harness.Env, t *harness.Topo, k *harness.KubeEnv, _ *scaleSet) (*testlab.Proc, error) {
		return t.Lab.Start(t.Lab.Node, "kube-proxy", harness.KubeProxyArgs(k.KubeProxy, k.CP.Kubeconfig, mode)...)
	}
}

// iptablesRules counts the lines of iptables-save, plus those of ipset
// save when ipset is installed (rules may match sets).
func iptablesRules(ctx context.Context, t *harness.Topo) (int, error) {
	n, err := harness.CountLines(ctx, t.Lab, t.Lab.Node, "iptables-save")
	if err != nil {
		return 0, err
	}
	if _, err := exec.LookPath("ipset"); err == nil {
		m, err := harness.CountLines(ctx, t.Lab, t.Lab.Node, "ipset", "save")
		if err != nil {
			return 0, err
		}
		n += m
	}
	return n, nil
}

// apiChange replaces the last service's EndpointSlice's endpoints.
func apiChange(ctx context.Context, _ *harness.Topo, k *harness.KubeEnv, s *scaleSet, _ []netip.Addr, to netip.Addr) error {
	return setEndpoints(ctx, k, s.last().Name, []netip.Addr{to})
}

func setEndpoints(ctx context.Context, k *harness.KubeEnv, service string, addrs []netip.Addr) error {
	slices := k.CP.Client.DiscoveryV1().EndpointSlices("default")
	sl, err := slices.Get(ctx, service+"-1", metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("getting %s's EndpointSlice: %w", service, err)
	}
	sl.Endpoints = nil
	for _, a := range addrs {
		sl.Endpoints = append(sl.Endpoints, discovery.Endpoint{Addresses: []string{a.String()}, Conditions: discovery.EndpointConditions{Ready: ptr.To(true)}})
	}
	if _, err := slices.Update(ctx, sl, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("updating %s's EndpointSlice: %w", service, err)
	}
	return nil
}

func Run(ctx context.Context, e *harness.Env) error {
	cfg := e.Config
	scales := slices.Clone(cfg.Scales)
	slices.Sort(scales)
	scales = slices.Compact(scales)
	res := &results.ControlPlaneResults{
		Meta:            harness.NewRunMeta(e, fmt.Sprintf("%d runs, scales %v, %d endpoints per service, %d changes", cfg.Runs, scales, cfg.Endpoints, cfg.Changes)),
		Metrics:         results.ControlPlaneMetrics,
		Scales:          scales,
		Endpoints:       cfg.Endpoints,
		Changes:         cfg.Changes,
		Figures:         map[string]map[string]map[string]*results.Series{},
		GenerateSeconds: map[string]float64{},
		HeapProfiles:    map[string]*results.HeapProfile{},
	}
	for _, p := range selectedProxies(e.Config) {
		res.Proxies = append(res.Proxies, p.Subject)
	}
	save := func() error {
		res.Meta.Finish()
		return harness.WriteJSON(cfg, "controlplane.json", res)
	}
	// One API server for every scale: each scale adds services to the
	// previous one's (the scales are nested, 1,000 ⊂ 5,000 ⊂ … ⊂ 20,000), which
	// saves creating them again.
	k := e.Kube(ctx)
	if k.Err != nil {
		e.Logf("no control plane (%v): only the kernel DNAT row can run", k.Err)
	}
	s := &scaleSet{}
	for i := range cfg.Endpoints {
		s.endpoints = append(s.endpoints, netip.AddrFrom4([4]byte{10, 244, 0, byte(100 + i)}))
	}
	for i := range cfg.Changes {
		s.changes = append(s.changes, netip.AddrFrom4([4]byte{10, 244, 0, byte(150 + i)}))
	}
	dir, err := os.MkdirTemp("", "bench-scale-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	s.targets = filepath.Join(dir, "targets")
	timedOut := map[string]*timeoutError{}
	for si, n := range scales {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		where := fmt.Sprintf("[scale %d/%d: %d×%d]", si+1, len(scales), n, cfg.Endpoints)
		if err := growScale(ctx, e, res, k, s, si, n, where); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			// The next scales would have holes: stop here.
			res.Meta.Errors = append(res.Meta.Errors, fmt.Sprintf("scale %d: %v", n, err))
			e.Logf("%s FAILED: %v", where, err)
			break
		}
		measureScale(ctx, e, res, k, s, n, where, timedOut)
		if err := save(); err != nil {
			return err
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	for _, p := range selectedProxies(e.Config) {
		for _, n := range scales {
			for _, m := range res.Metrics {
				if s := res.Series(m.ID, p.ID, n); !s.Filled() {
					s.NA = "error: every run failed (see the errors below)"
				}
			}
		}
	}
	return save()
}

// growScale creates services until s has n of them: in the API server, or,
// without one, as addresses for the kernel DNAT row alone.
func growScale(ctx context.Context, e *harness.Env, res *results.ControlPlaneResults, k *harness.KubeEnv, s *scaleSet, si, n int, where string) error {
	more := n - len(s.gen)
	start := time.Now()
	if k.Err == nil {
		gen, err := testkube.Generate(ctx, patientDialer(k.CP.RESTConfig), testkube.GenerateSpec{
			Services: more, Endpoints: s.endpoints, Prefix: fmt.Sprintf("scale%d", si)})
		if err != nil {
			return fmt.Errorf("creating the services: %w", err)
		}
		s.gen = append(s.gen, gen...)
		res.GenerateSeconds[strconv.Itoa(n)] = time.Since(start).Seconds()
		e.Logf("%s created %d more services × %d endpoints in the API server in %v", where, more, e.Config.Endpoints, time.Since(start).Round(100*time.Millisecond))
	} else {
		base := netip.MustParseAddr("10.96.0.100")
		for range len(s.gen) {
			base = base.Next()
		}
		for i := range more {
			s.gen = append(s.gen, testkube.Generated{Name: fmt.Sprintf("scale%d-%05d", si, i), ClusterIP: base, Port: harness.RRPort})
			base = base.Next()
		}
	}
	var targets strings.Builder
	for _, g := range s.gen {
		fmt.Fprintf(&targets, "%s\n", harness.AddrPort(g.ClusterIP, g.Port))
	}
	return os.WriteFile(s.targets, []byte(targets.String()), 0o644)
}

// timeoutError is a proxy that did not program every service within
// the time allowed. It is a result, not a failure: the proxy's runs at this
// and larger scales are skipped.
type timeoutError struct {
	timeout  time.Duration
	services int
	// budget: the proxy said it could not open a listener for every
	// service (listenerBudgetSpent), so waiting out the timeout would
	// change nothing.
	budget bool
}

func (t *timeoutError) Error() string {
	if t.budget {
		return fmt.Sprintf("programmed only part of %s services: its listener budget is spent (the open-files limit holds fewer listeners than service ports)", report.Thousands(int64(t.services)))
	}
	return fmt.Sprintf("did not program %s services within %v (--program-timeout)", report.Thousands(int64(t.services)), t.timeout)
}

// na is the reason a series of the proxy at scale n has no values: n is
// where it failed, or more.
func (t *timeoutError) na(n int) string {
	switch {
	case t.services != n:
		return "not run: it " + t.Error()
	case t.budget:
		return "partial: " + t.Error()
	}
	return "over " + t.timeout.String() + ": " + t.Error()
}

// measureScale measures every proxy over the services of s, cfg.Runs
// times (interleaved). Failures are recorded in res; a proxy that timed
// out is recorded in timedOut and not run again.
func measureScale(ctx context.Context, e *harness.Env, res *results.ControlPlaneResults, k *harness.KubeEnv, s *scaleSet, n int, where string, timedOut map[string]*timeoutError) {
	slow := map[string]bool{}
	for run := 1; run <= e.Config.Runs; run++ {
		for _, p := range selectedProxies(e.Config) {
			if ctx.Err() != nil {
				return
			}
			if slow[p.ID] {
				continue
			}
			at := fmt.Sprintf("%s run %d %s", where, run, p.ID)
			if t := timedOut[p.ID]; t != nil {
				res.SetNA(p.ID, n, t.na(n))
				continue
			}
			if err := p.na(e, k); err != nil {
				reason := err.Error()
				if ne, ok := harness.ErrNA(err); ok {
					reason = ne.Reason
				} else {
					reason = "error: " + reason
				}
				res.SetNA(p.ID, n, reason)
				e.Logf("%s: n/a: %s", at, reason)
				continue
			}
			if err := measureProgramming(ctx, e, res, p, k, s, n, at); err != nil {
				if ctx.Err() != nil {
					return
				}
				var t *timeoutError
				if errors.As(err, &t) {
					timedOut[p.ID] = t
					res.SetNA(p.ID, n, t.na(n))
					e.Logf("%s: %v; not run again", at, err)
					continue
				}
				res.Meta.Errors = append(res.Meta.Errors, fmt.Sprintf("scale %d run %d %s: %v", n, run, p.ID, err))
				e.Logf("%s: FAILED: %v", at, err)
				continue
			}
			if v := res.Series("program_s", p.ID, n).Values; run < e.Config.Runs && len(v) > 0 && v[len(v)-1] > e.Config.SlowRun.Seconds() {
				slow[p.ID] = true
				note := fmt.Sprintf("%s at %s services: measured once, since programming took %.0f s (over --slow-run %v)", p.Title, report.Thousands(int64(n)), v[len(v)-1], e.Config.SlowRun)
				res.Notes = append(res.Notes, note)
				e.Logf("%s: %s", at, note)
			}
		}
	}
}

// measureProgramming starts proxy p in a fresh lab over the scale's
// services and measures it.
func measureProgramming(ctx context.Context, e *harness.Env, res *results.ControlPlaneResults, p cpProxy, k *harness.KubeEnv, s *scaleSet, n int, at string) (err error) {
	cfg := e.Config
	t, err := harness.NewTopo(ctx, e, 1, append(append([]netip.Addr(nil), s.endpoints...), s.changes...))
	if err != nil {
		return fmt.Errorf("building the lab: %w", err)
	}
	defer t.Close()
	// Unprogrammed service addresses fail at once (instead of timing out),
	// so the probes poll fast: no route, and no rate limit on the ICMP
	// errors that say so (in this namespace only).
	if _, err := t.Lab.Exec(ctx, t.Lab.Node, "ip", "route", "replace", "unreachable", "10.96.0.0/16"); err != nil {
		return err
	}
	if _, err := t.Lab.Exec(ctx, t.Lab.Node, "sysctl", "-qw", "net.ipv4.icmp_ratelimit=0", "net.ipv4.icmp_msgs_per_sec=100000", "net.ipv4.icmp_msgs_burst=100000"); err != nil {
		return err
	}
	// The kernel's default again (NewTopo shortens it for the short
	// connection workloads, of which this lab has none): a conntrack
	// entry must outlive the node's TIME_WAIT socket (60 s), or the NAT
	// sends a new connection to a listener port whose tuple is still in
	// TIME_WAIT, and its SYN is rejected (uproxy's sharedRedirectPorts).
	if _, err := t.Lab.Exec(ctx, t.Lab.Node, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_time_wait=120"); err != nil {
		return err
	}
	if k.Err == nil {
		if err := k.Connect(ctx, t.Lab); err != nil {
			return err
		}
	}
	last := harness.AddrPort(s.last().ClusterIP, s.last().Port)
	probeArgs := []string{e.LoadBin, "load", "probe", "--target", last, "--timeout", cfg.ProgramTimeout.String(), "--interval", "10ms", "--attempt-timeout", "500ms"}
	pr, err := t.Lab.Start(t.Client.NS, "probe-last", probeArgs...)
	if err != nil {
		return err
	}
	defer harness.StopProc(pr, time.Second)
	time.Sleep(200 * time.Millisecond) // the probe is polling
	t0 := time.Now()
	proc, err := p.start(ctx, e, t, k, s)
	if err != nil {
		return fmt.Errorf("starting: %w", err)
	}
	defer harness.StopProc(proc, 5*time.Second)
	var lastOK load.ProbeResult
	var proxyOut harness.OutputProc
	if proc != nil {
		proxyOut = proc
	}
	werr := harness.WaitProgrammed(ctx, pr, proxyOut, cfg.ProgramTimeout+10*time.Second)
	if derr := harness.DecodeLine(pr.Output(), &lastOK); werr != nil || derr != nil || !lastOK.OK {
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(werr, harness.ErrBudgetSpent):
			t := &timeoutError{timeout: cfg.ProgramTimeout, services: n, budget: true}
			diagnosis(e, res, p, proc, n, at, t.Error())
			return t
		case proc != nil && proc.Exited():
			return fmt.Errorf("%s exited: %s", proc.Name, harness.Tail(proc.Output(), 10))
		case derr == nil && !lastOK.OK:
			if proc != nil {
				diagnosis(e, res, p, proc, n, at, "")
			}
			return &timeoutError{timeout: cfg.ProgramTimeout, services: n}
		}
		return fmt.Errorf("the last service did not answer within %v (%v): %s", cfg.ProgramTimeout, werr, harness.Tail(pr.Output(), 2))
	}
	// Then every service must answer (each is retried until it does).
	sw, err := t.Lab.Exec(ctx, t.Client.NS, e.LoadBin, "load", "sweep", "--targets-file", s.targets, "--timeout", cfg.ProgramTimeout.String())
	var swr load.SweepResult
	if jerr := harness.DecodeLine(sw, &swr); err != nil || jerr != nil || !swr.OK {
		return fmt.Errorf("not every service answers: %v %v %s", err, jerr, harness.Tail(sw, 2))
	}
	done := time.Unix(0, lastOK.AtUnixNano)
	if swr.Unprogrammed > 0 {
		done = time.Unix(0, max(lastOK.AtUnixNano, swr.DoneUnixNano))
	}
	programmed := done.Sub(t0).Seconds()
	res.Series("program_s", p.ID, n).Add(programmed)
	e.Logf("%s: the last service answered %.2fs after the start; then all %d answered in a %.1fs sweep (%d not yet programmed, %d retried)",
		at, time.Unix(0, lastOK.AtUnixNano).Sub(t0).Seconds(), swr.Answered, swr.Seconds, swr.Unprogrammed, swr.Retried)

	if proc != nil && strings.HasPrefix(p.ID, "uproxy") {
		// The rules are in place a moment before the sync logs that it
		// has ended.
		s, err := afterLists(proc.Output())
		for wait := time.Now().Add(5 * time.Second); err != nil && time.Now().Before(wait); {
			time.Sleep(20 * time.Millisecond)
			s, err = afterLists(proc.Output())
		}
		if err != nil {
			return fmt.Errorf("reading uproxy's log: %w; its first lines:\n%s", err, head(proc.Output(), 8))
		}
		res.Series("after_lists_s", p.ID, n).Add(s)
		e.Logf("%s: the first sync ended %.2fs after the initial lists arrived", at, s)
	} else {
		res.SetNA(p.ID, n, "only uproxy logs when its initial lists arrive", "after_lists_s")
	}

	rules, err := p.rules(ctx, t)
	if err != nil {
		return fmt.Errorf("counting rules: %w", err)
	}
	res.Series("rules", p.ID, n).Add(float64(rules))
	if proc != nil {
		kib, err := harness.RSSKiB(proc.Cmd.Process.Pid)
		if err != nil {
			return err
		}
		res.Series("rss_mib", p.ID, n).Add(float64(kib) / 1024)
		e.Logf("%s: %d rule lines, RSS %.0f MiB", at, rules, float64(kib)/1024)
		if strings.HasPrefix(p.ID, "uproxy") && !cfg.NoProfile && n == slices.Max(res.Scales) && res.HeapProfiles[p.ID] == nil {
			hp := heapProfile(ctx, e, t, n, float64(kib)/1024)
			res.HeapProfiles[p.ID] = hp
			e.Logf("%s: heap profile: %s", at, cmp.Or(hp.NA, "ok"))
		}
	} else {
		res.SetNA(p.ID, n, "no process: the rules live in the kernel", "rss_mib")
		e.Logf("%s: %d rule lines", at, rules)
	}

	// Endpoint changes of the last service.
	from := s.endpoints
	defer func() {
		// Put the original endpoints back for the next proxy.
		if k.Err == nil && p.ID != "dnat" {
			if rerr := setEndpoints(ctx, k, s.last().Name, s.endpoints); rerr != nil && err == nil {
				err = rerr
			}
		}
	}()
	viaAPI := p.ID != "dnat"
	if !viaAPI {
		res.SetNA(p.ID, n, "no API server: the harness writes the rules itself", "change_api_ms")
	}
	syncLogged := proc != nil && strings.HasPrefix(p.ID, "uproxy")
	if !syncLogged {
		res.SetNA(p.ID, n, "only uproxy logs each sync's start", "change_sync_ms", "change_commands")
	}
	for i, to := range s.changes {
		ct, err := timeChange(ctx, e, t, p, k, s, from, to, last)
		if err != nil {
			return fmt.Errorf("endpoint change %d: %w", i+1, err)
		}
		res.Series("change_ms", p.ID, n).Add(ms(ct.traffic.Sub(ct.start)))
		detail := ""
		if viaAPI {
			res.Series("change_api_ms", p.ID, n).Add(ms(ct.written.Sub(ct.start)))
			detail = fmt.Sprintf(" (API server %.1f ms", ms(ct.written.Sub(ct.start)))
		}
		if syncLogged {
			sl, err := waitChangeSync(proc, ct.start)
			if err != nil {
				return fmt.Errorf("endpoint change %d: reading uproxy's log: %w", i+1, err)
			}
			sync, took := sl.start, sl.took
			res.Series("change_sync_ms", p.ID, n).Add(ms(ct.traffic.Sub(sync)))
			if sl.commands >= 0 {
				res.Series("change_commands", p.ID, n).Add(float64(sl.commands))
			} else {
				res.SetNA(p.ID, n, "this uproxy's log does not say how many processes a sync ran", "change_commands")
			}
			detail += fmt.Sprintf(", uproxy %.1f ms from the start of its sync, which took %v; the probe's connection that reached the new endpoint began %.1f ms after the sync's start, was established %.1f ms later and answered %.1f ms after that",
				ms(ct.traffic.Sub(sync)), took, ms(ct.attempt.Sub(sync)), ms(ct.connected.Sub(ct.attempt)), ms(ct.traffic.Sub(ct.connected)))
			if !ct.prevEnd.IsZero() {
				detail += fmt.Sprintf(", the attempt before it ended %.1f ms after the sync's start", ms(ct.prevEnd.Sub(sync)))
			}
		}
		if detail != "" {
			detail += ")"
		}
		e.Logf("%s: endpoint change %d/%d followed in %.1f ms%s", at, i+1, len(s.changes), ms(ct.traffic.Sub(ct.start)), detail)
		from = []netip.Addr{to}
		if i < len(s.changes)-1 {
			time.Sleep(1200 * time.Millisecond) // past the proxies' minimum sync period
		}
	}
	return nil
}

// ms returns d in milliseconds.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// changeTiming is when an endpoint change was made, written and followed.
type changeTiming struct {
	start   time.Time // the harness begins the change
	written time.Time // the change is made: the API server answered the update
	traffic time.Time // a new connection reached the new endpoint
	// attempt is when the probe's connection that reached the new
	// endpoint began, and prevEnd when the attempt before it ended.
	attempt, prevEnd time.Time
	connected        time.Time // that connection was established
}

// timeChange moves the last service to endpoint to and returns when the
// change began, was written and was followed by a new connection reaching
// to. The probe tries every millisecond, so traffic is late by at most
// that and one connection's time.
func timeChange(ctx context.Context, e *harness.Env, t *harness.Topo, p cpProxy, k *harness.KubeEnv, s *scaleSet, from []netip.Addr, to netip.Addr, target string) (changeTiming, error) {
	var ct changeTiming
	pr, err := t.Lab.Start(t.Client.NS, "probe-change", e.LoadBin, "load", "probe", "--target", target, "--want", to.String(),
		"--timeout", "60s", "--interval", "1ms", "--attempt-timeout", "500ms")
	if err != nil {
		return ct, err
	}
	defer harness.StopProc(pr, time.Second)
	time.Sleep(300 * time.Millisecond) // the probe sees the old endpoints
	if pr.Exited() {
		return ct, fmt.Errorf("the probe ended before the change: %s", harness.Tail(pr.Output(), 2))
	}
	ct.start = time.Now()
	if err := p.change(ctx, t, k, s, from, to); err != nil {
		return ct, err
	}
	ct.written = time.Now()
	var r load.ProbeResult
	if err := harness.WaitProc(ctx, pr, 70*time.Second); err != nil || harness.DecodeLine(pr.Output(), &r) != nil || !r.OK {
		if ctx.Err() != nil {
			return ct, ctx.Err()
		}
		return ct, fmt.Errorf("traffic did not follow (%v): %s", err, harness.Tail(pr.Output(), 2))
	}
	ct.traffic = time.Unix(0, r.AtUnixNano)
	ct.attempt = time.Unix(0, r.StartUnixNano)
	ct.connected = time.Unix(0, r.ConnectedUnixNano)
	if r.PrevEndUnixNano != 0 {
		ct.prevEnd = time.Unix(0, r.PrevEndUnixNano)
	}
	return ct, nil
}

// waitChangeSync returns when the sync that applied a change made at
// after started, from proc's (uproxy's) log, waiting a moment for the
// line: the sync logs once it has ended, after the traffic may already
// have followed.
func waitChangeSync(proc *testlab.Proc, after time.Time) (syncLine, error) {
	sl, err := changeSync(proc.Output(), after)
	for wait := time.Now().Add(5 * time.Second); err != nil && time.Now().Before(wait); {
		time.Sleep(20 * time.Millisecond)
		sl, err = changeSync(proc.Output(), after)
	}
	return sl, err
}

// syncLine is what one of uproxy's "synced" lines says.
type syncLine struct {
	// start is the line's timestamp (the end, to the millisecond) less
	// took, the sync's duration.
	start time.Time
	took  time.Duration
	// commands is the number of processes (iptables, ipset) the sync
	// ran; -1 when the line does not say (builds before 2026-12-01).
	commands int
}

// changeSync returns the first incremental sync that changed a service
// and ended at or after after.
func changeSync(log string, after time.Time) (syncLine, error) {
	after = after.Truncate(time.Millisecond) // the log's resolution
	for line := range strings.Lines(log) {
		ts, rest, ok := strings.Cut(line, "\t")
		if !ok || !strings.Contains(rest, "\tsynced\t") {
			continue
		}
		end, err := time.Parse(time.RFC3339Nano, ts)
		if err != nil || end.Before(after) {
			// Earlier than the change, or the first line of an output
			// buffer that has cut its start off.
			continue
		}
		f := struct {
			Full            bool   `json:"full"`
			ServicesChanged int    `json:"servicesChanged"`
			RuleCommands    int    `json:"ruleCommands"`
			Duration        string `json:"duration"`
		}{RuleCommands: -1}
		fields := rest[strings.LastIndexByte(rest, '\t')+1:]
		if err := json.Unmarshal([]byte(fields), &f); err != nil {
			return syncLine{}, fmt.Errorf("synced line %q: %w", strings.TrimSpace(line), err)
		}
		if f.Full || f.ServicesChanged == 0 {
			continue
		}
		d, err := time.ParseDuration(f.Duration)
		if err != nil {
			return syncLine{}, fmt.Errorf("synced line %q: duration: %w", strings.TrimSpace(line), err)
		}
		return syncLine{start: end.Add(-d), took: d, commands: f.RuleCommands}, nil
	}
	return syncLine{}, fmt.Errorf(`no incremental "synced" line changing a service at or after %s`, after.Format(time.RFC3339Nano))
}

// patientDialer returns a copy of cfg whose connections are retried while
// the API server's socket relay has a full accept queue: a new client's
// first concurrent requests each dial (before HTTP/2 takes over), and the
// relay's listen backlog is short.
func patientDialer(cfg *rest.Config) *rest.Config {
	cfg = rest.CopyConfig(cfg)
	dial := cfg.Dial
	cfg.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		for try := 0; ; try++ {
			c, err := dial(ctx, network, addr)
			if err == nil || !errors.Is(err, syscall.EAGAIN) || try == 50 {
				return c, err
			}
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(time.Duration(10+try*10) * time.Millisecond):
			}
		}
	}
	return cfg
}

// diagnosis records why proxy p (process proc) may not have programmed n
// services in time, or (cause, when not empty) why it never will: its
// output goes to a file in logDir (the results folder holds only reports,
// raw results and charts), and cause, or what it was still running when
// the time ran out (kube-proxy's iptables-restore, say), becomes a note in
// the report, which names the file.
func diagnosis(e *harness.Env, res *results.ControlPlaneResults, p cpProxy, proc *testlab.Proc, n int, at, cause string) {
	name := filepath.Join(logDir(e.Config), fmt.Sprintf("cp-%s-%d.log", p.ID, n))
	log := "its log is " + name
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		log = fmt.Sprintf("its log could not be kept: %v", err)
	} else if err := keepOutput(name, proc.Output()); err != nil {
		log = fmt.Sprintf("its log could not be kept: %v", err)
	}
	e.Logf("%s: %s's output: %s; its last lines:\n%s", at, proc.Name, log, harness.Tail(proc.Output(), 10))
	note := fmt.Sprintf("%s at %s services: the %v ran out; %s", p.Title, report.Thousands(int64(n)), e.Config.ProgramTimeout, log)
	busy, err := runningChildren("/proc", proc.Cmd.Process.Pid)
	switch {
	case cause != "":
		note = fmt.Sprintf("%s at %s services: %s; %s", p.Title, report.Thousands(int64(n)), cause, log)
	case err != nil:
		e.Logf("%s: what %s was running: %v", at, proc.Name, err)
	case len(busy) > 0:
		note = fmt.Sprintf("%s at %s services: when the %v ran out, %s was still running %s; %s",
			p.Title, report.Thousands(int64(n)), e.Config.ProgramTimeout, proc.Name, strings.Join(busy, ", "), log)
	}
	res.Notes = append(res.Notes, note)
	e.Logf("%s: %s", at, note)
}

// heapProfile takes the heap profile of the uproxy in t's node namespace
// (started with --profiling, on its default debug address) at n services.
// The profile is of memory in use: Go samples allocations all along, so
// taking it costs the proxy nothing but the request.
func heapProfile(ctx context.Context, e *harness.Env, t *harness.Topo, n int, rssMiB float64) *results.HeapProfile {
	hp := &results.HeapProfile{Scale: n, RSSMiB: rssMiB}
	data := filepath.Join(t.Dir, "heap.pprof")
	if _, err := t.Lab.Exec(ctx, t.Lab.Node, "curl", "-sS", "--fail", "--max-time", "60", "-o", data,
		"http://127.0.0.1:10262/debug/pprof/heap"); err != nil {
		hp.NA = "fetching /debug/pprof/heap: " + err.Error()
		return hp
	}
	out, err := harness.Command(ctx, "go", "tool", "pprof", "-top", "-nodecount=20", "-sample_index=inuse_space", e.UproxyBin, data)
	if err != nil {
		hp.NA = "go tool pprof: " + err.Error()
		return hp
	}
	hp.Top = harness.TrimPprof(out)
	return hp
}

// logDir is the folder of a run's process logs: a temporary folder named
// after the report, outside the results folder, which holds only .md,
// .json and .png files (TestResultsFileTypes).
func logDir(cfg harness.Config) string {
	return filepath.Join(os.TempDir(), "bench-logs-"+cfg.Stem)
}

// maxKeptOutput bounds the output keepOutput writes: the last bytes are
// the ones that say what went wrong.
const maxKeptOutput = 1 << 20

// keepOutput writes a process's output to path, at most its last
// maxKeptOutput bytes.
func keepOutput(path, output string) error {
	if len(output) > maxKeptOutput {
		output = output[len(output)-maxKeptOutput:]
	}
	if err := os.WriteFile(path, []byte(output), 0o644); err != nil {
		return fmt.Errorf("keeping the output: %w", err)
	}
	return nil
}

// runningChildren returns the child processes of pid that are running, read
// from procfs (normally /proc), each as its command line and how long it
// has run: "iptables-restore -w 5 --noflush --counters (for 4m50s)". A
// child of any of pid's threads counts (a Go program forks from any).
func runningChildren(procfs string, pid int) ([]string, error) {
	tasks, err := filepath.Glob(filepath.Join(procfs, strconv.Itoa(pid), "task", "*", "children"))
	if err != nil {
		return nil, fmt.Errorf("listing the threads of %d: %w", pid, err)
	}
	b, err := os.ReadFile(filepath.Join(procfs, "uptime"))
	if err != nil {
		return nil, fmt.Errorf("reading the uptime: %w", err)
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return nil, fmt.Errorf("%s/uptime is empty", procfs)
	}
	uptime, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return nil, fmt.Errorf("%s/uptime: %w", procfs, err)
	}
	var out []string
	for _, task := range tasks {
		b, err := os.ReadFile(task)
		if err != nil {
			continue // the thread has ended
		}
		for _, child := range strings.Fields(string(b)) {
			cmdline, started, err := procInfo(procfs, child)
			if err != nil {
				continue // the child has ended
			}
			ran := time.Duration((uptime - started) * float64(time.Second)).Round(time.Second)
			out = append(out, fmt.Sprintf("%s (for %v)", cmdline, max(ran, 0)))
		}
	}
	return out, nil
}

// procInfo returns process pid's command line and when it started, in
// seconds since boot.
func procInfo(procfs, pid string) (cmdline string, started float64, err error) {
	b, err := os.ReadFile(filepath.Join(procfs, pid, "cmdline"))
	if err != nil {
		return "", 0, err
	}
	cmdline = strings.Join(strings.FieldsFunc(string(b), func(r rune) bool { return r == 0 }), " ")
	stat, err := os.ReadFile(filepath.Join(procfs, pid, "stat"))
	if err != nil {
		return "", 0, err
	}
	// The command name, in parentheses, may hold spaces: the fields that
	// follow it start at field 3 (state); the start time is field 22.
	i := strings.LastIndexByte(string(stat), ')')
	if i < 0 {
		return "", 0, fmt.Errorf("%s/%s/stat: no command name", procfs, pid)
	}
	fields := strings.Fields(string(stat[i+1:]))
	if len(fields) < 20 {
		return "", 0, fmt.Errorf("%s/%s/stat: %d fields after the command name, want at least 20", procfs, pid, len(fields))
	}
	ticks, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return "", 0, fmt.Errorf("%s/%s/stat: start time: %w", procfs, pid, err)
	}
	return cmdline, float64(ticks) / harness.UserHZ, nil
}

// afterLists returns, from uproxy's log, the seconds from "initial lists
// received" to the end of the first sync that followed ("synced"): how
// long uproxy took to program everything once the informers had listed
// it. Each log line starts with its ISO 8601 timestamp.
func afterLists(log string) (float64, error) {
	var lists time.Time
	for line := range strings.Lines(log) {
		ts, rest, ok := strings.Cut(line, "\t")
		if !ok {
			continue
		}
		switch {
		case lists.IsZero() && strings.Contains(rest, "\tinitial lists received"):
			t, err := time.Parse(time.RFC3339Nano, ts)
			if err != nil {
				return 0, fmt.Errorf("timestamp %q: %w", ts, err)
			}
			lists = t
		case !lists.IsZero() && strings.Contains(rest, "\tsynced\t"):
			t, err := time.Parse(time.RFC3339Nano, ts)
			if err != nil {
				return 0, fmt.Errorf("timestamp %q: %w", ts, err)
			}
			return t.Sub(lists).Seconds(), nil
		}
	}
	return 0, errors.New(`no "synced" line after "initial lists received"`)
}

// head returns the first n lines of s.
func head(s string, n int) string {
	var b strings.Builder
	for line := range strings.Lines(s) {
		if n == 0 {
			break
		}
		b.WriteString(line)
		n--
	}
	return b.String()
}
