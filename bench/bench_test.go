package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/bench/internal/paths"

	"github.com/uproxy/uproxy/bench/internal/harness"

	"github.com/uproxy/uproxy/bench/internal/results"

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
	err := runParts(ctx, harness.Config{Smoke: true, Out: out, Stem: "smoke", Verbose: true, Log: &logWriter{t: t, buf: &log}}, parts, true)
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
	for _, p := range paths.All {
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

// TestWorkloads checks --workloads: known ids select, an unknown one is
// refused, and none selects every workload.
func TestWorkloads(t *testing.T) {
	c, err := harness.Config{Workloads: []string{"udp", "idle"}}.WithDefaults(partCatalog())
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, w := range paths.WorkloadIDs {
		if c.Measures(w) {
			got = append(got, w)
		}
	}
	if diff := cmp.Diff([]string{"udp", "idle"}, got); diff != "" {
		t.Errorf("selected workloads (-want +got):\n%s", diff)
	}
	if _, err := (harness.Config{Workloads: []string{"udp", "sctp"}}).WithDefaults(partCatalog()); err == nil || !strings.Contains(err.Error(), `"sctp"`) {
		t.Errorf("unknown workload: error %v, want one naming it", err)
	}
	for _, w := range paths.WorkloadIDs {
		if !(harness.Config{}).Measures(w) {
			t.Errorf("no --workloads: %s not measured", w)
		}
	}
	for w, metrics := range paths.WorkloadMetrics {
		for _, m := range metrics {
			if !slices.ContainsFunc(results.DataPathMetrics, func(d results.Metric) bool { return d.ID == m }) {
				t.Errorf("workload %s: metric %s is not a data-path metric", w, m)
			}
		}
	}
}
