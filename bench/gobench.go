package main

import (
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/uproxy/uproxy/bench/internal/harness"

	"github.com/uproxy/uproxy/bench/internal/results"
)

// goBenchPackages are the packages whose benchmarks cover the hot paths.
var goBenchPackages = []string{"./balancer/", "./redirect/", "./proxy/"}

// hotPaths are the hot paths the issue asks benchmarks for: a benchmark
// covers one when its package matches and its name matches the pattern.
var hotPaths = []struct {
	What, Package string
	Name          *regexp.Regexp
	Owner         string
}{
	{"balancer Pick", "./balancer/", regexp.MustCompile(`^BenchmarkPick`), "balancer"},
	{"flow table lookup", "", regexp.MustCompile(`(?i)flow|lookup|conntrack|session`), "proxy (UDP flows) or redirect"},
	{"rule rendering for 10k services", "./redirect/", regexp.MustCompile(`(?i)render`), "redirect"},
	{"the sync after one endpoint change, among 10k services", "./proxy/", regexp.MustCompile(`^BenchmarkSyncEndpointChange`), "proxy"},
}

var benchLine = regexp.MustCompile(`^(Benchmark\S+?)(?:-\d+)?\s+\d+\s+([\d.]+) ns/op(?:\s+([\d.]+) B/op)?(?:\s+([\d.]+) allocs/op)?`)

func runGoBench(ctx context.Context, e *harness.Env) error {
	cfg := e.Config
	benchtime := "1s"
	if cfg.Smoke {
		// One iteration each: smoke checks that every benchmark runs and
		// parses, and some (BenchmarkSyncAll) set up 10,000 services per
		// iteration.
		benchtime = "1x"
	}
	args := []string{"test", "-run", "^$", "-bench", ".", "-benchmem", "-count", strconv.Itoa(cfg.Runs), "-benchtime", benchtime}
	res := &results.GoBenchResults{
		Meta:    harness.NewRunMeta(e, fmt.Sprintf("go %s", strings.Join(args, " "))),
		Command: "go " + strings.Join(args, " ") + " " + strings.Join(goBenchPackages, " "),
	}
	for _, pkg := range goBenchPackages {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		start := time.Now()
		cmd := exec.CommandContext(ctx, "go", append(args, pkg)...)
		cmd.Dir = cfg.Root
		out, err := cmd.CombinedOutput()
		p := results.GoBenchPkg{Package: pkg, Output: string(out)}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			p.NA = fmt.Sprintf("go test failed (%v): %s", err, harness.Tail(string(out), 5))
			e.Logf("gobench %s: n/a: %s", pkg, p.NA)
			res.Packages = append(res.Packages, p)
			continue
		}
		found := map[string]*results.GoBenchEntry{}
		var order []string
		for _, line := range strings.Split(string(out), "\n") {
			m := benchLine.FindStringSubmatch(line)
			if m == nil {
				continue
			}
			be := found[m[1]]
			if be == nil {
				be = &results.GoBenchEntry{Package: pkg, Name: m[1]}
				found[m[1]] = be
				order = append(order, m[1])
			}
			for _, f := range []struct {
				s *results.Series
				v string
			}{{&be.NsPerOp, m[2]}, {&be.BytesPerOp, m[3]}, {&be.AllocsPerOp, m[4]}} {
				if v, err := strconv.ParseFloat(f.v, 64); err == nil {
					f.s.Add(v)
				}
			}
		}
		for _, name := range order {
			res.Benchmarks = append(res.Benchmarks, *found[name])
		}
		res.Packages = append(res.Packages, p)
		e.Logf("gobench %s: %d benchmarks in %v", pkg, len(order), time.Since(start).Round(100*time.Millisecond))
	}
	for _, h := range hotPaths {
		hp := results.HotPath{What: h.What, Owner: h.Owner, Benchmarks: []string{}}
		for _, b := range res.Benchmarks {
			if (h.Package == "" || b.Package == h.Package) && h.Name.MatchString(b.Name) {
				hp.Benchmarks = append(hp.Benchmarks, strings.TrimPrefix(b.Package, "./")+b.Name)
			}
		}
		if len(hp.Benchmarks) == 0 {
			e.Logf("gobench: no benchmark covers %s (to be added in %s)", h.What, h.Owner)
		}
		res.HotPaths = append(res.HotPaths, hp)
	}
	res.Meta.Finish()
	return harness.WriteJSON(cfg, "gobench.json", res)
}
