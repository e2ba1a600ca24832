package main

import (
	"bytes"
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/uproxy/uproxy/internal/testlab"
)

// TestSmoke runs every benchmark part in smoke mode (tiny durations and
// counts) into a temporary folder, and checks that the harness works end to
// end: the report and its charts are written, and every figure has a value
// or says why not. It asserts nothing about performance: that is measured
// by `make bench`, never asserted in a test.
func TestSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping: the smoke benchmarks build namespaces and start real proxies (not -short)")
	}
	testlab.RequireRoot(t, "iptables-restore", "iptables-save", "curl")
	out := t.TempDir()
	var log bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	start := time.Now()
	err := runParts(ctx, Config{Smoke: true, Out: out, Stem: "smoke", Verbose: true, Log: &logWriter{t: t, buf: &log}}, parts, true)
	t.Logf("smoke run took %v", time.Since(start).Round(time.Second))
	if err != nil {
		t.Fatalf("smoke run: %v", err)
	}
	report, err := os.ReadFile(filepath.Join(out, "smoke.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"## Summary", "## The machine", "## Data path results", "## Control plane results", "## Go benchmarks", "## Where the CPU goes", "### Targets", "### Short connections", "### UDP requests", "### Bulk transfers", "## Not measured", "| one system call (getppid)",
		"### CPU per unit of work", "How each proxy's memory and its time to program every service grow"} {
		if !bytes.Contains(report, []byte(want)) {
			t.Errorf("the report has no %q", want)
		}
	}
	// Every data path and proxy has a row.
	for _, p := range dataPaths {
		if !bytes.Contains(report, []byte("| "+p.Title+" |")) {
			t.Errorf("the report has no row for %s", p.Title)
		}
	}
	pngs, _ := filepath.Glob(filepath.Join(out, "smoke", "*.png"))
	if len(pngs) == 0 {
		t.Error("no charts were drawn")
	}
	for _, p := range pngs {
		b, err := os.ReadFile(p)
		if err != nil || !bytes.HasPrefix(b, []byte("\x89PNG")) {
			t.Errorf("%s is not a PNG (%v)", p, err)
		}
	}
	// Every namespace the labs made is gone (the verbose log names them).
	for _, ns := range labNamespace.FindAllString(log.String(), -1) {
		if _, err := os.Stat(filepath.Join("/run/netns", ns)); err == nil {
			t.Errorf("namespace %s was left behind", ns)
		}
	}
}

var labNamespace = regexp.MustCompile(`uplab-[a-z0-9-]+-[0-9a-f]{6}\b`)

// logWriter sends the harness's progress lines to the test log.
type logWriter struct {
	t   *testing.T
	buf *bytes.Buffer
}

func (w *logWriter) Write(p []byte) (int, error) {
	w.buf.Write(p)
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func TestHistQuantiles(t *testing.T) {
	var h hist
	for i := 1; i <= 1000; i++ {
		h.record(time.Duration(i) * time.Microsecond)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Microsecond}, {0.99, 990 * time.Microsecond}, {1, 1000 * time.Microsecond}} {
		got := h.quantile(c.q)
		if d := float64(got-c.want) / float64(c.want); d < -0.035 || d > 0.035 {
			t.Errorf("quantile(%v) = %v, want %v ± 3.5%%", c.q, got, c.want)
		}
	}
	var empty hist
	if empty.quantile(0.5) != 0 {
		t.Error("an empty histogram's quantile is not 0")
	}
}

func TestRenderDNAT(t *testing.T) {
	eps := []netip.AddrPort{netip.MustParseAddrPort("10.244.0.10:8080"), netip.MustParseAddrPort("10.244.0.11:8080"), netip.MustParseAddrPort("10.244.0.12:8080")}
	p := dnatPort{Name: "default/web:http", ClusterIP: netip.MustParseAddr("10.96.0.10"), Port: 80, Protocol: "tcp", Endpoints: eps}
	rules := renderDNAT([]dnatPort{p}, "10.244.0.0/16")
	for _, want := range []string{
		"-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment \"default/web:http cluster IP\" -m tcp --dport 80 -j " + svcChain(p),
		"-m statistic --mode random --probability 0.33333333333 -j " + sepChain(p, eps[0]),
		"-m statistic --mode random --probability 0.50000000000 -j " + sepChain(p, eps[1]),
		"-A " + svcChain(p) + " -m comment --comment \"default/web:http -> 10.244.0.12:8080\" -j " + sepChain(p, eps[2]),
		"-A " + sepChain(p, eps[2]) + " -p tcp -m comment --comment \"default/web:http\" -m tcp -j DNAT --to-destination 10.244.0.12:8080",
	} {
		if !strings.Contains(rules, want+"\n") {
			t.Errorf("rules lack %q:\n%s", want, rules)
		}
	}
	if len(svcChain(p)) > 28 {
		t.Errorf("chain name %q is longer than iptables allows", svcChain(p))
	}
	moved := p
	moved.Endpoints = eps[2:]
	change := renderDNATChange(moved, eps, "10.244.0.0/16")
	if !strings.Contains(change, "-X "+sepChain(p, eps[0])+"\n") || strings.Contains(change, "-X "+sepChain(p, eps[2])) {
		t.Errorf("the change does not delete exactly the old endpoints' chains:\n%s", change)
	}
}

func TestSeriesStats(t *testing.T) {
	s := Series{Values: []float64{3, 1, 2, 10}}
	if lo, med, hi := s.stats(); lo != 1 || med != 2.5 || hi != 10 {
		t.Errorf("stats = %v %v %v, want 1 2.5 10", lo, med, hi)
	}
	if q := s.quantile(0.5); q != 2 {
		t.Errorf("p50 = %v, want 2", q)
	}
	if got := fmtNum(12345.6); got != "12,346" {
		t.Errorf("fmtNum(12345.6) = %q", got)
	}
}

// TestWorkloads checks --workloads: known ids select, an unknown one is
// refused, and none selects every workload.
func TestWorkloads(t *testing.T) {
	c, err := Config{Workloads: []string{"udp", "idle"}}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, w := range workloadIDs {
		if c.measures(w) {
			got = append(got, w)
		}
	}
	if diff := cmp.Diff([]string{"udp", "idle"}, got); diff != "" {
		t.Errorf("selected workloads (-want +got):\n%s", diff)
	}
	if _, err := (Config{Workloads: []string{"udp", "sctp"}}).withDefaults(); err == nil || !strings.Contains(err.Error(), `"sctp"`) {
		t.Errorf("unknown workload: error %v, want one naming it", err)
	}
	for _, w := range workloadIDs {
		if !(Config{}).measures(w) {
			t.Errorf("no --workloads: %s not measured", w)
		}
	}
	for w, metrics := range workloadMetrics {
		for _, m := range metrics {
			if !slices.ContainsFunc(dataMetrics, func(d Metric) bool { return d.ID == m }) {
				t.Errorf("workload %s: metric %s is not a data-path metric", w, m)
			}
		}
	}
}
