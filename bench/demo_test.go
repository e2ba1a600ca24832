package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/uproxy/uproxy/bench/internal/harness"

	"github.com/uproxy/uproxy/internal/testlab"
)

// TestDemo runs `make demo`'s program, as a newcomer would, and checks that
// it tells the whole story: the rules, the spread of requests over the
// pods, one explain and one status, and the teardown; and that every
// program it ran comes from a package `make deps-demo` installs.
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping: the demo builds namespaces and runs uproxy (not -short)")
	}
	testlab.RequireRoot(t, "iptables-save", "curl")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := t.TempDir()
	benchBin, uproxyBin := filepath.Join(dir, "bench"), filepath.Join(dir, "uproxy")
	// The bench is a module of its own, built here; uproxy from the
	// main module above it.
	if err := harness.GoBuild(ctx, ".", benchBin, "."); err != nil {
		t.Fatal(err)
	}
	if err := harness.GoBuild(ctx, "..", uproxyBin, "./cmd/uproxy"); err != nil {
		t.Fatal(err)
	}
	// The demo runs with every program on PATH traced, so that the test
	// knows each package a fresh machine needs for it (see
	// checkDemoPackages).
	tracer := newExecTracer(t, os.Getenv("PATH"))
	cmd := exec.CommandContext(ctx, benchBin, "demo", "--uproxy", uproxyBin, "--manifests", "deploy/examples")
	cmd.Dir = ".."
	cmd.Env = tracer.env(os.Environ())
	b, err := cmd.CombinedOutput()
	out := string(b)
	t.Logf("demo output:\n%s", out)
	if err != nil {
		t.Fatalf("demo: %v", err)
	}
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`-A UPROXY-SERVICES -d 10\.96\.0\.10/32 .*-j REDIRECT --to-ports \d+`),
		regexp.MustCompile(`from the client pod: web-0=10 web-1=10 web-2=10`),
		regexp.MustCompile(`weighted-round-robin: +web-0=15 web-1=5 web-2=5`),
		regexp.MustCompile(`sessionAffinity ClientIP: +web-\d=25\n`),
		regexp.MustCompile(`\[nat\] -A UPROXY-SERVICES -d 10\.96\.0\.10/32 .*--dport 80 -j REDIRECT`),
		regexp.MustCompile(`service port: +default/web:http \(ClusterIP\)`),
		regexp.MustCompile(`route to 10\.244\.0\.10:8080: 10\.244\.0\.10 dev br0`),
		regexp.MustCompile(`default/web +http +TCP +IPv4 +ClusterIP 10\.96\.0\.10:80 +\d+ +redirect +round-robin`),
		regexp.MustCompile(`default/web +http +10\.244\.0\.12:8080 +ready,serving`),
		regexp.MustCompile(`removed every namespace`),
	} {
		if !want.MatchString(out) {
			t.Errorf("the demo's output has no match for %q", want)
		}
	}
	checkDemoPackages(t, tracer.ran(t))
	for _, ns := range labNamespace.FindAllString(out, -1) {
		if _, err := os.Stat(filepath.Join("/run/netns", ns)); err == nil {
			t.Errorf("namespace %s was left behind", ns)
		}
	}
}
