package results

import (
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Machine describes where the benchmarks ran.
type Machine struct {
	Host    string `json:"host"`
	CPU     string `json:"cpu"`
	Cores   int    `json:"cores"`
	Memory  string `json:"memory"`
	Kernel  string `json:"kernel"`
	OS      string `json:"os"`
	LoadAvg string `json:"loadavg"`
	// SyscallNs is what one system call costs here, in nanoseconds
	// (syscallCost), when the report was written; zero in older results.
	SyscallNs int64 `json:"syscallNs,omitempty"`
	// Tools maps a tool to its version line, or to why it is missing.
	Tools [][2]string `json:"tools"`
}

// syscallCost times the cheapest system call, getppid(2): the cost of
// entering and leaving the kernel, which every proxy pays several times
// per request (a read and a write per message and direction). Some
// virtual machines make it several times dearer than hardware does,
// which changes how userspace proxies compare with the kernel's own
// paths. The best of five rounds: the least disturbed by other work.
func syscallCost() time.Duration {
	const n = 50000
	best := time.Duration(math.MaxInt64)
	for range 5 {
		start := time.Now()
		for range n {
			syscall.RawSyscall(syscall.SYS_GETPPID, 0, 0, 0)
		}
		best = min(best, time.Since(start)/n)
	}
	return best
}

// DescribeMachine reads the machine's description and the versions of the
// tools the benchmarks use.
func DescribeMachine(ctx context.Context, root string) Machine {
	m := Machine{Cores: runtime.NumCPU()}
	m.Host, _ = os.Hostname()
	m.CPU = "unknown"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				kb, _ := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 64)
				m.Memory = fmt.Sprintf("%.1f GiB", kb/(1<<20))
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/etc/os-release"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "PRETTY_NAME="); ok {
				m.OS = strings.Trim(v, `"`)
			}
		}
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		f := strings.Fields(string(b))
		if len(f) >= 3 {
			m.LoadAvg = strings.Join(f[:3], " ")
		}
	}
	m.SyscallNs = syscallCost().Nanoseconds()
	kubeBin := filepath.Join(root, "bench", ".cache", "bin")
	for _, t := range []struct {
		name string
		args []string
		pick func(string) string
	}{
		{"go", []string{"version"}, FirstLine},
		{"haproxy", []string{"-v"}, FirstLine},
		{"nginx", []string{"-v"}, FirstLine},
		{"iptables", []string{"--version"}, FirstLine},
		{"nft", []string{"--version"}, FirstLine},
		{"ipset", []string{"--version"}, FirstLine},
		{"etcd", []string{"--version"}, FirstLine},
		{filepath.Join(kubeBin, "kube-apiserver"), []string{"--version"}, FirstLine},
		{filepath.Join(kubeBin, "kube-proxy"), []string{"--version"}, FirstLine},
		{"perf", []string{"--version"}, FirstLine},
	} {
		name := filepath.Base(t.name)
		if _, err := exec.LookPath(t.name); err != nil {
			m.Tools = append(m.Tools, [2]string{name, "not installed"})
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		out, err := exec.CommandContext(cctx, t.name, t.args...).CombinedOutput()
		cancel()
		v := t.pick(string(out))
		if err != nil && v == "" {
			v = "unknown (" + err.Error() + ")"
		}
		m.Tools = append(m.Tools, [2]string{name, v})
	}
	return m
}

// GitCommit describes the working tree: the commit, and whether it has
// uncommitted changes.
func GitCommit(root string) string {
	out, err := exec.Command("git", "-C", root, "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	c := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "-C", root, "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(strings.TrimSpace(string(st))) > 0 {
		c += " + uncommitted changes"
	}
	return c
}

// FirstLine returns the first line of s, trimmed.
func FirstLine(s string) string {
	s = strings.TrimSpace(s)
	line, _, _ := strings.Cut(s, "\n")
	return strings.TrimSpace(line)
}
