package report

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/uproxy/uproxy/bench/internal/results"
)

// beforeAfter is one row of the report's "Before and after": one figure of
// one uproxy data path, measured with the baseline binary and with the
// current one in the same run.
type beforeAfter struct {
	metric    results.Metric
	path      results.Subject // the current binary's path
	base, cur *results.Series
}

// beforeAfterRows pairs every data path with its baseline twin, figure by
// figure, in the report's order. Figures that neither binary has (a
// workload left out, say) are left out.
func beforeAfterRows(dp *results.DataPathResults) []beforeAfter {
	var rows []beforeAfter
	for _, m := range dp.Metrics {
		for _, p := range dp.Paths {
			if strings.HasSuffix(p.ID, results.BaselineSuffix) || !slices.ContainsFunc(dp.Paths, func(s results.Subject) bool { return s.ID == p.ID+results.BaselineSuffix }) {
				continue
			}
			r := beforeAfter{metric: m, path: p, base: dp.Figures[m.ID][p.ID+results.BaselineSuffix], cur: dp.Figures[m.ID][p.ID]}
			if !r.base.Measured() && !r.cur.Measured() {
				continue
			}
			rows = append(rows, r)
		}
	}
	return rows
}

// ratio is the current median over the baseline's.
func (r beforeAfter) ratio() float64 {
	b, c := median(r.base), median(r.cur)
	if b == 0 {
		return math.NaN()
	}
	return c / b
}

// noise is the larger of the two binaries' spreads: a difference within
// it is no larger than the difference between runs of one binary.
func (r beforeAfter) noise() float64 { return math.Max(r.base.Spread(), r.cur.Spread()) }

// overlap reports whether the ranges [min, max] of the two binaries' runs
// share a value.
func (r beforeAfter) overlap() bool {
	blo, _, bhi := r.base.Stats()
	clo, _, chi := r.cur.Stats()
	return blo <= chi && clo <= bhi
}

// Verdicts of a before-and-after row.
const (
	verdictNoise   = "within noise"
	verdictBetter  = "better"
	verdictWorse   = "worse"
	verdictUnknown = "no verdict"
)

// verdict says whether the current binary's figure is within noise of the
// baseline's, or better or worse beyond it; why says why there is no
// verdict, if so.
func (r beforeAfter) verdict() (verdict, why string) {
	switch {
	case !r.base.Measured() || !r.cur.Measured():
		return verdictUnknown, "only one binary has this figure"
	case len(r.base.Values) < 2 || len(r.cur.Values) < 2:
		return verdictUnknown, "fewer than 2 runs, so no spread to call noise"
	}
	d, noise := r.ratio()-1, r.noise()
	if math.IsNaN(d) || math.IsNaN(noise) {
		return verdictUnknown, "a median of 0"
	}
	if math.Abs(d) <= noise {
		return verdictNoise, ""
	}
	if (d > 0) == r.metric.Higher {
		return verdictBetter, ""
	}
	return verdictWorse, ""
}

// WriteBeforeAfter writes the "Before and after" section: every figure of
// every uproxy path measured with both binaries, side by side.
func WriteBeforeAfter(b *strings.Builder, dp *results.DataPathResults) {
	rows := beforeAfterRows(dp)
	b.WriteString("## Before and after\n\n")
	from, commit := "an unrecorded baseline", "unknown"
	if dp.Baseline != nil {
		from, commit = "`"+dp.Baseline.From+"`", dp.Baseline.Commit
	}
	fmt.Fprintf(b, "Every uproxy data path of this run was also measured with the baseline binary, %s (commit %s), with the same flags, "+
		"as a path of its own (the rows \"…, baseline\" above), right before or after the current binary (commit %s) in every run, "+
		"in labs of their own. Median of %d runs of each.\n\n", from, commit, dp.Meta.Commit, dp.Meta.Runs)
	b.WriteString("**Noise** is the larger of the two binaries' spreads, a binary's spread being (max − min) / median of its runs: how far\n" +
		"apart runs of one binary land on this machine in this run. A figure is **within noise** when the current median differs from the\n" +
		"baseline's by no more than that fraction; otherwise it is better or worse (by the metric's direction). **Ranges overlap** when the\n" +
		"[min, max] of the two binaries' runs share a value. With fewer than 2 runs there is no spread, so no verdict.\n\n")
	counts := map[string][]string{}
	for _, r := range rows {
		v, _ := r.verdict()
		counts[v] = append(counts[v], fmt.Sprintf("%s, %s (%s)", r.path.Title, shortTitle(r.metric), ratio(median(r.cur), median(r.base))))
	}
	fmt.Fprintf(b, "%d of %d figures within noise.", len(counts[verdictNoise]), len(rows))
	for _, v := range []string{verdictWorse, verdictBetter} {
		if len(counts[v]) > 0 {
			fmt.Fprintf(b, " %s: %s.", strings.ToUpper(v[:1])+v[1:], strings.Join(counts[v], "; "))
		}
	}
	if n := len(counts[verdictUnknown]); n > 0 {
		fmt.Fprintf(b, " %d without a verdict (the table says why).", n)
	}
	b.WriteString("\n\n| figure | data path | baseline: median (min – max) | current: median (min – max) | current ÷ baseline | noise | ranges overlap | verdict |\n" +
		"|---|---|---:|---:|---:|---:|---|---|\n")
	for _, r := range rows {
		v, why := r.verdict()
		if why != "" {
			v += ": " + why
		}
		overlap := "–"
		if r.base.Measured() && r.cur.Measured() {
			overlap = map[bool]string{true: "yes", false: "no"}[r.overlap()]
		}
		noise := "–"
		if n := r.noise(); !math.IsNaN(n) && len(r.base.Values) > 1 && len(r.cur.Values) > 1 {
			noise = fmt.Sprintf("±%.1f%%", 100*n)
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %s | %s | %s |\n", shortTitle(r.metric), r.path.Title,
			rangeCell(r.base), rangeCell(r.cur), ratio(median(r.cur), median(r.base)), noise, overlap, mdEscape(v))
	}
	b.WriteString("\n")
}

// rangeCell formats a series as "median (min – max)", or its n/a reason.
func rangeCell(s *results.Series) string {
	if !s.Measured() {
		if s != nil && s.NA != "" {
			return "n/a: " + mdEscape(s.NA)
		}
		return "n/a"
	}
	lo, med, hi := s.Stats()
	return fmt.Sprintf("%s (%s – %s)", FmtNum(med), FmtNum(lo), FmtNum(hi))
}
