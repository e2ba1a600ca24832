package main

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
)

// dataTarget is one of the project's data-path targets: uproxy's figure
// of metric, as a ratio to base's measured in the same run, is at least
// (or, with atMost, at most) bound.
type dataTarget struct {
	what   string // as the report states it
	metric string
	base   string // the data path the ratio is to
	bound  float64
	atMost bool
	// profile is the section of "Where the CPU goes" that shows where the
	// workload's time went; empty when there is none.
	profile string
}

// dataTargets are the data-path targets, in the report's order.
var dataTargets = []dataTarget{
	{"bulk TCP throughput ≥ 0.90× kernel DNAT", "bulk_gbps", "dnat", 0.90, false, "Bulk transfers"},
	{"keep-alive request rate ≥ 1.2× HAProxy", "rr_rps", "haproxy", 1.2, false, "Keep-alive requests"},
	{"keep-alive p99 latency ≤ HAProxy's", "rr_p99_us", "haproxy", 1.0, true, "Keep-alive requests"},
	{"short-connection rate ≥ 1.0× HAProxy", "short_cps", "haproxy", 1.0, false, "Short connections"},
	{"UDP request rate ≥ 1.5× nginx stream", "udp_rps", "nginx", 1.5, false, "UDP requests"},
	{"memory per idle connection ≤ HAProxy's", "idle_kib", "haproxy", 1.0, true, ""},
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

// met reports whether ratio r meets t.
func (t dataTarget) met(r float64) bool {
	if t.atMost {
		return r <= t.bound
	}
	return r >= t.bound
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

// writeTargets writes the table of the project's targets, each read from
// this report's figures, with what met it and, for one that nothing met,
// the best figure and where its profile is.
func writeTargets(b *strings.Builder, dp *DataPathResults, cp *ControlPlaneResults, haveDP, haveCP bool) {
	b.WriteString("### Targets\n\n")
	b.WriteString("The project's targets, read from this report's figures. A data-path ratio is the median over the runs of uproxy's figure divided\n" +
		"by the yardstick's in the same run (in parentheses: the lowest and highest run). Where no uproxy data path meets a target,\n" +
		"[Where the CPU goes](#where-the-cpu-goes) has the profile of that workload.\n\n")
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
		best, bestPath := math.NaN(), ""
		for _, p := range paths {
			r, ok := ratioWithin(dp.Figures[t.metric][p.ID], dp.Figures[t.metric][t.base])
			if !ok {
				b.WriteString(" n/a |")
				continue
			}
			unpaired = unpaired || !r.paired
			cell := fmt.Sprintf("%.2f×", r.median)
			if r.paired && r.hi > r.lo {
				cell += fmt.Sprintf(" (%.2f–%.2f)", r.lo, r.hi)
			}
			if t.metric == "idle_kib" {
				cell = fmt.Sprintf("%s KiB, %s", fmtNum(median(dp.Figures[t.metric][p.ID])), cell)
			}
			fmt.Fprintf(b, " %s |", cell)
			if t.met(r.median) {
				metBy = append(metBy, p.Title)
			}
			if math.IsNaN(best) || (t.atMost && r.median < best) || (!t.atMost && r.median > best) {
				best, bestPath = r.median, p.Title
			}
		}
		switch {
		case len(metBy) > 0:
			fmt.Fprintf(b, " yes: %s |\n", strings.Join(metBy, "; "))
		case math.IsNaN(best):
			b.WriteString(" not measured |\n")
		default:
			fmt.Fprintf(b, " no: best %.2f× (%s)", best, bestPath)
			if t.profile != "" && hasProfiles(dp, t.profile) {
				fmt.Fprintf(b, "; profile: %s", t.profile)
			}
			b.WriteString(" |\n")
		}
	}
	b.WriteString("\n")
	if unpaired {
		b.WriteString("A ratio without a range is of the medians: a run of one of its two paths failed, so the runs do not pair up.\n\n")
	}
	// The UDP target asks for the ratio to the kernel too.
	var dnat []string
	for _, p := range paths {
		if r, ok := ratioWithin(dp.Figures["udp_rps"][p.ID], dp.Figures["udp_rps"]["dnat"]); ok {
			dnat = append(dnat, fmt.Sprintf("%s %.2f×", p.Title, r.median))
		}
	}
	if len(dnat) > 0 {
		fmt.Fprintf(b, "UDP request rate, as a ratio to kernel DNAT: %s.\n\n", strings.Join(dnat, "; "))
	}
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

// hasProfiles reports whether the report has the profiles of the workload
// that "Where the CPU goes" titles title.
func hasProfiles(dp *DataPathResults, title string) bool {
	return slices.ContainsFunc(dp.profiled(), func(w profiledWorkload) bool { return w.title == title && len(w.profiles) > 0 })
}

// Control-plane targets, at the largest scale measured.
const (
	cpTargetScale     = 10000
	cpTargetProgramS  = 1.0  // the first sync, after the initial lists
	cpTargetChangeP99 = 10.0 // ms, from uproxy's sync to traffic
)

func writeCPTargets(b *strings.Builder, cp *ControlPlaneResults) {
	proxies := uproxyPaths(cp.Proxies)
	if len(proxies) == 0 || len(cp.Scales) == 0 {
		return
	}
	n := slices.Max(cp.Scales)
	scale := strconv.Itoa(n)
	fmt.Fprintf(b, "Control plane, at %s services × %d endpoints", thousands(int64(n)), cp.Endpoints)
	if n < cpTargetScale {
		fmt.Fprintf(b, " (the targets are set at %s: this run measured fewer)", thousands(cpTargetScale))
	}
	b.WriteString(":\n\n")
	writeTargetsHeader(b, proxies)
	type row struct {
		what, metric string
		value        func(*Series) float64
		unit         string // after the figure; "" for a count
		met          func(float64) bool
	}
	rows := []row{
		{"programmed ≤ 1 s after the informers' initial lists (median of the runs)", "after_lists_s", median, " s",
			func(v float64) bool { return v <= cpTargetProgramS }},
		{"endpoint change followed by traffic ≤ 10 ms p99, from uproxy's sync (every change of every run)", "change_sync_ms",
			func(s *Series) float64 { return s.quantile(0.99) }, " ms", func(v float64) bool { return v <= cpTargetChangeP99 }},
		{"no iptables or ipset process run for an endpoint change (the most any change ran)", "change_commands",
			func(s *Series) float64 { return slices.Max(s.Values) }, "", func(v float64) bool { return v == 0 }},
	}
	for _, r := range rows {
		fmt.Fprintf(b, "| %s |", r.what)
		var metBy []string
		measured := false
		for _, p := range proxies {
			s := cp.Figures[r.metric][p.ID][scale]
			if s == nil || len(s.Values) == 0 {
				b.WriteString(" n/a |")
				continue
			}
			measured = true
			v := r.value(s)
			if r.unit == "" {
				fmt.Fprintf(b, " %.0f |", v)
			} else {
				fmt.Fprintf(b, " %s%s |", fmtNum(v), r.unit)
			}
			if r.met(v) {
				metBy = append(metBy, p.Title)
			}
		}
		switch {
		case len(metBy) > 0:
			fmt.Fprintf(b, " yes: %s |\n", strings.Join(metBy, "; "))
		case measured:
			b.WriteString(" no |\n")
		default:
			b.WriteString(" not measured |\n")
		}
	}
	b.WriteString("\nThe whole endpoint change, from the API write, includes the API server's own part: see the control-plane summary.\n\n")
}
