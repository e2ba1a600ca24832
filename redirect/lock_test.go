package redirect

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coreos/go-iptables/iptables"
	"github.com/google/go-cmp/cmp"
	testingclock "k8s.io/utils/clock/testing"
)

// lockMessage is what legacy iptables prints on stderr when it gave up
// waiting for the xtables lock (iptables 1.8.9, with -w 5), and exits 4.
const lockMessage = "Can't lock /run/xtables.lock: Resource temporarily unavailable\n" +
	"Another app is currently holding the xtables lock. Stopped waiting after 5s."

// exitError returns a real *exec.ExitError with the given status, from a
// shell that exits with it.
func exitError(t *testing.T, status int) *exec.ExitError {
	t.Helper()
	err := exec.Command("sh", "-c", fmt.Sprintf("exit %d", status)).Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != status {
		t.Fatalf("sh -c 'exit %d': %v", status, err)
	}
	return ee
}

// commandError is the error OSExec returns for a command that exited with
// status and printed stderr.
func commandError(t *testing.T, name string, args []string, status int, stderr string) error {
	t.Helper()
	return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), exitError(t, status), stderr)
}

// fakeIptables writes an iptables executable for go-iptables to run: it
// prints a legacy version, and otherwise fails with the xtables lock
// message and status 4 as long as the file busy exists, then exits with
// status 1 ("no such rule"). It returns the executable and busy.
func fakeIptables(t *testing.T) (path, busy string) {
	t.Helper()
	dir := t.TempDir()
	path, busy = filepath.Join(dir, "iptables"), filepath.Join(dir, "busy")
	script := fmt.Sprintf(`#!/bin/sh
case "$*" in *--version*) echo "iptables v1.8.9 (legacy)"; exit 0;; esac
if [ -e %q ]; then
	echo "Another app is currently holding the xtables lock. Stopped waiting after 1s." >&2
	exit 4
fi
echo "iptables: Bad rule (does a matching rule exist in that chain?)." >&2
exit 1
`, busy)
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path, busy
}

func TestIsXtablesLocked(t *testing.T) {
	ipt, busy := fakeIptables(t)
	h, err := iptables.New(iptables.Path(ipt), iptables.Timeout(1))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(busy, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	_, goIptablesLocked := h.Exists("nat", "OUTPUT", "-j", "UPROXY-SERVICES")
	os.Remove(busy)
	_, goIptablesMissing := h.Exists("nat", "OUTPUT", "-j", "UPROXY-SERVICES")
	if goIptablesMissing != nil {
		t.Fatalf("fake iptables without the lock: %v", goIptablesMissing)
	}
	args := []string{"--noflush", "-w", "5"}
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"iptables-restore, lock held", commandError(t, "iptables-restore", args, 4, lockMessage), true},
		{"iptables-restore without -w", commandError(t, "iptables-restore", nil, 4,
			"Another app is currently holding the xtables lock. Perhaps you want to use the -w option?"), true},
		{"wrapped by the caller", fmt.Errorf("redirect: IPv4: writing chains: %w", commandError(t, "iptables-restore", args, 4, lockMessage)), true},
		{"go-iptables, lock held", goIptablesLocked, true},
		{"status 4, another resource problem", commandError(t, "iptables-restore", args, 4, "iptables-restore: unable to initialize table 'nat'"), false},
		// While it waits, iptables prints the message; it may then fail for
		// another reason.
		{"status 1 after waiting", commandError(t, "iptables-restore", args, 1,
			"Another app is currently holding the xtables lock; still 4s 0us time ahead to have a chance to grab the lock...\niptables-restore: line 3 failed"), false},
		{"status 2", commandError(t, "iptables", nil, 2, "holding the xtables lock"), false},
		{"no exit status", errors.New("Another app is currently holding the xtables lock"), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := isXtablesLocked(tt.err); got != tt.want {
				t.Errorf("isXtablesLocked(%v) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}

// lockedKernel is a fakeKernel whose iptables-restore calls, and JumpRules
// Insert calls, fail with the xtables lock error while lockedRestores and
// lockedInserts are positive (each failure uses one up; -1 means for
// ever). It records the fake clock's time of each iptables-restore call.
type lockedKernel struct {
	*fakeKernel
	t     *testing.T
	clock *testingclock.FakeClock

	mu                            sync.Mutex
	lockedRestores, lockedInserts int
	restoreTimes                  []time.Duration // since start
	start                         time.Time
}

func (k *lockedKernel) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	if name == k.family.command("-restore") {
		k.mu.Lock()
		k.restoreTimes = append(k.restoreTimes, k.clock.Since(k.start))
		locked := k.lockedRestores != 0
		if k.lockedRestores > 0 {
			k.lockedRestores--
		}
		k.mu.Unlock()
		if locked {
			k.fakeKernel.mu.Lock()
			k.calls = append(k.calls, strings.Join(append([]string{name}, args...), " "))
			k.fakeKernel.mu.Unlock()
			return nil, commandError(k.t, name, args, 4, lockMessage)
		}
	}
	return k.fakeKernel.Run(ctx, name, args, stdin)
}

func (k *lockedKernel) Insert(table, chain string, pos int, spec ...string) error {
	k.mu.Lock()
	locked := k.lockedInserts != 0
	if k.lockedInserts > 0 {
		k.lockedInserts--
	}
	k.mu.Unlock()
	if locked {
		k.fakeKernel.mu.Lock()
		k.calls = append(k.calls, fmt.Sprintf("Insert %s %s %d", table, chain, pos))
		k.fakeKernel.mu.Unlock()
		return commandError(k.t, "iptables", []string{"-t", table, "-I", chain}, 4, lockMessage)
	}
	return k.fakeKernel.Insert(table, chain, pos, spec...)
}

// newLockedSyncer returns a Syncer over a lockedKernel whose pauses run on
// a fake clock that a goroutine advances, 10ms at a time, whenever the
// Syncer waits on it, until the test ends.
func newLockedSyncer(t *testing.T, cfg Config) (*Syncer, *lockedKernel) {
	t.Helper()
	fc := testingclock.NewFakeClock(time.Unix(1e9, 0))
	k := &lockedKernel{fakeKernel: newFakeKernel(IPv4), t: t, clock: fc, start: fc.Now()}
	cfg.Family, cfg.Exec, cfg.Jumps, cfg.Clock = IPv4, k, k, fc
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { // ends when the test does
		for {
			select {
			case <-done:
				return
			default:
			}
			if fc.HasWaiters() {
				fc.Step(10 * time.Millisecond)
			} else {
				time.Sleep(50 * time.Microsecond) // the fake clock's driver yields until the code waits on it
			}
		}
	})
	t.Cleanup(func() { close(done); wg.Wait() })
	return s, k
}

func TestSyncRetriesWhileXtablesLocked(t *testing.T) {
	ctx := context.Background()
	s, k := newLockedSyncer(t, Config{})
	k.lockedRestores, k.lockedInserts = 3, 2
	res, err := s.Sync(ctx, rulesA, false)
	if err != nil {
		t.Fatalf("Sync while the lock was held for 3 attempts: %v", err)
	}
	if !res.Wrote {
		t.Errorf("Sync = %+v, want Wrote", res)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
		t.Errorf("kernel (-want +got):\n%s", diff)
	}
	// 100ms, then 200ms, then 400ms between the attempts.
	want := []time.Duration{0, 100 * time.Millisecond, 300 * time.Millisecond, 700 * time.Millisecond}
	if diff := cmp.Diff(want, k.restoreTimes); diff != "" {
		t.Errorf("iptables-restore attempt times (-want +got):\n%s", diff)
	}
	calls := strings.Join(k.takeCalls(), "\n")
	if n := strings.Count(calls, callRestore); n != 4 {
		t.Errorf("%d iptables-restore calls, want 4:\n%s", n, calls)
	}
	// The first jump is inserted on the third attempt; the others at once.
	if n := strings.Count(calls, "Insert nat PREROUTING 1"); n != 3 {
		t.Errorf("%d attempts to insert the first jump, want 3:\n%s", n, calls)
	}
	if n := strings.Count(calls, "Insert "); n != 3+len(callsInsertJumps)-1 {
		t.Errorf("%d Insert calls, want %d:\n%s", n, 3+len(callsInsertJumps)-1, calls)
	}
}

func TestSyncGivesUpWhileXtablesLocked(t *testing.T) {
	ctx := context.Background()
	s, k := newLockedSyncer(t, Config{})
	if _, err := s.Sync(ctx, rulesB, false); err != nil {
		t.Fatal(err)
	}
	before := k.save()
	k.takeCalls()
	k.mu.Lock()
	k.lockedRestores, k.restoreTimes, k.start = -1, nil, k.clock.Now()
	k.mu.Unlock()

	_, err := s.Sync(ctx, rulesA, false)
	if err == nil {
		t.Fatal("Sync succeeded while the lock was held for ever")
	}
	if !errors.Is(err, ErrXtablesLocked) {
		t.Errorf("error %v does not wrap ErrXtablesLocked", err)
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 4 {
		t.Errorf("error %v does not wrap iptables-restore's exit status 4", err)
	}
	for _, want := range []string{
		"IPv4", "writing chains (nat UPROXY-SERVICES,UPROXY-NODEPORTS; mangle UPROXY-TPROXY,UPROXY-TPROXY-SERVICES-TCP,UPROXY-TPROXY-SERVICES-UDP,UPROXY-TPROXY-NODEPORTS-TCP,UPROXY-TPROXY-NODEPORTS-UDP,UPROXY-TPROXY-DIVERT,UPROXY-TPROXY-BRIDGED,UPROXY-TPROXY-OUTPUT,UPROXY-REPLIES; filter UPROXY-LISTENERS,UPROXY-FIREWALL)",
		"gave up after 5 attempts in 1.5s",
		"iptables-restore --noflush -w 5: exit status 4",
		"Another app is currently holding the xtables lock. Stopped waiting after 5s.",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	want := []time.Duration{0, 100 * time.Millisecond, 300 * time.Millisecond, 700 * time.Millisecond, 1500 * time.Millisecond}
	if diff := cmp.Diff(want, k.restoreTimes); diff != "" {
		t.Errorf("iptables-restore attempt times (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(before, k.save()); diff != "" {
		t.Errorf("the failed Sync changed the rules (-before +after):\n%s", diff)
	}

	// Once the lock is free, the next Sync (the runner retries a failed
	// one as full) reads the kernel back and writes.
	k.mu.Lock()
	k.lockedRestores = 0
	k.mu.Unlock()
	k.takeCalls()
	res, err := s.Sync(ctx, rulesA, true)
	if err != nil {
		t.Fatalf("Sync after the lock was released: %v", err)
	}
	if !res.Wrote {
		t.Errorf("Sync = %+v, want Wrote", res)
	}
	if calls := k.takeCalls(); !strings.HasPrefix(strings.Join(calls, "\n"), strings.Join(callsRead, "\n")) {
		t.Errorf("Sync after a failure did not read the kernel back first: %q", calls)
	}
	if diff := cmp.Diff(wantSave(IPv4, rulesA), k.save()); diff != "" {
		t.Errorf("kernel (-want +got):\n%s", diff)
	}
}

func TestSyncDoesNotRetryOtherFailures(t *testing.T) {
	s, k := newLockedSyncer(t, Config{})
	k.failRestore = commandError(t, "iptables-restore", []string{"--noflush", "-w", "5"}, 1, "iptables-restore: line 3 failed")
	_, err := s.Sync(context.Background(), rulesA, false)
	if err == nil || errors.Is(err, ErrXtablesLocked) || !strings.Contains(err.Error(), "line 3 failed") {
		t.Fatalf("Sync with a failing restore: %v; want the restore's own error", err)
	}
	if n := len(k.restoreTimes); n != 1 {
		t.Errorf("%d iptables-restore calls, want 1: only the lock is worth waiting for", n)
	}
}

func TestSyncLockRetryStopsWithContext(t *testing.T) {
	// A real clock and a long backoff: only the context can end the wait.
	k := &lockedKernel{fakeKernel: newFakeKernel(IPv4), t: t, clock: testingclock.NewFakeClock(time.Now()), lockedRestores: -1}
	s, err := New(Config{Family: IPv4, Exec: k, Jumps: k, LockBackoff: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = s.Sync(ctx, rulesA, false)
	if !errors.Is(err, ErrXtablesLocked) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Sync cancelled during the backoff: %v; want ErrXtablesLocked and the context's error", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Sync took %v to notice its context was done", d)
	}
}

func TestCleanupRetriesWhileXtablesLocked(t *testing.T) {
	ctx := context.Background()
	s, k := newLockedSyncer(t, Config{})
	if _, err := s.Sync(ctx, rulesB, false); err != nil {
		t.Fatal(err)
	}
	k.mu.Lock()
	k.lockedRestores = 2
	k.mu.Unlock()
	if err := Cleanup(ctx, Config{Family: IPv4, Exec: k, Jumps: k, Clock: k.clock}); err != nil {
		t.Fatalf("Cleanup while the lock was held for 2 attempts: %v", err)
	}
	if diff := cmp.Diff(newFakeKernel(IPv4).save(), k.save()); diff != "" {
		t.Errorf("kernel after Cleanup (-want +got):\n%s", diff)
	}
	if n := len(k.restoreTimes); n != 1+3 {
		t.Errorf("%d iptables-restore calls, want 4: the Sync's, then Cleanup's 2 locked and 1 more", n)
	}
}

func TestNewRejectsNegativeLockRetries(t *testing.T) {
	k := newFakeKernel(IPv4)
	for _, cfg := range []Config{{LockAttempts: -1}, {LockBackoff: -time.Second}} {
		cfg.Exec, cfg.Jumps = k, k
		if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "negative xtables lock retries") {
			t.Errorf("New(%+v) = %v, want an error", cfg, err)
		}
	}
}
