package harness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/uproxy/uproxy/bench/internal/results"
)

// PerfAvailable returns why perf cannot sample here, or "".
func PerfAvailable(ctx context.Context) string {
	if _, err := exec.LookPath("perf"); err != nil {
		return "perf is not installed (Debian package linux-perf)"
	}
	f, err := os.CreateTemp("", "bench-perf-check-")
	if err != nil {
		return err.Error()
	}
	f.Close()
	defer os.Remove(f.Name())
	if out, err := Command(ctx, "perf", "record", "-q", "-e", "cpu-clock", "-a", "-o", f.Name(), "--", "true"); err != nil {
		return "perf cannot sample the CPUs here: " + results.FirstLine(out)
	}
	return ""
}

// PerfCounters says whether perf can count hardware events here (`perf
// stat -e instructions true`), for the report.
func PerfCounters(ctx context.Context) string {
	out, err := Command(ctx, "perf", "stat", "-e", "instructions", "true")
	switch {
	case err != nil:
		return "perf stat failed: " + results.FirstLine(out)
	case strings.Contains(out, "not supported") || strings.Contains(out, "not counted"):
		return "not supported (`perf stat -e instructions true` counts nothing: no hardware counters in this virtual machine)"
	default:
		return "supported"
	}
}

// ProfilePath runs a workload of the load generator ("rr", "short", "udp"
// or "bulk") once more through r while perf samples every CPU and, for
// uproxy, while its own pprof endpoint records a CPU profile. The figures
// of this run are not kept.
func ProfilePath(ctx context.Context, e *Env, t *Topo, r *PathRun, perfNA, workload string, loadArgs []string) *results.Profile {
	prof := &results.Profile{}
	// pprof records whole seconds: at least one, and the load must cover it.
	d := max(e.Config.Duration, 1500*time.Millisecond)
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
			_, perfErr = Command(ctx, "perf", "record", "-q", "-e", "cpu-clock", "-a", "-o", perfData, "--", "sleep", strconv.Itoa(secs))
		})
	} else {
		prof.NA = append(prof.NA, "perf: "+perfNA)
	}
	if r.Pprof {
		wg.Go(func() { // ends when the profile is written, after secs
			_, pprofErr = t.Lab.Exec(ctx, t.Lab.Node, "curl", "-sS", "--fail", "--max-time", strconv.Itoa(secs+30),
				"-o", pprofData, fmt.Sprintf("http://127.0.0.1:10262/debug/pprof/profile?seconds=%d", secs))
		})
	}
	lr, loadErr := t.Load(ctx, e, workload, append(loadArgs, "--duration", d.String(), "--warmup", "0s")...)
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
		} else if err := readPerf(ctx, prof, perfData, r.Comm); err != nil {
			prof.NA = append(prof.NA, "perf report: "+err.Error())
		}
	}
	if r.Pprof {
		if pprofErr != nil {
			prof.NA = append(prof.NA, "pprof: "+pprofErr.Error())
		} else if out, err := Command(ctx, "go", "tool", "pprof", "-top", "-nodecount=20", r.Binary, pprofData); err != nil {
			prof.NA = append(prof.NA, "go tool pprof: "+err.Error())
		} else {
			prof.Pprof = TrimPprof(out)
		}
	}
	return prof
}

var perfLine = regexp.MustCompile(`^\s*([\d.]+)%\s+(\S+)\s+(.*?)\s*$`)

// readPerf fills Shares, TopSymbols and ProxySymbols from a perf.data file.
func readPerf(ctx context.Context, p *results.Profile, data, proxyComm string) error {
	out, err := Command(ctx, "perf", "report", "-i", data, "--stdio", "-q", "--sort", "comm,dso", "--percent-limit", "0")
	if err != nil {
		return err
	}
	groups := map[string]*results.Share{}
	order := []string{results.WhoLoad, results.WhoBackend, results.WhoProxy, results.WhoSoftirq, results.WhoOther, results.WhoIdle}
	for _, line := range strings.Split(out, "\n") {
		m := perfLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		pct, err := strconv.ParseFloat(m[1], 64)
		if err != nil {
			continue
		}
		who := results.WhoOther
		switch comm := m[2]; {
		case comm == "ubench-load":
			who = results.WhoLoad
		case comm == "ubench-backend":
			who = results.WhoBackend
		case proxyComm != "" && comm == proxyComm:
			who = results.WhoProxy
		case strings.HasPrefix(comm, "ksoftirqd"):
			who = results.WhoSoftirq
		case comm == "swapper":
			who = results.WhoIdle
		}
		g := groups[who]
		if g == nil {
			g = &results.Share{Who: who}
			groups[who] = g
		}
		g.Percent += pct
		if strings.HasPrefix(m[3], "[kernel") {
			g.Kernel += pct
		}
	}
	for _, who := range order {
		if g := groups[who]; g != nil {
			if who == results.WhoProxy {
				g.Who = results.WhoProxy + " (" + proxyComm + ")"
			}
			p.Shares = append(p.Shares, *g)
		}
	}
	comms := "ubench-load,ubench-backend,ksoftirqd/0,ksoftirqd/1"
	if proxyComm != "" {
		comms += "," + proxyComm
	}
	if out, err = Command(ctx, "perf", "report", "-i", data, "--stdio", "-q", "--comms", comms, "--sort", "comm,sym", "--percent-limit", "1"); err != nil {
		return err
	}
	p.TopSymbols = headLines(out, 15)
	if proxyComm != "" {
		if out, err = Command(ctx, "perf", "report", "-i", data, "--stdio", "-q", "--comms", proxyComm, "--sort", "dso,sym", "--percent-limit", "0.5"); err != nil {
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

// TrimPprof keeps pprof's summary lines and table.
func TrimPprof(out string) string {
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
