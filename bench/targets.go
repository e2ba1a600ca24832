package main

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode"
)

// dataTarget is one of the data-path targets: uproxy's figure of
// metric, as a ratio to each base's measured in the same run, is at least
// (or, with atMost, at most) that base's bound. A path meets the target
// when it meets every bound.
type dataTarget struct {
	what   string // as the report states it
	metric string
	bounds []ratioBound
	atMost bool
	// profile is the section of "Where the CPU goes" that shows where the
	// workload's time went; empty when there is none.
	profile string
}

// ratioBound is one bound of a data-path target: the ratio to base's
// figure (titled baseTitle in a cell with more than one bound).
type ratioBound struct {
	base, baseTitle string
	bound           float64
}

// dataTargets are the data-path targets, in the report's order. The
// long-flow UDP target compares with an older binary, not a yardstick:
// writeUDPTarget writes it.
var dataTargets = []dataTarget{
	{"`dns` (UDP, a new port per query) request rate ≥ 1.3× nginx stream and ≥ 0.75× kernel DNAT", "dns_rps",
		[]ratioBound{{"nginx", "nginx", 1.3}, {"dnat", "DNAT", 0.75}}, false, "UDP queries from a new port"},
	{"keep-alive request rate ≥ 1.15× HAProxy", "rr_rps", []ratioBound{{"haproxy", "HAProxy", 1.15}}, false, "Keep-alive requests"},
	{"short-connection rate ≥ 1.0× HAProxy", "short_cps", []ratioBound{{"haproxy", "HAProxy", 1.0}}, false, "Short connections"},
	{"keep-alive p99 latency ≤ HAProxy's", "rr_p99_us", []ratioBound{{"haproxy", "HAProxy", 1.0}}, true, "Keep-alive requests"},
	{"bulk TCP throughput ≥ 0.90× kernel DNAT", "bulk_gbps", []ratioBound{{"dnat", "DNAT", 0.90}}, false, "Bulk transfers"},
	{"memory per idle connection ≤ HAProxy's", "idle_kib", []ratioBound{{"haproxy", "HAProxy", 1.0}}, true, ""},
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
func ratioWithin(s, base *Series) (runRatio, bool) {
	if s == nil || base == nil || len(s.Values) == 0 || len(base.Values) == 0 {
		return runRatio{}, false
	}
	if len(s.Values) != len(base.Values) {
		m := median(s) / median(base)
		return runRatio{median: m, lo: m, hi: m}, !math.IsNaN(m) && !math.IsInf(m, 0)
	}
	var r Series
	for i, v := range s.Values {
		if base.Values[i] == 0 {
			return runRatio{}, false
		}
		r.add(v / base.Values[i])
	}
	lo, med, hi := r.stats()
	return runRatio{median: med, lo: lo, hi: hi, paired: true}, true
}

// met reports whether ratio r meets bound.
func (t dataTarget) met(r, bound float64) bool {
	if t.atMost {
		return r <= bound
	}
	return r >= bound
}

// margin is how far ratio r is from bound, as a factor: 1 or more when r
// meets it, less the further it is from meeting it.
func (t dataTarget) margin(r, bound float64) float64 {
	if t.atMost {
		return bound / r
	}
	return r / bound
}

// uproxyPaths returns the subjects whose id starts with "uproxy", in order,
// but for the baseline binary's (--baseline): the targets are the current
// code's.
func uproxyPaths(subjects []Subject) []Subject {
	var out []Subject
	for _, s := range subjects {
		if strings.HasPrefix(s.ID, "uproxy") && !strings.HasSuffix(s.ID, baselineSuffix) {
			out = append(out, s)
		}
	}
	return out
}

// writeTargets writes the table of the targets, each read from this
// report's figures, with what met it and, for one that nothing met, the
// closest figure and a link to the profile that bounds it.
func writeTargets(b *strings.Builder, dp *DataPathResults, cp *ControlPlaneResults, haveDP, haveCP bool) {
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

func writeDataTargets(b *strings.Builder, dp *DataPathResults) {
	paths := uproxyPaths(dp.Paths)
	if len(paths) == 0 {
		b.WriteString("No uproxy data path was measured.\n\n")
		return
	}
	writeTargetsHeader(b, paths)
	unpaired := false
	for _, t := range dataTargets {
		fmt.Fprintf(b, "| %s |", t.what)
		var metBy []string
		closest, closestPath := math.NaN(), Subject{}
		var closestCell string
		for _, p := range paths {
			var cells []string
			margin, met := math.Inf(1), true
			for _, bd := range t.bounds {
				r, ok := ratioWithin(dp.Figures[t.metric][p.ID], dp.Figures[t.metric][bd.base])
				if !ok {
					cells = nil
					break
				}
				unpaired = unpaired || !r.paired
				cell := fmt.Sprintf("%.2f×", r.median)
				if r.paired && r.hi > r.lo {
					cell += fmt.Sprintf(" (%.2f–%.2f)", r.lo, r.hi)
				}
				if len(t.bounds) > 1 {
					cell += " " + bd.baseTitle
				}
				cells = append(cells, cell)
				margin = math.Min(margin, t.margin(r.median, bd.bound))
				met = met && t.met(r.median, bd.bound)
			}
			if cells == nil {
				b.WriteString(" n/a |")
				continue
			}
			cell := strings.Join(cells, ", ")
			if t.metric == "idle_kib" {
				cell = fmt.Sprintf("%s KiB, %s", fmtNum(median(dp.Figures[t.metric][p.ID])), cell)
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
			if link := profileLink(dp, t.profile, closestPath); link != "" {
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
func writeUDPTarget(b *strings.Builder, dp *DataPathResults, paths []Subject) {
	const metric = "udp_rps"
	b.WriteString("| long-flow UDP (`udp`) request rate no lower than before (the baseline binary's, in the same runs) |")
	m := Metric{ID: metric, Higher: true}
	var metBy, decided []string
	measured := false
	for _, p := range paths {
		cur := dp.Figures[metric][p.ID]
		if base := dp.Figures[metric][p.ID+baselineSuffix]; base.measured() {
			row := beforeAfter{metric: m, path: p, base: base, cur: cur}
			if !cur.measured() {
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
		if link := profileLink(dp, "UDP requests", Subject{}); link != "" {
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
func profileLink(dp *DataPathResults, title string, p Subject) string {
	if title == "" {
		return ""
	}
	i := slices.IndexFunc(dp.profiled(), func(w profiledWorkload) bool { return w.title == title && len(w.profiles) > 0 })
	if i < 0 {
		return ""
	}
	link := fmt.Sprintf("[%s](#%s)", title, anchor(title))
	if dp.profiled()[i].profiles[p.ID] != nil {
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
func writeTargetsHeader(b *strings.Builder, subjects []Subject) {
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

// Control-plane targets, at cpTargetScale services.
const (
	cpTargetScale     = 10000
	cpTargetProgramS  = 1.0  // tproxy mode's first sync, after the initial lists
	cpTargetChangeP99 = 10.0 // ms, from uproxy's sync to traffic
	cpTargetRSS       = 0.5  // of kube-proxy nftables's, in the same run
	// cpTargetRSSBase is the proxy whose RSS the target is a ratio to.
	cpTargetRSSBase = "kp-nftables"
	// cpTargetSyncProxy is the proxy the first-sync target is set for.
	cpTargetSyncProxy = "uproxy-tproxy"
)

// cpTargetRow is one control-plane target: value gives a proxy's figure
// at a scale and its cell, or ok false when it has none.
type cpTargetRow struct {
	what  string
	value func(p Subject, scale string) (v float64, cell string, ok bool)
	met   func(float64) bool
	// only, when set, is the one proxy whose figure decides the target;
	// the others' are shown for comparison.
	only string
	// bound says what bounds an unmet target, or that nothing does yet.
	bound string
}

func writeCPTargets(b *strings.Builder, cp *ControlPlaneResults) {
	proxies := uproxyPaths(cp.Proxies)
	if len(proxies) == 0 || len(cp.Scales) == 0 {
		return
	}
	n := cpTargetScale
	if !slices.Contains(cp.Scales, n) {
		n = slices.Max(cp.Scales)
	}
	scale := strconv.Itoa(n)
	fmt.Fprintf(b, "Control plane, at %s services × %d endpoints", thousands(int64(n)), cp.Endpoints)
	if n != cpTargetScale {
		fmt.Fprintf(b, " (the targets are set at %s, which this run did not measure)", thousands(cpTargetScale))
	}
	b.WriteString(":\n\n")
	writeTargetsHeader(b, proxies)
	series := func(metric string, p Subject) *Series {
		if s := cp.Figures[metric][p.ID][scale]; s.measured() {
			return s
		}
		return nil
	}
	noProfile := "no profile of the control plane is taken: see [Control plane results](#control-plane-results)"
	rssBound := noProfile
	if slices.ContainsFunc(proxies, func(p Subject) bool { hp := cp.HeapProfiles[p.ID]; return hp != nil && hp.NA == "" }) {
		rssBound = fmt.Sprintf("profile: [%s](#%s)", heapSection, anchor(heapSection))
	}
	rows := []cpTargetRow{
		{"RSS ≤ 0.5× kube-proxy nftables's, in the same run",
			func(p Subject, scale string) (float64, string, bool) {
				s := series("rss_mib", p)
				r, ok := ratioWithin(s, cp.Figures["rss_mib"][cpTargetRSSBase][scale])
				if !ok {
					return 0, "", false
				}
				cell := fmt.Sprintf("%s MiB, %.2f×", fmtNum(median(s)), r.median)
				if r.paired && r.hi > r.lo {
					cell += fmt.Sprintf(" (%.2f–%.2f)", r.lo, r.hi)
				}
				return r.median, cell, true
			}, func(v float64) bool { return v <= cpTargetRSS }, "", rssBound},
		{"tproxy mode: first sync ≤ 1 s after the informers' initial lists (median of the runs)",
			func(p Subject, _ string) (float64, string, bool) {
				s := series("after_lists_s", p)
				if s == nil {
					return 0, "", false
				}
				return median(s), fmtNum(median(s)) + " s", true
			}, func(v float64) bool { return v <= cpTargetProgramS }, cpTargetSyncProxy,
			"no CPU profile of the first sync is taken (one would slow the sync it measures): see [Control plane results](#control-plane-results)"},
		{"endpoint change followed by traffic ≤ 10 ms p99, from uproxy's sync (every change of every run)",
			func(p Subject, _ string) (float64, string, bool) {
				s := series("change_sync_ms", p)
				if s == nil {
					return 0, "", false
				}
				v := s.quantile(0.99)
				return v, fmtNum(v) + " ms", true
			}, func(v float64) bool { return v <= cpTargetChangeP99 }, "", noProfile},
		{"no iptables or ipset process run for an endpoint change (the most any change ran)",
			func(p Subject, _ string) (float64, string, bool) {
				s := series("change_commands", p)
				if s == nil {
					return 0, "", false
				}
				v := slices.Max(s.Values)
				return v, fmt.Sprintf("%.0f", v), true
			}, func(v float64) bool { return v == 0 }, "", ""},
	}
	for _, r := range rows {
		fmt.Fprintf(b, "| %s |", r.what)
		var metBy []string
		measured := false
		for _, p := range proxies {
			v, cell, ok := r.value(p, scale)
			if !ok {
				b.WriteString(" n/a |")
				continue
			}
			fmt.Fprintf(b, " %s |", cell)
			if r.only != "" && p.ID != r.only {
				continue
			}
			measured = true
			if r.met(v) {
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
