package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/bench/lab"
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
	lab.RequireRoot(t, "iptables-restore", "iptables-save", "curl")
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
	for _, want := range []string{"## Summary", "## The machine", "## Data path results", "## Control plane results", "## Go benchmarks", "## Where the CPU goes", "## Not measured"} {
		if !bytes.Contains(report, []byte(want)) {
			t.Errorf("the report has no %q section", want)
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
