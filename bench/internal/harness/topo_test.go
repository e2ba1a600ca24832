package harness

import (
	"os"
	"runtime"
	"testing"
	"time"
)

func TestStatCPUTicks(t *testing.T) {
	for _, c := range []struct {
		name, stat string
		want       int64
		wantErr    bool
	}{
		// utime 300, stime 20 (fields 14 and 15).
		{"plain", "201 (iptables-restor) R 100 201 100 0 -1 4194304 1 0 0 0 300 20 0 0 20 0 1 0 90000", 320, false},
		// A command name with spaces and a parenthesis.
		{"odd name", "202 (a b) c) S 100 202 100 0 -1 0 0 0 0 0 7 5 0 0 20 0 1 0 119950", 12, false},
		{"short", "203 (x) S 1 2 3", 0, true},
		{"no name", "garbage", 0, true},
		{"not a number", "204 (x) S 100 204 100 0 -1 0 0 0 0 0 x 5 0", 0, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := statCPUTicks(c.stat)
			if (err != nil) != c.wantErr || got != c.want {
				t.Errorf("statCPUTicks = %d, %v; want %d, error %v", got, err, c.want, c.wantErr)
			}
		})
	}
}

// TestCPUTime checks that this process's CPU time, read from /proc, grows
// while it spins, and by no more than the wall time on every core.
func TestCPUTime(t *testing.T) {
	pid := os.Getpid()
	before, err := cpuTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for x := 0; time.Since(start) < 300*time.Millisecond; x++ {
	}
	after, err := cpuTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	wall := time.Since(start)
	if d := after - before; d <= 0 || d > wall*time.Duration(runtime.NumCPU())+20*time.Millisecond {
		t.Errorf("spinning for %v used %v of CPU", wall, d)
	}
}
