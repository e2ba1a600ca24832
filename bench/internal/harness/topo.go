package harness

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/uproxy/uproxy/bench/internal/results"

	"github.com/uproxy/uproxy/bench/internal/load"

	"github.com/uproxy/uproxy/internal/testlab"
)

// The service every data path serves, whatever carries it.
const (
	BenchVIP    = "10.96.0.10"
	RRPort      = 80   // TCP request/response (keep-alive, short, idle)
	BulkPort    = 5001 // TCP bulk
	UDPPort     = 53   // UDP echo
	RRTarget    = 8080
	BulkTarget  = 5001
	UDPTarget   = 9000
	ClusterCIDR = "10.244.0.0/16"
	// BenchNode is the Node object the proxies run as.
	BenchNode = "bench-node"
)

// Topo is one fresh lab: a node, backend pods on its bridge, and a client
// pod routed through it.
type Topo struct {
	Lab      *testlab.Lab
	Backends []*testlab.Pod
	Client   *testlab.Pod
	// Dir holds the proxies' configuration files; close removes it.
	Dir string
}

// NewTopo builds a lab with n backend pods (be-0… at 10.244.0.10…, each
// running the benchmark servers on :8080, :5001 and udp :9000) and a
// routed client pod (10.244.1.2). extra adds addresses to the first
// backend (for services with many endpoints). The caller must close it.
func NewTopo(ctx context.Context, e *Env, n int, extra []netip.Addr) (_ *Topo, err error) {
	l, err := testlab.New(testlab.Options{Logf: e.labLogf()})
	if err != nil {
		return nil, err
	}
	t := &Topo{Lab: l}
	defer func() {
		if err != nil {
			t.Close()
		}
	}()
	if t.Dir, err = os.MkdirTemp("", "bench-lab-"); err != nil {
		return nil, err
	}
	// Conntrack entries of closed connections would linger for two
	// minutes, and the conntrack table is shared by every namespace on the
	// machine: the short-connection workloads would fill it. Our node's
	// entries go after a second.
	if _, err := l.Exec(ctx, l.Node, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_time_wait=1"); err != nil {
		return nil, err
	}
	for i := range n {
		p, err := l.AddPod(fmt.Sprintf("be-%d", i))
		if err != nil {
			return nil, err
		}
		t.Backends = append(t.Backends, p)
	}
	for _, a := range extra {
		if _, err := l.Exec(ctx, t.Backends[0].NS, "ip", "addr", "add", a.String()+"/24", "dev", "eth0"); err != nil {
			return nil, err
		}
	}
	for _, p := range t.Backends {
		if _, err := l.Start(p.NS, p.Name, e.backendBin, "backend",
			"--rr", fmt.Sprintf(":%d", RRTarget), "--sink", fmt.Sprintf(":%d", BulkTarget), "--udp", fmt.Sprintf(":%d", UDPTarget)); err != nil {
			return nil, err
		}
	}
	if t.Client, err = l.AddRoutedPod("client"); err != nil {
		return nil, err
	}
	for _, p := range t.Backends {
		if _, err := t.Probe(ctx, e, AddrPort(p.IP, RRTarget), false, "", 10*time.Second); err != nil {
			return nil, fmt.Errorf("backend %s: %w", p.Name, err)
		}
	}
	return t, nil
}

func (t *Topo) Close() {
	t.Lab.Close()
	if t.Dir != "" {
		os.RemoveAll(t.Dir)
	}
}

func AddrPort(a netip.Addr, port uint16) string { return netip.AddrPortFrom(a, port).String() }

func VIP(port uint16) string { return AddrPort(netip.MustParseAddr(BenchVIP), port) }

// Probe runs `load probe` in the client pod until target answers (over UDP
// if udp; by the endpoint want, if not empty).
func (t *Topo) Probe(ctx context.Context, e *Env, target string, udp bool, want string, timeout time.Duration) (load.ProbeResult, error) {
	args := []string{e.LoadBin, "load", "probe", "--target", target, "--timeout", timeout.String()}
	if udp {
		args = append(args, "--udp")
	}
	if want != "" {
		args = append(args, "--want", want)
	}
	var r load.ProbeResult
	out, err := t.Lab.Exec(ctx, t.Client.NS, args...)
	if jerr := DecodeLine(out, &r); jerr != nil && err == nil {
		err = jerr
	}
	return r, err
}

// Load runs a `load` workload in the client pod and decodes its result.
func (t *Topo) Load(ctx context.Context, e *Env, workload string, args ...string) (load.LoadResult, error) {
	var r load.LoadResult
	out, err := t.Lab.Exec(ctx, t.Client.NS, append([]string{e.LoadBin, "load", workload}, args...)...)
	if err != nil {
		return r, err
	}
	if err := DecodeLine(out, &r); err != nil {
		return r, err
	}
	return r, nil
}

// DecodeLine decodes the first line of out that holds a JSON object.
func DecodeLine(out string, v any) error {
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) > 0 && line[0] == '{' {
			return json.Unmarshal(line, v)
		}
	}
	return fmt.Errorf("no JSON result in output %q", Tail(out, 5))
}

// RSSKiB returns the resident memory (VmRSS) of pid and of all its
// descendants, in KiB: nginx's master and workers, say.
func RSSKiB(pid int) (int64, error) {
	pids := append([]int{pid}, Descendants(pid)...)
	var total int64
	for _, p := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p))
		if err != nil {
			if p == pid {
				return 0, fmt.Errorf("reading the memory of pid %d: %w", p, err)
			}
			continue // a child that just ended
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
				if err != nil {
					return 0, fmt.Errorf("pid %d: VmRSS %q: %w", p, v, err)
				}
				total += kb
			}
		}
	}
	return total, nil
}

// cpuTime returns the CPU time, user and system, that pid and its
// descendants have used so far (nginx's master and workers, say).
func cpuTime(pid int) (time.Duration, error) {
	var ticks int64
	for _, p := range append([]int{pid}, Descendants(pid)...) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p))
		if err != nil {
			if p == pid {
				return 0, fmt.Errorf("reading the CPU time of pid %d: %w", p, err)
			}
			continue // a child that just ended
		}
		t, err := statCPUTicks(string(b))
		if err != nil {
			return 0, fmt.Errorf("pid %d: %w", p, err)
		}
		ticks += t
	}
	return time.Duration(ticks) * time.Second / UserHZ, nil // see userHZ
}

// statCPUTicks returns utime + stime (fields 14 and 15) of a
// /proc/PID/stat line, in clock ticks.
func statCPUTicks(stat string) (int64, error) {
	// pid (comm) state …; comm may hold spaces and parentheses.
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("no command name in stat %q", results.FirstLine(stat))
	}
	f := strings.Fields(stat[i+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("stat has %d fields after the command name, want at least 13", len(f))
	}
	var sum int64
	for _, v := range f[11:13] {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("stat: CPU time %q: %w", v, err)
		}
		sum += n
	}
	return sum, nil
}

// CPUMeter measures the CPU time a proxy process uses over one workload.
type CPUMeter struct {
	pid   int
	start time.Duration
	err   error
}

// StartCPU starts measuring r's proxy process, or returns nil when no
// process carries the traffic (the kernel paths, and kube-proxy, which only
// programs the kernel).
func StartCPU(r *PathRun) *CPUMeter {
	if r.Proc == nil || !r.Userspace {
		return nil
	}
	m := &CPUMeter{pid: r.Proc.Cmd.Process.Pid}
	m.start, m.err = cpuTime(m.pid)
	return m
}

// Per returns the CPU time used since startCPU, in µs per unit of work.
func (m *CPUMeter) Per(units float64) (float64, error) {
	if m.err != nil {
		return 0, m.err
	}
	end, err := cpuTime(m.pid)
	if err != nil {
		return 0, err
	}
	if units <= 0 {
		return 0, fmt.Errorf("no work to divide the CPU time by")
	}
	return float64(end-m.start) / float64(time.Microsecond) / units, nil
}

// Descendants lists the processes whose ancestor is pid.
func Descendants(pid int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	parent := map[int]int{}
	for _, en := range ents {
		p, err := strconv.Atoi(en.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", en.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid …; comm may hold spaces and parentheses.
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) < 2 {
			continue
		}
		if pp, err := strconv.Atoi(f[1]); err == nil {
			parent[p] = pp
		}
	}
	var out []int
	for p := range parent {
		for a := parent[p]; a > 1; a = parent[a] {
			if a == pid {
				out = append(out, p)
				break
			}
		}
	}
	return out
}

// Tail returns the last n lines of s.
func Tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Command runs a command in the root namespace (a read-only query such as
// a version) and returns its combined output.
func Command(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, Tail(string(out), 3))
	}
	return string(out), nil
}

// Restore feeds rules to iptables-restore in ns (--noflush if noflush).
func Restore(ctx context.Context, l *testlab.Lab, ns, rules string, noflush bool) error {
	args := []string{"netns", "exec", ns, "iptables-restore", "-w", "5"}
	if noflush {
		args = append(args, "--noflush")
	}
	cmd := exec.CommandContext(ctx, "ip", args...)
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("iptables-restore in %s: %w: %s", ns, err, Tail(string(out), 5))
	}
	return nil
}

// CountLines counts the lines a command prints in ns.
func CountLines(ctx context.Context, l *testlab.Lab, ns string, args ...string) (int, error) {
	out, err := l.Exec(ctx, ns, args...)
	if err != nil {
		return 0, err
	}
	return strings.Count(out, "\n"), nil
}
