package main

import (
	"context"
	"errors"
	"fmt"
	"os/signal"
	"syscall"
	"time"

	"github.com/uproxy/uproxy/bench/internal/paths"

	"github.com/uproxy/uproxy/bench/internal/controlplane"

	"github.com/uproxy/uproxy/bench/internal/harness"

	"github.com/uproxy/uproxy/bench/internal/report"

	"github.com/spf13/cobra"
)

// part is one benchmark part: it measures and writes its JSON results.
type part struct {
	name  string
	short string
	run   func(ctx context.Context, e *harness.Env) error
}

var parts = []part{
	{"datapath", "Every workload through every data path (network namespaces)", paths.Run},
	{"controlplane", "Services × endpoints in a real API server: programming time, endpoint change latency, rules, RSS", controlplane.Run},
	{"gobench", "go test -bench for the hot paths (balancer, redirect, proxy)", runGoBench},
}

// newPartCommands returns one command per part, plus report and all.
func newPartCommands() []*cobra.Command {
	var cmds []*cobra.Command
	for _, p := range parts {
		var c harness.Config
		cmd := &cobra.Command{
			Use:   p.name,
			Short: p.short,
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				c.Command = harness.CommandLine()
				return runParts(cmd.Context(), c, []part{p}, false)
			},
		}
		harness.RegisterConfigFlags(cmd.Flags(), &c, partCatalog())
		cmds = append(cmds, cmd)
	}
	var rc harness.Config
	reportCmd := &cobra.Command{
		Use:   "report",
		Short: "Assemble OUT/STEM.md and its PNG charts from the parts' results",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := rc.WithDefaults(partCatalog())
			if err != nil {
				return err
			}
			sum, err := report.Write(cfg.ReportOutput())
			if err != nil {
				return err
			}
			fmt.Fprintf(cfg.Log, "bench: report: %s (%d charts); %d figures, %d n/a\n", cfg.ReportPath(), sum.Charts, sum.Figures, sum.NA)
			return errors.Join(sum.Errors...)
		},
	}
	harness.RegisterConfigFlags(reportCmd.Flags(), &rc, partCatalog())
	var ac harness.Config
	all := &cobra.Command{
		Use:   "all",
		Short: "Run every part, then the report (make bench; --smoke for make bench-smoke)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ac.Command = harness.CommandLine()
			return runParts(cmd.Context(), ac, parts, true)
		},
	}
	harness.RegisterConfigFlags(all.Flags(), &ac, partCatalog())
	return append(cmds, reportCmd, all)
}

// runParts runs the parts in order, then (if report) the report. A part
// that fails does not stop the next ones; the error is returned at the
// end, after the report, which says what failed.
func runParts(ctx context.Context, c harness.Config, ps []part, withReport bool) error {
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	cfg, err := c.WithDefaults(partCatalog())
	if err != nil {
		return err
	}
	start := time.Now()
	fmt.Fprintf(cfg.Log, "bench: results in %s (report %s)\n", cfg.DataDir(), cfg.ReportPath())
	e, err := harness.NewEnv(ctx, cfg)
	if err != nil {
		return err
	}
	defer e.Close()
	var errs []error
	for _, p := range ps {
		if ctx.Err() != nil {
			break
		}
		pstart := time.Now()
		e.Logf("== %s", p.name)
		if err := p.run(ctx, e); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", p.name, err))
			e.Logf("== %s FAILED after %v: %v", p.name, time.Since(pstart).Round(time.Second), err)
			continue
		}
		e.Logf("== %s done in %v", p.name, time.Since(pstart).Round(time.Second))
	}
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted: %w", ctx.Err())
	}
	if withReport {
		sum, err := report.Write(cfg.ReportOutput())
		if err != nil {
			errs = append(errs, fmt.Errorf("report: %w", err))
		} else {
			e.Logf("report: %s (%d charts); %d figures, %d n/a", cfg.ReportPath(), sum.Charts, sum.Figures, sum.NA)
			errs = append(errs, sum.Errors...)
		}
	}
	e.Logf("total %v", time.Since(start).Round(time.Second))
	return errors.Join(errs...)
}

// partCatalog is what the parts measure, from their tables.
func partCatalog() harness.Catalog {
	return harness.Catalog{Paths: paths.IDs(), CheckPath: paths.CheckPath, Workloads: paths.WorkloadIDs, Proxies: controlplane.ProxyIDs()}
}
