package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// dataMetrics are the data-path figures, in report order.
var dataMetrics = []Metric{
	{"bulk_gbps", "Bulk single-stream TCP throughput", "Gbit/s", true},
	{"rr_rps", "Keep-alive request/response rate", "req/s", true},
	{"rr_p50_us", "Keep-alive request/response latency, p50", "µs", false},
	{"rr_p99_us", "Keep-alive request/response latency, p99", "µs", false},
	{"short_cps", "Short-connection rate (connect, one request, close)", "conn/s", true},
	{"udp_rps", "UDP request/response rate", "req/s", true},
	{"udp_p99_us", "UDP request/response latency, p99", "µs", false},
	{"dns_rps", "UDP queries from a new port each (DNS-like)", "req/s", true},
	{"dns_p99_us", "UDP queries from a new port each, latency p99", "µs", false},
	{"idle_kib", "Memory per idle connection", "KiB/conn", false},
	{"idle_fds", "File descriptors per idle connection", "fd/conn", false},
	{"bulk_cpu_us", "Proxy CPU per MiB carried (bulk)", "µs/MiB", false},
	{"rr_cpu_us", "Proxy CPU per keep-alive request", "µs/req", false},
	{"short_cpu_us", "Proxy CPU per short connection", "µs/conn", false},
	{"udp_cpu_us", "Proxy CPU per UDP request", "µs/req", false},
	{"dns_cpu_us", "Proxy CPU per UDP query from a new port", "µs/req", false},
}

// costMetrics maps a rate to the proxy's CPU per unit of it, which the
// summary's cost table puts next to it.
var costMetrics = []struct{ rate, cpu string }{
	{"bulk_gbps", "bulk_cpu_us"},
	{"rr_rps", "rr_cpu_us"},
	{"short_cps", "short_cpu_us"},
	{"udp_rps", "udp_cpu_us"},
	{"dns_rps", "dns_cpu_us"},
}

// isCost reports whether metric is a CPU cost per unit of work.
func isCost(metric string) bool {
	return slices.ContainsFunc(costMetrics, func(c struct{ rate, cpu string }) bool { return c.cpu == metric })
}

// kernelCPU says why a path has no CPU cost per unit of work.
const kernelCPU = "no process carries the traffic: the kernel does, in the softirq of whichever process sends a packet (see Where the CPU goes)"

// workloadIDs are the data-path workloads, in the order they run;
// workloadMetrics maps each to the metrics it measures.
var (
	workloadIDs     = []string{"bulk", "rr", "short", "udp", "dns", "idle"}
	workloadMetrics = map[string][]string{
		"bulk":  {"bulk_gbps", "bulk_cpu_us"},
		"rr":    {"rr_rps", "rr_p50_us", "rr_p99_us", "rr_cpu_us"},
		"short": {"short_cps", "short_cpu_us"},
		"udp":   {"udp_rps", "udp_p99_us", "udp_cpu_us"},
		"dns":   {"dns_rps", "dns_p99_us", "dns_cpu_us"},
		"idle":  {"idle_kib", "idle_fds"},
	}
)

// DataPathResults is the datapath part's output (datapath.json).
type DataPathResults struct {
	Meta    RunMeta   `json:"meta"`
	Paths   []Subject `json:"paths"`
	Metrics []Metric  `json:"metrics"`
	// Figures maps a metric id and a path id to its series.
	Figures map[string]map[string]*Series `json:"figures"`
	// Profiles maps a path id to where its CPU went during the keep-alive
	// workload.
	Profiles map[string]*Profile `json:"profiles"`
	// ShortProfiles maps a path id to where its CPU went during the
	// short-connection workload.
	ShortProfiles map[string]*Profile `json:"shortProfiles,omitempty"`
	// UDPProfiles maps a path id to where its CPU went during the UDP
	// workload, for the paths that carry UDP.
	UDPProfiles map[string]*Profile `json:"udpProfiles,omitempty"`
	// DNSProfiles maps a path id to where its CPU went during the UDP
	// queries from a new port each (the dns workload).
	DNSProfiles map[string]*Profile `json:"dnsProfiles,omitempty"`
	// BulkProfiles maps a path id to where its CPU went during the bulk
	// workload; their Rate is in MiB/s, so the CPU is per MiB carried.
	BulkProfiles map[string]*Profile `json:"bulkProfiles,omitempty"`
	// ProfileNA says why there are no perf profiles, if so.
	ProfileNA string `json:"profileNA,omitempty"`
	// PerfCounters says whether perf's hardware counters work here.
	PerfCounters string `json:"perfCounters,omitempty"`
	// Errors per workload that still produced a figure (UDP losses,
	// failed connections), for the report's notes.
	Notes []string `json:"notes,omitempty"`
	// Settings of the workloads.
	Duration  string `json:"duration"`
	Conns     int    `json:"conns"`
	IdleConns int    `json:"idleConns"`
	// IdleNote says why IdleConns is lower than asked, if it is.
	IdleNote string `json:"idleNote,omitempty"`
	// Baseline is the binary that the <id>-baseline paths ran, if any.
	Baseline *BaselineInfo `json:"baseline,omitempty"`
}

// BaselineInfo says which uproxy binary the baseline paths ran.
type BaselineInfo struct {
	// From is the flag that named it: "--baseline PATH" or
	// "--baseline-rev REV".
	From string `json:"from"`
	// Commit is the commit it was built from, or "unknown".
	Commit string `json:"commit"`
}

func (r *DataPathResults) series(metric, path string) *Series {
	m := r.Figures[metric]
	if m == nil {
		m = map[string]*Series{}
		r.Figures[metric] = m
	}
	s := m[path]
	if s == nil {
		s = &Series{}
		m[path] = s
	}
	return s
}

// setNA marks every figure of path that has no value yet as n/a.
func (r *DataPathResults) setNA(path, reason string, metrics ...string) {
	if len(metrics) == 0 {
		for _, m := range r.Metrics {
			metrics = append(metrics, m.ID)
		}
	}
	for _, m := range metrics {
		if s := r.series(m, path); len(s.Values) == 0 && s.NA == "" {
			s.NA = reason
		}
	}
}

func runDataPath(ctx context.Context, e *env) error {
	cfg := e.cfg
	paths := cfg.selectedPaths()
	res := &DataPathResults{
		Meta:          newRunMeta(e, fmt.Sprintf("%d runs, %v per workload, %d connections, %d idle connections", cfg.Runs, cfg.Duration, cfg.Conns, cfg.IdleConns)),
		Metrics:       dataMetrics,
		Figures:       map[string]map[string]*Series{},
		Profiles:      map[string]*Profile{},
		ShortProfiles: map[string]*Profile{},
		UDPProfiles:   map[string]*Profile{},
		DNSProfiles:   map[string]*Profile{},
		BulkProfiles:  map[string]*Profile{},
		Duration:      cfg.Duration.String(),
		Conns:         cfg.Conns,
		IdleConns:     cfg.IdleConns,
		IdleNote:      cfg.IdleNote,
	}
	for _, p := range paths {
		res.Paths = append(res.Paths, p.Subject)
	}
	if e.baseline != nil {
		res.Baseline = &BaselineInfo{From: e.baseline.from, Commit: e.baseline.commit}
	}
	var k *kubeEnv
	for _, p := range paths {
		if strings.HasPrefix(p.ID, "kp-") {
			if k = e.kube(ctx); k.err != nil {
				e.logf("no control plane, so no kube-proxy: %v", k.err)
			}
			defer func() {
				if err := k.deleteBenchService(ctx); err != nil {
					e.logf("%v", err)
				}
			}()
			break
		}
	}
	if !cfg.NoProfile {
		if res.ProfileNA = perfAvailable(ctx); res.ProfileNA == "" {
			res.PerfCounters = perfCounters(ctx)
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
			e.logf("%s: %v", where, time.Since(start).Round(100*time.Millisecond))
			if err != nil {
				if n, ok := errNA(err); ok {
					res.setNA(p.ID, n.reason)
					e.logf("%s: n/a: %s", where, n.reason)
					continue
				}
				if ctx.Err() != nil {
					return ctx.Err()
				}
				msg := fmt.Sprintf("run %d %s: %v", run, p.ID, err)
				res.Meta.Errors = append(res.Meta.Errors, msg)
				e.logf("%s: FAILED: %v", where, err)
			}
		}
	}
	// Workloads left out have no figure, nor does a path that failed in
	// every run: say so.
	for _, w := range workloadIDs {
		if !cfg.measures(w) {
			for _, p := range paths {
				res.setNA(p.ID, "not measured in this run (--workloads)", workloadMetrics[w]...)
			}
		}
	}
	for _, p := range paths {
		for _, m := range res.Metrics {
			if s := res.series(m.ID, p.ID); !s.filled() {
				s.NA = "error: every run failed (see the errors below)"
			}
		}
	}
	res.Meta.finish()
	return writeJSON(cfg, "datapath.json", res)
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// measurePath runs every workload through p once: the idle connections
// in a fresh lab of their own (measureIdle), the others in another.
func measurePath(ctx context.Context, e *env, res *DataPathResults, p dataPath, k *kubeEnv, run int, where string) error {
	userspace, err := measureLoads(ctx, e, res, p, k, run, where)
	if err != nil || !userspace || !e.cfg.measures("idle") {
		return err
	}
	return measureIdle(ctx, e, res, p, k, run, where)
}

// startPath builds a fresh lab and sets p up in it, ready for traffic.
// The caller calls stop.
func startPath(ctx context.Context, e *env, p dataPath, k *kubeEnv, where string) (t *topo, r *pathRun, stop func(), err error) {
	t, err = newTopo(ctx, e, 2, nil)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("building the lab: %w", err)
	}
	r, err = p.setup(ctx, e, t, k)
	if err != nil {
		t.close()
		return nil, nil, nil, err
	}
	stop = func() {
		stopProc(r.proc, 5*time.Second)
		t.close()
	}
	readyTimeout := 30 * time.Second
	if r.proc != nil && r.comm == "kube-proxy" {
		readyTimeout = 90 * time.Second
	}
	start := time.Now()
	if err := waitReady(ctx, e, t, r, readyTimeout); err != nil {
		stop()
		return nil, nil, nil, err
	}
	e.logf("%s: ready in %v", where, time.Since(start).Round(time.Millisecond))
	return t, r, stop, nil
}

// measureLoads runs the bulk, keep-alive, short-connection and UDP
// workloads through p (those Config.Workloads selects), and profiles it;
// userspace reports whether a proxy process carries the connections (and
// measureIdle has one to measure).
func measureLoads(ctx context.Context, e *env, res *DataPathResults, p dataPath, k *kubeEnv, run int, where string) (userspace bool, err error) {
	cfg := e.cfg
	t, r, stop, err := startPath(ctx, e, p, k, where)
	if err != nil {
		return false, err
	}
	defer stop()
	d := cfg.Duration.String()
	warm := (cfg.Duration / 5).String()
	conns := strconv.Itoa(cfg.Conns)
	note := func(workload string, lr LoadResult) {
		if lr.Errors > 0 {
			res.Notes = append(res.Notes, fmt.Sprintf("run %d, %s, %s: %d errors (first: %s)", run, p.ID, workload, lr.Errors, lr.FirstError))
		}
	}
	// cost records the proxy's CPU per unit of work over one workload's
	// run (units: every op, or MiB), or why there is none.
	cost := func(metric string, m *cpuMeter, units float64) {
		if m == nil {
			res.setNA(p.ID, kernelCPU, metric)
			return
		}
		v, err := m.per(units)
		if err != nil {
			res.Notes = append(res.Notes, fmt.Sprintf("run %d, %s, %s: %v", run, p.ID, metric, err))
			return
		}
		res.series(metric, p.ID).add(v)
	}
	targets := func(ts []string) []string {
		var out []string
		for _, t := range ts {
			out = append(out, "--target", t)
		}
		return out
	}

	var lr LoadResult
	// Bulk.
	if cfg.measures("bulk") {
		m := startCPU(r)
		lr, err = t.load(ctx, e, "bulk", append(targets(r.bulk), "--duration", d)...)
		if err != nil || lr.Bytes == 0 {
			return false, fmt.Errorf("bulk: %v %s", err, lr.FirstError)
		}
		res.series("bulk_gbps", p.ID).add(lr.Gbps)
		cost("bulk_cpu_us", m, float64(lr.Bytes)/(1<<20))
		note("bulk", lr)
		e.logf("%s bulk: %.2f Gbit/s", where, lr.Gbps)
	}

	// Keep-alive request/response.
	if cfg.measures("rr") {
		m := startCPU(r)
		lr, err = t.load(ctx, e, "rr", append(targets(r.rr), "--duration", d, "--warmup", warm, "--conns", conns)...)
		if err != nil || lr.Ops == 0 {
			return false, fmt.Errorf("keep-alive: %v %s", err, lr.FirstError)
		}
		res.series("rr_rps", p.ID).add(lr.Rate)
		res.series("rr_p50_us", p.ID).add(lr.P50us)
		res.series("rr_p99_us", p.ID).add(lr.P99us)
		cost("rr_cpu_us", m, float64(lr.AllOps))
		note("keep-alive", lr)
		e.logf("%s keep-alive: %.0f req/s, p50 %.0fµs, p99 %.0fµs", where, lr.Rate, lr.P50us, lr.P99us)
	}

	// Short connections.
	if cfg.measures("short") {
		m := startCPU(r)
		lr, err = t.load(ctx, e, "short", append(targets(r.rr), "--duration", d, "--warmup", warm, "--conns", conns)...)
		if err != nil || lr.Ops == 0 {
			return false, fmt.Errorf("short connections: %v %s", err, lr.FirstError)
		}
		res.series("short_cps", p.ID).add(lr.Rate)
		cost("short_cpu_us", m, float64(lr.AllOps))
		note("short", lr)
		e.logf("%s short connections: %.0f conn/s", where, lr.Rate)
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
		if !cfg.measures(u.workload) {
			continue
		}
		if len(r.udp) == 0 {
			res.setNA(p.ID, r.udpNA, u.rate, u.p99, u.cpu)
			e.logf("%s %s: n/a: %s", where, u.what, r.udpNA)
			continue
		}
		if _, err := t.probe(ctx, e, r.udp[0], true, "", 3*time.Second); err != nil {
			if !strings.HasPrefix(p.ID, "uproxy") {
				return false, fmt.Errorf("%s: the service does not answer: %w", u.what, err)
			}
			reason := "not implemented (a UDP service through uproxy does not answer)"
			res.setNA(p.ID, reason, u.rate, u.p99, u.cpu)
			e.logf("%s %s: n/a: %s", where, u.what, reason)
			continue
		}
		args := append(append(targets(r.udp), "--duration", d, "--warmup", warm, "--conns", conns), u.extra...)
		m := startCPU(r)
		lr, err = t.load(ctx, e, "udp", args...)
		if err != nil || lr.Ops == 0 {
			return false, fmt.Errorf("%s: %v %s", u.what, err, lr.FirstError)
		}
		res.series(u.rate, p.ID).add(lr.Rate)
		res.series(u.p99, p.ID).add(lr.P99us)
		cost(u.cpu, m, float64(lr.AllOps))
		note(u.workload, lr)
		udpOK = udpOK || u.workload == "udp"
		dnsOK = dnsOK || u.workload == "dns"
		e.logf("%s %s: %.0f req/s, p99 %.0fµs", where, u.what, lr.Rate, lr.P99us)
	}

	// Idle connections: measured by measureIdle, on a fresh proxy, for a
	// proxy process.
	switch {
	case r.userspace, !cfg.measures("idle"):
	case p.ID == "dnat":
		if size, err := conntrackObjSize(); err == nil {
			res.series("idle_kib", p.ID).add(float64(size) / 1024)
			e.logf("%s idle: kernel only: one conntrack entry of %d bytes per connection", where, size)
		} else {
			res.setNA(p.ID, "no proxy process; the kernel's conntrack entry size is unknown: "+err.Error(), "idle_kib")
		}
		res.setNA(p.ID, "no process carries the connections", "idle_fds")
	default:
		res.setNA(p.ID, "no process carries the connections (the kernel does: see the DNAT row)", "idle_kib", "idle_fds")
	}

	// Smoke mode profiles one kernel path and uproxy: enough to check that
	// perf and pprof work.
	if run == 1 && !cfg.NoProfile && (!cfg.Smoke || p.ID == "dnat" || p.ID == "uproxy") {
		if cfg.measures("rr") {
			prof := profilePath(ctx, e, t, r, res.ProfileNA, "rr", append(targets(r.rr), "--conns", conns))
			res.Profiles[p.ID] = prof
			e.logf("%s keep-alive profile: %s", where, prof.summary())
		}
		if cfg.measures("short") {
			prof := profilePath(ctx, e, t, r, res.ProfileNA, "short", append(targets(r.rr), "--conns", conns))
			res.ShortProfiles[p.ID] = prof
			e.logf("%s short-connection profile: %s", where, prof.summary())
		}
		if udpOK {
			prof := profilePath(ctx, e, t, r, res.ProfileNA, "udp", append(targets(r.udp), "--conns", conns))
			res.UDPProfiles[p.ID] = prof
			e.logf("%s UDP profile: %s", where, prof.summary())
		}
		if dnsOK {
			prof := profilePath(ctx, e, t, r, res.ProfileNA, "udp", append(targets(r.udp), "--conns", conns, "--new-socket"))
			res.DNSProfiles[p.ID] = prof
			e.logf("%s UDP new-port profile: %s", where, prof.summary())
		}
		if cfg.measures("bulk") {
			prof := profilePath(ctx, e, t, r, res.ProfileNA, "bulk", targets(r.bulk))
			res.BulkProfiles[p.ID] = prof
			e.logf("%s bulk profile: %s", where, prof.summary())
		}
	}
	return r.userspace, nil
}

// measureIdle opens the idle connections through p, set up afresh in a
// lab of its own, and records what they cost the proxy process. A proxy
// that has carried the other workloads holds memory it freed but kept
// (a Go heap, allocator arenas), which the idle connections would reuse
// and hide; and its growth from a fresh start is what a new proxy pays.
func measureIdle(ctx context.Context, e *env, res *DataPathResults, p dataPath, k *kubeEnv, run int, where string) error {
	cfg := e.cfg
	t, r, stop, err := startPath(ctx, e, p, k, where+" (idle)")
	if err != nil {
		return err
	}
	defer stop()
	idle, err := idleConnections(ctx, e, t, r)
	if err != nil {
		return fmt.Errorf("idle connections: %w\n%s output:\n%s", err, r.proc.Name, tail(r.proc.Output(), 10))
	}
	res.series("idle_kib", p.ID).add(idle.kib)
	res.series("idle_fds", p.ID).add(idle.fds)
	e.logf("%s idle: %.1f KiB and %.1f descriptors per connection (%d connections)", where, idle.kib, idle.fds, idle.established)
	if idle.established < cfg.IdleConns {
		note := fmt.Sprintf("run %d, %s, idle: %d of %d connections established, and the figures are per established connection; then connections failed, and the load stopped (first error: %s)",
			run, p.ID, idle.established, cfg.IdleConns, idle.firstError)
		if line := lastMatching(r.proc.Output(), "too many open files"); line != "" {
			note += fmt.Sprintf("; %s ran out of file descriptors (its limit is %d)", r.comm, e.noFile)
		}
		res.Notes = append(res.Notes, note)
		e.logf("%s idle: %s", where, note)
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
func idleConnections(ctx context.Context, e *env, t *topo, r *pathRun) (idleResult, error) {
	var res idleResult
	pid := r.proc.Cmd.Process.Pid
	before, err := settledRSS(pid)
	if err != nil {
		return res, err
	}
	fdsBefore := openFiles(pid)
	args := []string{e.loadBin, "load", "idle", "--conns", strconv.Itoa(e.cfg.IdleConns), "--hold", "3m"}
	for _, tg := range r.rr {
		args = append(args, "--target", tg)
	}
	p, err := t.lab.Start(t.client.NS, "idle-load", args...)
	if err != nil {
		return res, err
	}
	defer stopProc(p, 10*time.Second)
	var lr LoadResult
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if err := decodeLine(p.Output(), &lr); err == nil {
			break
		}
		if p.Exited() || time.Now().After(deadline) || ctx.Err() != nil {
			return res, fmt.Errorf("the idle load did not report: %s", tail(p.Output(), 5))
		}
		time.Sleep(50 * time.Millisecond)
	}
	res.established, res.firstError = lr.Established, lr.FirstError
	if lr.Established < max(1, e.cfg.IdleConns/100) {
		return res, fmt.Errorf("only %d of %d connections established (first error: %s)", lr.Established, e.cfg.IdleConns, lr.FirstError)
	}
	time.Sleep(500 * time.Millisecond) // let the proxy settle
	after, err := rssKiB(pid)
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
	prev, err := rssKiB(pid)
	for range 10 {
		if err != nil {
			return 0, err
		}
		time.Sleep(500 * time.Millisecond)
		var cur int64
		if cur, err = rssKiB(pid); err == nil && cur-prev < 64 && prev-cur < 64 {
			return cur, nil
		}
		prev = cur
	}
	return prev, err
}

// openFiles counts the open descriptors of pid and its descendants.
func openFiles(pid int) int {
	n := 0
	for _, p := range append([]int{pid}, descendants(pid)...) {
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
