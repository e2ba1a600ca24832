package results

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// DataPathMetrics are the data-path figures, in report order.
var DataPathMetrics = []Metric{
	{"bulk_gbps", "Bulk single-stream TCP throughput", "Gbit/s", true},
	{"rr_rps", "Keep-alive request/response rate", "req/s", true},
	{"rr_p50_us", "Keep-alive request/response latency, p50", "µs", false},
	{"rr_p99_us", "Keep-alive request/response latency, p99", "µs", false},
	{"short_cps", "Short-connection rate (connect, one request, close)", "conn/s", true},
	{"udp_rps", "UDP request/response rate", "req/s", true},
	{"udp_p99_us", "UDP request/response latency, p99", "µs", false},
	{"dns_rps", "UDP queries from a new port each (DNS-like)", "req/s", true},
	{"dns_p99_us", "UDP queries from a new port each, latency p99", "µs", false},
	{"idle_kib", "Memory per idle connection", "KiB/conn", false},
	{"idle_fds", "File descriptors per idle connection", "fd/conn", false},
	{"bulk_cpu_us", "Proxy CPU per MiB carried (bulk)", "µs/MiB", false},
	{"rr_cpu_us", "Proxy CPU per keep-alive request", "µs/req", false},
	{"short_cpu_us", "Proxy CPU per short connection", "µs/conn", false},
	{"udp_cpu_us", "Proxy CPU per UDP request", "µs/req", false},
	{"dns_cpu_us", "Proxy CPU per UDP query from a new port", "µs/req", false},
}

// DataPathResults is the datapath part's output (datapath.json).
type DataPathResults struct {
	Meta    RunMeta   `json:"meta"`
	Paths   []Subject `json:"paths"`
	Metrics []Metric  `json:"metrics"`
	// Figures maps a metric id and a path id to its series.
	Figures map[string]map[string]*Series `json:"figures"`
	// Profiles maps a path id to where its CPU went during the keep-alive
	// workload.
	Profiles map[string]*Profile `json:"profiles"`
	// ShortProfiles maps a path id to where its CPU went during the
	// short-connection workload.
	ShortProfiles map[string]*Profile `json:"shortProfiles,omitempty"`
	// UDPProfiles maps a path id to where its CPU went during the UDP
	// workload, for the paths that carry UDP.
	UDPProfiles map[string]*Profile `json:"udpProfiles,omitempty"`
	// DNSProfiles maps a path id to where its CPU went during the UDP
	// queries from a new port each (the dns workload).
	DNSProfiles map[string]*Profile `json:"dnsProfiles,omitempty"`
	// BulkProfiles maps a path id to where its CPU went during the bulk
	// workload; their Rate is in MiB/s, so the CPU is per MiB carried.
	BulkProfiles map[string]*Profile `json:"bulkProfiles,omitempty"`
	// ProfileNA says why there are no perf profiles, if so.
	ProfileNA string `json:"profileNA,omitempty"`
	// PerfCounters says whether perf's hardware counters work here.
	PerfCounters string `json:"perfCounters,omitempty"`
	// Errors per workload that still produced a figure (UDP losses,
	// failed connections), for the report's notes.
	Notes []string `json:"notes,omitempty"`
	// Settings of the workloads.
	Duration  string `json:"duration"`
	Conns     int    `json:"conns"`
	IdleConns int    `json:"idleConns"`
	// IdleNote says why IdleConns is lower than asked, if it is.
	IdleNote string `json:"idleNote,omitempty"`
	// Baseline is the binary that the <id>-baseline paths ran, if any.
	Baseline *BaselineInfo `json:"baseline,omitempty"`
}

// BaselineInfo says which uproxy binary the baseline paths ran.
type BaselineInfo struct {
	// From is the flag that named it: "--baseline PATH" or
	// "--baseline-rev REV".
	From string `json:"from"`
	// Commit is the commit it was built from, or "unknown".
	Commit string `json:"commit"`
}

// ControlPlaneMetrics are the control-plane figures, in report order.
var ControlPlaneMetrics = []Metric{
	{"program_s", "Time from proxy start until every service is programmed and the last one answers", "s", false},
	{"after_lists_s", "uproxy only: time from the informers' initial lists to the end of the first sync (rules written), from uproxy's log", "s", false},
	{"change_ms", "Time from one endpoint change until traffic follows it", "ms", false},
	{"change_api_ms", "The API server's part of an endpoint change: the update request, until it returns (the write is in etcd)", "ms", false},
	{"change_sync_ms", "uproxy only: the proxy's part of an endpoint change, from the start of the sync it triggered (uproxy's log, 1 ms resolution) until traffic follows", "ms", false},
	{"change_commands", "uproxy only: processes (iptables, ipset) that the sync of an endpoint change ran, from uproxy's log", "processes", false},
	{"rules", "Kernel rules (lines of iptables-save, plus ipset save if any; nft list ruleset for nftables)", "lines", false},
	{"rss_mib", "Proxy RSS once everything is programmed", "MiB", false},
}

// ControlPlaneResults is the controlplane part's output (controlplane.json).
type ControlPlaneResults struct {
	Meta    RunMeta   `json:"meta"`
	Proxies []Subject `json:"proxies"`
	Metrics []Metric  `json:"metrics"`
	Scales  []int     `json:"scales"`
	// Endpoints per service; Changes timed per proxy, scale and run.
	Endpoints int `json:"endpoints"`
	Changes   int `json:"changes"`
	// Figures maps a metric, a proxy and a scale (decimal) to its series.
	// The change_* metrics (perChange) hold every change of every run; the
	// others one value per run.
	Figures map[string]map[string]map[string]*Series `json:"figures"`
	// GenerateSeconds maps a scale to the time the API server took to
	// create its objects.
	GenerateSeconds map[string]float64 `json:"generateSeconds"`
	// Notes on how the runs went (a proxy measured once, say).
	Notes []string `json:"notes,omitempty"`
	// HeapProfiles maps a uproxy proxy id to where its memory went at the
	// largest scale, in the first run there.
	HeapProfiles map[string]*HeapProfile `json:"heapProfiles,omitempty"`
}

// HeapProfile is a uproxy's Go heap once it has programmed every service:
// what bounds its RSS.
type HeapProfile struct {
	Scale  int     `json:"scale"`
	RSSMiB float64 `json:"rssMiB"`
	// Top is `go tool pprof -top -sample_index=inuse_space` of the heap
	// profile from its /debug/pprof/heap.
	Top string `json:"top,omitempty"`
	// NA says why there is no profile.
	NA string `json:"na,omitempty"`
}

// Profile is where the CPU went while one data path carried one workload
// (keep-alive requests, short connections, UDP requests or a bulk
// transfer).
type Profile struct {
	// Shares is the machine's CPU time by process group (perf, sampling
	// every CPU), in percent of all samples.
	Shares []Share `json:"shares,omitempty"`
	// TopSymbols are perf's hottest functions in the groups that belong
	// to the benchmark (load generator, backends, proxy, softirq threads).
	TopSymbols string `json:"topSymbols,omitempty"`
	// ProxySymbols are perf's hottest functions in the proxy process.
	ProxySymbols string `json:"proxySymbols,omitempty"`
	// Pprof is `go tool pprof -top` of the proxy's own CPU profile (uproxy).
	Pprof string `json:"pprof,omitempty"`
	// Rate is the workload's rate (requests or connections per second;
	// for bulk, MiB per second) while it was profiled, to turn the shares
	// into CPU time per request, connection or MiB.
	Rate float64 `json:"rate,omitempty"`
	// Seconds is the length of the perf recording; Cores the CPUs it
	// sampled.
	Seconds float64 `json:"seconds,omitempty"`
	Cores   int     `json:"cores,omitempty"`
	// NA says what could not be profiled, and why.
	NA []string `json:"na,omitempty"`
}

// Share is one process group's part of the CPU samples.
type Share struct {
	Who     string  `json:"who"`
	Percent float64 `json:"percent"`
	// Kernel is the part of Percent spent in the kernel.
	Kernel float64 `json:"kernel"`
}

// GoBenchResults is the gobench part's output (gobench.json).
type GoBenchResults struct {
	Meta       RunMeta        `json:"meta"`
	Command    string         `json:"command"`
	Packages   []GoBenchPkg   `json:"packages"`
	Benchmarks []GoBenchEntry `json:"benchmarks"`
	// HotPaths maps each hot path to the benchmarks that cover it, or to
	// an empty list when none does.
	HotPaths []HotPath `json:"hotPaths"`
}

// GoBenchPkg is one package's run.
type GoBenchPkg struct {
	Package string `json:"package"`
	// NA says why the package's benchmarks did not run (a build failure).
	NA     string `json:"na,omitempty"`
	Output string `json:"output"`
}

// GoBenchEntry is one benchmark, over every count.
type GoBenchEntry struct {
	Package     string `json:"package"`
	Name        string `json:"name"`
	NsPerOp     Series `json:"nsPerOp"`
	BytesPerOp  Series `json:"bytesPerOp"`
	AllocsPerOp Series `json:"allocsPerOp"`
}

// HotPath is whether a hot path has a benchmark.
type HotPath struct {
	What       string   `json:"what"`
	Owner      string   `json:"owner"`
	Benchmarks []string `json:"benchmarks"`
}

// BaselineSuffix ends the id of a data path run by the baseline binary.
const BaselineSuffix = "-baseline"

// Measured reports whether s holds at least one value.
func (s *Series) Measured() bool { return s != nil && len(s.Values) > 0 }

// Spread is how far apart the runs of one binary land: (max − min) /
// median, or NaN without a median to divide by.
func (s *Series) Spread() float64 {
	if !s.Measured() {
		return math.NaN()
	}
	lo, med, hi := s.Stats()
	if med == 0 || math.IsNaN(med) {
		return math.NaN()
	}
	return (hi - lo) / math.Abs(med)
}

// HasBaselinePaths reports whether the results hold a baseline twin.
func (r *DataPathResults) HasBaselinePaths() bool {
	return slices.ContainsFunc(r.Paths, func(s Subject) bool { return strings.HasSuffix(s.ID, BaselineSuffix) })
}

func (r *ControlPlaneResults) Series(metric, proxy string, scale int) *Series {
	m := r.Figures[metric]
	if m == nil {
		m = map[string]map[string]*Series{}
		r.Figures[metric] = m
	}
	p := m[proxy]
	if p == nil {
		p = map[string]*Series{}
		m[proxy] = p
	}
	key := strconv.Itoa(scale)
	s := p[key]
	if s == nil {
		s = &Series{}
		p[key] = s
	}
	return s
}

func (r *ControlPlaneResults) SetNA(proxy string, scale int, reason string, metrics ...string) {
	if len(metrics) == 0 {
		for _, m := range r.Metrics {
			metrics = append(metrics, m.ID)
		}
	}
	for _, m := range metrics {
		if s := r.Series(m, proxy, scale); len(s.Values) == 0 && s.NA == "" {
			s.NA = reason
		}
	}
}

func (r *DataPathResults) Series(metric, path string) *Series {
	m := r.Figures[metric]
	if m == nil {
		m = map[string]*Series{}
		r.Figures[metric] = m
	}
	s := m[path]
	if s == nil {
		s = &Series{}
		m[path] = s
	}
	return s
}

// SetNA marks every figure of path that has no value yet as n/a.
func (r *DataPathResults) SetNA(path, reason string, metrics ...string) {
	if len(metrics) == 0 {
		for _, m := range r.Metrics {
			metrics = append(metrics, m.ID)
		}
	}
	for _, m := range metrics {
		if s := r.Series(m, path); len(s.Values) == 0 && s.NA == "" {
			s.NA = reason
		}
	}
}

// Share returns the share of group who (for the proxy, "proxy (<comm>)"
// matches whoProxy); nil if the profile has none.
func (p *Profile) Share(who string) *Share {
	for i := range p.Shares {
		if strings.HasPrefix(p.Shares[i].Who, who) {
			return &p.Shares[i]
		}
	}
	return nil
}

// PerOp turns a percentage of all the samples into CPU time per request
// or connection, in µs, at the profiled rate; NaN without a rate.
func (p *Profile) PerOp(percent float64) float64 {
	if p.Rate == 0 {
		return math.NaN()
	}
	return percent / 100 * float64(p.Cores) * 1e6 / p.Rate
}

func (p *Profile) Summary() string {
	var parts []string
	for _, s := range p.Shares {
		parts = append(parts, fmt.Sprintf("%s %.0f%%", s.Who, s.Percent))
	}
	if p.Pprof != "" {
		parts = append(parts, "pprof ok")
	}
	for _, n := range p.NA {
		parts = append(parts, "n/a: "+n)
	}
	return strings.Join(parts, ", ")
}

// Process groups of the profiles, by perf's command name.
const (
	WhoLoad    = "load generator"
	WhoBackend = "backends"
	WhoProxy   = "proxy"
	WhoSoftirq = "softirq threads"
	WhoIdle    = "idle"
	WhoOther   = "other processes"
)

// Cost pairs a rate with the proxy's CPU per unit of it.
type Cost struct{ Rate, CPU string }

// CostMetrics are the rates and their costs, which the summary's cost
// table puts side by side.
var CostMetrics = []Cost{
	{"bulk_gbps", "bulk_cpu_us"},
	{"rr_rps", "rr_cpu_us"},
	{"short_cps", "short_cpu_us"},
	{"udp_rps", "udp_cpu_us"},
	{"dns_rps", "dns_cpu_us"},
}

// IsCost reports whether metric is a CPU cost per unit of work.
func IsCost(metric string) bool {
	return slices.ContainsFunc(CostMetrics, func(c Cost) bool { return c.CPU == metric })
}

// PerChange says whether metric holds one value per endpoint change (and
// is reported as p50, p99 and max) rather than one per run.
func PerChange(metric string) bool { return strings.HasPrefix(metric, "change_") }

// ReadJSON reads a part's results, file name in dir; ok is false if the
// part has not run.
func ReadJSON(dir, name string, v any) (ok bool, err error) {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return false, fmt.Errorf("%s: %w", name, err)
	}
	return true, nil
}
