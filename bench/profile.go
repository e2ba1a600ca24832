package main

import (
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Profile is where the CPU went while one data path carried one workload
// (keep-alive requests, short connections, UDP requests or a bulk
// transfer).
type Profile struct {
	// Shares is the machine's CPU time by process group (perf, sampling
	// every CPU), in percent of all samples.
	Shares []Share `json:"shares,omitempty"`
	// TopSymbols are perf's hottest functions in the groups that belong
	// to the benchmark (load generator, backends, proxy, softirq threads).
	TopSymbols string `json:"topSymbols,omitempty"`
	// ProxySymbols are perf's hottest functions in the proxy process.
	ProxySymbols string `json:"proxySymbols,omitempty"`
	// Pprof is `go tool pprof -top` of the proxy's own CPU profile (uproxy).
	Pprof string `json:"pprof,omitempty"`
	// Rate is the workload's rate (requests or connections per second;
	// for bulk, MiB per second) while it was profiled, to turn the shares
	// into CPU time per request, connection or MiB.
	Rate float64 `json:"rate,omitempty"`
	// Seconds is the length of the perf recording; Cores the CPUs it
	// sampled.
	Seconds float64 `json:"seconds,omitempty"`
	Cores   int     `json:"cores,omitempty"`
	// NA says what could not be profiled, and why.
	NA []string `json:"na,omitempty"`
}

// Share is one process group's part of the CPU samples.
type Share struct {
	Who     string  `json:"who"`
	Percent float64 `json:"percent"`
	// Kernel is the part of Percent spent in the kernel.
	Kernel float64 `json:"kernel"`
}

// share returns the share of group who (for the proxy, "proxy (<comm>)"
// matches whoProxy); nil if the profile has none.
func (p *Profile) share(who string) *Share {
	for i := range p.Shares {
		if strings.HasPrefix(p.Shares[i].Who, who) {
			return &p.Shares[i]
		}
	}
	return nil
}

// perOp turns a percentage of all the samples into CPU time per request
// or connection, in µs, at the profiled rate; NaN without a rate.
func (p *Profile) perOp(percent float64) float64 {
	if p.Rate == 0 {
		return math.NaN()
	}
	return percent / 100 * float64(p.Cores) * 1e6 / p.Rate
}

func (p *Profile) summary() string {
	var parts []string
	for _, s := range p.Shares {
		parts = append(parts, fmt.Sprintf("%s %.0f%%", s.Who, s.Percent))
	}
	if p.Pprof != "" {
		parts = append(parts, "pprof ok")
	}
	for _, n := range p.NA {
		parts = append(parts, "n/a: "+n)
	}
	return strings.Join(parts, ", ")
}

// perfAvailable returns why perf cannot sample here, or "".
func perfAvailable(ctx context.Context) string {
	if _, err := exec.LookPath("perf"); err != nil {
		return "perf is not installed (Debian package linux-perf)"
	}
	f, err := os.CreateTemp("", "bench-perf-check-")
	if err != nil {
		return err.Error()
	}
	f.Close()
	defer os.Remove(f.Name())
	if out, err := command(ctx, "perf", "record", "-q", "-e", "cpu-clock", "-a", "-o", f.Name(), "--", "true"); err != nil {
		return "perf cannot sample the CPUs here: " + firstLine(out)
	}
	return ""
}

// perfCounters says whether perf can count hardware events here (`perf
// stat -e instructions true`), for the report.
func perfCounters(ctx context.Context) string {
	out, err := command(ctx, "perf", "stat", "-e", "instructions", "true")
	switch {
	case err != nil:
		return "perf stat failed: " + firstLine(out)
	case strings.Contains(out, "not supported") || strings.Contains(out, "not counted"):
		return "not supported (`perf stat -e instructions true` counts nothing: no hardware counters in this virtual machine)"
	default:
		return "supported"
	}
}

// Process groups of the profiles, by perf's command name.
const (
	whoLoad    = "load generator"
	whoBackend = "backends"
	whoProxy   = "proxy"
	whoSoftirq = "softirq threads"
	whoIdle    = "idle"
	whoOther   = "other processes"
)

// profilePath runs a workload of the load generator ("rr", "short", "udp"
// or "bulk") once more through r while perf samples every CPU and, for
// uproxy, while its own pprof endpoint records a CPU profile. The figures
// of this run are not kept.
func profilePath(ctx context.Context, e *env, t *topo, r *pathRun, perfNA, workload string, loadArgs []string) *Profile {
	prof := &Profile{}
	// pprof records whole seconds: at least one, and the load must cover it.
	d := max(e.cfg.Duration, 1500*time.Millisecond)
	secs := max(1, int((d - 500*time.Millisecond).Seconds()))
	dir, err := os.MkdirTemp("", "bench-profile-")
	if err != nil {
		prof.NA = append(prof.NA, err.Error())
		return prof
	}
	defer os.RemoveAll(dir)
	perfData := filepath.Join(dir, "perf.data")
	pprofData := filepath.Join(dir, "cpu.pprof")
	var wg sync.WaitGroup
	var perfErr, pprofErr error
	if perfNA == "" {
		wg.Go(func() { // ends with perf, after secs
			_, perfErr = command(ctx, "perf", "record", "-q", "-e", "cpu-clock", "-a", "-o", perfData, "--", "sleep", strconv.Itoa(secs))
		})
	} else {
		prof.NA = append(prof.NA, "perf: "+perfNA)
	}
	if r.pprof {
		wg.Go(func() { // ends when the profile is written, after secs
			_, pprofErr = t.lab.Exec(ctx, t.lab.Node, "curl", "-sS", "--fail", "--max-time", strconv.Itoa(secs+30),
				"-o", pprofData, fmt.Sprintf("http://127.0.0.1:10262/debug/pprof/profile?seconds=%d", secs))
		})
	}
	lr, loadErr := t.load(ctx, e, workload, append(loadArgs, "--duration", d.String(), "--warmup", "0s")...)
	wg.Wait()
	if loadErr != nil {
		prof.NA = append(prof.NA, "the profiled workload failed: "+loadErr.Error())
	}
	prof.Rate, prof.Seconds, prof.Cores = lr.Rate, float64(secs), runtime.NumCPU()
	if workload == "bulk" && lr.Seconds > 0 {
		prof.Rate = float64(lr.Bytes) / lr.Seconds / (1 << 20)
	}
	if perfNA == "" {
		if perfErr != nil {
			prof.NA = append(prof.NA, "perf record: "+perfErr.Error())
		} else if err := prof.readPerf(ctx, perfData, r.comm); err != nil {
			prof.NA = append(prof.NA, "perf report: "+err.Error())
		}
	}
	if r.pprof {
		if pprofErr != nil {
			prof.NA = append(prof.NA, "pprof: "+pprofErr.Error())
		} else if out, err := command(ctx, "go", "tool", "pprof", "-top", "-nodecount=20", r.binary, pprofData); err != nil {
			prof.NA = append(prof.NA, "go tool pprof: "+err.Error())
		} else {
			prof.Pprof = trimPprof(out)
		}
	}
	return prof
}

var perfLine = regexp.MustCompile(`^\s*([\d.]+)%\s+(\S+)\s+(.*?)\s*$`)

// readPerf fills Shares, TopSymbols and ProxySymbols from a perf.data file.
func (p *Profile) readPerf(ctx context.Context, data, proxyComm string) error {
	out, err := command(ctx, "perf", "report", "-i", data, "--stdio", "-q", "--sort", "comm,dso", "--percent-limit", "0")
	if err != nil {
		return err
	}
	groups := map[string]*Share{}
	order := []string{whoLoad, whoBackend, whoProxy, whoSoftirq, whoOther, whoIdle}
	for _, line := range strings.Split(out, "\n") {
		m := perfLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		pct, err := strconv.ParseFloat(m[1], 64)
		if err != nil {
			continue
		}
		who := whoOther
		switch comm := m[2]; {
		case comm == "ubench-load":
			who = whoLoad
		case comm == "ubench-backend":
			who = whoBackend
		case proxyComm != "" && comm == proxyComm:
			who = whoProxy
		case strings.HasPrefix(comm, "ksoftirqd"):
			who = whoSoftirq
		case comm == "swapper":
			who = whoIdle
		}
		g := groups[who]
		if g == nil {
			g = &Share{Who: who}
			groups[who] = g
		}
		g.Percent += pct
		if strings.HasPrefix(m[3], "[kernel") {
			g.Kernel += pct
		}
	}
	for _, who := range order {
		if g := groups[who]; g != nil {
			if who == whoProxy {
				g.Who = whoProxy + " (" + proxyComm + ")"
			}
			p.Shares = append(p.Shares, *g)
		}
	}
	comms := "ubench-load,ubench-backend,ksoftirqd/0,ksoftirqd/1"
	if proxyComm != "" {
		comms += "," + proxyComm
	}
	if out, err = command(ctx, "perf", "report", "-i", data, "--stdio", "-q", "--comms", comms, "--sort", "comm,sym", "--percent-limit", "1"); err != nil {
		return err
	}
	p.TopSymbols = headLines(out, 15)
	if proxyComm != "" {
		if out, err = command(ctx, "perf", "report", "-i", data, "--stdio", "-q", "--comms", proxyComm, "--sort", "dso,sym", "--percent-limit", "0.5"); err != nil {
			return err
		}
		p.ProxySymbols = headLines(out, 15)
	}
	return nil
}

// headLines returns the first n non-empty lines of s.
func headLines(s string, n int) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.TrimSpace(l) == "" {
			continue
		}
		out = append(out, strings.TrimRight(l, " "))
		if len(out) == n {
			break
		}
	}
	return strings.Join(out, "\n")
}

// trimPprof keeps pprof's summary lines and table.
func trimPprof(out string) string {
	var keep []string
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "File:") || strings.HasPrefix(l, "Build ID:") || strings.HasPrefix(l, "Type:") || strings.HasPrefix(l, "Time:") {
			continue
		}
		if strings.TrimSpace(l) != "" {
			keep = append(keep, strings.TrimRight(l, " "))
		}
	}
	return strings.Join(keep, "\n")
}
