package main

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestStatCPUTicks(t *testing.T) {
	for _, c := range []struct {
		name, stat string
		want       int64
		wantErr    bool
	}{
		// utime 300, stime 20 (fields 14 and 15).
		{"plain", "201 (iptables-restor) R 100 201 100 0 -1 4194304 1 0 0 0 300 20 0 0 20 0 1 0 90000", 320, false},
		// A command name with spaces and a parenthesis.
		{"odd name", "202 (a b) c) S 100 202 100 0 -1 0 0 0 0 0 7 5 0 0 20 0 1 0 119950", 12, false},
		{"short", "203 (x) S 1 2 3", 0, true},
		{"no name", "garbage", 0, true},
		{"not a number", "204 (x) S 100 204 100 0 -1 0 0 0 0 0 x 5 0", 0, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := statCPUTicks(c.stat)
			if (err != nil) != c.wantErr || got != c.want {
				t.Errorf("statCPUTicks = %d, %v; want %d, error %v", got, err, c.want, c.wantErr)
			}
		})
	}
}

// TestCPUTime checks that this process's CPU time, read from /proc, grows
// while it spins, and by no more than the wall time on every core.
func TestCPUTime(t *testing.T) {
	pid := os.Getpid()
	before, err := cpuTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for x := 0; time.Since(start) < 300*time.Millisecond; x++ {
	}
	after, err := cpuTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	wall := time.Since(start)
	if d := after - before; d <= 0 || d > wall*time.Duration(runtime.NumCPU())+20*time.Millisecond {
		t.Errorf("spinning for %v used %v of CPU", wall, d)
	}
}

// TestCostSummary writes the summary's cost table from synthetic results:
// each CPU cost next to its rate, n/a for a kernel path.
func TestCostSummary(t *testing.T) {
	dp := &DataPathResults{
		Meta:    RunMeta{Runs: 3},
		Metrics: dataMetrics,
		Figures: map[string]map[string]*Series{},
		Paths:   []Subject{{ID: "dnat", Title: "kernel DNAT"}, {ID: "uproxy", Title: "uproxy redirect"}},
	}
	set := func(metric, path string, v ...float64) { dp.series(metric, path).Values = v }
	set("bulk_gbps", "dnat", 20)
	set("rr_rps", "dnat", 50000)
	set("bulk_gbps", "uproxy", 10, 12, 11)
	set("bulk_cpu_us", "uproxy", 90, 100, 110)
	set("rr_rps", "uproxy", 30000, 31000, 29000)
	set("rr_cpu_us", "uproxy", 8, 9, 10)
	set("short_cps", "uproxy", 5000)
	set("short_cpu_us", "uproxy", 40)
	dp.setNA("dnat", kernelCPU, "bulk_cpu_us", "rr_cpu_us")
	var b strings.Builder
	writeCostSummary(&b, dp)
	var rows []string
	for _, l := range strings.Split(b.String(), "\n") {
		if strings.HasPrefix(l, "| ") {
			rows = append(rows, l)
		}
	}
	want := []string{
		"| data path | bulk (Gbit/s) | bulk CPU (µs/MiB) | keep-alive (req/s) | keep-alive CPU (µs/req) | short conns (conn/s) | short conns CPU (µs/conn) | UDP (req/s) | UDP CPU (µs/req) | UDP, new port per query (req/s) | UDP, new port, CPU (µs/req) |",
		"| kernel DNAT | 20.0 | n/a | 50,000 | n/a | n/a | n/a | n/a | n/a | n/a | n/a |",
		"| uproxy redirect | 11.0 | 100 | 30,000 | 9.00 | 5000 | 40.0 | n/a | n/a | n/a | n/a |",
	}
	if diff := cmp.Diff(want, rows); diff != "" {
		t.Errorf("cost table (-want +got):\n%s\n%s", diff, b.String())
	}
	// The rates' table leaves the costs to this one.
	var sum strings.Builder
	writeDataSummary(&sum, dp)
	if strings.Contains(sum.String(), "CPU (µs") {
		t.Errorf("the rates' summary table has CPU columns:\n%s", sum.String())
	}
	// Results from before the costs were measured have no cost table.
	old := &DataPathResults{Metrics: dataMetrics[:11], Figures: dp.Figures, Paths: dp.Paths}
	var none strings.Builder
	writeCostSummary(&none, old)
	if none.Len() != 0 {
		t.Errorf("results without CPU costs got a cost table:\n%s", none.String())
	}
}

// TestCostCurves draws the control plane's cost curves (RSS and time to
// program every service against the number of services) from synthetic
// results at the default scales, and checks the summary's text, the charts'
// files and the points they are drawn through.
func TestCostCurves(t *testing.T) {
	cfg, err := Config{Out: t.TempDir(), Stem: "curves"}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]int{1000, 5000, 10000, 20000}, cfg.Scales); diff != "" {
		t.Fatalf("default scales (-want +got):\n%s", diff)
	}
	if err := os.MkdirAll(cfg.dataDir(), 0o755); err != nil {
		t.Fatal(err)
	}
	cp := &ControlPlaneResults{
		Metrics: cpMetrics,
		Scales:  cfg.Scales,
		Figures: map[string]map[string]map[string]*Series{},
		Proxies: []Subject{{ID: "dnat", Title: "kernel DNAT"}, {ID: "uproxy", Title: "uproxy redirect"}, {ID: "kp-iptables", Title: "kube-proxy iptables"}},
	}
	for i, n := range cfg.Scales {
		cp.series("program_s", "uproxy", n).Values = []float64{0.4 * float64(i+1), 0.5 * float64(i+1), 0.6 * float64(i+1)}
		cp.series("rss_mib", "uproxy", n).Values = []float64{50 * float64(i+1)}
		cp.series("program_s", "dnat", n).Values = []float64{float64(n) / 1000}
		cp.setNA("dnat", n, "no process: the rules live in the kernel", "rss_mib")
	}
	cp.series("program_s", "kp-iptables", 1000).Values = []float64{5}
	cp.series("rss_mib", "kp-iptables", 1000).Values = []float64{90}
	cp.setNA("kp-iptables", 5000, "over 5m0s: did not program 5,000 services", "program_s", "rss_mib")
	var b strings.Builder
	if err := writeCostCurves(&b, cfg, cp); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"(1,000, 5,000, 10,000, 20,000)", "](curves/cp_rss_mib.png)", "](curves/cp_program_s.png)"} {
		if !strings.Contains(b.String(), s) {
			t.Errorf("the cost curves lack %q:\n%s", s, b.String())
		}
	}
	for _, f := range []string{"cp_rss_mib.png", "cp_program_s.png"} {
		png, err := os.ReadFile(filepath.Join(cfg.dataDir(), f))
		if err != nil || !strings.HasPrefix(string(png), "\x89PNG") {
			t.Errorf("%s is not a PNG (%v)", f, err)
		}
	}
	points := func(metric, proxy string) []float64 {
		var out []float64
		for _, n := range cp.Scales {
			if v, ok := cpValue(cp, metric, proxy, n); ok {
				out = append(out, v)
			}
		}
		return out
	}
	if diff := cmp.Diff([]float64{0.5, 1, 1.5, 2}, points("program_s", "uproxy")); diff != "" {
		t.Errorf("uproxy's programming curve (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]float64{90}, points("rss_mib", "kp-iptables")); diff != "" {
		t.Errorf("a proxy that timed out: RSS curve (-want +got):\n%s", diff)
	}
	if got := points("rss_mib", "dnat"); len(got) != 0 {
		t.Errorf("kernel DNAT has no process, yet an RSS curve: %v", got)
	}
	// Without any figure, no charts and no text.
	var none strings.Builder
	if err := writeCostCurves(&none, cfg, &ControlPlaneResults{Metrics: cpMetrics, Scales: cfg.Scales, Proxies: cp.Proxies, Figures: map[string]map[string]map[string]*Series{}}); err != nil || none.Len() != 0 {
		t.Errorf("no figures: %q, %v", none.String(), err)
	}
}

// TestNotMeasuredGrouped checks that "Not measured" gives one line per
// data path and reason, naming every figure it holds for.
func TestNotMeasuredGrouped(t *testing.T) {
	dp := &DataPathResults{Metrics: dataMetrics, Figures: map[string]map[string]*Series{}, Paths: []Subject{{ID: "dnat", Title: "kernel DNAT"}}}
	dp.setNA("dnat", kernelCPU, "rr_cpu_us", "short_cpu_us")
	dp.setNA("dnat", "no process carries the connections", "idle_fds")
	var b strings.Builder
	writeNA(&b, dp, &ControlPlaneResults{}, &GoBenchResults{}, true, false, false)
	var lines []string
	for _, l := range strings.Split(b.String(), "\n") {
		if strings.HasPrefix(l, "- ") {
			lines = append(lines, l)
		}
	}
	want := []string{
		"- kernel DNAT, fds/conn (fd/conn): no process carries the connections",
		"- kernel DNAT, keep-alive CPU (µs/req), short conns CPU (µs/conn): " + kernelCPU,
	}
	if diff := cmp.Diff(want, lines); diff != "" {
		t.Errorf("not measured (-want +got):\n%s", diff)
	}
}
