package harness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/uproxy/uproxy/bench/internal/report"

	"github.com/uproxy/uproxy/bench/internal/results"

	"github.com/spf13/pflag"

	"github.com/uproxy/uproxy/internal/testkube"
)

// Config configures the benchmark parts (datapath, controlplane, gobench,
// report and all). Every zero value means the default that its comment
// gives; smoke mode has its own, tiny, defaults.
type Config struct {
	// Out is the results folder: the report is Out/<Stem>.md, and its
	// charts and raw data are in Out/<Stem>/. Empty means bench/results in
	// the module root, or a new temporary folder in smoke mode.
	Out string
	// Stem names the report; empty means <YYYY-MM-DD>-<host name>.
	Stem string
	// Smoke shrinks every duration and count so that the whole harness
	// runs in seconds. Its figures mean nothing; it checks that every part
	// works end to end.
	Smoke bool
	// Runs is how many times each measurement is repeated (the report
	// gives min, median and max); zero means 3 (5 with a baseline, as
	// a before-and-after comparison needs), or 1 in smoke mode.
	Runs int
	// Duration is the length of each timed data-path workload, warm-up
	// included; zero means 5s, or 300ms in smoke mode.
	Duration time.Duration
	// Paths selects data paths by id (see paths.All); empty means all.
	Paths []string
	// Workloads selects the data-path workloads by id (see paths.WorkloadIDs);
	// empty means all.
	Workloads []string
	// Conns is the keep-alive workload's connection count, and the UDP
	// workload's socket count; zero means 32.
	Conns int
	// IdleConns is the idle-connection workload's count; zero means
	// 10,000, or 200 in smoke mode.
	IdleConns int
	// Baseline is a uproxy binary built from an older commit: every
	// selected uproxy data path is also measured with it, as a path of its
	// own (<id>-baseline: the same flags, the other binary) interleaved
	// with the current one, and the report compares the two ("Before and
	// after"). Empty means no baseline, unless BaselineRev is set.
	Baseline string
	// BaselineRev is a git revision of the checkout at Root to build the
	// baseline from (git archive into a temporary folder, then go build);
	// empty means none. At most one of Baseline and BaselineRev is set.
	BaselineRev string
	// Proxies selects control-plane proxies by id (see cpProxies); empty
	// means all.
	Proxies []string
	// Scales are the control plane's service counts; empty means 1000,
	// 5000, 10000 and 20000 (the points of the cost curves), or 50
	// in smoke mode.
	Scales []int
	// Endpoints is the number of endpoints of every generated service;
	// zero means 10, or 3 in smoke mode.
	Endpoints int
	// Changes is how many endpoint changes are timed per proxy, scale and
	// run; zero means 5, or 1 in smoke mode.
	Changes int
	// ProgramTimeout bounds the wait for a proxy to program every service;
	// zero means 5 minutes, or 2 minutes in smoke mode.
	ProgramTimeout time.Duration
	// SlowRun: a proxy that takes longer than this to program a scale's
	// services is measured once at that scale, not Runs times, to keep the
	// whole run within the hour; zero means 1 minute.
	SlowRun time.Duration
	// NoProfile skips the profiles: CPU (perf, pprof) and uproxy's heap.
	NoProfile bool
	// Root is the uproxy module root; empty means the one above the
	// working directory (testkube.ModuleRoot).
	Root string
	// Log receives one progress line per measurement; nil means stderr.
	Log io.Writer
	// Verbose also logs every process the labs start.
	Verbose bool

	// Command is the command line that started the run, which the report
	// quotes; empty means none is recorded (tests).
	Command string

	// IdleNote, set by the harness, says why IdleConns was lowered.
	IdleNote string
}

// CommandLine returns how this process was started, as a user would type
// it from the checkout's root (the bench is a module of its own in bench/).
func CommandLine() string {
	return strings.Join(append([]string{"cd bench && go run ."}, os.Args[1:]...), " ")
}

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults(cat Catalog) (Config, error) {
	pick := func(v, full, smoke int) int {
		if v != 0 {
			return v
		}
		if c.Smoke {
			return smoke
		}
		return full
	}
	// Five runs make the report that decides the targets: a median
	// with a spread that one slow run cannot move.
	c.Runs = pick(c.Runs, 5, 1)
	c.Conns = pick(c.Conns, 32, 32)
	c.IdleConns = pick(c.IdleConns, 10000, 200)
	c.Endpoints = pick(c.Endpoints, 10, 3)
	c.Changes = pick(c.Changes, 5, 1)
	if c.Duration == 0 {
		c.Duration = 5 * time.Second
		if c.Smoke {
			c.Duration = 300 * time.Millisecond
		}
	}
	if c.SlowRun == 0 {
		c.SlowRun = time.Minute
	}
	if c.ProgramTimeout == 0 {
		c.ProgramTimeout = 5 * time.Minute
		if c.Smoke {
			c.ProgramTimeout = 2 * time.Minute
		}
	}
	if len(c.Scales) == 0 {
		c.Scales = []int{1000, 5000, 10000, 20000}
		if c.Smoke {
			c.Scales = []int{50}
		}
	}
	if c.Log == nil {
		c.Log = os.Stderr
	}
	var err error
	if c.Root == "" {
		if c.Root, err = testkube.ModuleRoot(); err != nil {
			return c, err
		}
	}
	if c.Stem == "" {
		host, err := os.Hostname()
		if err != nil {
			return c, fmt.Errorf("host name for the report's name: %w", err)
		}
		host, _, _ = strings.Cut(host, ".")
		c.Stem = time.Now().Format("2006-01-02") + "-" + host
	}
	if c.Out == "" {
		if c.Smoke {
			if c.Out, err = os.MkdirTemp("", "uproxy-bench-smoke-"); err != nil {
				return c, fmt.Errorf("smoke results folder: %w", err)
			}
		} else {
			c.Out = filepath.Join(c.Root, "bench", "results")
		}
	}
	for _, s := range c.Scales {
		if s < 1 {
			return c, fmt.Errorf("scale %d: want at least one service", s)
		}
	}
	if c.Endpoints > 40 {
		return c, fmt.Errorf("%d endpoints per service: at most 40 (addresses 10.244.0.100-139)", c.Endpoints)
	}
	if c.Changes > 50 {
		return c, fmt.Errorf("%d endpoint changes: at most 50 (addresses 10.244.0.150-199)", c.Changes)
	}
	if c.Baseline != "" && c.BaselineRev != "" {
		return c, errors.New("--baseline and --baseline-rev: give one baseline, not both")
	}
	for _, p := range c.Paths {
		if err := cat.CheckPath(c, p); err != nil {
			return c, err
		}
	}
	for _, w := range c.Workloads {
		if !slices.Contains(cat.Workloads, w) {
			return c, fmt.Errorf("unknown workload %q (have %s)", w, strings.Join(cat.Workloads, ", "))
		}
	}
	return c, nil
}

// Measures reports whether the data path part runs workload w.
func (c Config) Measures(w string) bool {
	return len(c.Workloads) == 0 || slices.Contains(c.Workloads, w)
}

// DataDir is the folder of the raw results and charts.
func (c Config) DataDir() string { return filepath.Join(c.Out, c.Stem) }

// ReportPath is the Markdown report's path.
func (c Config) ReportPath() string { return filepath.Join(c.Out, c.Stem+".md") }

// RegisterConfigFlags binds c's fields to flags.
func RegisterConfigFlags(fs *pflag.FlagSet, c *Config, cat Catalog) {
	fs.StringVar(&c.Out, "out", "", "Results folder (the report is OUT/STEM.md, charts and raw data in OUT/STEM/). Default bench/results, or a new temporary folder with --smoke.")
	fs.StringVar(&c.Stem, "stem", "", "Report name. Default YYYY-MM-DD-HOST.")
	fs.BoolVar(&c.Smoke, "smoke", false, "Tiny durations and counts: check that the harness works end to end in seconds (the figures mean nothing).")
	fs.IntVar(&c.Runs, "runs", 0, "Repetitions of every measurement (min, median and max are reported). Default 5 (1 with --smoke).")
	fs.DurationVar(&c.Duration, "duration", 0, "Length of each timed data-path workload, warm-up included. Default 5s (300ms with --smoke).")
	fs.StringSliceVar(&c.Paths, "paths", nil, "Data paths to measure, by id: "+strings.Join(cat.Paths, ",")+". Default all.")
	fs.StringVar(&c.Baseline, "baseline", "", "Data paths: a uproxy binary built from an older commit. Every selected uproxy path is also measured with it (as <id>-baseline, same flags), interleaved in the same run, and the report gets a \"Before and after\" section. Default runs become 5.")
	fs.StringVar(&c.BaselineRev, "baseline-rev", "", "Data paths: as --baseline, with uproxy built from this git revision of the checkout (git archive, then go build ./cmd/uproxy).")
	fs.StringSliceVar(&c.Workloads, "workloads", nil, "Data-path workloads to run, by id: "+strings.Join(cat.Workloads, ",")+". Default all; the others' figures are reported as not measured.")
	fs.IntVar(&c.Conns, "conns", 0, "Connections of the keep-alive workload, sockets of the UDP one. Default 32.")
	fs.IntVar(&c.IdleConns, "idle-conns", 0, "Concurrent idle connections for the memory workload. Default 10000 (200 with --smoke).")
	fs.StringSliceVar(&c.Proxies, "proxies", nil, "Control plane: proxies to measure, by id: "+strings.Join(cat.Proxies, ",")+". Default all.")
	fs.IntSliceVar(&c.Scales, "scales", nil, "Control plane: service counts. Default 1000,5000,10000,20000 (50 with --smoke).")
	fs.IntVar(&c.Endpoints, "endpoints", 0, "Control plane: endpoints per service. Default 10 (3 with --smoke).")
	fs.IntVar(&c.Changes, "changes", 0, "Control plane: endpoint changes timed per proxy, scale and run. Default 5 (1 with --smoke).")
	fs.DurationVar(&c.ProgramTimeout, "program-timeout", 0, "Control plane: longest wait for a proxy to program every service (it is not run again at larger scales). Default 5m (2m with --smoke).")
	fs.DurationVar(&c.SlowRun, "slow-run", 0, "Control plane: a proxy slower than this to program a scale is measured once there, not --runs times. Default 1m.")
	fs.BoolVar(&c.NoProfile, "no-profile", false, "Skip the profiles: CPU (perf and pprof) and, in the control plane, uproxy's heap.")
	fs.BoolVarP(&c.Verbose, "verbose", "v", false, "Also log every process the labs start.")
}

// Catalog is what the parts can measure, by id: the flags' help lists
// them, and withDefaults refuses others. The command builds it from the
// parts' own tables (partCatalog).
type Catalog struct {
	Paths []string
	// CheckPath returns an error unless id names a data path that c can
	// measure (a baseline twin needs a baseline).
	CheckPath func(c Config, id string) error
	Workloads []string
	Proxies   []string
}

// Env is what the parts share: the configuration, the binaries and the
// progress log.
type Env struct {
	Config Config
	binDir string
	// loadBin, backendBin, ioCopyBin and uringBin are this tool under four
	// names, so that profiles tell the load generator, the backends, the
	// reference Go proxy and the io_uring yardstick apart.
	LoadBin, backendBin, IOCopyBin, URingBin string
	// UproxyBin is built from the working tree; uproxyErr says why not.
	UproxyBin string
	UproxyErr error
	// Baseline is the --baseline or --baseline-rev binary, if any.
	Baseline *baselineBin
	// NoFile is the open-files limit of every process we start.
	NoFile uint64
	mu     sync.Mutex

	kubeOnce sync.Once
	KubeEnv  *KubeEnv
}

// Kube returns the control plane that the parts share, starting it on
// first use; its err says why there is none. close stops it.
func (e *Env) Kube(ctx context.Context) *KubeEnv {
	e.kubeOnce.Do(func() { e.KubeEnv = startKube(ctx, e) })
	return e.KubeEnv
}

func NewEnv(ctx context.Context, cfg Config) (*Env, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("the benchmarks need root: they build network namespaces (run as root, or use sudo)")
	}
	if err := os.MkdirAll(cfg.DataDir(), 0o755); err != nil {
		return nil, fmt.Errorf("results folder: %w", err)
	}
	noFile, err := raiseNoFile()
	if err != nil {
		return nil, err
	}
	// A proxy holds two descriptors per connection (client and backend
	// sides): the idle workload must fit in the limit.
	if fit := (int(noFile) - 150) / 2 / 100 * 100; cfg.IdleConns > fit {
		cfg.IdleNote = fmt.Sprintf("%s idle connections instead of %s: the hard limit on open files per process is %s here and cannot be raised (no CAP_SYS_RESOURCE), and a proxy holds two descriptors per connection",
			report.Thousands(int64(fit)), report.Thousands(int64(cfg.IdleConns)), report.Thousands(int64(noFile)))
		cfg.IdleConns = fit
	}
	dir, err := os.MkdirTemp("", "uproxy-bench-bin-")
	if err != nil {
		return nil, err
	}
	e := &Env{Config: cfg, binDir: dir, NoFile: noFile}
	if cfg.IdleNote != "" {
		e.Logf("%s", cfg.IdleNote)
	}
	start := time.Now()
	self := filepath.Join(dir, "ubench")
	if err := GoBuild(ctx, filepath.Join(cfg.Root, "bench"), self, "."); err != nil {
		e.Close()
		return nil, err
	}
	e.LoadBin, e.backendBin, e.IOCopyBin, e.URingBin = filepath.Join(dir, "ubench-load"), filepath.Join(dir, "ubench-backend"), filepath.Join(dir, "ubench-iocopy"), filepath.Join(dir, "ubench-uring")
	for _, l := range []string{e.LoadBin, e.backendBin, e.IOCopyBin, e.URingBin} {
		if err := os.Link(self, l); err != nil {
			e.Close()
			return nil, fmt.Errorf("linking %s: %w", l, err)
		}
	}
	e.UproxyBin = filepath.Join(dir, "uproxy")
	if e.UproxyErr = GoBuild(ctx, cfg.Root, e.UproxyBin, "./cmd/uproxy"); e.UproxyErr != nil {
		e.Logf("uproxy does not build; its rows will say so: %v", e.UproxyErr)
	}
	if cfg.HasBaseline() {
		if e.Baseline, err = prepareBaseline(ctx, cfg, filepath.Join(dir, "baseline")); err != nil {
			e.Close()
			return nil, err
		}
		e.Logf("baseline uproxy: %s", e.Baseline.describe())
	}
	e.Logf("built the load generator, backends and uproxy in %v", time.Since(start).Round(100*time.Millisecond))
	return e, nil
}

// raiseNoFile raises the open-files limit, which every process we start
// inherits, as far as it goes (2^18; root may raise the hard limit where it
// has CAP_SYS_RESOURCE), and returns it. Go restores the original soft
// limit in its children only when nobody called Setrlimit.
func raiseNoFile() (uint64, error) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0, fmt.Errorf("reading the open-files limit: %w", err)
	}
	want := syscall.Rlimit{Cur: 1 << 18, Max: 1 << 18}
	if lim.Max < want.Max && syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want) == nil {
		return want.Max, nil
	}
	lim.Cur = lim.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0, fmt.Errorf("raising the open-files limit to %d: %w", lim.Max, err)
	}
	return lim.Max, nil
}

func GoBuild(ctx context.Context, root, out, pkg string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, pkg)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %w: %s", pkg, err, strings.TrimSpace(string(b)))
	}
	return nil
}

func (e *Env) Close() {
	if e.KubeEnv != nil {
		e.KubeEnv.close()
	}
	os.RemoveAll(e.binDir)
}

// Logf writes one progress line.
func (e *Env) Logf(format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	fmt.Fprintf(e.Config.Log, "bench: "+format+"\n", args...)
}

// labLogf is the labs' process log: silent unless verbose.
func (e *Env) labLogf() func(string, ...any) {
	if !e.Config.Verbose {
		return nil
	}
	return func(format string, args ...any) { e.Logf("  lab: "+format, args...) }
}

// WriteJSON writes a part's results into the data folder.
func WriteJSON(cfg Config, name string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	path := filepath.Join(cfg.DataDir(), name)
	if err := os.WriteFile(path+".tmp", append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return os.Rename(path+".tmp", path)
}

// NewRunMeta starts the metadata of a part's run.
func NewRunMeta(e *Env, settings string) results.RunMeta {
	return results.RunMeta{Start: time.Now(), Smoke: e.Config.Smoke, Runs: e.Config.Runs, Commit: results.GitCommit(e.Config.Root), Settings: settings,
		Command: e.Config.Command}
}

// ReportOutput is where cfg's report reads its results and goes.
func (c Config) ReportOutput() report.Output {
	return report.Output{Root: c.Root, Dir: c.DataDir(), Stem: c.Stem, Path: c.ReportPath()}
}
