package main

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestRatioWithin(t *testing.T) {
	for _, tc := range []struct {
		name    string
		s, base *Series
		want    runRatio
		ok      bool
	}{
		{"paired runs", &Series{Values: []float64{10, 30, 20}}, &Series{Values: []float64{10, 20, 10}},
			runRatio{median: 1.5, lo: 1, hi: 2, paired: true}, true},
		// The ratio of the medians would be 20/10 = 2; within runs, run 1
		// is 2/1 and run 2 is 20/20.
		{"within each run, not of the medians", &Series{Values: []float64{2, 20}}, &Series{Values: []float64{1, 20}},
			runRatio{median: 1.5, lo: 1, hi: 2, paired: true}, true},
		{"a failed run: medians", &Series{Values: []float64{30, 10}}, &Series{Values: []float64{10}},
			runRatio{median: 2, lo: 2, hi: 2}, true},
		{"no figure", &Series{NA: "not supported"}, &Series{Values: []float64{1}}, runRatio{}, false},
		{"no base", &Series{Values: []float64{1}}, nil, runRatio{}, false},
		{"a zero base", &Series{Values: []float64{1}}, &Series{Values: []float64{0}}, runRatio{}, false},
	} {
		got, ok := ratioWithin(tc.s, tc.base)
		if ok != tc.ok {
			t.Errorf("%s: ok = %v, want %v", tc.name, ok, tc.ok)
		}
		if diff := cmp.Diff(tc.want, got, cmp.AllowUnexported(runRatio{})); ok && diff != "" {
			t.Errorf("%s: ratio (-want +got):\n%s", tc.name, diff)
		}
	}
}

// TestTargetsTable checks the targets table on made-up figures: which
// targets each uproxy path meets, the best figure of one that none meets,
// and the control plane's rows at the largest scale.
func TestTargetsTable(t *testing.T) {
	series := func(v ...float64) *Series { return &Series{Values: v} }
	dp := &DataPathResults{
		Paths: []Subject{{ID: "dnat", Title: "DNAT"}, {ID: "haproxy", Title: "HAProxy"}, {ID: "nginx", Title: "nginx"},
			{ID: "uproxy", Title: "uproxy A"}, {ID: "uproxy-b", Title: "uproxy B"},
			// An older binary (--baseline) meets no target for the current one.
			{ID: "uproxy-baseline", Title: "uproxy A, baseline"}},
		Figures: map[string]map[string]*Series{
			"bulk_gbps": {"dnat": series(20, 10), "uproxy": series(10, 6), "uproxy-b": series(12, 5)},
			"rr_rps":    {"haproxy": series(100, 100), "uproxy": series(130, 120), "uproxy-b": series(100, 90), "uproxy-baseline": series(200, 200)},
			"rr_p99_us": {"haproxy": series(100, 100), "uproxy": series(90, 100), "uproxy-b": series(110, 120)},
			"short_cps": {"haproxy": series(10, 10), "uproxy": series(9, 9)},
			"udp_rps":   {"dnat": series(200, 200), "nginx": series(100, 100), "uproxy": series(150, 160), "uproxy-b": series(140, 140)},
			"idle_kib":  {"haproxy": series(3.3), "uproxy": series(1), "uproxy-b": series(4)},
		},
		BulkProfiles: map[string]*Profile{"uproxy": {}},
	}
	cp := &ControlPlaneResults{
		Proxies: []Subject{{ID: "dnat", Title: "DNAT"}, {ID: "uproxy", Title: "uproxy A"}, {ID: "uproxy-shared", Title: "uproxy shared"}},
		Scales:  []int{1000, 10000},
		Figures: map[string]map[string]map[string]*Series{
			"after_lists_s": {"uproxy": {"1000": series(0.1), "10000": series(1.2, 1.3)}, "uproxy-shared": {"10000": series(0.8, 0.9, 1.1)}},
			"change_sync_ms": {"uproxy": {"10000": series(3, 4, 5, 6)},
				"uproxy-shared": {"10000": series(3, 4, 5, 60)}},
			"change_commands": {"uproxy": {"10000": series(0, 0)}, "uproxy-shared": {"10000": series(0, 2)}},
		},
		Endpoints: 10,
	}
	var b strings.Builder
	writeTargets(&b, dp, cp, true, true)
	var got []string
	for line := range strings.Lines(b.String()) {
		if strings.HasPrefix(line, "| ") && !strings.HasPrefix(line, "| target") {
			got = append(got, strings.TrimSpace(line))
		}
	}
	want := []string{
		"| bulk TCP throughput ≥ 0.90× kernel DNAT | 0.55× (0.50–0.60) | 0.55× (0.50–0.60) | no: best 0.55× (uproxy A); profile: Bulk transfers |",
		"| keep-alive request rate ≥ 1.2× HAProxy | 1.25× (1.20–1.30) | 0.95× (0.90–1.00) | yes: uproxy A |",
		"| keep-alive p99 latency ≤ HAProxy's | 0.95× (0.90–1.00) | 1.15× (1.10–1.20) | yes: uproxy A |",
		"| short-connection rate ≥ 1.0× HAProxy | 0.90× | n/a | no: best 0.90× (uproxy A) |",
		"| UDP request rate ≥ 1.5× nginx stream | 1.55× (1.50–1.60) | 1.40× | yes: uproxy A |",
		"| memory per idle connection ≤ HAProxy's | 1.00 KiB, 0.30× | 4.00 KiB, 1.21× | yes: uproxy A |",
		"| programmed ≤ 1 s after the informers' initial lists (median of the runs) | 1.25 s | 0.900 s | yes: uproxy shared |",
		"| endpoint change followed by traffic ≤ 10 ms p99, from uproxy's sync (every change of every run) | 6.00 ms | 60.0 ms | yes: uproxy A |",
		"| no iptables or ipset process run for an endpoint change (the most any change ran) | 0 | 2 | yes: uproxy A |",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("targets table (-want +got):\n%s\nwhole:\n%s", diff, b.String())
	}
	if !strings.Contains(b.String(), "UDP request rate, as a ratio to kernel DNAT: uproxy A 0.78×; uproxy B 0.70×.") {
		t.Errorf("no UDP ratio to kernel DNAT:\n%s", b.String())
	}
}
