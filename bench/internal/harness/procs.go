package harness

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"time"

	"github.com/uproxy/uproxy/bench/internal/results"

	"github.com/uproxy/uproxy/bench/internal/load"

	"github.com/uproxy/uproxy/internal/testlab"
)

// PathRun is a data path set up in one lab.
type PathRun struct {
	// Targets of the TCP request/response, bulk and UDP workloads.
	RR, Bulk, UDP []string
	// udpNA says why there is no UDP figure, when udp is empty.
	UDPNA string
	// Proc is the proxy process (or kube-proxy, which only programs the
	// kernel); nil when the harness programs the kernel itself.
	Proc *testlab.Proc
	// Userspace is true when proc carries the connections.
	Userspace bool
	// Comm is the proxy's process name, for perf; empty for kernel paths.
	Comm string
	// Pprof is true when the proxy serves /debug/pprof on
	// 127.0.0.1:10262 in the node namespace (uproxy, with --profiling).
	Pprof bool
	// Binary is the proxy's executable, for pprof's symbols.
	Binary string
	// ExitNA, if set, tells from the output of a proc that exited at once
	// that the path cannot be measured (an *results.NAError), or returns nil.
	ExitNA func(output string) error
}

// WaitReady waits until the service answers from the client pod, failing
// early if the proxy process exits.
func WaitReady(ctx context.Context, e *Env, t *Topo, r *PathRun, timeout time.Duration) error {
	pr, err := t.Lab.Start(t.Client.NS, "probe-ready", e.LoadBin, "load", "probe", "--target", r.RR[0], "--timeout", timeout.String())
	if err != nil {
		return err
	}
	defer StopProc(pr, time.Second)
	for {
		if r.Proc != nil && r.Proc.Exited() {
			out := r.Proc.Output()
			if r.ExitNA != nil {
				if err := r.ExitNA(out); err != nil {
					return err
				}
			}
			return fmt.Errorf("%s exited (%v):\n%s", r.Proc.Name, r.Proc.Wait(time.Second), Tail(out, 10))
		}
		if pr.Exited() {
			var res load.ProbeResult
			if err := DecodeLine(pr.Output(), &res); err != nil || !res.OK {
				msg := fmt.Sprintf("the service does not answer: %s", Tail(pr.Output(), 2))
				if r.Proc != nil {
					msg += "\n" + r.Proc.Name + " output:\n" + Tail(r.Proc.Output(), 10)
				}
				return errors.New(msg)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// LastMatching returns the last line of s that contains sub.
func LastMatching(s, sub string) string {
	lines := strings.Split(s, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.Contains(lines[i], sub) {
			return lines[i]
		}
	}
	return ""
}

// WaitProc waits for p to end, up to timeout or until ctx is done, and
// returns its error.
func WaitProc(ctx context.Context, p *testlab.Proc, timeout time.Duration) error {
	if err := WaitProgrammed(ctx, p, nil, timeout); err != nil {
		return fmt.Errorf("%s: %w", p.Name, err)
	}
	return p.Wait(time.Second) // it has ended: this returns at once
}

// StopProc stops a proxy we started (SIGTERM, then SIGKILL), by its pid.
func StopProc(p *testlab.Proc, grace time.Duration) {
	if p == nil || p.Exited() {
		return
	}
	_ = p.Signal(syscall.SIGTERM)
	if p.Wait(grace) != nil && !p.Exited() {
		_ = p.Cmd.Process.Kill()
		_ = p.Wait(5 * time.Second)
	}
}

// ErrNA returns the results.NAError in err, if any.
func ErrNA(err error) (*results.NAError, bool) {
	var n *results.NAError
	ok := errors.As(err, &n)
	return n, ok
}

// UserHZ is the unit of /proc/PID/stat's start and CPU times: USER_HZ, 100 ticks a
// second on every architecture that Go supports on Linux (proc(5), "divide
// by sysconf(_SC_CLK_TCK)").
const UserHZ = 100

// WaitProgrammed waits up to timeout for the probe to end, and returns
// errBudgetSpent early once the proxy (nil: none to watch) has logged
// listenerBudgetSpent: then the last service never answers. The proxy's
// output is read once a second, as it grows with its listeners.
func WaitProgrammed(ctx context.Context, probe, proxy OutputProc, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	next := time.Now().Add(time.Second)
	for !probe.Exited() {
		if time.Now().After(deadline) {
			return fmt.Errorf("still running after %v", timeout)
		}
		if proxy != nil && time.Now().After(next) {
			if strings.Contains(proxy.Output(), ListenerBudgetSpent) {
				return ErrBudgetSpent
			}
			next = time.Now().Add(time.Second)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}

// OutputProc is what waitProgrammed reads of a process (a *testlab.Proc).
type OutputProc interface {
	Exited() bool
	Output() string
}

// ListenerBudgetSpent is what uproxy logs when service ports go without a
// listener because its listener budget (--max-listeners) is spent.
const ListenerBudgetSpent = "the listener budget is spent"

// ErrBudgetSpent says that the proxy's listener budget is spent (see
// WaitProgrammed).
var ErrBudgetSpent = errors.New("the proxy's listener budget is spent")
