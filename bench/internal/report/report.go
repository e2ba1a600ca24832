package report

import (
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/uproxy/uproxy/bench/internal/results"
)

// Summary is what Write tells its caller.
type Summary struct {
	Charts, Figures, NA int
	// errs are the parts' failures and any figure with neither a value nor
	// a reason: the harness is broken if there is one.
	Errors []error
}

// Output says what a report reads and where it goes.
type Output struct {
	Root string // the checkout, whose commit and machine the report names
	Dir  string // the parts' JSON results, and the charts drawn from them
	Stem string // the report's name; its charts are under Stem/
	Path string // the report itself
}

// Write assembles the Markdown report and its charts from the parts'
// JSON results in out.Dir.
func Write(out Output) (Summary, error) {
	var sum Summary
	var dp results.DataPathResults
	var cp results.ControlPlaneResults
	var gb results.GoBenchResults
	haveDP, err := results.ReadJSON(out.Dir, "datapath.json", &dp)
	if err != nil {
		return sum, err
	}
	haveCP, err := results.ReadJSON(out.Dir, "controlplane.json", &cp)
	if err != nil {
		return sum, err
	}
	haveGB, err := results.ReadJSON(out.Dir, "gobench.json", &gb)
	if err != nil {
		return sum, err
	}
	if !haveDP && !haveCP && !haveGB {
		return sum, fmt.Errorf("no results in %s: run a part first (datapath, controlplane, gobench)", out.Dir)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	machine := results.DescribeMachine(ctx, out.Root)

	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	w("# uproxy benchmarks: %s\n\n", out.Stem)
	commit := "unknown"
	for _, m := range []*results.RunMeta{&dp.Meta, &cp.Meta, &gb.Meta} {
		if m.Commit != "" {
			commit = m.Commit
			break
		}
	}
	w("Made by %s on %s, from uproxy commit %s. Raw results: [`%s/`](%s/).\n\n",
		madeBy(&dp.Meta, &cp.Meta, &gb.Meta), machine.Host, commit, out.Stem, out.Stem)
	if dp.Meta.Smoke || cp.Meta.Smoke || gb.Meta.Smoke {
		w("**Smoke run**: tiny durations and counts, to check that the harness works. These figures mean nothing.\n\n")
	}
	w("Every figure is the median of its runs, with its ratio to the kernel DNAT path (or, for the control plane, to the harness's own\n" +
		"iptables-restore of the same rules) measured in the same run: the machine is shared, so absolute figures are noisy,\n" +
		"ratios less so. The detailed tables give min, median and max.\n\n")

	// Summary.
	w("## Summary\n\n")
	if haveDP {
		WriteDataSummary(&b, &dp)
		WriteCostSummary(&b, &dp)
	}
	if haveCP {
		writeCPSummary(&b, &cp)
		if err := WriteCostCurves(&b, out, &cp); err != nil {
			return sum, err
		}
	}
	if haveDP || haveCP {
		writeTargets(&b, &dp, &cp, haveDP, haveCP)
	}
	if haveGB {
		w("Go benchmarks: %d benchmarks in %d packages; hot paths without a benchmark: %s (see [Go benchmarks](#go-benchmarks)).\n\n",
			len(gb.Benchmarks), len(gb.Packages), missingHotPaths(&gb))
	}

	if haveDP && dp.HasBaselinePaths() {
		WriteBeforeAfter(&b, &dp)
	}
	writeMachine(&b, machine)
	if haveDP {
		writeMethod(&b, &dp, &cp, haveCP)
		n, err := writeDataDetails(&b, out, &dp)
		sum.Charts += n
		if err != nil {
			return sum, err
		}
	}
	if haveCP {
		n, err := writeCPDetails(&b, out, &cp)
		sum.Charts += n
		if err != nil {
			return sum, err
		}
	}
	if haveGB {
		writeGoBench(&b, &gb)
	}
	if haveDP {
		writeProfiles(&b, &dp)
	}
	WriteNA(&b, &dp, &cp, &gb, haveDP, haveCP, haveGB)

	// Figures and reasons, and the harness's own failures.
	for _, part := range []struct {
		name string
		have bool
		meta *results.RunMeta
	}{{"datapath", haveDP, &dp.Meta}, {"controlplane", haveCP, &cp.Meta}, {"gobench", haveGB, &gb.Meta}} {
		if !part.have {
			continue
		}
		for _, e := range part.meta.Errors {
			sum.Errors = append(sum.Errors, fmt.Errorf("%s: %s", part.name, e))
		}
	}
	if haveDP {
		for _, m := range dp.Metrics {
			for _, p := range dp.Paths {
				s := dp.Figures[m.ID][p.ID]
				switch {
				case s != nil && len(s.Values) > 0:
					sum.Figures++
				case s.Filled():
					sum.NA++
				default:
					sum.Errors = append(sum.Errors, fmt.Errorf("datapath: %s of %s has neither a figure nor a reason", m.ID, p.ID))
				}
			}
		}
	}
	if haveCP {
		for _, m := range cp.Metrics {
			for _, p := range cp.Proxies {
				for _, n := range cp.Scales {
					s := cp.Figures[m.ID][p.ID][strconv.Itoa(n)]
					switch {
					case s != nil && len(s.Values) > 0:
						sum.Figures++
					case s.Filled():
						sum.NA++
					default:
						sum.Errors = append(sum.Errors, fmt.Errorf("controlplane: %s of %s at %d services has neither a figure nor a reason", m.ID, p.ID, n))
					}
				}
			}
		}
	}
	if haveGB {
		for _, p := range gb.Packages {
			if p.NA != "" {
				sum.NA++
			}
		}
		sum.Figures += len(gb.Benchmarks)
	}
	if err := os.WriteFile(out.Path, []byte(b.String()), 0o644); err != nil {
		return sum, fmt.Errorf("writing the report: %w", err)
	}
	return sum, nil
}

// FmtNum formats a figure with about three significant digits.
func FmtNum(v float64) string {
	switch a := math.Abs(v); {
	case math.IsNaN(v):
		return "–"
	case a >= 10000:
		return Thousands(int64(math.Round(v)))
	case a >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case a >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	case a >= 1:
		return strconv.FormatFloat(v, 'f', 2, 64)
	default:
		return strconv.FormatFloat(v, 'f', 3, 64)
	}
}

func Thousands(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var out []string
	for len(s) > 3 {
		out = append([]string{s[len(s)-3:]}, out...)
		s = s[:len(s)-3]
	}
	out = append([]string{s}, out...)
	r := strings.Join(out, ",")
	if neg {
		r = "-" + r
	}
	return r
}

// ratio formats v relative to base.
func ratio(v, base float64) string {
	if math.IsNaN(v) || math.IsNaN(base) || base == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f×", v/base)
}

func median(s *results.Series) float64 {
	if s == nil || len(s.Values) == 0 {
		return math.NaN()
	}
	_, m, _ := s.Stats()
	return m
}

func WriteDataSummary(b *strings.Builder, dp *results.DataPathResults) {
	fmt.Fprintf(b, "### Data paths\n\nMedian of %d runs; in parentheses, the ratio to kernel DNAT. %d connections for keep-alive, short connections and UDP; %s idle connections for memory.\n\n",
		dp.Meta.Runs, dp.Conns, Thousands(int64(dp.IdleConns)))
	if dp.IdleNote != "" {
		fmt.Fprintf(b, "Note: %s.\n\n", dp.IdleNote)
	}
	// The CPU costs have a table of their own (writeCostSummary).
	metrics := slices.DeleteFunc(slices.Clone(dp.Metrics), func(m results.Metric) bool { return results.IsCost(m.ID) })
	b.WriteString("| data path |")
	for _, m := range metrics {
		fmt.Fprintf(b, " %s |", shortTitle(m))
	}
	b.WriteString("\n|---|")
	for range metrics {
		b.WriteString("---:|")
	}
	b.WriteString("\n")
	for _, p := range dp.Paths {
		fmt.Fprintf(b, "| %s |", p.Title)
		for _, m := range metrics {
			s := dp.Figures[m.ID][p.ID]
			if s == nil || len(s.Values) == 0 {
				b.WriteString(" n/a |")
				continue
			}
			med := median(s)
			if p.ID == "dnat" {
				fmt.Fprintf(b, " %s |", FmtNum(med))
				continue
			}
			fmt.Fprintf(b, " %s (%s) |", FmtNum(med), ratio(med, median(dp.Figures[m.ID]["dnat"])))
		}
		b.WriteString("\n")
	}
	b.WriteString("\nWhy a cell is n/a: [Not measured](#not-measured). Memory and descriptors per idle connection are the proxy process's growth (RSS, open files)\ndivided by the connections; for kernel DNAT the memory is the size of the one conntrack entry the kernel keeps per connection (its\nslab object size), since no process carries the connection.\n\n")
}

// WriteCostSummary writes the table of the proxy's CPU per unit of work,
// each next to its rate; results from before these were measured have
// none, and no table.
func WriteCostSummary(b *strings.Builder, dp *results.DataPathResults) {
	type pair struct{ rate, cpu results.Metric }
	var pairs []pair
	for _, c := range results.CostMetrics {
		ri := slices.IndexFunc(dp.Metrics, func(m results.Metric) bool { return m.ID == c.Rate })
		ci := slices.IndexFunc(dp.Metrics, func(m results.Metric) bool { return m.ID == c.CPU })
		if ri >= 0 && ci >= 0 {
			pairs = append(pairs, pair{dp.Metrics[ri], dp.Metrics[ci]})
		}
	}
	if len(pairs) == 0 {
		return
	}
	fmt.Fprintf(b, "### CPU per unit of work\n\nThe proxy process's CPU time (user and system, its child processes included, from /proc/PID/stat) over each workload's\n"+
		"whole run, divided by the work done in it (every request or connection, warm-up included; or every MiB), next to the rate;\n"+
		"median of %d runs. The kernel paths have no figure: no process carries their traffic, and the cost is softirq work in\n"+
		"whichever process sends a packet, which [Where the CPU goes](#where-the-cpu-goes) shows.\n\n", dp.Meta.Runs)
	b.WriteString("| data path |")
	for _, p := range pairs {
		fmt.Fprintf(b, " %s | %s |", shortTitle(p.rate), shortTitle(p.cpu))
	}
	b.WriteString("\n|---|")
	for range pairs {
		b.WriteString("---:|---:|")
	}
	b.WriteString("\n")
	cell := func(s *results.Series) string {
		if !s.Measured() {
			return "n/a"
		}
		return FmtNum(median(s))
	}
	for _, p := range dp.Paths {
		fmt.Fprintf(b, "| %s |", p.Title)
		for _, pr := range pairs {
			fmt.Fprintf(b, " %s | %s |", cell(dp.Figures[pr.rate.ID][p.ID]), cell(dp.Figures[pr.cpu.ID][p.ID]))
		}
		b.WriteString("\n")
	}
	b.WriteString("\n")
}

// shortTitle is a metric's summary-table header.
func shortTitle(m results.Metric) string {
	names := map[string]string{
		"bulk_gbps":  "bulk",
		"rr_rps":     "keep-alive",
		"rr_p50_us":  "keep-alive p50",
		"rr_p99_us":  "keep-alive p99",
		"short_cps":  "short conns",
		"udp_rps":    "UDP",
		"udp_p99_us": "UDP p99",
		"dns_rps":    "UDP, new port per query",
		"dns_p99_us": "UDP, new port, p99",
		"idle_kib":   "memory/conn",
		"idle_fds":   "fds/conn",
		// The CPU costs, in the cost table's header next to their rates.
		"bulk_cpu_us":  "bulk CPU",
		"rr_cpu_us":    "keep-alive CPU",
		"short_cpu_us": "short conns CPU",
		"udp_cpu_us":   "UDP CPU",
		"dns_cpu_us":   "UDP, new port, CPU",
	}
	n := names[m.ID]
	if n == "" {
		n = m.ID
	}
	return n + " (" + m.Unit + ")"
}

// ControlPlaneSummary returns the summary's cell of metric for proxy at n
// services, and its value (NaN when it has none: a cell that says why).
func ControlPlaneSummary(cp *results.ControlPlaneResults, metric, proxy string, n int) (string, float64) {
	s := cp.Figures[metric][proxy][strconv.Itoa(n)]
	if s == nil || len(s.Values) == 0 {
		// A proxy that timed out: say so where its time would be.
		if s != nil && metric == "program_s" {
			if over, ok := strings.CutPrefix(s.NA, "over "); ok {
				limit, _, _ := strings.Cut(over, ":")
				return "> " + limit + " (timed out)", math.NaN()
			}
			if strings.HasPrefix(s.NA, "partial: ") {
				return "partial (listener budget spent)", math.NaN()
			}
			if strings.HasPrefix(s.NA, "not run: ") {
				return "not run (failed at fewer)", math.NaN()
			}
		}
		return "n/a", math.NaN()
	}
	if results.PerChange(metric) {
		return FmtNum(s.Quantile(0.5)) + " / " + FmtNum(s.Quantile(0.99)), s.Quantile(0.5)
	}
	m := median(s)
	return FmtNum(m), m
}

func writeCPSummary(b *strings.Builder, cp *results.ControlPlaneResults) {
	fmt.Fprintf(b, "### Control plane\n\nServices × %d endpoints in a real kube-apiserver; median of %d runs (endpoint changes: p50 / p99 of %d changes per run;\nuproxy's part of a change is from the start of the sync it triggered, in uproxy's log); in parentheses, the ratio to kernel DNAT (the harness loading the same rules with iptables-restore).\n\n",
		cp.Endpoints, cp.Meta.Runs, cp.Changes)
	b.WriteString("| proxy | services | programmed (s) | endpoint change p50 / p99 (ms) | uproxy's part p50 / p99 (ms) | rule lines | RSS (MiB) |\n|---|---:|---:|---:|---:|---:|---:|\n")
	for _, n := range cp.Scales {
		for _, p := range cp.Proxies {
			fmt.Fprintf(b, "| %s | %s |", p.Title, Thousands(int64(n)))
			for _, m := range []string{"program_s", "change_ms", "change_sync_ms", "rules", "rss_mib"} {
				cell, v := ControlPlaneSummary(cp, m, p.ID, n)
				_, base := ControlPlaneSummary(cp, m, "dnat", n)
				if p.ID == "dnat" || math.IsNaN(v) || math.IsNaN(base) {
					fmt.Fprintf(b, " %s |", cell)
				} else {
					fmt.Fprintf(b, " %s (%s) |", cell, ratio(v, base))
				}
			}
			b.WriteString("\n")
		}
	}
	b.WriteString("\n")
}

func missingHotPaths(gb *results.GoBenchResults) string {
	var miss []string
	for _, h := range gb.HotPaths {
		if len(h.Benchmarks) == 0 {
			miss = append(miss, h.What)
		}
	}
	if len(miss) == 0 {
		return "none"
	}
	return strings.Join(miss, ", ")
}

func writeMachine(b *strings.Builder, m results.Machine) {
	fmt.Fprintf(b, "## The machine\n\n| | |\n|---|---|\n| host | %s |\n| CPU | %s |\n| cores | %d |\n| memory | %s |\n| kernel | %s |\n| OS | %s |\n| load average when the report was written | %s |\n",
		m.Host, m.CPU, m.Cores, m.Memory, m.Kernel, m.OS, m.LoadAvg)
	if m.SyscallNs > 0 {
		fmt.Fprintf(b, "| one system call (getppid), when the report was written | %.2f µs |\n", float64(m.SyscallNs)/1000)
	}
	for _, t := range m.Tools {
		fmt.Fprintf(b, "| %s | %s |\n", t[0], strings.ReplaceAll(t[1], "|", "/"))
	}
	b.WriteString("\nThe machine is shared with other work (tests of other changes may run at the same time), and has 2 cores for\nthe load generator, the backends and the proxy together: compare paths by their ratios, not across reports.\n\n")
}

func writeMethod(b *strings.Builder, dp *results.DataPathResults, cp *results.ControlPlaneResults, haveCP bool) {
	fmt.Fprintf(b, `## How it was measured

Every measurement runs in network namespaces that the harness creates and deletes (internal/testlab): a **node**
namespace with a bridge (10.244.0.1/24), **backend pods** on the bridge (10.244.0.10, .11), and a **client pod**
on a routed veth of its own (10.244.1.2, gateway 10.244.1.1), so that every packet between client and backends is
routed by the node in both directions, as with a routed CNI. Each data path gets a fresh lab in every run. The
service is 10.96.0.10: port 80 (request/response), 5001 (bulk) and 53/udp (echo), over the two backends.

**Load generators and backends**: the project's own, in Go (bench/internal/load), run as
`+"`bench load …`"+` in the client pod and `+"`bench backend`"+` in each backend pod. wrk and iperf3 are not used: one
generator covers every workload (UDP and idle connections too) with the same latency histogram (log-linear, 3%%
buckets), and iperf3's control connection would not survive a balancer that sends it to another backend.

| workload | what the client does |
|---|---|
| bulk | one TCP connection sends 256 KiB writes for %s; the sink answers with the byte count; Gbit/s = bytes / time to that answer |
| keep-alive | %d connections, each sends a 64-byte request as soon as the 128-byte answer to the previous one arrived; first fifth of %s is warm-up |
| short connections | %d workers, each: connect, one request, the server answers and closes, close |
| UDP | %d sockets, each sends a 64-byte datagram as soon as the previous one is echoed (200 ms timeout counts as a loss) |
| UDP, a new port per query | as UDP, but each datagram goes out from a new socket, as a DNS stub resolver sends its queries: every query is a new flow to a proxy |
| idle connections | %s connections, each makes one request then stays open, through a freshly started proxy in a lab of its own; memory = (proxy RSS after − before) / connections; nginx counts master and workers |

Runs are interleaved (every path in run 1, then every path in run 2, …), %d runs.

| data path | how |
|---|---|
`, dp.Duration, dp.Conns, dp.Duration, dp.Conns, dp.Conns, Thousands(int64(dp.IdleConns)), dp.Meta.Runs)
	for _, p := range dp.Paths {
		fmt.Fprintf(b, "| %s | %s |\n", p.Title, p.How)
	}
	b.WriteString("\nkube-proxy runs with its defaults except `--conntrack-max-per-core=0 --conntrack-min=0 --conntrack-tcp-timeout-established=0\n--conntrack-tcp-timeout-close-wait=0 --oom-score-adj=0` (the conntrack table size is shared by the whole machine: it must not change it),\nand `--cluster-cidr=10.244.0.0/16`, against a real etcd and kube-apiserver in a lab of their own (internal/testkube).\n\n")
	if haveCP {
		fmt.Fprintf(b, "**Control plane**: for each scale, a fresh API server gets N Services (ClusterIP, port 80) each with one EndpointSlice of %d\nendpoints (addresses on one backend pod). Then, per run and proxy, in a fresh lab: a probe polls the **last** service from the\nclient pod, the proxy starts, and the time until the last service answers is taken; a sweep then checks that every service\nanswers (retrying those that do not, in which case the time is when the last of them answered). Then the last service's\nendpoints are replaced by one new endpoint, %d times, 1.2 s apart; each time, a probe (a new connection every 5 ms) times\nthe change from the API write until a connection reaches the new endpoint.\n\n",
			cp.Endpoints, cp.Changes)
		for _, p := range cp.Proxies {
			fmt.Fprintf(b, "- **%s**: %s\n", p.Title, p.How)
		}
		b.WriteString("\n")
	}
}

func writeDataDetails(b *strings.Builder, out Output, dp *results.DataPathResults) (int, error) {
	b.WriteString("## Data path results\n\n")
	charts := 0
	for _, m := range dp.Metrics {
		better := "lower is better"
		if m.Higher {
			better = "higher is better"
		}
		fmt.Fprintf(b, "### %s\n\n%s, %s.\n\n", m.Title, m.Unit, better)
		file, err := results.BarChart(out.Dir, m.ID, m.Title, m.Unit, dp.Paths, func(id string) *results.Series { return dp.Figures[m.ID][id] })
		if err != nil {
			return charts, err
		}
		if file != "" {
			charts++
			fmt.Fprintf(b, "![%s](%s/%s)\n\n", m.Title, out.Stem, file)
		}
		b.WriteString("| data path | min | median | max | × kernel DNAT |\n|---|---:|---:|---:|---:|\n")
		base := median(dp.Figures[m.ID]["dnat"])
		for _, p := range dp.Paths {
			s := dp.Figures[m.ID][p.ID]
			if s == nil || len(s.Values) == 0 {
				reason := ""
				if s != nil {
					reason = s.NA
				}
				fmt.Fprintf(b, "| %s | n/a: %s | | | |\n", p.Title, mdEscape(reason))
				continue
			}
			lo, med, hi := s.Stats()
			fmt.Fprintf(b, "| %s | %s | %s | %s | %s |\n", p.Title, FmtNum(lo), FmtNum(med), FmtNum(hi), ratio(med, base))
		}
		b.WriteString("\n")
	}
	if len(dp.Notes) > 0 {
		b.WriteString("Notes on the runs (errors that the load generators saw; the figures above count only what succeeded):\n\n")
		for _, n := range dp.Notes {
			fmt.Fprintf(b, "- %s\n", mdEscape(n))
		}
		b.WriteString("\n")
	}
	return charts, nil
}

// ControlPlaneValue is the figure of metric that the control plane's charts and
// ratios use: the median of the runs, or of every change.
func ControlPlaneValue(cp *results.ControlPlaneResults, metric, proxy string, n int) (float64, bool) {
	s := cp.Figures[metric][proxy][strconv.Itoa(n)]
	if s == nil || len(s.Values) == 0 {
		return 0, false
	}
	if results.PerChange(metric) {
		return s.Quantile(0.5), true
	}
	return median(s), true
}

// cpChart draws metric against the number of services, a line per proxy,
// and returns the file's name in the data folder ("" when no proxy has
// the figure).
func cpChart(out Output, cp *results.ControlPlaneResults, m results.Metric) (string, error) {
	title := m.Title
	if results.PerChange(m.ID) {
		title += " (p50)"
	}
	return results.ScaleChart(out.Dir, "cp_"+m.ID, title, m.Unit, cp.Scales, cp.Proxies,
		func(proxy string, n int) (float64, bool) { return ControlPlaneValue(cp, m.ID, proxy, n) })
}

// cpCostCurves are the figures that the summary charts against the number
// of services: what a proxy costs as its work grows.
var cpCostCurves = []string{"rss_mib", "program_s"}

// WriteCostCurves writes the summary's charts of cpCostCurves.
func WriteCostCurves(b *strings.Builder, out Output, cp *results.ControlPlaneResults) error {
	var charts []string
	for _, id := range cpCostCurves {
		i := slices.IndexFunc(cp.Metrics, func(m results.Metric) bool { return m.ID == id })
		if i < 0 {
			continue
		}
		file, err := cpChart(out, cp, cp.Metrics[i])
		if err != nil {
			return err
		}
		if file != "" {
			charts = append(charts, fmt.Sprintf("![%s](%s/%s)", cp.Metrics[i].Title, out.Stem, file))
		}
	}
	if len(charts) == 0 {
		return nil
	}
	scales := make([]string, len(cp.Scales))
	for i, n := range cp.Scales {
		scales[i] = Thousands(int64(n))
	}
	fmt.Fprintf(b, "How each proxy's memory and its time to program every service grow with the number of services (%s): the\n"+
		"median at each scale, a line per proxy; a proxy that timed out has no point there and beyond.\n\n%s\n\n", strings.Join(scales, ", "), strings.Join(charts, "\n\n"))
	return nil
}

func writeCPDetails(b *strings.Builder, out Output, cp *results.ControlPlaneResults) (int, error) {
	b.WriteString("## Control plane results\n\n")
	charts := 0
	if len(cp.GenerateSeconds) > 0 {
		b.WriteString("Creating the objects in the API server (not part of any figure):")
		for _, n := range cp.Scales {
			if s, ok := cp.GenerateSeconds[strconv.Itoa(n)]; ok {
				fmt.Fprintf(b, " %s services in %.1f s;", Thousands(int64(n)), s)
			}
		}
		b.WriteString("\n\n")
	}
	for _, n := range cp.Notes {
		fmt.Fprintf(b, "- %s\n", mdEscape(n))
	}
	if len(cp.Notes) > 0 {
		b.WriteString("\n")
	}
	for _, m := range cp.Metrics {
		fmt.Fprintf(b, "### %s\n\n%s, lower is better.", m.Title, m.Unit)
		if results.PerChange(m.ID) {
			b.WriteString(" Every change of every run; p50, p99 and max.")
		} else {
			b.WriteString(" Min, median and max of the runs.")
		}
		b.WriteString("\n\n")
		value := func(proxy string, n int) (float64, bool) { return ControlPlaneValue(cp, m.ID, proxy, n) }
		file, err := cpChart(out, cp, m)
		if err != nil {
			return charts, err
		}
		if file != "" {
			charts++
			fmt.Fprintf(b, "![%s](%s/%s)\n\n", m.Title, out.Stem, file)
		}
		b.WriteString("| proxy | services | ")
		if results.PerChange(m.ID) {
			b.WriteString("p50 | p99 | max | changes | × kernel DNAT (p50) |\n|---|---:|---:|---:|---:|---:|---:|\n")
		} else {
			b.WriteString("min | median | max | × kernel DNAT |\n|---|---:|---:|---:|---:|---:|\n")
		}
		for _, n := range cp.Scales {
			for _, p := range cp.Proxies {
				s := cp.Figures[m.ID][p.ID][strconv.Itoa(n)]
				if s == nil || len(s.Values) == 0 {
					reason := ""
					if s != nil {
						reason = s.NA
					}
					fmt.Fprintf(b, "| %s | %s | n/a: %s | | | |", p.Title, Thousands(int64(n)), mdEscape(reason))
					if results.PerChange(m.ID) {
						b.WriteString(" |")
					}
					b.WriteString("\n")
					continue
				}
				base, _ := value("dnat", n)
				if _, ok := value("dnat", n); !ok {
					base = math.NaN()
				}
				if results.PerChange(m.ID) {
					fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %d | %s |\n", p.Title, Thousands(int64(n)),
						FmtNum(s.Quantile(0.5)), FmtNum(s.Quantile(0.99)), FmtNum(s.Quantile(1)), len(s.Values), ratio(s.Quantile(0.5), base))
					continue
				}
				lo, med, hi := s.Stats()
				fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %s |\n", p.Title, Thousands(int64(n)), FmtNum(lo), FmtNum(med), FmtNum(hi), ratio(med, base))
			}
		}
		b.WriteString("\n")
	}
	writeHeapProfiles(b, cp)
	return charts, nil
}

// heapSection is the title of the control plane's heap profiles.
const heapSection = "Where uproxy's memory goes"

// writeHeapProfiles writes uproxy's heap profiles at the largest scale:
// what its RSS is made of.
func writeHeapProfiles(b *strings.Builder, cp *results.ControlPlaneResults) {
	if len(cp.HeapProfiles) == 0 {
		return
	}
	fmt.Fprintf(b, "### %s\n\nEach uproxy's Go heap once every service was programmed, in the first run at the largest scale: memory in use\n"+
		"(`go tool pprof -top -sample_index=inuse_space` of /debug/pprof/heap on its debug address, with --profiling). The heap is\n"+
		"part of the RSS; the rest is the Go runtime's own, freed memory not yet returned, and the binary.\n\n", heapSection)
	for _, p := range cp.Proxies {
		hp := cp.HeapProfiles[p.ID]
		if hp == nil {
			continue
		}
		fmt.Fprintf(b, "#### %s: heap at %s services (RSS %s MiB)\n\n", p.Title, Thousands(int64(hp.Scale)), FmtNum(hp.RSSMiB))
		if hp.NA != "" {
			fmt.Fprintf(b, "n/a: %s\n\n", mdEscape(hp.NA))
			continue
		}
		fmt.Fprintf(b, "```\n%s\n```\n\n", hp.Top)
	}
}

func writeGoBench(b *strings.Builder, gb *results.GoBenchResults) {
	fmt.Fprintf(b, "## Go benchmarks\n\n`%s`, in the module root. Min, median and max of the counts. These have no kernel counterpart, so no ratio.\n\n", gb.Command)
	b.WriteString("| hot path | benchmarks |\n|---|---|\n")
	for _, h := range gb.HotPaths {
		if len(h.Benchmarks) == 0 {
			fmt.Fprintf(b, "| %s | **missing**: to be added in %s |\n", h.What, h.Owner)
			continue
		}
		fmt.Fprintf(b, "| %s | %d: %s |\n", h.What, len(h.Benchmarks), mdEscape(strings.Join(shorten(h.Benchmarks, 4), ", ")))
	}
	b.WriteString("\n")
	for _, p := range gb.Packages {
		if p.NA != "" {
			fmt.Fprintf(b, "- `%s`: n/a: %s\n", p.Package, mdEscape(p.NA))
		}
	}
	if len(gb.Benchmarks) > 0 {
		b.WriteString("\n| benchmark | ns/op min | median | max | B/op | allocs/op |\n|---|---:|---:|---:|---:|---:|\n")
		for _, be := range gb.Benchmarks {
			lo, med, hi := be.NsPerOp.Stats()
			fmt.Fprintf(b, "| %s%s | %s | %s | %s | %s | %s |\n", strings.TrimPrefix(be.Package, "./"), mdEscape(be.Name),
				FmtNum(lo), FmtNum(med), FmtNum(hi), FmtNum(median(&be.BytesPerOp)), FmtNum(median(&be.AllocsPerOp)))
		}
	}
	b.WriteString("\n")
}

func shorten(list []string, n int) []string {
	if len(list) <= n {
		return list
	}
	return append(slices.Clone(list[:n]), fmt.Sprintf("and %d more", len(list)-n))
}

// profiledWorkload is one workload's profiles, as "Where the CPU goes"
// titles them; unit is what the rate counts ("req", "conn", "MiB").
type profiledWorkload struct {
	title, unit string
	profiles    map[string]*results.Profile
}

// profiled returns the profiles of every workload, in the report's order.
func profiledWorkloads(r *results.DataPathResults) []profiledWorkload {
	return []profiledWorkload{
		{"Keep-alive requests", "req", r.Profiles},
		{"Short connections", "conn", r.ShortProfiles},
		{"UDP requests", "req", r.UDPProfiles},
		{"UDP queries from a new port", "req", r.DNSProfiles},
		{"Bulk transfers", "MiB", r.BulkProfiles},
	}
}

func writeProfiles(b *strings.Builder, dp *results.DataPathResults) {
	b.WriteString("## Where the CPU goes\n\n")
	if dp.ProfileNA != "" {
		fmt.Fprintf(b, "perf could not sample here: %s.\n\n", mdEscape(dp.ProfileNA))
	}
	workloads := profiledWorkloads(dp)
	if !slices.ContainsFunc(workloads, func(w profiledWorkload) bool { return len(w.profiles) > 0 }) {
		b.WriteString("No profiles were taken (--no-profile).\n\n")
		return
	}
	// Results from before short connections, then UDP, were profiled
	// have fewer extra runs.
	runs := "one extra keep-alive run, one extra short-connection run and one extra UDP run per data path that carries UDP (their figures are not kept)"
	switch {
	case len(dp.ShortProfiles) == 0:
		runs = "one extra keep-alive run per data path (its figures are not kept)"
	case len(dp.UDPProfiles) == 0:
		runs = "one extra keep-alive run and one extra short-connection run per data path (their figures are not kept)"
	case len(dp.DNSProfiles) > 0:
		runs = "one extra run of each workload (keep-alive, short connections, UDP and UDP from a new port per query where the path carries UDP, and bulk) per data path (their figures are not kept)"
	case len(dp.BulkProfiles) > 0:
		runs = "one extra run of each workload (keep-alive, short connections, UDP where the path carries it, and bulk) per data path (their figures are not kept)"
	}
	b.WriteString("During " + runs + `,
` + "`perf record -e cpu-clock -a`" + ` sampled every CPU of the machine; the samples are grouped by process (the load
generator and the backends are the same program under two names, so that they can be told apart). The event is the
software CPU clock, which works everywhere; hardware counters (cycles, instructions): `)
	b.WriteString(dp.PerfCounters)
	b.WriteString(`. CPU per request (or connection) is the group's share of the machine's cores divided by the rate of that
run ("other processes" is work on the machine that is not the benchmark's; "idle" is CPU time nobody used). For uproxy,
its own CPU profile (pprof, from /debug/pprof on its debug address) shows which Go functions and system calls the time
is spent in.

`)
	for _, w := range workloads {
		if len(w.profiles) == 0 {
			continue
		}
		fmt.Fprintf(b, "### %s\n\n", w.title)
		writeShares(b, dp, w.profiles, w.unit)
		b.WriteString(analysis(dp, w.profiles, w.unit))
	}
	b.WriteString(`A userspace proxy adds two sockets and two trips through the scheduler per request on top of the kernel path: its cost
shows as the proxy's own time, most of it in the kernel (socket reads and writes, or splice, and epoll), and as more
kernel time in the client and backends, whose packets now cross two TCP connections. The kernel paths' cost is netfilter
(conntrack lookups, the nat chains, nft_do_chain or ipt_do_table) in the softirq of whichever process sends a packet.
`)
	if hasSymbol(dp, "pvm_irq_enable") {
		b.WriteString(`Samples in ` + "`pvm_irq_enable`" + ` are time this virtual machine's kernel spent with interrupts disabled (the sampling
interrupt is delivered when they are enabled again), mostly network softirq work; perf cannot see inside it here.
`)
	}
	b.WriteString("\n")
	for _, p := range dp.Paths {
		for _, w := range workloads {
			pr := w.profiles[p.ID]
			if pr == nil {
				continue
			}
			fmt.Fprintf(b, "### %s: %s\n\n", p.Title, strings.ToLower(w.title))
			for _, n := range pr.NA {
				fmt.Fprintf(b, "- n/a: %s\n", mdEscape(n))
			}
			if len(pr.NA) > 0 {
				b.WriteString("\n")
			}
			if pr.TopSymbols != "" {
				fmt.Fprintf(b, "Hottest functions of the benchmark's processes (%% of all samples):\n\n```\n%s\n```\n\n", pr.TopSymbols)
			}
			if pr.ProxySymbols != "" {
				fmt.Fprintf(b, "Hottest functions in the proxy process:\n\n```\n%s\n```\n\n", pr.ProxySymbols)
			}
			if pr.Pprof != "" {
				fmt.Fprintf(b, "uproxy's own CPU profile (`go tool pprof -top`):\n\n```\n%s\n```\n\n", pr.Pprof)
			}
		}
	}
}

// writeShares writes the table of the machine's CPU by process group, one
// row per profiled path; unit is what the rate counts ("req", "conn").
func writeShares(b *strings.Builder, dp *results.DataPathResults, profiles map[string]*results.Profile, unit string) {
	fmt.Fprintf(b, "| data path | %s/s while profiled |", unit)
	order := []string{results.WhoLoad, results.WhoBackend, results.WhoProxy, results.WhoSoftirq, results.WhoOther, results.WhoIdle}
	for _, who := range order {
		fmt.Fprintf(b, " %s |", who)
	}
	b.WriteString("\n|---|---:|")
	for range order {
		b.WriteString("---:|")
	}
	b.WriteString("\n")
	for _, p := range dp.Paths {
		pr := profiles[p.ID]
		if pr == nil || len(pr.Shares) == 0 {
			continue
		}
		fmt.Fprintf(b, "| %s | %s |", p.Title, FmtNum(pr.Rate))
		for _, who := range order {
			sh := pr.Share(who)
			if sh == nil {
				b.WriteString(" – |")
				continue
			}
			cell := fmt.Sprintf("%.0f%% (kernel %.0f%%)", sh.Percent, sh.Kernel)
			if who != results.WhoIdle && who != results.WhoOther && pr.Rate > 0 {
				cell += fmt.Sprintf(", %s µs/%s", FmtNum(pr.PerOp(sh.Percent)), unit)
			}
			fmt.Fprintf(b, " %s |", cell)
		}
		b.WriteString("\n")
	}
	b.WriteString("\n")
}

// analysis writes a few sentences on where each path spends its CPU in
// one workload's profiles, from their figures; unit is what the rate
// counts ("req", "conn").
func analysis(dp *results.DataPathResults, profiles map[string]*results.Profile, unit string) string {
	var b strings.Builder
	cost := func(pr *results.Profile, who string) (float64, float64, bool) {
		s := pr.Share(who)
		if s == nil || pr.Rate <= 0 {
			return 0, 0, false
		}
		return pr.PerOp(s.Percent), s.Kernel / math.Max(s.Percent, 1e-9), true
	}
	total := func(pr *results.Profile) float64 {
		var t float64
		for _, s := range pr.Shares {
			if s.Who != results.WhoIdle && s.Who != results.WhoOther {
				t += s.Percent
			}
		}
		return pr.PerOp(t)
	}
	idle := func(pr *results.Profile) float64 {
		if s := pr.Share(results.WhoIdle); s != nil {
			return s.Percent
		}
		return 0
	}
	noun := map[string]string{"req": "request", "conn": "connection", "MiB": "MiB carried"}[unit]
	base := math.NaN()
	if pr := profiles["dnat"]; pr != nil && len(pr.Shares) > 0 {
		base = total(pr)
	}
	b.WriteString("**Reading the profiles.**\n\n")
	for _, p := range dp.Paths {
		pr := profiles[p.ID]
		if pr == nil || len(pr.Shares) == 0 {
			continue
		}
		t := total(pr)
		fmt.Fprintf(&b, "- **%s**: %s µs of CPU per %s in all (%s kernel DNAT), with %.0f%% of the CPUs idle", p.Title, FmtNum(t), noun, ratio(t, base), idle(pr))
		if c, k, ok := cost(pr, results.WhoProxy); ok && c > 0.05 {
			fmt.Fprintf(&b, "; the proxy process itself %s µs, %.0f%% of it in the kernel", FmtNum(c), 100*k)
		}
		lc, _, _ := cost(pr, results.WhoLoad)
		bc, _, _ := cost(pr, results.WhoBackend)
		sc, _, _ := cost(pr, results.WhoSoftirq)
		fmt.Fprintf(&b, "; the client %s µs and the backends %s µs", FmtNum(lc), FmtNum(bc))
		if sc >= 0.05 {
			fmt.Fprintf(&b, ", softirq threads %s µs", FmtNum(sc))
		}
		if sym := firstSymbols(pr.ProxySymbols, 3); sym != "" {
			fmt.Fprintf(&b, "; the proxy's hottest functions: %s", sym)
		} else if sym := firstSymbols(pr.TopSymbols, 3); sym != "" {
			fmt.Fprintf(&b, "; the hottest functions: %s", sym)
		}
		b.WriteString(".\n")
	}
	b.WriteString("\n")
	return b.String()
}

// madeBy names the commands that made the parts in a report: `bench all`
// (make bench) when none recorded its own, as before they did.
func madeBy(metas ...*results.RunMeta) string {
	var cmds []string
	for _, m := range metas {
		if m.Command != "" && !slices.Contains(cmds, m.Command) {
			cmds = append(cmds, m.Command)
		}
	}
	if len(cmds) == 0 {
		return "`cd bench && go run . all` (`make bench`)"
	}
	for i, c := range cmds {
		cmds[i] = "`" + c + "`"
	}
	return strings.Join(cmds, " and ")
}

// hasSymbol reports whether any profile's listing names sym.
func hasSymbol(dp *results.DataPathResults, sym string) bool {
	for _, w := range profiledWorkloads(dp) {
		for _, p := range w.profiles {
			if strings.Contains(p.TopSymbols, sym) || strings.Contains(p.ProxySymbols, sym) {
				return true
			}
		}
	}
	return false
}

// firstSymbols returns the first n distinct function names of perf's
// symbol listing, leaving out pvm_irq_enable (see the report's note).
func firstSymbols(listing string, n int) string {
	var out []string
	seen := map[string]bool{"pvm_irq_enable": true}
	for _, l := range strings.Split(listing, "\n") {
		f := strings.Fields(l)
		if len(f) == 0 || seen[f[len(f)-1]] {
			continue
		}
		seen[f[len(f)-1]] = true
		out = append(out, "`"+f[len(f)-1]+"`")
		if len(out) == n {
			break
		}
	}
	return strings.Join(out, ", ")
}

func WriteNA(b *strings.Builder, dp *results.DataPathResults, cp *results.ControlPlaneResults, gb *results.GoBenchResults, haveDP, haveCP, haveGB bool) {
	b.WriteString("## Not measured\n\nEvery figure that could not be measured here, and why.\n\n")
	seen := map[string]bool{}
	any := false
	add := func(line string) {
		if !seen[line] {
			seen[line] = true
			any = true
			fmt.Fprintf(b, "- %s\n", mdEscape(line))
		}
	}
	if haveDP {
		for _, p := range dp.Paths {
			// One line per reason, naming the figures it holds for.
			var reasons []string
			which := map[string][]string{}
			for _, m := range dp.Metrics {
				if s := dp.Figures[m.ID][p.ID]; s != nil && len(s.Values) == 0 && s.NA != "" {
					if which[s.NA] == nil {
						reasons = append(reasons, s.NA)
					}
					which[s.NA] = append(which[s.NA], shortTitle(m))
				}
			}
			for _, r := range reasons {
				add(fmt.Sprintf("%s, %s: %s", p.Title, strings.Join(which[r], ", "), r))
			}
		}
		if dp.ProfileNA != "" {
			add("CPU profiles (perf): " + dp.ProfileNA)
		}
	}
	if haveCP {
		for _, p := range cp.Proxies {
			for _, n := range cp.Scales {
				// One line per reason, naming the figures it holds for.
				var reasons []string
				which := map[string][]string{}
				for _, m := range cp.Metrics {
					if s := cp.Figures[m.ID][p.ID][strconv.Itoa(n)]; s != nil && len(s.Values) == 0 && s.NA != "" {
						if which[s.NA] == nil {
							reasons = append(reasons, s.NA)
						}
						which[s.NA] = append(which[s.NA], m.ID)
					}
				}
				for _, r := range reasons {
					add(fmt.Sprintf("control plane, %s at %s services (%s): %s", p.Title, Thousands(int64(n)), strings.Join(which[r], ", "), r))
				}
			}
		}
	}
	if haveGB {
		for _, h := range gb.HotPaths {
			if len(h.Benchmarks) == 0 {
				add(fmt.Sprintf("Go benchmark of the %s: none exists yet (to be added in %s)", h.What, h.Owner))
			}
		}
	}
	if !any {
		b.WriteString("Nothing: every figure was measured.\n")
	}
	b.WriteString("\n")
	var Errors []string
	for _, m := range []*results.RunMeta{&dp.Meta, &cp.Meta, &gb.Meta} {
		Errors = append(Errors, m.Errors...)
	}
	if len(Errors) > 0 {
		b.WriteString("## Errors\n\nThese measurements failed (not a known limitation: a bug in a proxy or in the harness):\n\n")
		for _, e := range Errors {
			fmt.Fprintf(b, "- %s\n", mdEscape(results.FirstLine(e)))
		}
		b.WriteString("\n")
	}
}

// mdEscape keeps text from breaking a Markdown table.
func mdEscape(s string) string {
	s = strings.ReplaceAll(s, "\n", " ")
	return strings.ReplaceAll(s, "|", "\\|")
}
