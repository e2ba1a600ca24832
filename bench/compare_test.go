package main

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func metricByID(t *testing.T, id string) Metric {
	t.Helper()
	for _, m := range dataMetrics {
		if m.ID == id {
			return m
		}
	}
	t.Fatalf("no data metric %s", id)
	return Metric{}
}

// TestBeforeAfterVerdict checks the comparison of a figure measured with
// the baseline and the current binary: noise is the larger spread of the
// two, and a difference beyond it is better or worse by the metric's
// direction.
func TestBeforeAfterVerdict(t *testing.T) {
	for _, c := range []struct {
		name      string
		metric    string
		base, cur []float64
		want      string
		overlap   bool
		noise     float64
	}{
		// Spreads 10% and 4%: a 2% drop is within noise.
		{"within noise", "rr_rps", []float64{95, 100, 105}, []float64{96, 98, 100}, verdictNoise, true, 0.10},
		// A 20% drop of a rate, spreads 2% and 2.5%: worse.
		{"rate drop", "rr_rps", []float64{99, 100, 101}, []float64{79, 80, 81}, verdictWorse, false, 0.025},
		// A 20% drop of a cost (lower is better): better.
		{"memory drop", "idle_kib", []float64{9.9, 10, 10.1}, []float64{7.9, 8, 8.1}, verdictBetter, false, 0.025},
		// A 20% rise of latency: worse.
		{"latency rise", "rr_p99_us", []float64{99, 100, 101}, []float64{119, 120, 121}, verdictWorse, false, 0.02},
		// One run each: no spread, no verdict.
		{"one run", "bulk_gbps", []float64{10}, []float64{12}, verdictUnknown, false, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := beforeAfter{metric: metricByID(t, c.metric), base: &Series{Values: c.base}, cur: &Series{Values: c.cur}}
			if got, _ := r.verdict(); got != c.want {
				t.Errorf("verdict = %q, want %q (ratio %.3f, noise %.3f)", got, c.want, r.ratio(), r.noise())
			}
			if got := r.overlap(); got != c.overlap {
				t.Errorf("overlap = %v, want %v", got, c.overlap)
			}
			if got := r.noise(); got < c.noise-1e-9 || got > c.noise+1e-9 {
				t.Errorf("noise = %v, want %v", got, c.noise)
			}
		})
	}
	missing := beforeAfter{metric: metricByID(t, "udp_rps"), base: &Series{NA: "not implemented"}, cur: &Series{Values: []float64{1, 2}}}
	if v, why := missing.verdict(); v != verdictUnknown || why == "" {
		t.Errorf("a figure only the current binary has: verdict %q (%q), want %q with a reason", v, why, verdictUnknown)
	}
}

// TestBeforeAfterSection writes the section from synthetic results of two
// uproxy modes and their baselines, and checks its rows.
func TestBeforeAfterSection(t *testing.T) {
	cfg := Config{Baseline: "/tmp/uproxy-old", Paths: []string{"uproxy", "uproxy-tproxy"}}
	dp := &DataPathResults{
		Meta:     RunMeta{Runs: 5, Commit: "abc1234"},
		Metrics:  dataMetrics,
		Figures:  map[string]map[string]*Series{},
		Baseline: &BaselineInfo{From: "--baseline /tmp/uproxy-old", Commit: "0123456"},
	}
	for _, p := range cfg.selectedPaths() {
		dp.Paths = append(dp.Paths, p.Subject)
	}
	set := func(metric, path string, v ...float64) { dp.series(metric, path).Values = v }
	set("rr_rps", "uproxy", 96, 98, 100, 99, 97)
	set("rr_rps", "uproxy-baseline", 95, 100, 105, 101, 99)
	set("rr_rps", "uproxy-tproxy", 79, 80, 81, 80, 80)
	set("rr_rps", "uproxy-tproxy-baseline", 99, 100, 101, 100, 100)
	set("idle_kib", "uproxy", 7.9, 8, 8.1, 8, 8)
	set("idle_kib", "uproxy-baseline", 9.9, 10, 10.1, 10, 10)
	dp.series("udp_rps", "uproxy-tproxy").Values = []float64{5000, 5100}
	dp.series("udp_rps", "uproxy-tproxy-baseline").NA = "not implemented"
	var b strings.Builder
	writeBeforeAfter(&b, dp)
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
	ids := func(c Config) []string {
		var out []string
		for _, p := range c.selectedPaths() {
			out = append(out, p.ID)
		}
		return out
	}
	for _, c := range []struct {
		name string
		cfg  Config
		want []string
	}{
		{"no baseline", Config{Paths: []string{"dnat", "uproxy", "uproxy-tproxy"}}, []string{"dnat", "uproxy", "uproxy-tproxy"}},
		{"baseline", Config{BaselineRev: "HEAD~1", Paths: []string{"dnat", "uproxy", "uproxy-tproxy"}},
			[]string{"dnat", "uproxy", "uproxy-baseline", "uproxy-tproxy", "uproxy-tproxy-baseline"}},
		{"twin selects both", Config{Baseline: "/x", Paths: []string{"uproxy-tproxy-baseline"}}, []string{"uproxy-tproxy", "uproxy-tproxy-baseline"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if diff := cmp.Diff(c.want, ids(c.cfg)); diff != "" {
				t.Errorf("paths (-want +got):\n%s", diff)
			}
		})
	}
	all := Config{Baseline: "/x"}.selectedPaths()
	uproxyPaths := 0
	for _, p := range dataPaths {
		if strings.HasPrefix(p.ID, "uproxy") {
			uproxyPaths++
		}
	}
	if n := len(all) - len(dataPaths); n != uproxyPaths || n < 4 {
		t.Errorf("every path with a baseline: %d twins, want one per uproxy path (%d, at least 4)", n, uproxyPaths)
	}
	for _, c := range []struct {
		cfg     Config
		wantErr string
	}{
		{Config{Paths: []string{"uproxy-baseline"}}, "needs a baseline binary"},
		{Config{Baseline: "/x", Paths: []string{"dnat-baseline"}}, `unknown data path "dnat-baseline"`},
		{Config{Baseline: "/x", BaselineRev: "HEAD", Paths: []string{"uproxy"}}, "not both"},
	} {
		_, err := c.cfg.withDefaults()
		if err == nil || !strings.Contains(err.Error(), c.wantErr) {
			t.Errorf("%+v: error %v, want one containing %q", c.cfg.Paths, err, c.wantErr)
		}
	}
	// The full report is five runs: the default, with or without a baseline.
	for _, c := range []Config{{Baseline: "/x", Stem: "s", Out: "/tmp"}, {Stem: "s", Out: "/tmp"}} {
		if got, err := c.withDefaults(); err != nil || got.Runs != 5 {
			t.Errorf("runs with baseline %q: %d (%v), want 5", c.Baseline, got.Runs, err)
		}
	}
}
