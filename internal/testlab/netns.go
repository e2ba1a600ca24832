// Package testlab builds throw-away network namespaces for tests, demos and
// benchmarks, so that nothing touches the root namespace's rules or routes.
//
// Every namespace it creates has a unique name with the "uplab-" prefix and
// is deleted when the test (or the Lab) that made it ends, even on failure.
package testlab

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// envNetns is set, in a re-executed test process, to the namespace it runs in.
const envNetns = "UPROXY_LAB_NETNS"

// RequireRoot skips t unless the process is root and every named command is
// on PATH. It says which requirement is missing.
func RequireRoot(t testing.TB, cmds ...string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root to create network namespaces")
	}
	for _, c := range append([]string{"ip"}, cmds...) {
		if _, err := exec.LookPath(c); err != nil {
			t.Skipf("skipping: %s is not installed (as root, `make deps-test` installs the packages the tests need)", c)
		}
	}
}

// UniqueName returns a namespace (or link) name with the given prefix and
// a random suffix, short enough for an interface name (15 bytes).
func UniqueName(prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// InNetns reports whether this process was started by RunInNetns.
func InNetns() bool { return os.Getenv(envNetns) != "" }

// RunInNetns runs the calling test inside a fresh, empty network namespace
// (with only lo, brought up) and reports whether the caller is that inner
// run. The usual pattern is:
//
//	func TestRules(t *testing.T) {
//		if !lab.RunInNetns(t) {
//			return // the outer run: the inner one has already reported
//		}
//		... // runs inside the namespace: iptables, routes and listeners are private
//	}
//
// The outer run re-executes the test binary for this test alone under
// `ip netns exec`, relays its output, fails if it failed, and deletes the
// namespace afterwards. It skips when not root or when ip is missing.
func RunInNetns(t *testing.T, cmds ...string) bool {
	t.Helper()
	if InNetns() {
		return true
	}
	RequireRoot(t, cmds...)
	ns := NewNetns(t, "uplab-")
	args := []string{"netns", "exec", ns, os.Args[0], "-test.run", "^" + topName(t.Name()) + "$", "-test.v", "-test.count=1"}
	if sub := subName(t.Name()); sub != "" {
		args[len(args)-3] += "/^" + sub + "$"
	}
	// The inner run gets the outer one's remaining time, less a margin, so
	// a hung inner test fails (and the namespace is still deleted) before
	// the outer test binary is killed.
	timeout := 10 * time.Minute
	if d, ok := t.Deadline(); ok {
		timeout = time.Until(d) - 10*time.Second
		if timeout < 10*time.Second {
			timeout = 10 * time.Second
		}
	}
	args = append(args, "-test.timeout="+timeout.String())
	ctx, cancel := context.WithTimeout(context.Background(), timeout+5*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ip", args...)
	cmd.Env = append(os.Environ(), envNetns+"="+ns)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	t.Logf("inside netns %s:\n%s", ns, out.String())
	if err != nil {
		t.Fatalf("test failed inside netns %s: %v", ns, err)
	}
	if strings.Contains(out.String(), "--- SKIP: "+t.Name()) && !strings.Contains(out.String(), "--- PASS: "+t.Name()) {
		t.Skip("skipped inside the namespace (see log)")
	}
	return false
}

func topName(name string) string {
	top, _, _ := strings.Cut(name, "/")
	return top
}

func subName(name string) string {
	_, sub, _ := strings.Cut(name, "/")
	return sub
}

// NewNetns creates a network namespace named prefix+random, brings its lo
// up, and deletes it when t ends. It returns the name.
func NewNetns(t testing.TB, prefix string) string {
	t.Helper()
	ns := UniqueName(prefix)
	if err := Run("ip", "netns", "add", ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { DeleteNetns(ns) })
	if err := initNetns(ns); err != nil {
		t.Fatal(err)
	}
	return ns
}

// initNetns brings a new namespace's lo up and turns off IPv6 duplicate
// address detection for the links that will be created in (or moved
// into) it, since they take its default settings. While a link-local
// address is tentative the kernel solicits neighbours from the unspecified
// address (RFC 4861 7.2.2) and the first packets to a neighbour can be
// lost: IPv6 connections in a fresh namespace then took a SYN
// retransmission (1s) or two.
func initNetns(ns string) error {
	if err := Run("ip", "netns", "exec", ns, "sysctl", "-qw",
		"net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0"); err != nil {
		return err
	}
	return Run("ip", "-n", ns, "link", "set", "lo", "up")
}

// DeleteNetns deletes ns, first killing any process still inside it that
// this process started (ip netns pids lists them; we only kill our own
// descendants' namespace, which nothing else uses).
func DeleteNetns(ns string) {
	if out, err := exec.Command("ip", "netns", "pids", ns).Output(); err == nil {
		for _, pid := range strings.Fields(string(out)) {
			_ = exec.Command("kill", "-9", pid).Run()
		}
	}
	_ = exec.Command("ip", "netns", "delete", ns).Run()
}

// Run runs a command and returns an error that includes its output.
func Run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// DoInNetns runs fn on an OS thread switched into the network namespace ns
// (a name under /run/netns), and switches the thread back afterwards; the
// sockets fn creates belong to ns for good. It checks that the thread is
// in ns before running fn, so fn never runs in the caller's own namespace. fn must not start
// goroutines that expect to be in ns.
func DoInNetns(ns string, fn func() error) error {
	target, err := os.Open(filepath.Join("/run/netns", ns))
	if err != nil {
		return err
	}
	defer target.Close()
	var want unix.Stat_t
	if err := unix.Fstat(int(target.Fd()), &want); err != nil {
		return err
	}
	errc := make(chan error, 1)
	go func() { // ends after fn; its thread dies with it if it cannot switch back
		runtime.LockOSThread()
		home, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer home.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("setns to %s: %w", ns, err)
			return
		}
		// From here on the thread stays locked unless it is back home: if
		// anything fails, the runtime ends the thread with the goroutine.
		var got unix.Stat_t
		if err := unix.Stat("/proc/thread-self/ns/net", &got); err != nil || got.Dev != want.Dev || got.Ino != want.Ino {
			errc <- fmt.Errorf("setns to %s: the thread is elsewhere (%v)", ns, err)
			return
		}
		ferr := fn()
		if err := unix.Setns(int(home.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns back from %s: %w", ns, err)
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}
