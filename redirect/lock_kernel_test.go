package redirect

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coreos/go-iptables/iptables"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/internal/testlab"
)

// legacyExec runs the legacy iptables tools (iptables-legacy-save and
// -restore) for the Syncer's iptables-save and iptables-restore, which
// take the xtables lock (iptables-nft takes none), and ipset as it is. It
// records the error of every iptables-restore attempt, before the Syncer's
// retries see it, and calls onLocked after the first that failed on the
// lock.
type legacyExec struct {
	mu       sync.Mutex
	restores []error
	onLocked func()
}

func (x *legacyExec) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	if !testlab.InNetns() {
		return nil, errors.New("refusing to run iptables outside a test network namespace")
	}
	restore := name == "iptables-restore"
	if restore || name == "iptables-save" {
		name = strings.Replace(name, "iptables", "iptables-legacy", 1)
	}
	out, err := OSExec{}.Run(ctx, name, args, stdin)
	if restore {
		x.mu.Lock()
		x.restores = append(x.restores, err)
		first := isXtablesLocked(err) && x.onLocked != nil
		onLocked := x.onLocked
		if first {
			x.onLocked = nil
		}
		x.mu.Unlock()
		if first {
			onLocked()
		}
	}
	return out, err
}

func (x *legacyExec) attempts() []error {
	x.mu.Lock()
	defer x.mu.Unlock()
	return append([]error(nil), x.restores...)
}

// holdLock takes the xtables lock, an exclusive flock(2) on path, as
// iptables does, and returns the function that releases it.
func holdLock(t *testing.T, path string) (release func()) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { unix.Flock(int(f.Fd()), unix.LOCK_UN); f.Close() }) }
	t.Cleanup(release)
	return release
}

// TestKernelSyncWaitsForXtablesLock runs the Syncer against legacy
// iptables while another process (this test) holds the xtables lock: the
// Sync fails over to its retries and succeeds once the lock is released,
// or gives up with an error that says why.
func TestKernelSyncWaitsForXtablesLock(t *testing.T) {
	if !testlab.RunInNetns(t, "iptables-legacy", "iptables-legacy-save", "iptables-legacy-restore", "ipset") {
		return
	}
	if out, err := exec.Command("iptables-legacy-save", "-t", "nat").CombinedOutput(); err != nil {
		t.Skipf("iptables-legacy is not usable in a fresh network namespace (does this kernel have the legacy ip_tables tables?): %v: %s", err, out)
	}
	// iptables 1.8 takes its lock file's path from XTABLES_LOCKFILE
	// (iptables(8), LOCK FILE): a private one keeps the test off the
	// machine's /run/xtables.lock. go-iptables' commands inherit it.
	lockFile := filepath.Join(t.TempDir(), "xtables.lock")
	t.Setenv("XTABLES_LOCKFILE", lockFile)
	legacy, err := exec.LookPath("iptables-legacy")
	if err != nil {
		t.Fatal(err)
	}
	jumps, err := iptables.New(iptables.Path(legacy), iptables.Timeout(1))
	if err != nil {
		t.Fatal(err)
	}
	rules := Rules{Intercepts: []InterceptRule{svc("default/web:http", TCP, "10.96.0.10", 80, 40001)}}
	saved := func() string {
		t.Helper()
		out, err := exec.Command("iptables-legacy-save", "-t", "nat").Output()
		if err != nil {
			t.Fatal(err)
		}
		var lines []string
		for line := range strings.Lines(string(out)) {
			if !strings.HasPrefix(line, "#") { // the time of the save
				lines = append(lines, line)
			}
		}
		return strings.Join(lines, "")
	}
	wantRules := []string{
		`-A OUTPUT -m mark ! --mark 0x400000/0x400000 -m comment --comment "uproxy service portals" -j UPROXY-SERVICES`,
		`-A PREROUTING -m mark ! --mark 0x400000/0x400000 -m comment --comment "uproxy service portals" -j UPROXY-SERVICES`,
		"-j REDIRECT --to-ports 40001",
	}

	t.Run("released while waiting", func(t *testing.T) {
		release := holdLock(t, lockFile)
		x := &legacyExec{onLocked: release}
		s, err := New(Config{Family: IPv4, Exec: x, Jumps: jumps, Wait: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Sync(context.Background(), rules, false); err != nil {
			t.Fatalf("Sync after the lock was released: %v", err)
		}
		attempts := x.attempts()
		if len(attempts) != 2 || !isXtablesLocked(attempts[0]) || attempts[1] != nil {
			t.Fatalf("iptables-legacy-restore attempts: %v; want one that failed on the lock, then one that succeeded", attempts)
		}
		if !strings.Contains(attempts[0].Error(), "Another app is currently holding the xtables lock") {
			t.Errorf("the locked attempt's error %q lacks iptables' message", attempts[0])
		}
		nat := saved()
		for _, want := range wantRules {
			if n := strings.Count(nat, want); n != 1 {
				t.Errorf("%d copies of %q in nat:\n%s", n, want, nat)
			}
		}
	})

	t.Run("held throughout", func(t *testing.T) {
		before := saved()
		release := holdLock(t, lockFile)
		x := &legacyExec{}
		s, err := New(Config{Family: IPv4, Exec: x, Jumps: jumps, Wait: time.Second, LockAttempts: 2})
		if err != nil {
			t.Fatal(err)
		}
		moved := Rules{Intercepts: []InterceptRule{svc("default/web:http", TCP, "10.96.0.10", 80, 40002)}}
		_, err = s.Sync(context.Background(), moved, false)
		if !errors.Is(err, ErrXtablesLocked) {
			t.Fatalf("Sync with the lock held throughout: %v; want ErrXtablesLocked", err)
		}
		for _, want := range []string{"writing chains (nat UPROXY-SERVICES,UPROXY-NODEPORTS;", "gave up after 2 attempts",
			"exit status 4", "Another app is currently holding the xtables lock. Stopped waiting after 1s."} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not say %q", err, want)
			}
		}
		if after := saved(); after != before {
			t.Errorf("the failed Sync changed the rules:\nbefore:\n%s\nafter:\n%s", before, after)
		}
		release()
		if _, err := s.Sync(context.Background(), moved, true); err != nil {
			t.Fatalf("Sync after the lock was released: %v", err)
		}
		if nat := saved(); !strings.Contains(nat, "-j REDIRECT --to-ports 40002") || strings.Contains(nat, "--to-ports 40001") {
			t.Errorf("nat after the retried Sync:\n%s", nat)
		}
	})
}
