package report

import (
	"bytes"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"github.com/uproxy/uproxy/bench/internal/results"
)

// The targets live in targets.json, which the report reads: what each
// states, the metric it reads, and its bounds. The code knows how to read
// each metric from a run's figures.

//go:embed targets.json
var targetsJSON []byte

// targetFile is targets.json.
type targetFile struct {
	// DataPath are the data-path targets, in the report's order.
	DataPath []dataTarget `json:"dataPath"`
	// Baseline is the target that compares with an older binary, not a
	// yardstick: writeUDPTarget writes it.
	Baseline baselineTarget `json:"baseline"`
	// ControlPlane are the control-plane targets, at Scale services.
	ControlPlane struct {
		Scale   int        `json:"scale"`
		Targets []cpTarget `json:"targets"`
	} `json:"controlPlane"`
}

// dataTarget is one of the data-path targets: uproxy's figure of
// Metric, as a ratio to each base's measured in the same run, is at least
// (or, with AtMost, at most) that base's bound. A path meets the target
// when it meets every bound.
type dataTarget struct {
	What   string       `json:"what"` // as the report states it
	Metric string       `json:"metric"`
	Bounds []ratioBound `json:"bounds"`
	AtMost bool         `json:"atMost"`
	// Profile is the section of "Where the CPU goes" that shows where the
	// workload's time went; empty when there is none.
	Profile string `json:"profile"`
}

// ratioBound is one bound of a data-path target: the ratio to Base's
// figure (titled Title in a cell with more than one bound).
type ratioBound struct {
	Base  string  `json:"base"`
	Title string  `json:"title"`
	Ratio float64 `json:"ratio"`
}

// baselineTarget is a metric of uproxy's that is to be no worse than the
// baseline binary's in the same runs.
type baselineTarget struct {
	What    string `json:"what"`
	Metric  string `json:"metric"`
	Profile string `json:"profile"`
}

// cpTarget is one control-plane target: ID says which figure it reads
// (cpTargetValue), AtMost its bound; Base, for a ratio, is the proxy the
// ratio is to, and Only, when set, the one proxy whose figure decides it.
type cpTarget struct {
	ID     string  `json:"id"`
	What   string  `json:"what"`
	AtMost float64 `json:"atMost"`
	Base   string  `json:"base"`
	Only   string  `json:"only"`
}

// targets are targets.json's, checked (parseTargets) when the harness
// starts: a mistake in the file stops it at once.
var targets = mustParseTargets(targetsJSON)

func mustParseTargets(b []byte) targetFile {
	t, err := parseTargets(b)
	if err != nil {
		panic(err)
	}
	return t
}

// cpTargetIDs are the control-plane targets the report knows how to read.
var cpTargetIDs = []string{"rss", "first-sync", "change-p99", "change-commands"}

// parseTargets reads a targets file, and says which target and field is
// wrong when one is.
func parseTargets(b []byte) (targetFile, error) {
	var t targetFile
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&t); err != nil {
		return targetFile{}, fmt.Errorf("targets.json: %w", err)
	}
	known := map[string]bool{}
	for _, m := range results.DataPathMetrics {
		known[m.ID] = true
	}
	for i, d := range t.DataPath {
		switch {
		case d.What == "":
			return targetFile{}, fmt.Errorf("targets.json: dataPath[%d].what is empty", i)
		case !known[d.Metric]:
			return targetFile{}, fmt.Errorf("targets.json: dataPath[%d] (%s): metric %q is not a data-path metric", i, d.What, d.Metric)
		case len(d.Bounds) == 0:
			return targetFile{}, fmt.Errorf("targets.json: dataPath[%d] (%s): no bounds", i, d.What)
		}
		for j, bd := range d.Bounds {
			if bd.Base == "" || bd.Title == "" || bd.Ratio <= 0 {
				return targetFile{}, fmt.Errorf("targets.json: dataPath[%d] (%s): bounds[%d] needs a base, a title and a positive ratio", i, d.What, j)
			}
		}
	}
	if !known[t.Baseline.Metric] {
		return targetFile{}, fmt.Errorf("targets.json: baseline: metric %q is not a data-path metric", t.Baseline.Metric)
	}
	if t.ControlPlane.Scale <= 0 {
		return targetFile{}, errors.New("targets.json: controlPlane.scale must be positive")
	}
	for i, c := range t.ControlPlane.Targets {
		if !slices.Contains(cpTargetIDs, c.ID) {
			return targetFile{}, fmt.Errorf("targets.json: controlPlane.targets[%d]: id %q is none of %s", i, c.ID, strings.Join(cpTargetIDs, ", "))
		}
		if c.What == "" {
			return targetFile{}, fmt.Errorf("targets.json: controlPlane.targets[%d] (%s): what is empty", i, c.ID)
		}
	}
	return t, nil
}

// runRatio is a figure's ratio to a base measured in the same runs.
type runRatio struct {
	median, lo, hi float64
	// paired is false when the two series do not have one value per run
	// each (a run failed), and the ratio is then of their medians.
	paired bool
}

// ratioWithin returns the median, minimum and maximum over the runs of
// s's value divided by base's in the same run. The runs are interleaved
// (every path in run 1, then every path in run 2), so a ratio within a
// run compares figures measured minutes apart at most.
func ratioWithin(s, base *results.Series) (runRatio, bool) {
	if s == nil || base == nil || len(s.Values) == 0 || len(base.Values) == 0 {
		return runRatio{}, false
	}
	if len(s.Values) != len(base.Values) {
		m := median(s) / median(base)
		return runRatio{median: m, lo: m, hi: m}, !math.IsNaN(m) && !math.IsInf(m, 0)
	}
	var r results.Series
	for i, v := range s.Values {
		if base.Values[i] == 0 {
			return runRatio{}, false
		}
		r.Add(v / base.Values[i])
	}
	lo, med, hi := r.Stats()
	return runRatio{median: med, lo: lo, hi: hi, paired: true}, true
}

// met reports whether ratio r meets bound.
func (t dataTarget) met(r, bound float64) bool {
	if t.AtMost {
		return r <= bound
	}
	return r >= bound
}

// margin is how far ratio r is from bound, as a factor: 1 or more when r
// meets it, less the further it is from meeting it.
func (t dataTarget) margin(r, bound float64) float64 {
	if t.AtMost {
		return bound / r
	}
	return r / bound
}

// uproxyPaths returns the subjects whose id starts with "uproxy", in order,
// but for the baseline binary's (--baseline): the targets are the current
// code's.
func uproxyPaths(subjects []results.Subject) []results.Subject {
	var out []results.Subject
	for _, s := range subjects {
		if strings.HasPrefix(s.ID, "uproxy") && !strings.HasSuffix(s.ID, results.BaselineSuffix) {
			out = append(out, s)
		}
	}
	return out
}

// writeTargets writes the table of the targets, each read from this
// report's figures, with what met it and, for one that nothing met, the
// closest figure and a link to the profile that bounds it.
func writeTargets(b *strings.Builder, dp *results.DataPathResults, cp *results.ControlPlaneResults, haveDP, haveCP bool) {
	b.WriteString("### Targets\n\n")
	b.WriteString("The targets, read from this report's figures. A data-path ratio is the median over the runs of uproxy's figure divided\n" +
		"by the yardstick's in the same run (in parentheses: the lowest and highest run). For a target that no uproxy path meets,\n" +
		"the last column links to the profile of that workload in [Where the CPU goes](#where-the-cpu-goes), which shows what bounds it.\n\n")
	if haveDP {
		writeDataTargets(b, dp)
	}
	if haveCP {
		writeCPTargets(b, cp)
	}
}

func writeDataTargets(b *strings.Builder, dp *results.DataPathResults) {
	paths := uproxyPaths(dp.Paths)
	if len(paths) == 0 {
		b.WriteString("No uproxy data path was measured.\n\n")
		return
	}
	writeTargetsHeader(b, paths)
	unpaired := false
	for _, t := range targets.DataPath {
		fmt.Fprintf(b, "| %s |", t.What)
		var metBy []string
		closest, closestPath := math.NaN(), results.Subject{}
		var closestCell string
		for _, p := range paths {
			var cells []string
			margin, met := math.Inf(1), true
			for _, bd := range t.Bounds {
				r, ok := ratioWithin(dp.Figures[t.Metric][p.ID], dp.Figures[t.Metric][bd.Base])
				if !ok {
					cells = nil
					break
				}
				unpaired = unpaired || !r.paired
				cell := fmt.Sprintf("%.2f×", r.median)
				if r.paired && r.hi > r.lo {
					cell += fmt.Sprintf(" (%.2f–%.2f)", r.lo, r.hi)
				}
				if len(t.Bounds) > 1 {
					cell += " " + bd.Title
				}
				cells = append(cells, cell)
				margin = math.Min(margin, t.margin(r.median, bd.Ratio))
				met = met && t.met(r.median, bd.Ratio)
			}
			if cells == nil {
				b.WriteString(" n/a |")
				continue
			}
			cell := strings.Join(cells, ", ")
			if t.Metric == "idle_kib" {
				cell = fmt.Sprintf("%s KiB, %s", FmtNum(median(dp.Figures[t.Metric][p.ID])), cell)
			}
			fmt.Fprintf(b, " %s |", cell)
			if met {
				metBy = append(metBy, p.Title)
			}
			if math.IsNaN(closest) || margin > closest {
				closest, closestPath, closestCell = margin, p, strings.Join(cells, ", ")
			}
		}
		switch {
		case len(metBy) > 0:
			fmt.Fprintf(b, " yes: %s |\n", strings.Join(metBy, "; "))
		case math.IsNaN(closest):
			b.WriteString(" not measured |\n")
		default:
			fmt.Fprintf(b, " no: closest %s (%s)", closestPath.Title, closestCell)
			if link := profileLink(dp, t.Profile, closestPath); link != "" {
				b.WriteString("; profile: " + link)
			}
			b.WriteString(" |\n")
		}
	}
	writeUDPTarget(b, dp, paths)
	b.WriteString("\n")
	if unpaired {
		b.WriteString("A ratio without a range is of the medians: a run of one of its two paths failed, so the runs do not pair up.\n\n")
	}
}

// writeUDPTarget writes the row of the long-flow UDP target: the udp
// workload's rate no lower than the baseline binary's. Only a baseline
// binary measured in the same runs (--baseline, --baseline-rev) decides
// it: another run's figures are from another moment of a shared machine.
// Without one, the row says so and gives the ratios to the yardsticks.
func writeUDPTarget(b *strings.Builder, dp *results.DataPathResults, paths []results.Subject) {
	metric := targets.Baseline.Metric
	fmt.Fprintf(b, "| %s |", targets.Baseline.What)
	m := results.Metric{ID: metric, Higher: true}
	var metBy, decided []string
	measured := false
	for _, p := range paths {
		cur := dp.Figures[metric][p.ID]
		if base := dp.Figures[metric][p.ID+results.BaselineSuffix]; base.Measured() {
			row := beforeAfter{metric: m, path: p, base: base, cur: cur}
			if !cur.Measured() {
				b.WriteString(" n/a |")
				continue
			}
			v, why := row.verdict()
			if why != "" {
				v = why
			}
			fmt.Fprintf(b, " %.2f× the baseline: %s |", row.ratio(), v)
			if v == verdictNoise || v == verdictBetter {
				metBy = append(metBy, p.Title)
			}
			if why == "" {
				decided = append(decided, p.Title)
			}
			continue
		}
		var cells []string
		for _, y := range []struct{ id, title string }{{"dnat", "DNAT"}, {"nginx", "nginx"}} {
			if r, ok := ratioWithin(cur, dp.Figures[metric][y.id]); ok {
				cells = append(cells, fmt.Sprintf("%.2f× %s", r.median, y.title))
			}
		}
		if len(cells) == 0 {
			b.WriteString(" n/a |")
			continue
		}
		measured = true
		fmt.Fprintf(b, " %s |", strings.Join(cells, ", "))
	}
	switch {
	case len(metBy) > 0:
		fmt.Fprintf(b, " yes: %s |\n", strings.Join(metBy, "; "))
	case len(decided) > 0:
		fmt.Fprintf(b, " no: slower than the baseline (%s)", strings.Join(decided, "; "))
		if link := profileLink(dp, targets.Baseline.Profile, results.Subject{}); link != "" {
			b.WriteString("; profile: " + link)
		}
		b.WriteString(" |\n")
	case measured:
		b.WriteString(" not decidable in this run: no baseline binary was measured (--baseline or --baseline-rev); the cells are the ratios to kernel DNAT and nginx stream |\n")
	default:
		b.WriteString(" not measured |\n")
	}
}

// profileLink links to the section of "Where the CPU goes" titled title
// and, if it has one, to p's own profile of that workload; "" when the
// report has no profile of the workload.
func profileLink(dp *results.DataPathResults, title string, p results.Subject) string {
	if title == "" {
		return ""
	}
	i := slices.IndexFunc(profiledWorkloads(dp), func(w profiledWorkload) bool { return w.title == title && len(w.profiles) > 0 })
	if i < 0 {
		return ""
	}
	link := fmt.Sprintf("[%s](#%s)", title, anchor(title))
	if profiledWorkloads(dp)[i].profiles[p.ID] != nil {
		own := p.Title + ": " + strings.ToLower(title)
		link += fmt.Sprintf(", [%s's](#%s)", p.Title, anchor(own))
	}
	return link
}

// anchor is the fragment that GitHub's Markdown gives heading h: lower
// case, spaces as hyphens, and no punctuation but hyphens and underscores.
func anchor(h string) string {
	var a strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r == ' ':
			a.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			a.WriteRune(r)
		}
	}
	return a.String()
}

// writeTargetsHeader writes the header of a targets table: a column per
// subject, then whether the target is met.
func writeTargetsHeader(b *strings.Builder, subjects []results.Subject) {
	b.WriteString("| target |")
	for _, p := range subjects {
		fmt.Fprintf(b, " %s |", p.Title)
	}
	b.WriteString(" met |\n|---|")
	for range subjects {
		b.WriteString("---:|")
	}
	b.WriteString("---|\n")
}

// cpTargetRow is one control-plane target: value gives a proxy's figure
// at a scale and its cell, or ok false when it has none.
type cpTargetRow struct {
	cpTarget
	value func(p results.Subject, scale string) (v float64, cell string, ok bool)
	// bound says what bounds an unmet target, or that nothing does yet.
	bound string
}

func writeCPTargets(b *strings.Builder, cp *results.ControlPlaneResults) {
	proxies := uproxyPaths(cp.Proxies)
	if len(proxies) == 0 || len(cp.Scales) == 0 {
		return
	}
	target := targets.ControlPlane.Scale
	n := target
	if !slices.Contains(cp.Scales, n) {
		n = slices.Max(cp.Scales)
	}
	scale := strconv.Itoa(n)
	fmt.Fprintf(b, "Control plane, at %s services × %d endpoints", Thousands(int64(n)), cp.Endpoints)
	if n != target {
		fmt.Fprintf(b, " (the targets are set at %s, which this run did not measure)", Thousands(int64(target)))
	}
	b.WriteString(":\n\n")
	writeTargetsHeader(b, proxies)
	series := func(metric string, p results.Subject) *results.Series {
		if s := cp.Figures[metric][p.ID][scale]; s.Measured() {
			return s
		}
		return nil
	}
	noProfile := "no profile of the control plane is taken: see [Control plane results](#control-plane-results)"
	rssBound := noProfile
	if slices.ContainsFunc(proxies, func(p results.Subject) bool { hp := cp.HeapProfiles[p.ID]; return hp != nil && hp.NA == "" }) {
		rssBound = fmt.Sprintf("profile: [%s](#%s)", heapSection, anchor(heapSection))
	}
	var rows []cpTargetRow
	for _, t := range targets.ControlPlane.Targets {
		r := cpTargetRow{cpTarget: t}
		switch t.ID {
		case "rss":
			r.value = func(p results.Subject, scale string) (float64, string, bool) {
				s := series("rss_mib", p)
				rr, ok := ratioWithin(s, cp.Figures["rss_mib"][t.Base][scale])
				if !ok {
					return 0, "", false
				}
				cell := fmt.Sprintf("%s MiB, %.2f×", FmtNum(median(s)), rr.median)
				if rr.paired && rr.hi > rr.lo {
					cell += fmt.Sprintf(" (%.2f–%.2f)", rr.lo, rr.hi)
				}
				return rr.median, cell, true
			}
			r.bound = rssBound
		case "first-sync":
			r.value = func(p results.Subject, _ string) (float64, string, bool) {
				s := series("after_lists_s", p)
				if s == nil {
					return 0, "", false
				}
				return median(s), FmtNum(median(s)) + " s", true
			}
			r.bound = "no CPU profile of the first sync is taken (one would slow the sync it measures): see [Control plane results](#control-plane-results)"
		case "change-p99":
			r.value = func(p results.Subject, _ string) (float64, string, bool) {
				s := series("change_sync_ms", p)
				if s == nil {
					return 0, "", false
				}
				v := s.Quantile(0.99)
				return v, FmtNum(v) + " ms", true
			}
			r.bound = noProfile
		case "change-commands":
			r.value = func(p results.Subject, _ string) (float64, string, bool) {
				s := series("change_commands", p)
				if s == nil {
					return 0, "", false
				}
				v := slices.Max(s.Values)
				return v, fmt.Sprintf("%.0f", v), true
			}
		}
		rows = append(rows, r)
	}
	for _, r := range rows {
		fmt.Fprintf(b, "| %s |", r.What)
		var metBy []string
		measured := false
		for _, p := range proxies {
			v, cell, ok := r.value(p, scale)
			if !ok {
				b.WriteString(" n/a |")
				continue
			}
			fmt.Fprintf(b, " %s |", cell)
			if r.Only != "" && p.ID != r.Only {
				continue
			}
			measured = true
			if v <= r.AtMost {
				metBy = append(metBy, p.Title)
			}
		}
		switch {
		case len(metBy) > 0:
			fmt.Fprintf(b, " yes: %s |\n", strings.Join(metBy, "; "))
		case measured && r.bound != "":
			fmt.Fprintf(b, " no; %s |\n", r.bound)
		case measured:
			b.WriteString(" no |\n")
		default:
			b.WriteString(" not measured |\n")
		}
	}
	b.WriteString("\nThe whole endpoint change, from the API write, includes the API server's own part: see the control-plane summary.\n\n")
}
