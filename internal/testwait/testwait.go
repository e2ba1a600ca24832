// Package testwait waits in tests on conditions rather than on time: Until
// polls a condition until it holds or a deadline passes, and Never and
// Throughout check that one stays false, or true, for a while, polling
// instead of one long sleep. A
// test that waits on a timer of the code under test injects a fake clock
// (k8s.io/utils/clock/testing) instead.
package testwait

import (
	"testing"
	"time"
)

// Interval is how often Until and Never look at their condition.
const Interval = 10 * time.Millisecond

// Until calls cond every Interval until it returns true, and fails t
// (Fatalf, so from the test's goroutine only) once timeout has passed
// without it, naming what it waited for.
func Until(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	UntilOK(t, timeout, what, func() (bool, string) { return cond(), "" })
}

// UntilOK is Until for a condition that also says what it saw, which the
// failure reports: the detail of its last call.
func UntilOK(t testing.TB, timeout time.Duration, what string, cond func() (ok bool, detail string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, detail := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			if detail != "" {
				t.Fatalf("timed out after %v waiting for %s; last: %s", timeout, what, detail)
			}
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(Interval)
	}
}

// Poll calls cond every Interval until it returns true, and reports
// whether it did before timeout: for a caller that reports the failure
// itself, with what it gathers only then.
func Poll(timeout time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(timeout); ; time.Sleep(Interval) {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

// Never calls cond every Interval for d, and fails t (Errorf) as soon as it
// returns true, naming what must not happen.
func Never(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	Throughout(t, d, Interval, what, func() (bool, string) { return !cond(), "" })
}

// Throughout calls cond every interval for d (an expensive check samples
// less often), and fails t (Errorf) as soon as it returns false, naming
// what must hold and what cond saw.
func Throughout(t testing.TB, d, every time.Duration, what string, cond func() (ok bool, detail string)) {
	t.Helper()
	start := time.Now()
	for end := start.Add(d); time.Now().Before(end); time.Sleep(every) {
		if ok, detail := cond(); !ok {
			if detail != "" {
				t.Errorf("%s, after %v: %s", what, time.Since(start).Round(time.Millisecond), detail)
			} else {
				t.Errorf("%s, after %v", what, time.Since(start).Round(time.Millisecond))
			}
			return
		}
	}
}
