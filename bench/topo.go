package main

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

	"github.com/uproxy/uproxy/internal/testlab"
)

// The service every data path serves, whatever carries it.
const (
	benchVIP    = "10.96.0.10"
	rrPort      = 80   // TCP request/response (keep-alive, short, idle)
	bulkPort    = 5001 // TCP bulk
	udpPort     = 53   // UDP echo
	rrTarget    = 8080
	bulkTarget  = 5001
	udpTarget   = 9000
	clusterCIDR = "10.244.0.0/16"
	// benchNode is the Node object the proxies run as.
	benchNode = "bench-node"
)

// topo is one fresh lab: a node, backend pods on its bridge, and a client
// pod routed through it.
type topo struct {
	lab      *testlab.Lab
	backends []*testlab.Pod
	client   *testlab.Pod
	// dir holds the proxies' configuration files; close removes it.
	dir string
}

// newTopo builds a lab with n backend pods (be-0… at 10.244.0.10…, each
// running the benchmark servers on :8080, :5001 and udp :9000) and a
// routed client pod (10.244.1.2). extra adds addresses to the first
// backend (for services with many endpoints). The caller must close it.
func newTopo(ctx context.Context, e *env, n int, extra []netip.Addr) (_ *topo, err error) {
	l, err := testlab.New(testlab.Options{Logf: e.labLogf()})
	if err != nil {
		return nil, err
	}
	t := &topo{lab: l}
	defer func() {
		if err != nil {
			t.close()
		}
	}()
	if t.dir, err = os.MkdirTemp("", "bench-lab-"); err != nil {
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
		t.backends = append(t.backends, p)
	}
	for _, a := range extra {
		if _, err := l.Exec(ctx, t.backends[0].NS, "ip", "addr", "add", a.String()+"/24", "dev", "eth0"); err != nil {
			return nil, err
		}
	}
	for _, p := range t.backends {
		if _, err := l.Start(p.NS, p.Name, e.backendBin, "backend",
			"--rr", fmt.Sprintf(":%d", rrTarget), "--sink", fmt.Sprintf(":%d", bulkTarget), "--udp", fmt.Sprintf(":%d", udpTarget)); err != nil {
			return nil, err
		}
	}
	if t.client, err = l.AddRoutedPod("client"); err != nil {
		return nil, err
	}
	for _, p := range t.backends {
		if _, err := t.probe(ctx, e, addrPort(p.IP, rrTarget), false, "", 10*time.Second); err != nil {
			return nil, fmt.Errorf("backend %s: %w", p.Name, err)
		}
	}
	return t, nil
}

func (t *topo) close() {
	t.lab.Close()
	if t.dir != "" {
		os.RemoveAll(t.dir)
	}
}

func addrPort(a netip.Addr, port uint16) string { return netip.AddrPortFrom(a, port).String() }

func vip(port uint16) string { return addrPort(netip.MustParseAddr(benchVIP), port) }

// probe runs `load probe` in the client pod until target answers (over UDP
// if udp; by the endpoint want, if not empty).
func (t *topo) probe(ctx context.Context, e *env, target string, udp bool, want string, timeout time.Duration) (ProbeResult, error) {
	args := []string{e.loadBin, "load", "probe", "--target", target, "--timeout", timeout.String()}
	if udp {
		args = append(args, "--udp")
	}
	if want != "" {
		args = append(args, "--want", want)
	}
	var r ProbeResult
	out, err := t.lab.Exec(ctx, t.client.NS, args...)
	if jerr := decodeLine(out, &r); jerr != nil && err == nil {
		err = jerr
	}
	return r, err
}

// load runs a `load` workload in the client pod and decodes its result.
func (t *topo) load(ctx context.Context, e *env, workload string, args ...string) (LoadResult, error) {
	var r LoadResult
	out, err := t.lab.Exec(ctx, t.client.NS, append([]string{e.loadBin, "load", workload}, args...)...)
	if err != nil {
		return r, err
	}
	if err := decodeLine(out, &r); err != nil {
		return r, err
	}
	return r, nil
}

// decodeLine decodes the first line of out that holds a JSON object.
func decodeLine(out string, v any) error {
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) > 0 && line[0] == '{' {
			return json.Unmarshal(line, v)
		}
	}
	return fmt.Errorf("no JSON result in output %q", tail(out, 5))
}

// rssKiB returns the resident memory (VmRSS) of pid and of all its
// descendants, in KiB: nginx's master and workers, say.
func rssKiB(pid int) (int64, error) {
	pids := append([]int{pid}, descendants(pid)...)
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
	for _, p := range append([]int{pid}, descendants(pid)...) {
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
	return time.Duration(ticks) * time.Second / userHZ, nil // see userHZ
}

// statCPUTicks returns utime + stime (fields 14 and 15) of a
// /proc/PID/stat line, in clock ticks.
func statCPUTicks(stat string) (int64, error) {
	// pid (comm) state …; comm may hold spaces and parentheses.
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("no command name in stat %q", firstLine(stat))
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

// cpuMeter measures the CPU time a proxy process uses over one workload.
type cpuMeter struct {
	pid   int
	start time.Duration
	err   error
}

// startCPU starts measuring r's proxy process, or returns nil when no
// process carries the traffic (the kernel paths, and kube-proxy, which only
// programs the kernel).
func startCPU(r *pathRun) *cpuMeter {
	if r.proc == nil || !r.userspace {
		return nil
	}
	m := &cpuMeter{pid: r.proc.Cmd.Process.Pid}
	m.start, m.err = cpuTime(m.pid)
	return m
}

// per returns the CPU time used since startCPU, in µs per unit of work.
func (m *cpuMeter) per(units float64) (float64, error) {
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

// descendants lists the processes whose ancestor is pid.
func descendants(pid int) []int {
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

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// firstLine returns the first line of s, trimmed.
func firstLine(s string) string {
	s = strings.TrimSpace(s)
	line, _, _ := strings.Cut(s, "\n")
	return strings.TrimSpace(line)
}

// command runs a command in the root namespace (a read-only query such as
// a version) and returns its combined output.
func command(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, tail(string(out), 3))
	}
	return string(out), nil
}

// restore feeds rules to iptables-restore in ns (--noflush if noflush).
func restore(ctx context.Context, l *testlab.Lab, ns, rules string, noflush bool) error {
	args := []string{"netns", "exec", ns, "iptables-restore", "-w", "5"}
	if noflush {
		args = append(args, "--noflush")
	}
	cmd := exec.CommandContext(ctx, "ip", args...)
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("iptables-restore in %s: %w: %s", ns, err, tail(string(out), 5))
	}
	return nil
}

// countLines counts the lines a command prints in ns.
func countLines(ctx context.Context, l *testlab.Lab, ns string, args ...string) (int, error) {
	out, err := l.Exec(ctx, ns, args...)
	if err != nil {
		return 0, err
	}
	return strings.Count(out, "\n"), nil
}
