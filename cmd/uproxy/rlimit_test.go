package main

import (
	"errors"
	"syscall"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestRaiseNoFile(t *testing.T) {
	for _, tt := range []struct {
		name      string
		start     syscall.Rlimit
		canRaise  bool // may raise the hard limit (CAP_SYS_RESOURCE)
		want      uint64
		wantLimit syscall.Rlimit
	}{
		{"privileged", syscall.Rlimit{Cur: 1024, Max: 4096}, true, wantNoFile, syscall.Rlimit{Cur: wantNoFile, Max: wantNoFile}},
		{"unprivileged: soft up to hard", syscall.Rlimit{Cur: 1024, Max: 20000}, false, 20000, syscall.Rlimit{Cur: 20000, Max: 20000}},
		{"already high", syscall.Rlimit{Cur: 2 * wantNoFile, Max: 2 * wantNoFile}, false, 2 * wantNoFile, syscall.Rlimit{Cur: 2 * wantNoFile, Max: 2 * wantNoFile}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			lim := tt.start
			get := func(_ int, l *syscall.Rlimit) error { *l = lim; return nil }
			set := func(_ int, l *syscall.Rlimit) error {
				if l.Max > lim.Max && !tt.canRaise {
					return syscall.EPERM
				}
				lim = *l
				return nil
			}
			got, err := raiseNoFile(set, get)
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.want {
				t.Errorf("raiseNoFile() = %d, want %d", got, tt.want)
			}
			if diff := cmp.Diff(tt.wantLimit, lim); diff != "" {
				t.Errorf("limit (-want +got):\n%s", diff)
			}
		})
	}
	get := func(int, *syscall.Rlimit) error { return errors.New("no") }
	if _, err := raiseNoFile(nil, get); err == nil {
		t.Error("raiseNoFile() with a failing getrlimit: no error")
	}
}

// boundCase is a case of TestDescriptorBounds.
type boundCase struct {
	name   string
	flag   int
	noFile uint64
	want   int
}

// TestDescriptorBounds checks the bounds derived from the open-files
// limit, each the flag's value when it is set.
func TestDescriptorBounds(t *testing.T) {
	for _, b := range []struct {
		name  string
		bound func(flag int, noFile uint64) int
		cases []boundCase
	}{
		{"udpMaxFlows", udpMaxFlows, []boundCase{
			{"a large limit", 0, 1 << 20, 65536},
			{"half of a small limit", 0, 20000, 10000},
			{"an unknown limit", 0, 0, 65536},
			{"a limit of one", 0, 1, 1},
			{"the flag, above the limit", 100000, 20000, 100000},
			{"the flag, below it", 500, 1 << 20, 500},
		}},
		{"udpPoolMax", udpPoolMax, []boundCase{
			{"a large limit", 0, 1 << 20, 4096},
			{"a quarter of a small limit", 0, 4000, 1000},
			{"an unknown limit", 0, 0, 4096},
			{"a limit of one", 0, 1, 1},
			{"the flag", 10000, 4000, 10000},
		}},
		{"maxListeners", maxListeners, []boundCase{
			{"an eighth of a large limit kept", 0, 1 << 20, 1<<20 - 1<<17},
			{"1,024 of a mid limit kept", 0, 4096, 3072},
			{"half of a small limit kept", 0, 1024, 512},
			{"a limit of one", 0, 1, 1},
			{"an unknown limit: no bound", 0, 0, 0},
			{"the flag", 100, 4096, 100},
			{"-1: no bound", -1, 4096, 0},
		}},
		{"maxConnections", maxConnections, []boundCase{
			{"half of a large limit less an eighth", 0, 1 << 20, (1<<20 - 1<<17) / 2},
			{"half of a mid limit less 1,024", 0, 4096, 1536},
			{"a quarter of a small limit", 0, 1024, 256},
			{"a limit of one", 0, 1, 1},
			{"an unknown limit: no bound", 0, 0, 0},
			{"the flag", 100, 4096, 100},
			{"-1: no bound", -1, 4096, 0},
		}},
		{"maxConnectionsPerPort", func(flag int, total uint64) int { return maxConnectionsPerPort(flag, int(total)) }, []boundCase{
			{"a quarter of the bound across services", 0, 1536, 384},
			{"a bound of one", 0, 1, 1},
			{"no bound across services: none", 0, 0, 0},
			{"the flag", 100, 1536, 100},
			{"-1: no bound", -1, 1536, 0},
		}},
	} {
		for _, tt := range b.cases {
			t.Run(b.name+"/"+tt.name, func(t *testing.T) {
				if got := b.bound(tt.flag, tt.noFile); got != tt.want {
					t.Errorf("%s(%d, %d) = %d, want %d", b.name, tt.flag, tt.noFile, got, tt.want)
				}
			})
		}
	}
}
