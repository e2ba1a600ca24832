package testwait

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// recorder is a testing.TB that records failures instead of failing.
type recorder struct {
	testing.TB
	failed  bool
	message string
}

func (r *recorder) Helper() {}
func (r *recorder) Fatalf(format string, args ...any) {
	r.failed = true
	r.message = sprintf(format, args...)
	panic(r)
}
func (r *recorder) Errorf(format string, args ...any) {
	r.failed = true
	r.message = sprintf(format, args...)
}

// run calls f with a recorder, and returns it once f has returned or
// failed fatally.
func run(t *testing.T, f func(tb testing.TB)) (r *recorder) {
	r = &recorder{TB: t}
	defer func() {
		if p := recover(); p != nil && p != any(r) {
			panic(p)
		}
	}()
	f(r)
	return r
}

func TestUntil(t *testing.T) {
	var n atomic.Int32
	if r := run(t, func(tb testing.TB) {
		Until(tb, time.Second, "the third call", func() bool { return n.Add(1) == 3 })
	}); r.failed {
		t.Errorf("Until failed on a condition that held: %s", r.message)
	}
	if n.Load() != 3 {
		t.Errorf("Until called the condition %d times, want 3", n.Load())
	}
	r := run(t, func(tb testing.TB) {
		UntilOK(tb, 30*time.Millisecond, "never", func() (bool, string) { return false, "still false" })
	})
	if !r.failed || !strings.Contains(r.message, "waiting for never; last: still false") {
		t.Errorf("UntilOK past its deadline: failed %v, %q", r.failed, r.message)
	}
}

func TestPoll(t *testing.T) {
	var n atomic.Int32
	if !Poll(time.Second, func() bool { return n.Add(1) == 3 }) || n.Load() != 3 {
		t.Errorf("Poll on a condition true at its third call: %d calls", n.Load())
	}
	if Poll(20*time.Millisecond, func() bool { return false }) {
		t.Error("Poll reported a condition that never held")
	}
}

func TestNever(t *testing.T) {
	if r := run(t, func(tb testing.TB) { Never(tb, 30*time.Millisecond, "it happened", func() bool { return false }) }); r.failed {
		t.Errorf("Never failed on a condition that stayed false: %s", r.message)
	}
	start := time.Now()
	r := run(t, func(tb testing.TB) {
		Never(tb, time.Minute, "it happened", func() bool { return time.Since(start) > 20*time.Millisecond })
	})
	if !r.failed || !strings.HasPrefix(r.message, "it happened, after ") {
		t.Errorf("Never on a condition that became true: failed %v, %q", r.failed, r.message)
	}
	if time.Since(start) > 10*time.Second {
		t.Errorf("Never waited out its whole time after the condition held")
	}
}

func sprintf(format string, args ...any) string { return fmt.Sprintf(format, args...) }

func TestThroughout(t *testing.T) {
	var n atomic.Int32
	r := run(t, func(tb testing.TB) {
		Throughout(tb, time.Minute, time.Millisecond, "it holds", func() (bool, string) { return n.Add(1) < 3, "the third call" })
	})
	if !r.failed || !strings.Contains(r.message, ": the third call") || n.Load() != 3 {
		t.Errorf("Throughout on a condition false at its third call: failed %v, %q, %d calls", r.failed, r.message, n.Load())
	}
}
