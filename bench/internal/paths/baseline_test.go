package paths

import (
	"strings"
	"testing"

	"github.com/uproxy/uproxy/bench/internal/harness"

	"github.com/uproxy/uproxy/bench/internal/report"

	"github.com/uproxy/uproxy/bench/internal/results"

	"github.com/google/go-cmp/cmp"
)

// TestBeforeAfterSection writes the section from synthetic results of two
// uproxy modes and their baselines, and checks its rows.
func TestBeforeAfterSection(t *testing.T) {
	cfg := harness.Config{Baseline: "/tmp/uproxy-old", Paths: []string{"uproxy", "uproxy-tproxy"}}
	dp := &results.DataPathResults{
		Meta:     results.RunMeta{Runs: 5, Commit: "abc1234"},
		Metrics:  results.DataPathMetrics,
		Figures:  map[string]map[string]*results.Series{},
		Baseline: &results.BaselineInfo{From: "--baseline /tmp/uproxy-old", Commit: "0123456"},
	}
	for _, p := range selectedPaths(cfg) {
		dp.Paths = append(dp.Paths, p.Subject)
	}
	set := func(metric, path string, v ...float64) { dp.Series(metric, path).Values = v }
	set("rr_rps", "uproxy", 96, 98, 100, 99, 97)
	set("rr_rps", "uproxy-baseline", 95, 100, 105, 101, 99)
	set("rr_rps", "uproxy-tproxy", 79, 80, 81, 80, 80)
	set("rr_rps", "uproxy-tproxy-baseline", 99, 100, 101, 100, 100)
	set("idle_kib", "uproxy", 7.9, 8, 8.1, 8, 8)
	set("idle_kib", "uproxy-baseline", 9.9, 10, 10.1, 10, 10)
	dp.Series("udp_rps", "uproxy-tproxy").Values = []float64{5000, 5100}
	dp.Series("udp_rps", "uproxy-tproxy-baseline").NA = "not implemented"
	var b strings.Builder
	report.WriteBeforeAfter(&b, dp)
	out := b.String()
	var rows []string
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "| ") && !strings.HasPrefix(l, "| figure") {
			rows = append(rows, l)
		}
	}
	want := []string{
		"| keep-alive (req/s) | uproxy redirect | 100 (95.0 – 105) | 98.0 (96.0 – 100) | 0.98× | ±10.0% | yes | within noise |",
		"| keep-alive (req/s) | uproxy tproxy | 100 (99.0 – 101) | 80.0 (79.0 – 81.0) | 0.80× | ±2.5% | no | worse |",
		"| UDP (req/s) | uproxy tproxy | n/a: not implemented | 5050 (5000 – 5100) | – | – | – | no verdict: only one binary has this figure |",
		"| memory/conn (KiB/conn) | uproxy redirect | 10.0 (9.90 – 10.1) | 8.00 (7.90 – 8.10) | 0.80× | ±2.5% | no | better |",
	}
	if diff := cmp.Diff(want, rows); diff != "" {
		t.Errorf("rows (-want +got):\n%s\nsection:\n%s", diff, out)
	}
	for _, s := range []string{"## Before and after", "`--baseline /tmp/uproxy-old` (commit 0123456)", "current binary (commit abc1234)", "1 of 4 figures within noise.",
		"Worse: uproxy tproxy, keep-alive (req/s) (0.80×).", "Better: uproxy redirect, memory/conn (KiB/conn) (0.80×).", "1 without a verdict (the table says why)."} {
		if !strings.Contains(out, s) {
			t.Errorf("the section lacks %q:\n%s", s, out)
		}
	}
}

// TestBaselinePaths checks which data paths a baseline adds: a twin after
// every selected uproxy path, selected by either id, and none without a
// baseline binary.
func TestBaselinePaths(t *testing.T) {
	ids := func(c harness.Config) []string {
		var out []string
		for _, p := range selectedPaths(c) {
			out = append(out, p.ID)
		}
		return out
	}
	for _, c := range []struct {
		name string
		cfg  harness.Config
		want []string
	}{
		{"no baseline", harness.Config{Paths: []string{"dnat", "uproxy", "uproxy-tproxy"}}, []string{"dnat", "uproxy", "uproxy-tproxy"}},
		{"baseline", harness.Config{BaselineRev: "HEAD~1", Paths: []string{"dnat", "uproxy", "uproxy-tproxy"}},
			[]string{"dnat", "uproxy", "uproxy-baseline", "uproxy-tproxy", "uproxy-tproxy-baseline"}},
		{"twin selects both", harness.Config{Baseline: "/x", Paths: []string{"uproxy-tproxy-baseline"}}, []string{"uproxy-tproxy", "uproxy-tproxy-baseline"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if diff := cmp.Diff(c.want, ids(c.cfg)); diff != "" {
				t.Errorf("paths (-want +got):\n%s", diff)
			}
		})
	}
	all := selectedPaths(harness.Config{Baseline: "/x"})
	uproxyPaths := 0
	for _, p := range All {
		if strings.HasPrefix(p.ID, "uproxy") {
			uproxyPaths++
		}
	}
	if n := len(all) - len(All); n != uproxyPaths || n < 4 {
		t.Errorf("every path with a baseline: %d twins, want one per uproxy path (%d, at least 4)", n, uproxyPaths)
	}
	for _, c := range []struct {
		cfg     harness.Config
		wantErr string
	}{
		{harness.Config{Paths: []string{"uproxy-baseline"}}, "needs a baseline binary"},
		{harness.Config{Baseline: "/x", Paths: []string{"dnat-baseline"}}, `unknown data path "dnat-baseline"`},
		{harness.Config{Baseline: "/x", BaselineRev: "HEAD", Paths: []string{"uproxy"}}, "not both"},
	} {
		_, err := c.cfg.WithDefaults(harness.Catalog{Paths: IDs(), CheckPath: CheckPath, Workloads: WorkloadIDs})
		if err == nil || !strings.Contains(err.Error(), c.wantErr) {
			t.Errorf("%+v: error %v, want one containing %q", c.cfg.Paths, err, c.wantErr)
		}
	}
	// The full report is five runs: the default, with or without a baseline.
	for _, c := range []harness.Config{{Baseline: "/x", Stem: "s", Out: "/tmp"}, {Stem: "s", Out: "/tmp"}} {
		if got, err := c.WithDefaults(harness.Catalog{Paths: IDs(), CheckPath: CheckPath, Workloads: WorkloadIDs}); err != nil || got.Runs != 5 {
			t.Errorf("runs with baseline %q: %d (%v), want 5", c.Baseline, got.Runs, err)
		}
	}
}
