package report

import (
	"testing"

	"github.com/uproxy/uproxy/bench/internal/results"
)

func metricByID(t *testing.T, id string) results.Metric {
	t.Helper()
	for _, m := range results.DataPathMetrics {
		if m.ID == id {
			return m
		}
	}
	t.Fatalf("no data metric %s", id)
	return results.Metric{}
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
			r := beforeAfter{metric: metricByID(t, c.metric), base: &results.Series{Values: c.base}, cur: &results.Series{Values: c.cur}}
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
	missing := beforeAfter{metric: metricByID(t, "udp_rps"), base: &results.Series{NA: "not implemented"}, cur: &results.Series{Values: []float64{1, 2}}}
	if v, why := missing.verdict(); v != verdictUnknown || why == "" {
		t.Errorf("a figure only the current binary has: verdict %q (%q), want %q with a reason", v, why, verdictUnknown)
	}
}
