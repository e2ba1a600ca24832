package changes

import (
	"context"
	"errors"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/uproxy/uproxy/internal/testwait"
)

type runCall struct {
	at   time.Time
	full bool
}

// startRunner runs a Runner (MinInterval 1s, MaxInterval 30s) on a fake
// clock set to start, until the test ends. Each run reports its time and
// fullness on calls, then returns what result returns.
func startRunner(t *testing.T, start time.Time, result func() error) (r *Runner, clk *clocktesting.FakeClock, calls <-chan runCall) {
	clk = clocktesting.NewFakeClock(start)
	ch := make(chan runCall, 10)
	r = NewRunner(RunnerConfig{MinInterval: time.Second, MaxInterval: 30 * time.Second, Clock: clk}, func(ctx context.Context, full bool) error {
		ch <- runCall{clk.Now(), full}
		return result()
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Loop(ctx); close(done) }() // ends at the test's cleanup
	t.Cleanup(func() { cancel(); <-done })
	return r, clk, ch
}

func TestRunnerBoundsFrequency(t *testing.T) {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	fail := make(chan bool, 10)
	r, clk, calls := startRunner(t, start, func() error {
		if <-fail {
			return errors.New("boom")
		}
		return nil
	})

	expect := func(at time.Duration, full bool, failIt bool) {
		t.Helper()
		fail <- failIt
		select {
		case c := <-calls:
			if got := c.at.Sub(start); got != at || c.full != full {
				t.Fatalf("run at %v full=%v; want at %v full=%v", got, c.full, at, full)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no run; want one at %v", at)
		}
	}
	expectNone := func() {
		t.Helper()
		select {
		case c := <-calls:
			t.Fatalf("unexpected run at %v", c.at.Sub(start))
		case <-time.After(50 * time.Millisecond):
		}
	}
	step := func(d time.Duration) {
		t.Helper()
		testwait.Until(t, 5*time.Second, "the runner to wait on the clock", clk.HasWaiters)
		clk.Step(d)
	}

	// Nothing runs before the first request, not even the periodic run.
	step(time.Minute)
	expectNone()
	start = start.Add(time.Minute)

	r.Run() // the first run is immediate and full
	expect(0, true, false)

	// Requests within MinInterval are batched into one run at MinInterval.
	r.Run()
	r.Run()
	expectNone()
	step(500 * time.Millisecond)
	expectNone()
	step(500 * time.Millisecond)
	expect(time.Second, false, false)

	// With no requests, a full run comes every MaxInterval.
	step(30 * time.Second)
	expect(31*time.Second, true, false)

	// A failure retries as full, with backoff 1s, 2s, ... until success.
	r.Run()
	step(time.Second)
	expect(32*time.Second, false, true)
	step(time.Second)
	expect(33*time.Second, true, true)
	step(time.Second)
	expectNone()
	step(time.Second)
	expect(35*time.Second, true, false)

	// After success, requests are served at MinInterval again.
	r.Run()
	step(time.Second)
	expect(36*time.Second, false, false)
}

// TestRunnerSkippedRunDoesNotCount checks that a run whose SyncFunc
// returns ErrSyncSkipped (the initial lists not complete) neither delays
// the next request by MinInterval nor makes the next run incremental.
func TestRunnerSkippedRunDoesNotCount(t *testing.T) {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	results := make(chan error, 10)
	r, _, calls := startRunner(t, start, func() error { return <-results })
	expect := func(full bool, result error) {
		t.Helper()
		results <- result
		select {
		case c := <-calls:
			if c.at != start || c.full != full {
				t.Fatalf("run at %v full=%v; want at once (%v), full=%v", c.at.Sub(start), c.full, 0, full)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("no run; want one at once")
		}
	}
	r.Run()
	expect(true, ErrSyncSkipped)
	// The lists arrive at the same instant: served at once, still full.
	r.Run()
	expect(true, nil)
	// A real run counts: the next request waits for MinInterval.
	r.Run()
	select {
	case c := <-calls:
		t.Fatalf("run at %v, within MinInterval of a real run", c.at.Sub(start))
	case <-time.After(50 * time.Millisecond):
	}
}
