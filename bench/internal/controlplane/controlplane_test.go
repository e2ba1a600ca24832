package controlplane

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/bench/internal/harness"

	"github.com/uproxy/uproxy/bench/internal/report"

	"github.com/uproxy/uproxy/bench/internal/results"

	"github.com/google/go-cmp/cmp"

	"github.com/uproxy/uproxy/internal/testwait"
)

// fakeProc is a process in a fake /proc tree.
type fakeProc struct {
	pid, cmdline, stat string
}

func TestRunningChildren(t *testing.T) {
	restore := fakeProc{"201", "iptables-restore\x00-w\x005\x00--noflush\x00--counters\x00",
		"201 (iptables-restor) R 100 201 100 0 -1 4194304 1 0 0 0 300 20 0 0 20 0 1 0 90000 21260 5000 ..."}
	// A command name with a space and a parenthesis, and no arguments.
	odd := fakeProc{"202", "", "202 (a b) c) S 100 202 100 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 119950 0 0"}
	tests := []struct {
		name     string
		uptime   string
		children map[string]string // task → its children file
		procs    []fakeProc
		want     []string
	}{
		{
			name:     "one child of the main thread",
			uptime:   "1200.00 2000.00\n",
			children: map[string]string{"100": "201 "},
			procs:    []fakeProc{restore},
			want:     []string{"iptables-restore -w 5 --noflush --counters (for 5m0s)"},
		},
		{
			name:     "children of other threads; one has ended",
			uptime:   "1200.49 2000.00\n",
			children: map[string]string{"100": "", "104": "201 203", "105": "202"},
			procs:    []fakeProc{restore, odd},
			want:     []string{"iptables-restore -w 5 --noflush --counters (for 5m0s)", " (for 1s)"},
		},
		{
			name:     "no children",
			uptime:   "1200.00 2000.00\n",
			children: map[string]string{"100": ""},
			want:     nil,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := t.TempDir()
			write := func(path, s string) {
				t.Helper()
				path = filepath.Join(root, path)
				if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			write("uptime", tt.uptime)
			for task, children := range tt.children {
				write(filepath.Join("100", "task", task, "children"), children)
			}
			for _, p := range tt.procs {
				write(filepath.Join(p.pid, "cmdline"), p.cmdline)
				write(filepath.Join(p.pid, "stat"), p.stat)
			}
			got, err := runningChildren(root, 100)
			if err != nil {
				t.Fatalf("runningChildren: %v", err)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("runningChildren (-want +got):\n%s", diff)
			}
		})
	}
}

func TestRunningChildrenErrors(t *testing.T) {
	tests := []struct {
		name   string
		uptime string // empty: no uptime file
		want   string
	}{
		{"no uptime", "", "reading the uptime"},
		{"empty uptime", "\n", "uptime is empty"},
		{"bad uptime", "soon 1.0\n", "uptime: strconv.ParseFloat"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := t.TempDir()
			if tt.uptime != "" {
				if err := os.WriteFile(filepath.Join(root, "uptime"), []byte(tt.uptime), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			_, err := runningChildren(root, 100)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("runningChildren: error %v, want one containing %q", err, tt.want)
			}
		})
	}
}

// TestRunningChildrenReal finds a child of this very process in the real
// /proc.
func TestRunningChildrenReal(t *testing.T) {
	if _, err := os.Stat("/proc/self/task"); err != nil {
		t.Skip("skipping: no /proc")
	}
	cmd := execSleep(t)
	want := "sleep 30 (for "
	// Start returns once execve has closed the child's descriptors, but
	// the kernel sets the new command line up after that (the ELF
	// loader's create_elf_tables): until then the child's cmdline is
	// empty, so a loaded machine may need a second look.
	testwait.UntilOK(t, 5*time.Second, fmt.Sprintf("a running child whose command line starts with %q (pid %d)", want, cmd.Process.Pid), func() (bool, string) {
		got, err := runningChildren("/proc", os.Getpid())
		if err != nil {
			t.Fatalf("runningChildren: %v", err)
		}
		return slices.ContainsFunc(got, func(c string) bool { return strings.HasPrefix(c, want) }), fmt.Sprintf("%q", got)
	})
}

func TestKeepOutput(t *testing.T) {
	long := strings.Repeat("x", maxKeptOutput) + "the end\n"
	tests := []struct {
		name, output, want string
	}{
		{"short", "I1129 started\nE1129 failed\n", "I1129 started\nE1129 failed\n"},
		{"empty", "", ""},
		{"longer than the limit: the end is kept", long, long[len(long)-maxKeptOutput:]},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "cp-kp-iptables-5000.log")
			if err := keepOutput(path, tt.output); err != nil {
				t.Fatalf("keepOutput: %v", err)
			}
			got, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tt.want {
				t.Errorf("kept %d bytes ending %q, want %d ending %q", len(got), harness.Tail(string(got), 1), len(tt.want), harness.Tail(tt.want, 1))
			}
		})
	}
	if err := keepOutput(filepath.Join(t.TempDir(), "no", "such", "folder", "x.log"), "x"); err == nil {
		t.Error("keepOutput into a missing folder: no error")
	}
}

// execSleep starts `sleep 30` as a child of the test process; the test's
// cleanup kills it (by its pid) and waits for it.
func execSleep(t *testing.T) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Skipf("skipping: cannot start sleep: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd
}

func TestAfterLists(t *testing.T) {
	log := "2026-11-29T20:28:15.085Z\tINFO\tproxy\tproxy/proxier.go:322\twaiting for the initial lists of Services and EndpointSlices before syncing\n" +
		"2026-11-29T20:28:15.151Z\tINFO\tkube\tproxy/kubesource.go:121\tinitial lists received\n" +
		"2026-11-29T20:28:15.188Z\tINFO\tproxy\tproxy/proxier.go:768\tlistening\t{\"port\": 41411}\n" +
		"2026-11-29T20:28:15.821Z\tINFO\tproxy\tproxy/proxier.go:371\tsynced\t{\"full\": true}\n" +
		"2026-11-29T20:28:16.342Z\tINFO\tproxy\tproxy/proxier.go:371\tsynced\t{\"full\": false}\n"
	got, err := afterLists(log)
	if err != nil || got < 0.6699 || got > 0.6701 {
		t.Errorf("afterLists = %v, %v; want 0.670", got, err)
	}
	// A sync logged before the lists arrived does not count.
	if _, err := afterLists("2026-11-29T20:28:15.821Z\tINFO\tproxy\tx.go:1\tsynced\t{}\n"); err == nil {
		t.Error("afterLists without the lists line: no error")
	}
}

func TestChangeSync(t *testing.T) {
	line := func(ts, fields string) string {
		return ts + "\tINFO\tproxy\tproxy/proxier.go:403\tsynced\t" + fields + "\n"
	}
	at := func(s string) time.Time {
		t.Helper()
		v, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	// The output buffer may have cut the first line short.
	log := "30T04:59:59.000Z\tINFO\tproxy\tproxy/proxier.go:403\tsynced\t{}\n" +
		line("2026-11-30T05:00:00.100Z", `{"full": false, "servicesChanged": 1, "services": 1000, "endpoints": 10000, "rulesWritten": 0, "duration": "20µs"}`) +
		line("2026-11-30T05:00:01.000Z", `{"full": true, "servicesChanged": 1000, "services": 1000, "endpoints": 10000, "rules": 2040, "rulesWritten": 0, "duration": "3ms"}`) +
		line("2026-11-30T05:00:01.500Z", `{"full": false, "servicesChanged": 0, "services": 1000, "endpoints": 10000, "rulesWritten": 0, "duration": "5µs"}`) +
		line("2026-11-30T05:00:01.512Z", `{"full": false, "servicesChanged": 1, "services": 1000, "endpoints": 10000, "rulesWritten": 0, "ruleCommands": 0, "duration": "1.5ms"}`)
	for _, tc := range []struct {
		after        string
		want         string // "" for an error
		wantCommands int
	}{
		// Skips the earlier sync, the periodic full one and the one that
		// changed nothing.
		{"2026-11-30T05:00:00.200Z", "2026-11-30T05:00:01.5105Z", 0},
		// The log's millisecond resolution: a sync logged in the change's
		// millisecond counts. This line does not say how many processes
		// the sync ran.
		{"2026-11-30T05:00:00.1004Z", "2026-11-30T05:00:00.09998Z", -1},
		{"2026-11-30T05:00:01.600Z", "", 0},
	} {
		got, err := changeSync(log, at(tc.after))
		if tc.want == "" {
			if err == nil {
				t.Errorf("changeSync(after %s) = %+v; want an error", tc.after, got)
			}
			continue
		}
		if err != nil || !got.start.Equal(at(tc.want)) || got.commands != tc.wantCommands {
			t.Errorf("changeSync(after %s) = %+v, %v; want the start %s and %d commands", tc.after, got, err, tc.want, tc.wantCommands)
		}
	}
	if _, err := changeSync(line("2026-11-30T05:00:02.000Z", `{"full": false, "servicesChanged": 1, "duration": 7}`), at("2026-11-30T05:00:01.000Z")); err == nil {
		t.Error("changeSync with a malformed duration: no error")
	}
}

// TestProgramFailureInReport checks how a proxy that did not program
// every service shows where its time would be: past the timeout, short of
// listeners (uproxy's listener budget), and at the larger scales it was
// then not run at.
func TestProgramFailureInReport(t *testing.T) {
	timeout := &timeoutError{timeout: 5 * time.Minute, services: 20000}
	budget := &timeoutError{timeout: 5 * time.Minute, services: 20000, budget: true}
	for _, tt := range []struct {
		name string
		err  *timeoutError
		n    int
		want string
	}{
		{"timed out", timeout, 20000, "> 5m0s (timed out)"},
		{"listener budget spent", budget, 20000, "partial (listener budget spent)"},
		{"after a timeout", timeout, 40000, "not run (failed at fewer)"},
		{"after a spent budget", budget, 40000, "not run (failed at fewer)"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			res := &results.ControlPlaneResults{Figures: map[string]map[string]map[string]*results.Series{}}
			res.SetNA("uproxy", tt.n, tt.err.na(tt.n), "program_s")
			got, v := report.ControlPlaneSummary(res, "program_s", "uproxy", tt.n)
			if got != tt.want || !math.IsNaN(v) {
				t.Errorf("cpMetricSummary = %q, %v; want %q, NaN", got, v, tt.want)
			}
		})
	}
}

// scriptedProc is an outputProc whose output and end the test sets.
type scriptedProc struct {
	mu     sync.Mutex
	out    string
	exited bool
}

func (f *scriptedProc) Exited() bool   { f.mu.Lock(); defer f.mu.Unlock(); return f.exited }
func (f *scriptedProc) Output() string { f.mu.Lock(); defer f.mu.Unlock(); return f.out }

// TestWaitProgrammed checks that the wait for the last service ends when
// the probe does, and early, without the probe, once uproxy says its
// listener budget is spent: before, the harness waited out the whole
// --program-timeout for a service that could never answer.
func TestWaitProgrammed(t *testing.T) {
	ctx := context.Background()
	probe := &scriptedProc{}
	proxy := &scriptedProc{out: "listening\n"}
	if err := harness.WaitProgrammed(ctx, probe, proxy, 100*time.Millisecond); err == nil || errors.Is(err, harness.ErrBudgetSpent) {
		t.Errorf("a probe that runs on: %v; want a timeout", err)
	}
	probe.mu.Lock()
	probe.exited = true
	probe.mu.Unlock()
	if err := harness.WaitProgrammed(ctx, probe, nil, time.Second); err != nil {
		t.Errorf("an ended probe: %v", err)
	}
	probe = &scriptedProc{}
	proxy.mu.Lock()
	proxy.out += `ERROR	service ports have no listener: ` + harness.ListenerBudgetSpent + "\n"
	proxy.mu.Unlock()
	// Returned before the minute is out, or the error would be the
	// timeout's.
	if err := harness.WaitProgrammed(ctx, probe, proxy, time.Minute); !errors.Is(err, harness.ErrBudgetSpent) {
		t.Errorf("a spent budget: %v; want %v", err, harness.ErrBudgetSpent)
	}
}
