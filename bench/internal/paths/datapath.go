package paths

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/uproxy/uproxy/bench/internal/harness"

	"github.com/uproxy/uproxy/bench/internal/results"

	"github.com/uproxy/uproxy/bench/internal/load"
)

// KernelCPU says why a path has no CPU cost per unit of work.
const KernelCPU = "no process carries the traffic: the kernel does, in the softirq of whichever process sends a packet (see Where the CPU goes)"

// WorkloadIDs are the data-path workloads, in the order they run;
// WorkloadMetrics maps each to the metrics it measures.
var (
	WorkloadIDs     = []string{"bulk", "rr", "short", "udp", "dns", "idle"}
	WorkloadMetrics = map[string][]string{
		"bulk":  {"bulk_gbps", "bulk_cpu_us"},
		"rr":    {"rr_rps", "rr_p50_us", "rr_p99_us", "rr_cpu_us"},
		"short": {"short_cps", "short_cpu_us"},
		"udp":   {"udp_rps", "udp_p99_us", "udp_cpu_us"},
		"dns":   {"dns_rps", "dns_p99_us", "dns_cpu_us"},
		"idle":  {"idle_kib", "idle_fds"},
	}
)

func Run(ctx context.Context, e *harness.Env) error {
	cfg := e.Config
	paths := selectedPaths(cfg)
	res := &results.DataPathResults{
		Meta:          harness.NewRunMeta(e, fmt.Sprintf("%d runs, %v per workload, %d connections, %d idle connections", cfg.Runs, cfg.Duration, cfg.Conns, cfg.IdleConns)),
		Metrics:       results.DataPathMetrics,
		Figures:       map[string]map[string]*results.Series{},
		Profiles:      map[string]*results.Profile{},
		ShortProfiles: map[string]*results.Profile{},
		UDPProfiles:   map[string]*results.Profile{},
		DNSProfiles:   map[string]*results.Profile{},
		BulkProfiles:  map[string]*results.Profile{},
		Duration:      cfg.Duration.String(),
		Conns:         cfg.Conns,
		IdleConns:     cfg.IdleConns,
		IdleNote:      cfg.IdleNote,
	}
	for _, p := range paths {
		res.Paths = append(res.Paths, p.Subject)
	}
	if e.Baseline != nil {
		res.Baseline = &results.BaselineInfo{From: e.Baseline.From, Commit: e.Baseline.Commit}
	}
	var k *harness.KubeEnv
	for _, p := range paths {
		if strings.HasPrefix(p.ID, "kp-") {
			if k = e.Kube(ctx); k.Err != nil {
				e.Logf("no control plane, so no kube-proxy: %v", k.Err)
			}
			defer func() {
				if err := k.DeleteBenchService(ctx); err != nil {
					e.Logf("%v", err)
				}
			}()
			break
		}
	}
	if !cfg.NoProfile {
		if res.ProfileNA = harness.PerfAvailable(ctx); res.ProfileNA == "" {
			res.PerfCounters = harness.PerfCounters(ctx)
		}
	}
	// Runs are interleaved (every path in run 1, then in run 2, …), so that
	// a change in the machine's load spreads over every path alike, and
	// every other run takes the paths in reverse order, so that no path
	// always runs right after the same one: in the runs of
	// bench/results/history/2026-11-30-udp-listeners.md, two builds of the
	// same TCP code, measured one after the other, differed by up to 15%.
	step, steps := 0, cfg.Runs*len(paths)
	for run := 1; run <= cfg.Runs; run++ {
		order := paths
		if run%2 == 0 {
			order = slices.Clone(paths)
			slices.Reverse(order)
		}
		for _, p := range order {
			step++
			if ctx.Err() != nil {
				return ctx.Err()
			}
			where := fmt.Sprintf("[%d/%d] run %d %s", step, steps, run, p.ID)
			start := time.Now()
			err := measurePath(ctx, e, res, p, k, run, where)
			e.Logf("%s: %v", where, time.Since(start).Round(100*time.Millisecond))
			if err != nil {
				if n, ok := harness.ErrNA(err); ok {
					res.SetNA(p.ID, n.Reason)
					e.Logf("%s: n/a: %s", where, n.Reason)
					continue
				}
				if ctx.Err() != nil {
					return ctx.Err()
				}
				msg := fmt.Sprintf("run %d %s: %v", run, p.ID, err)
				res.Meta.Errors = append(res.Meta.Errors, msg)
				e.Logf("%s: FAILED: %v", where, err)
			}
		}
	}
	// Workloads left out have no figure, nor does a path that failed in
	// every run: say so.
	for _, w := range WorkloadIDs {
		if !cfg.Measures(w) {
			for _, p := range paths {
				res.SetNA(p.ID, "not measured in this run (--workloads)", WorkloadMetrics[w]...)
			}
		}
	}
	for _, p := range paths {
		for _, m := range res.Metrics {
			if s := res.Series(m.ID, p.ID); !s.Filled() {
				s.NA = "error: every run failed (see the errors below)"
			}
		}
	}
	res.Meta.Finish()
	return harness.WriteJSON(cfg, "datapath.json", res)
}

// measurePath runs every workload through p once: the idle connections
// in a fresh lab of their own (measureIdle), the others in another.
func measurePath(ctx context.Context, e *harness.Env, res *results.DataPathResults, p dataPath, k *harness.KubeEnv, run int, where string) error {
	userspace, err := measureLoads(ctx, e, res, p, k, run, where)
	if err != nil || !userspace || !e.Config.Measures("idle") {
		return err
	}
	return measureIdle(ctx, e, res, p, k, run, where)
}

// startPath builds a fresh lab and sets p up in it, ready for traffic.
// The caller calls stop.
func startPath(ctx context.Context, e *harness.Env, p dataPath, k *harness.KubeEnv, where string) (t *harness.Topo, r *harness.PathRun, stop func(), err error) {
	t, err = harness.NewTopo(ctx, e, 2, nil)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("building the lab: %w", err)
	}
	r, err = p.setup(ctx, e, t, k)
	if err != nil {
		t.Close()
		return nil, nil, nil, err
	}
	stop = func() {
		harness.StopProc(r.Proc, 5*time.Second)
		t.Close()
	}
	readyTimeout := 30 * time.Second
	if r.Proc != nil && r.Comm == "kube-proxy" {
		readyTimeout = 90 * time.Second
	}
	start := time.Now()
	if err := harness.WaitReady(ctx, e, t, r, readyTimeout); err != nil {
		stop()
		return nil, nil, nil, err
	}
	e.Logf("%s: ready in %v", where, time.Since(start).Round(time.Millisecond))
	return t, r, stop, nil
}

// measureLoads runs the bulk, keep-alive, short-connection and UDP
// workloads through p (those Config.Workloads selects), and profiles it;
// userspace reports whether a proxy process carries the connections (and
// measureIdle has one to measure).
func measureLoads(ctx context.Context, e *harness.Env, res *results.DataPathResults, p dataPath, k *harness.KubeEnv, run int, where string) (userspace bool, err error) {
	cfg := e.Config
	t, r, stop, err := startPath(ctx, e, p, k, where)
	if err != nil {
		return false, err
	}
	defer stop()
	d := cfg.Duration.String()
	warm := (cfg.Duration / 5).String()
	conns := strconv.Itoa(cfg.Conns)
	note := func(workload string, lr load.LoadResult) {
		if lr.Errors > 0 {
			res.Notes = append(res.Notes, fmt.Sprintf("run %d, %s, %s: %d errors (first: %s)", run, p.ID, workload, lr.Errors, lr.FirstError))
		}
	}
	// cost records the proxy's CPU per unit of work over one workload's
	// run (units: every op, or MiB), or why there is none.
	cost := func(metric string, m *harness.CPUMeter, units float64) {
		if m == nil {
			res.SetNA(p.ID, KernelCPU, metric)
			return
		}
		v, err := m.Per(units)
		if err != nil {
			res.Notes = append(res.Notes, fmt.Sprintf("run %d, %s, %s: %v", run, p.ID, metric, err))
			return
		}
		res.Series(metric, p.ID).Add(v)
	}
	targets := func(ts []string) []string {
		var out []string
		for _, t := range ts {
			out = append(out, "--target", t)
		}
		return out
	}

	var lr load.LoadResult
	// Bulk.
	if cfg.Measures("bulk") {
		m := harness.StartCPU(r)
		lr, err = t.Load(ctx, e, "bulk", append(targets(r.Bulk), "--duration", d)...)
		if err != nil || lr.Bytes == 0 {
			return false, fmt.Errorf("bulk: %v %s", err, lr.FirstError)
		}
		res.Series("bulk_gbps", p.ID).Add(lr.Gbps)
		cost("bulk_cpu_us", m, float64(lr.Bytes)/(1<<20))
		note("bulk", lr)
		e.Logf("%s bulk: %.2f Gbit/s", where, lr.Gbps)
	}

	// Keep-alive request/response.
	if cfg.Measures("rr") {
		m := harness.StartCPU(r)
		lr, err = t.Load(ctx, e, "rr", append(targets(r.RR), "--duration", d, "--warmup", warm, "--conns", conns)...)
		if err != nil || lr.Ops == 0 {
			return false, fmt.Errorf("keep-alive: %v %s", err, lr.FirstError)
		}
		res.Series("rr_rps", p.ID).Add(lr.Rate)
		res.Series("rr_p50_us", p.ID).Add(lr.P50us)
		res.Series("rr_p99_us", p.ID).Add(lr.P99us)
		cost("rr_cpu_us", m, float64(lr.AllOps))
		note("keep-alive", lr)
		e.Logf("%s keep-alive: %.0f req/s, p50 %.0fµs, p99 %.0fµs", where, lr.Rate, lr.P50us, lr.P99us)
	}

	// Short connections.
	if cfg.Measures("short") {
		m := harness.StartCPU(r)
		lr, err = t.Load(ctx, e, "short", append(targets(r.RR), "--duration", d, "--warmup", warm, "--conns", conns)...)
		if err != nil || lr.Ops == 0 {
			return false, fmt.Errorf("short connections: %v %s", err, lr.FirstError)
		}
		res.Series("short_cps", p.ID).Add(lr.Rate)
		cost("short_cpu_us", m, float64(lr.AllOps))
		note("short", lr)
		e.Logf("%s short connections: %.0f conn/s", where, lr.Rate)
	}

	// UDP: long-lived sockets, then one new socket per query.
	udpOK, dnsOK := false, false
	for _, u := range []struct {
		workload, rate, p99, cpu, what string
		extra                          []string
	}{
		{"udp", "udp_rps", "udp_p99_us", "udp_cpu_us", "udp", nil},
		{"dns", "dns_rps", "dns_p99_us", "dns_cpu_us", "udp, a new port per query", []string{"--new-socket"}},
	} {
		if !cfg.Measures(u.workload) {
			continue
		}
		if len(r.UDP) == 0 {
			res.SetNA(p.ID, r.UDPNA, u.rate, u.p99, u.cpu)
			e.Logf("%s %s: n/a: %s", where, u.what, r.UDPNA)
			continue
		}
		if _, err := t.Probe(ctx, e, r.UDP[0], true, "", 3*time.Second); err != nil {
			if !strings.HasPrefix(p.ID, "uproxy") {
				return false, fmt.Errorf("%s: the service does not answer: %w", u.what, err)
			}
			reason := "not implemented (a UDP service through uproxy does not answer)"
			res.SetNA(p.ID, reason, u.rate, u.p99, u.cpu)
			e.Logf("%s %s: n/a: %s", where, u.what, reason)
			continue
		}
		args := append(append(targets(r.UDP), "--duration", d, "--warmup", warm, "--conns", conns), u.extra...)
		m := harness.StartCPU(r)
		lr, err = t.Load(ctx, e, "udp", args...)
		if err != nil || lr.Ops == 0 {
			return false, fmt.Errorf("%s: %v %s", u.what, err, lr.FirstError)
		}
		res.Series(u.rate, p.ID).Add(lr.Rate)
		res.Series(u.p99, p.ID).Add(lr.P99us)
		cost(u.cpu, m, float64(lr.AllOps))
		note(u.workload, lr)
		udpOK = udpOK || u.workload == "udp"
		dnsOK = dnsOK || u.workload == "dns"
		e.Logf("%s %s: %.0f req/s, p99 %.0fµs", where, u.what, lr.Rate, lr.P99us)
	}

	// Idle connections: measured by measureIdle, on a fresh proxy, for a
	// proxy process.
	switch {
	case r.Userspace, !cfg.Measures("idle"):
	case p.ID == "dnat":
		if size, err := conntrackObjSize(); err == nil {
			res.Series("idle_kib", p.ID).Add(float64(size) / 1024)
			e.Logf("%s idle: kernel only: one conntrack entry of %d bytes per connection", where, size)
		} else {
			res.SetNA(p.ID, "no proxy process; the kernel's conntrack entry size is unknown: "+err.Error(), "idle_kib")
		}
		res.SetNA(p.ID, "no process carries the connections", "idle_fds")
	default:
		res.SetNA(p.ID, "no process carries the connections (the kernel does: see the DNAT row)", "idle_kib", "idle_fds")
	}

	// Smoke mode profiles one kernel path and uproxy: enough to check that
	// perf and pprof work.
	if run == 1 && !cfg.NoProfile && (!cfg.Smoke || p.ID == "dnat" || p.ID == "uproxy") {
		if cfg.Measures("rr") {
			prof := harness.ProfilePath(ctx, e, t, r, res.ProfileNA, "rr", append(targets(r.RR), "--conns", conns))
			res.Profiles[p.ID] = prof
			e.Logf("%s keep-alive profile: %s", where, prof.Summary())
		}
		if cfg.Measures("short") {
			prof := harness.ProfilePath(ctx, e, t, r, res.ProfileNA, "short", append(targets(r.RR), "--conns", conns))
			res.ShortProfiles[p.ID] = prof
			e.Logf("%s short-connection profile: %s", where, prof.Summary())
		}
		if udpOK {
			prof := harness.ProfilePath(ctx, e, t, r, res.ProfileNA, "udp", append(targets(r.UDP), "--conns", conns))
			res.UDPProfiles[p.ID] = prof
			e.Logf("%s UDP profile: %s", where, prof.Summary())
		}
		if dnsOK {
			prof := harness.ProfilePath(ctx, e, t, r, res.ProfileNA, "udp", append(targets(r.UDP), "--conns", conns, "--new-socket"))
			res.DNSProfiles[p.ID] = prof
			e.Logf("%s UDP new-port profile: %s", where, prof.Summary())
		}
		if cfg.Measures("bulk") {
			prof := harness.ProfilePath(ctx, e, t, r, res.ProfileNA, "bulk", targets(r.Bulk))
			res.BulkProfiles[p.ID] = prof
			e.Logf("%s bulk profile: %s", where, prof.Summary())
		}
	}
	return r.Userspace, nil
}

// measureIdle opens the idle connections through p, set up afresh in a
// lab of its own, and records what they cost the proxy process. A proxy
// that has carried the other workloads holds memory it freed but kept
// (a Go heap, allocator arenas), which the idle connections would reuse
// and hide; and its growth from a fresh start is what a new proxy pays.
func measureIdle(ctx context.Context, e *harness.Env, res *results.DataPathResults, p dataPath, k *harness.KubeEnv, run int, where string) error {
	cfg := e.Config
	t, r, stop, err := startPath(ctx, e, p, k, where+" (idle)")
	if err != nil {
		return err
	}
	defer stop()
	idle, err := idleConnections(ctx, e, t, r)
	if err != nil {
		return fmt.Errorf("idle connections: %w\n%s output:\n%s", err, r.Proc.Name, harness.Tail(r.Proc.Output(), 10))
	}
	res.Series("idle_kib", p.ID).Add(idle.kib)
	res.Series("idle_fds", p.ID).Add(idle.fds)
	e.Logf("%s idle: %.1f KiB and %.1f descriptors per connection (%d connections)", where, idle.kib, idle.fds, idle.established)
	if idle.established < cfg.IdleConns {
		note := fmt.Sprintf("run %d, %s, idle: %d of %d connections established, and the figures are per established connection; then connections failed, and the load stopped (first error: %s)",
			run, p.ID, idle.established, cfg.IdleConns, idle.firstError)
		if line := harness.LastMatching(r.Proc.Output(), "too many open files"); line != "" {
			note += fmt.Sprintf("; %s ran out of file descriptors (its limit is %d)", r.Comm, e.NoFile)
		}
		res.Notes = append(res.Notes, note)
		e.Logf("%s idle: %s", where, note)
	}
	return nil
}

// idleResult is what idle connections cost the proxy process.
type idleResult struct {
	established int
	firstError  string
	// kib and fds are the growth of the proxy's RSS and open descriptors,
	// per established connection.
	kib, fds float64
}

// idleConnections opens the idle connections through r and measures the
// proxy process's growth per connection. Connections that fail (a proxy
// out of descriptors, say) are left out; under 1% established is an error.
func idleConnections(ctx context.Context, e *harness.Env, t *harness.Topo, r *harness.PathRun) (idleResult, error) {
	var res idleResult
	pid := r.Proc.Cmd.Process.Pid
	before, err := settledRSS(pid)
	if err != nil {
		return res, err
	}
	fdsBefore := openFiles(pid)
	args := []string{e.LoadBin, "load", "idle", "--conns", strconv.Itoa(e.Config.IdleConns), "--hold", "3m"}
	for _, tg := range r.RR {
		args = append(args, "--target", tg)
	}
	p, err := t.Lab.Start(t.Client.NS, "idle-load", args...)
	if err != nil {
		return res, err
	}
	defer harness.StopProc(p, 10*time.Second)
	var lr load.LoadResult
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if err := harness.DecodeLine(p.Output(), &lr); err == nil {
			break
		}
		if p.Exited() || time.Now().After(deadline) || ctx.Err() != nil {
			return res, fmt.Errorf("the idle load did not report: %s", harness.Tail(p.Output(), 5))
		}
		time.Sleep(50 * time.Millisecond)
	}
	res.established, res.firstError = lr.Established, lr.FirstError
	if lr.Established < max(1, e.Config.IdleConns/100) {
		return res, fmt.Errorf("only %d of %d connections established (first error: %s)", lr.Established, e.Config.IdleConns, lr.FirstError)
	}
	time.Sleep(500 * time.Millisecond) // let the proxy settle
	after, err := harness.RSSKiB(pid)
	if err != nil {
		return res, err
	}
	res.kib = float64(after-before) / float64(lr.Established)
	res.fds = float64(openFiles(pid)-fdsBefore) / float64(lr.Established)
	return res, nil
}

// settledRSS returns pid's resident memory once it has stopped moving
// (two readings 500 ms apart within 64 KiB, for at most 5 s): a freshly
// started proxy is still allocating, or giving back what its start-up
// used, and a baseline taken then would skew the growth measured from it.
func settledRSS(pid int) (int64, error) {
	prev, err := harness.RSSKiB(pid)
	for range 10 {
		if err != nil {
			return 0, err
		}
		time.Sleep(500 * time.Millisecond)
		var cur int64
		if cur, err = harness.RSSKiB(pid); err == nil && cur-prev < 64 && prev-cur < 64 {
			return cur, nil
		}
		prev = cur
	}
	return prev, err
}

// openFiles counts the open descriptors of pid and its descendants.
func openFiles(pid int) int {
	n := 0
	for _, p := range append([]int{pid}, harness.Descendants(pid)...) {
		if ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p)); err == nil {
			n += len(ents)
		}
	}
	return n
}

// conntrackObjSize returns the size of a conntrack entry (the
// nf_conntrack slab's object size).
func conntrackObjSize() (int, error) {
	b, err := os.ReadFile("/proc/slabinfo")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[0] == "nf_conntrack" {
			return strconv.Atoi(f[3])
		}
	}
	return 0, fmt.Errorf("no nf_conntrack slab in /proc/slabinfo")
}
