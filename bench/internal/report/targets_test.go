package report

import (
	"strconv"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/bench/internal/results"

	"github.com/google/go-cmp/cmp"
)

func TestRatioWithin(t *testing.T) {
	for _, tc := range []struct {
		name    string
		s, base *results.Series
		want    runRatio
		ok      bool
	}{
		{"paired runs", &results.Series{Values: []float64{10, 30, 20}}, &results.Series{Values: []float64{10, 20, 10}},
			runRatio{median: 1.5, lo: 1, hi: 2, paired: true}, true},
		// The ratio of the medians would be 20/10 = 2; within runs, run 1
		// is 2/1 and run 2 is 20/20.
		{"within each run, not of the medians", &results.Series{Values: []float64{2, 20}}, &results.Series{Values: []float64{1, 20}},
			runRatio{median: 1.5, lo: 1, hi: 2, paired: true}, true},
		{"a failed run: medians", &results.Series{Values: []float64{30, 10}}, &results.Series{Values: []float64{10}},
			runRatio{median: 2, lo: 2, hi: 2}, true},
		{"no figure", &results.Series{NA: "not supported"}, &results.Series{Values: []float64{1}}, runRatio{}, false},
		{"no base", &results.Series{Values: []float64{1}}, nil, runRatio{}, false},
		{"a zero base", &results.Series{Values: []float64{1}}, &results.Series{Values: []float64{0}}, runRatio{}, false},
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

// tableRows returns the rows of the Markdown tables in s, but for headers.
func tableRows(s string) []string {
	var got []string
	for line := range strings.Lines(s) {
		if strings.HasPrefix(line, "| ") && !strings.HasPrefix(line, "| target") {
			got = append(got, strings.TrimSpace(line))
		}
	}
	return got
}

// TestTargetsTable checks the targets table on made-up figures: which
// targets each uproxy path meets, the closest figure of one that none
// meets with a link to its profile, and the control plane's rows at
// 10,000 services (not the largest scale).
func TestTargetsTable(t *testing.T) {
	series := func(v ...float64) *results.Series { return &results.Series{Values: v} }
	dp := &results.DataPathResults{
		Paths: []results.Subject{{ID: "dnat", Title: "DNAT"}, {ID: "haproxy", Title: "HAProxy"}, {ID: "nginx", Title: "nginx"},
			{ID: "uproxy", Title: "uproxy A"}, {ID: "uproxy-b", Title: "uproxy B"},
			// An older binary (--baseline) meets no target for the current one.
			{ID: "uproxy-baseline", Title: "uproxy A, baseline"}},
		Figures: map[string]map[string]*results.Series{
			"bulk_gbps": {"dnat": series(20, 10), "uproxy": series(10, 6), "uproxy-b": series(12, 5)},
			// A meets the nginx bound but not DNAT's; B both.
			"dns_rps":   {"dnat": series(100, 100), "nginx": series(50, 50), "uproxy": series(70, 70), "uproxy-b": series(80, 76)},
			"rr_rps":    {"haproxy": series(100, 100), "uproxy": series(120, 110), "uproxy-b": series(100, 90), "uproxy-baseline": series(200, 200)},
			"rr_p99_us": {"haproxy": series(100, 100), "uproxy": series(90, 100), "uproxy-b": series(110, 120)},
			"short_cps": {"haproxy": series(10, 10), "uproxy": series(9, 9)},
			"udp_rps":   {"dnat": series(200, 200), "nginx": series(100, 100), "uproxy": series(150, 160), "uproxy-b": series(140, 140)},
			"idle_kib":  {"haproxy": series(3.3), "uproxy": series(1), "uproxy-b": series(4)},
		},
		Profiles:     map[string]*results.Profile{"uproxy": {}},
		BulkProfiles: map[string]*results.Profile{"uproxy": {}},
	}
	cp := &results.ControlPlaneResults{
		Proxies: []results.Subject{{ID: "dnat", Title: "DNAT"}, {ID: "kp-nftables", Title: "kube-proxy nftables"},
			{ID: "uproxy", Title: "uproxy A"}, {ID: "uproxy-tproxy", Title: "uproxy tproxy"}},
		Scales: []int{1000, 10000, 20000},
		Figures: map[string]map[string]map[string]*results.Series{
			"rss_mib": {"kp-nftables": {"10000": series(100, 120)}, "uproxy": {"10000": series(60, 70)},
				"uproxy-tproxy": {"10000": series(60, 60), "20000": series(10)}},
			// Only tproxy mode's first sync is a target: uproxy A's is shown.
			"after_lists_s": {"uproxy": {"1000": series(0.1), "10000": series(0.5, 0.6)}, "uproxy-tproxy": {"10000": series(0.8, 1.2, 1.3)}},
			"change_sync_ms": {"uproxy": {"10000": series(3, 4, 5, 6)},
				"uproxy-tproxy": {"10000": series(3, 4, 5, 60)}},
			"change_commands": {"uproxy": {"10000": series(0, 0)}, "uproxy-tproxy": {"10000": series(0, 2)}},
		},
		Endpoints: 10,
		// Where the memory goes, for the unmet RSS target.
		HeapProfiles: map[string]*results.HeapProfile{"uproxy-tproxy": {Scale: 20000, Top: "flat flat%"}},
	}
	var b strings.Builder
	writeTargets(&b, dp, cp, true, true)
	want := []string{
		"| `dns` (UDP, a new port per query) request rate ≥ 1.3× nginx stream and ≥ 0.75× kernel DNAT | 1.40× nginx, 0.70× DNAT | 1.56× (1.52–1.60) nginx, 0.78× (0.76–0.80) DNAT | yes: uproxy B |",
		"| keep-alive request rate ≥ 1.15× HAProxy | 1.15× (1.10–1.20) | 0.95× (0.90–1.00) | yes: uproxy A |",
		"| short-connection rate ≥ 1.0× HAProxy | 0.90× | n/a | no: closest uproxy A (0.90×) |",
		"| keep-alive p99 latency ≤ HAProxy's | 0.95× (0.90–1.00) | 1.15× (1.10–1.20) | yes: uproxy A |",
		"| bulk TCP throughput ≥ 0.90× kernel DNAT | 0.55× (0.50–0.60) | 0.55× (0.50–0.60) | no: closest uproxy A (0.55× (0.50–0.60)); profile: [Bulk transfers](#bulk-transfers), [uproxy A's](#uproxy-a-bulk-transfers) |",
		"| memory per idle connection ≤ HAProxy's | 1.00 KiB, 0.30× | 4.00 KiB, 1.21× | yes: uproxy A |",
		"| long-flow UDP (`udp`) request rate no lower than before (the baseline binary's, in the same runs) | 0.78× DNAT, 1.55× nginx | 0.70× DNAT, 1.40× nginx | not decidable in this run: no baseline binary was measured (--baseline or --baseline-rev); the cells are the ratios to kernel DNAT and nginx stream |",
		"| RSS ≤ 0.5× kube-proxy nftables's, in the same run | 65.0 MiB, 0.59× (0.58–0.60) | 60.0 MiB, 0.55× (0.50–0.60) | no; profile: [Where uproxy's memory goes](#where-uproxys-memory-goes) |",
		"| tproxy mode: first sync ≤ 1 s after the informers' initial lists (median of the runs) | 0.550 s | 1.20 s | no; no CPU profile of the first sync is taken (one would slow the sync it measures): see [Control plane results](#control-plane-results) |",
		"| endpoint change followed by traffic ≤ 10 ms p99, from uproxy's sync (every change of every run) | 6.00 ms | 60.0 ms | yes: uproxy A |",
		"| no iptables or ipset process run for an endpoint change (the most any change ran) | 0 | 2 | yes: uproxy A |",
	}
	if diff := cmp.Diff(want, tableRows(b.String())); diff != "" {
		t.Errorf("targets table (-want +got):\n%s\nwhole:\n%s", diff, b.String())
	}
	if !strings.Contains(b.String(), "Control plane, at 10,000 services × 10 endpoints:") {
		t.Errorf("the control-plane targets are not at 10,000 services:\n%s", b.String())
	}
}

// TestUDPTargetBaseline checks the long-flow UDP target with a baseline
// binary in the same runs: within noise or better meets it, worse does
// not, and a path without a twin shows its yardstick ratios.
func TestUDPTargetBaseline(t *testing.T) {
	series := func(v ...float64) *results.Series { return &results.Series{Values: v} }
	paths := []results.Subject{{ID: "uproxy", Title: "uproxy A"}, {ID: "uproxy-b", Title: "uproxy B"}, {ID: "uproxy-c", Title: "uproxy C"}}
	for _, tc := range []struct {
		name     string
		a, aBase *results.Series
		want     string
	}{
		{"within noise", series(98, 100, 102), series(99, 101, 103),
			"| long-flow UDP (`udp`) request rate no lower than before (the baseline binary's, in the same runs) | 0.99× the baseline: within noise | 0.99× the baseline: within noise | 0.50× DNAT | yes: uproxy A; uproxy B |"},
		{"worse", series(80, 81, 82), series(99, 101, 103),
			"| long-flow UDP (`udp`) request rate no lower than before (the baseline binary's, in the same runs) | 0.80× the baseline: worse | 0.99× the baseline: within noise | 0.50× DNAT | yes: uproxy B |"},
	} {
		dp := &results.DataPathResults{Figures: map[string]map[string]*results.Series{"udp_rps": {
			"dnat": series(100, 100, 100), "uproxy": tc.a, "uproxy-baseline": tc.aBase,
			"uproxy-b": series(98, 100, 102), "uproxy-b-baseline": series(99, 101, 103), "uproxy-c": series(50, 50, 50)}}}
		var b strings.Builder
		writeUDPTarget(&b, dp, paths)
		if diff := cmp.Diff([]string{tc.want}, tableRows(b.String())); diff != "" {
			t.Errorf("%s (-want +got):\n%s", tc.name, diff)
		}
	}
	// Every twin slower: not met, with the paths that decided it.
	dp := &results.DataPathResults{Figures: map[string]map[string]*results.Series{"udp_rps": {
		"uproxy": series(80, 81, 82), "uproxy-baseline": series(99, 101, 103)}}}
	var b strings.Builder
	writeUDPTarget(&b, dp, paths[:1])
	want := "| long-flow UDP (`udp`) request rate no lower than before (the baseline binary's, in the same runs) | 0.80× the baseline: worse | no: slower than the baseline (uproxy A) |"
	if diff := cmp.Diff([]string{want}, tableRows(b.String())); diff != "" {
		t.Errorf("all worse (-want +got):\n%s", diff)
	}
}

func TestAnchor(t *testing.T) {
	got := []string{anchor("Keep-alive requests"), anchor("uproxy (io_uring): UDP queries from a new port"), anchor(heapSection)}
	want := []string{"keep-alive-requests", "uproxy-io_uring-udp-queries-from-a-new-port", "where-uproxys-memory-goes"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("anchors (-want +got):\n%s", diff)
	}
}

// TestHeapProfiles checks the section that the RSS target links to: its
// title, and each uproxy's profile or why there is none.
func TestHeapProfiles(t *testing.T) {
	cp := &results.ControlPlaneResults{
		Proxies: []results.Subject{{ID: "kp-nftables", Title: "kube-proxy nftables"}, {ID: "uproxy", Title: "uproxy A"}, {ID: "uproxy-tproxy", Title: "uproxy tproxy"}},
		HeapProfiles: map[string]*results.HeapProfile{
			"uproxy":        {Scale: 20000, RSSMiB: 300, Top: "      flat  flat%\n   100MB 50% proxy.(*tracker).apply"},
			"uproxy-tproxy": {Scale: 20000, RSSMiB: 310, NA: "fetching /debug/pprof/heap: exit status 7"},
		},
	}
	var b strings.Builder
	writeHeapProfiles(&b, cp)
	for _, want := range []string{
		"### " + heapSection + "\n",
		"#### uproxy A: heap at 20,000 services (RSS 300 MiB)\n\n```\n      flat  flat%\n   100MB 50% proxy.(*tracker).apply\n```\n",
		"#### uproxy tproxy: heap at 20,000 services (RSS 310 MiB)\n\nn/a: fetching /debug/pprof/heap: exit status 7\n",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("no %q in:\n%s", want, b.String())
		}
	}
	var none strings.Builder
	writeHeapProfiles(&none, &results.ControlPlaneResults{})
	if diff := cmp.Diff("", none.String()); diff != "" {
		t.Errorf("without profiles (-want +got):\n%s", diff)
	}
}

// TestTargetsFile checks targets.json: it parses, and each target's text
// states the bound the report checks, so that the two cannot drift apart.
func TestTargetsFile(t *testing.T) {
	tf, err := parseTargets(targetsJSON)
	if err != nil {
		t.Fatal(err)
	}
	if len(tf.DataPath) == 0 || len(tf.ControlPlane.Targets) == 0 {
		t.Fatalf("targets.json has %d data-path and %d control-plane targets", len(tf.DataPath), len(tf.ControlPlane.Targets))
	}
	for _, d := range tf.DataPath {
		for _, bd := range d.Bounds {
			if bd.Ratio != 1 && !strings.Contains(d.What, strconv.FormatFloat(bd.Ratio, 'f', -1, 64)) {
				t.Errorf("%q does not state its bound %g", d.What, bd.Ratio)
			}
		}
	}
	for _, c := range tf.ControlPlane.Targets {
		if c.AtMost != 0 && !strings.Contains(c.What, strconv.FormatFloat(c.AtMost, 'f', -1, 64)) {
			t.Errorf("%q does not state its bound %g", c.What, c.AtMost)
		}
	}
}

// TestTargetsFileErrors checks that a mistake in the targets file is an
// error naming the target and the field.
func TestTargetsFileErrors(t *testing.T) {
	const good = `{"dataPath": [{"what": "w", "metric": "rr_rps", "bounds": [{"base": "haproxy", "title": "HAProxy", "ratio": 1.1}]}],
		"baseline": {"what": "b", "metric": "udp_rps"}, "controlPlane": {"scale": 10, "targets": [{"id": "rss", "what": "r", "atMost": 0.5}]}}`
	if _, err := parseTargets([]byte(good)); err != nil {
		t.Fatalf("a good file: %v", err)
	}
	for _, tt := range []struct{ name, from, to, want string }{
		{"unknown metric", `"metric": "rr_rps"`, `"metric": "rr_rpz"`, `dataPath[0] (w): metric "rr_rpz" is not a data-path metric`},
		{"no ratio", `"ratio": 1.1`, `"ratio": 0`, `dataPath[0] (w): bounds[0] needs a base, a title and a positive ratio`},
		{"unknown field", `"atMost": 0.5`, `"atMots": 0.5`, `unknown field "atMots"`},
		{"unknown control-plane target", `"id": "rss"`, `"id": "cpu"`, `controlPlane.targets[0]: id "cpu" is none of`},
		{"no scale", `"scale": 10`, `"scale": 0`, `controlPlane.scale must be positive`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseTargets([]byte(strings.Replace(good, tt.from, tt.to, 1)))
			if err == nil || !strings.Contains(err.Error(), "targets.json: ") || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one naming targets.json and containing %q", err, tt.want)
			}
		})
	}
}

// TestFmtNum checks the report's number format: thousands separated from
// 10,000 on, no decimals from 100 on.
func TestFmtNum(t *testing.T) {
	if got := FmtNum(12345.6); got != "12,346" {
		t.Errorf("FmtNum(12345.6) = %q", got)
	}
}
