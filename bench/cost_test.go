package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/bench/internal/paths"

	"github.com/uproxy/uproxy/bench/internal/harness"

	"github.com/uproxy/uproxy/bench/internal/report"

	"github.com/uproxy/uproxy/bench/internal/results"

	"github.com/google/go-cmp/cmp"
)

// TestCostSummary writes the summary's cost table from synthetic results:
// each CPU cost next to its rate, n/a for a kernel path.
func TestCostSummary(t *testing.T) {
	dp := &results.DataPathResults{
		Meta:    results.RunMeta{Runs: 3},
		Metrics: results.DataPathMetrics,
		Figures: map[string]map[string]*results.Series{},
		Paths:   []results.Subject{{ID: "dnat", Title: "kernel DNAT"}, {ID: "uproxy", Title: "uproxy redirect"}},
	}
	set := func(metric, path string, v ...float64) { dp.Series(metric, path).Values = v }
	set("bulk_gbps", "dnat", 20)
	set("rr_rps", "dnat", 50000)
	set("bulk_gbps", "uproxy", 10, 12, 11)
	set("bulk_cpu_us", "uproxy", 90, 100, 110)
	set("rr_rps", "uproxy", 30000, 31000, 29000)
	set("rr_cpu_us", "uproxy", 8, 9, 10)
	set("short_cps", "uproxy", 5000)
	set("short_cpu_us", "uproxy", 40)
	dp.SetNA("dnat", paths.KernelCPU, "bulk_cpu_us", "rr_cpu_us")
	var b strings.Builder
	report.WriteCostSummary(&b, dp)
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
	report.WriteDataSummary(&sum, dp)
	if strings.Contains(sum.String(), "CPU (µs") {
		t.Errorf("the rates' summary table has CPU columns:\n%s", sum.String())
	}
	// Results from before the costs were measured have no cost table.
	old := &results.DataPathResults{Metrics: results.DataPathMetrics[:11], Figures: dp.Figures, Paths: dp.Paths}
	var none strings.Builder
	report.WriteCostSummary(&none, old)
	if none.Len() != 0 {
		t.Errorf("results without CPU costs got a cost table:\n%s", none.String())
	}
}

// TestCostCurves draws the control plane's cost curves (RSS and time to
// program every service against the number of services) from synthetic
// results at the default scales, and checks the summary's text, the charts'
// files and the points they are drawn through.
func TestCostCurves(t *testing.T) {
	cfg, err := harness.Config{Out: t.TempDir(), Stem: "curves"}.WithDefaults(partCatalog())
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]int{1000, 5000, 10000, 20000}, cfg.Scales); diff != "" {
		t.Fatalf("default scales (-want +got):\n%s", diff)
	}
	if err := os.MkdirAll(cfg.DataDir(), 0o755); err != nil {
		t.Fatal(err)
	}
	cp := &results.ControlPlaneResults{
		Metrics: results.ControlPlaneMetrics,
		Scales:  cfg.Scales,
		Figures: map[string]map[string]map[string]*results.Series{},
		Proxies: []results.Subject{{ID: "dnat", Title: "kernel DNAT"}, {ID: "uproxy", Title: "uproxy redirect"}, {ID: "kp-iptables", Title: "kube-proxy iptables"}},
	}
	for i, n := range cfg.Scales {
		cp.Series("program_s", "uproxy", n).Values = []float64{0.4 * float64(i+1), 0.5 * float64(i+1), 0.6 * float64(i+1)}
		cp.Series("rss_mib", "uproxy", n).Values = []float64{50 * float64(i+1)}
		cp.Series("program_s", "dnat", n).Values = []float64{float64(n) / 1000}
		cp.SetNA("dnat", n, "no process: the rules live in the kernel", "rss_mib")
	}
	cp.Series("program_s", "kp-iptables", 1000).Values = []float64{5}
	cp.Series("rss_mib", "kp-iptables", 1000).Values = []float64{90}
	cp.SetNA("kp-iptables", 5000, "over 5m0s: did not program 5,000 services", "program_s", "rss_mib")
	var b strings.Builder
	if err := report.WriteCostCurves(&b, cfg.ReportOutput(), cp); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"(1,000, 5,000, 10,000, 20,000)", "](curves/cp_rss_mib.png)", "](curves/cp_program_s.png)"} {
		if !strings.Contains(b.String(), s) {
			t.Errorf("the cost curves lack %q:\n%s", s, b.String())
		}
	}
	for _, f := range []string{"cp_rss_mib.png", "cp_program_s.png"} {
		png, err := os.ReadFile(filepath.Join(cfg.DataDir(), f))
		if err != nil || !strings.HasPrefix(string(png), "\x89PNG") {
			t.Errorf("%s is not a PNG (%v)", f, err)
		}
	}
	points := func(metric, proxy string) []float64 {
		var out []float64
		for _, n := range cp.Scales {
			if v, ok := report.ControlPlaneValue(cp, metric, proxy, n); ok {
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
	if err := report.WriteCostCurves(&none, cfg.ReportOutput(), &results.ControlPlaneResults{Metrics: results.ControlPlaneMetrics, Scales: cfg.Scales, Proxies: cp.Proxies, Figures: map[string]map[string]map[string]*results.Series{}}); err != nil || none.Len() != 0 {
		t.Errorf("no figures: %q, %v", none.String(), err)
	}
}

// TestNotMeasuredGrouped checks that "Not measured" gives one line per
// data path and reason, naming every figure it holds for.
func TestNotMeasuredGrouped(t *testing.T) {
	dp := &results.DataPathResults{Metrics: results.DataPathMetrics, Figures: map[string]map[string]*results.Series{}, Paths: []results.Subject{{ID: "dnat", Title: "kernel DNAT"}}}
	dp.SetNA("dnat", paths.KernelCPU, "rr_cpu_us", "short_cpu_us")
	dp.SetNA("dnat", "no process carries the connections", "idle_fds")
	var b strings.Builder
	report.WriteNA(&b, dp, &results.ControlPlaneResults{}, &results.GoBenchResults{}, true, false, false)
	var lines []string
	for _, l := range strings.Split(b.String(), "\n") {
		if strings.HasPrefix(l, "- ") {
			lines = append(lines, l)
		}
	}
	want := []string{
		"- kernel DNAT, fds/conn (fd/conn): no process carries the connections",
		"- kernel DNAT, keep-alive CPU (µs/req), short conns CPU (µs/conn): " + paths.KernelCPU,
	}
	if diff := cmp.Diff(want, lines); diff != "" {
		t.Errorf("not measured (-want +got):\n%s", diff)
	}
}
