package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

const sample = `<?xml version="1.0" encoding="UTF-8"?>
<testsuites>
  <testsuite name="Kubernetes e2e suite">
    <testcase name="[SynchronizedBeforeSuite]" status="passed"></testcase>
    <testcase name="[It] [sig-network] Services should serve a basic endpoint from pods [Conformance]" status="passed"></testcase>
    <testcase name="[It] [sig-network] Services should be rejected when no endpoints exist" status="failed"><failure message="connection reset&#xA;more">x</failure></testcase>
    <testcase name="[It] [sig-network] Services should work after restarting apiserver [Disruptive]" status="skipped"><skipped message="skipped - Requires at least 2 nodes (not 1)"></skipped></testcase>
    <testcase name="[It] [sig-storage] something else" status="passed"></testcase>
  </testsuite>
</testsuites>`

func TestReadJUnit(t *testing.T) {
	for _, tc := range []struct {
		name  string
		focus string
		skip  string
		want  map[string]result
	}{
		{
			name:  "focus",
			focus: `\[sig-network\] Services`,
			want: map[string]result{
				"[sig-network] Services should serve a basic endpoint from pods [Conformance]": {Status: "passed"},
				"[sig-network] Services should be rejected when no endpoints exist":            {Status: "failed", Message: "connection reset"},
				"[sig-network] Services should work after restarting apiserver [Disruptive]":   {Status: "skipped", Message: "Requires at least 2 nodes (not 1)"},
			},
		},
		{
			name:  "skip",
			focus: `\[sig-network\] Services`,
			skip:  `Disruptive|rejected`,
			want: map[string]result{
				"[sig-network] Services should serve a basic endpoint from pods [Conformance]": {Status: "passed"},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var skip *regexp.Regexp
			if tc.skip != "" {
				skip = regexp.MustCompile(tc.skip)
			}
			got, err := readJUnit(strings.NewReader(sample), regexp.MustCompile(tc.focus), skip)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("readJUnit (-want +got):\n%s", diff)
			}
		})
	}
}

func TestRun(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	ours := write("ours.xml", sample)
	theirs := write("theirs.xml", strings.Replace(sample, `status="failed"><failure message="connection reset&#xA;more">x</failure>`, `status="passed">`, 1))
	reasons := write("reasons", "# comment\nDisruptive\tneeds two nodes\n")
	out := filepath.Join(dir, "out.md")
	var stdout strings.Builder
	err := run([]string{"-focus", `\[sig-network\] Services`, "-count", "uproxy", "-reasons", reasons, "-out", out,
		"kube-proxy=" + theirs, "uproxy=" + ours, "missing=" + filepath.Join(dir, "none.xml")}, &stdout)
	if err == nil || !strings.Contains(err.Error(), "1 spec(s) fail with uproxy") {
		t.Errorf("run: error %v, want the spec that fails only with uproxy", err)
	}
	wantOut := "fails only with uproxy: uproxy: [sig-network] Services should be rejected when no endpoints exist (passes with kube-proxy)\n" +
		"conformance: 1 passed, 1 failed, 1 skipped\n"
	if diff := cmp.Diff(wantOut, stdout.String()); diff != "" {
		t.Errorf("stdout (-want +got):\n%s", diff)
	}
	md, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	wantMD := `| spec | kube-proxy | uproxy | missing | why not run, or not passed |
|---|---|---|---|---|
| [sig-network] Services should be rejected when no endpoints exist | pass | **fail** | not run |  |
| [sig-network] Services should serve a basic endpoint from pods [Conformance] | pass | pass | not run |  |
| [sig-network] Services should work after restarting apiserver [Disruptive] | skip | skip | not run | needs two nodes |
`
	if diff := cmp.Diff(wantMD, string(md)); diff != "" {
		t.Errorf("table (-want +got):\n%s", diff)
	}
}

// TestRunNothingRan checks that a counted run with no report, or one whose
// specs were all skipped, is an error, not a pass.
func TestRunNothingRan(t *testing.T) {
	dir := t.TempDir()
	skipped := filepath.Join(dir, "skipped.xml")
	text := strings.NewReplacer(`status="passed"`, `status="skipped"`, `status="failed"`, `status="skipped"`,
		`<failure message="connection reset&#xA;more">x</failure>`, "").Replace(sample)
	if err := os.WriteFile(skipped, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, file := range []string{filepath.Join(dir, "none.xml"), skipped} {
		var stdout strings.Builder
		err := run([]string{"-focus", `\[sig-network\] Services`, "-out", filepath.Join(dir, "out.md"), "uproxy=" + file}, &stdout)
		if err == nil || !strings.Contains(err.Error(), "no spec passed or failed") {
			t.Errorf("%s: error %v, want one saying no spec ran", filepath.Base(file), err)
		}
	}
}

// TestTableReasons checks where a known reason goes: on a spec that did
// not pass somewhere, matched by its name or by the suite's message, and
// on no spec that passed in every column.
func TestTableReasons(t *testing.T) {
	reasons, err := readReasons(strings.NewReader("Requires at least 2 nodes\tneeds two nodes\nLoadBalancer\tneeds a cloud load balancer\n"))
	if err != nil {
		t.Fatal(err)
	}
	cols := []column{
		{name: "a", results: map[string]result{
			"x on Type LoadBalancer":  {Status: "passed"},
			"y":                       {Status: "skipped", Message: "Requires at least 2 nodes (not 1)"},
			"z on Type LoadBalancer":  {Status: "skipped", Message: "no cloud"},
			"zz on Type LoadBalancer": {Status: "skipped", Message: "no cloud"},
		}},
		{name: "b", results: map[string]result{
			"x on Type LoadBalancer":  {Status: "passed"},
			"y":                       {Status: "skipped", Message: "Requires at least 2 nodes (not 1)"},
			"z on Type LoadBalancer":  {Status: "passed"},
			"zz on Type LoadBalancer": {Status: "skipped", Message: "no cloud"},
		}},
	}
	want := `| spec | a | b | why not run, or not passed |
|---|---|---|---|
| x on Type LoadBalancer | pass | pass |  |
| y | skip | skip | needs two nodes |
| z on Type LoadBalancer | skip | pass | no cloud |
| zz on Type LoadBalancer | skip | skip | needs a cloud load balancer |
`
	if diff := cmp.Diff(want, table(cols, reasons)); diff != "" {
		t.Errorf("table (-want +got):\n%s", diff)
	}
}
