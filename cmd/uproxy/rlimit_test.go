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

func TestUDPMaxFlows(t *testing.T) {
	for _, tt := range []struct {
		name   string
		flag   int
		noFile uint64
		want   int
	}{
		{"a large limit", 0, 1 << 20, 65536},
		{"half of a small limit", 0, 20000, 10000},
		{"an unknown limit", 0, 0, 65536},
		{"a limit of one", 0, 1, 1},
		{"the flag, above the limit", 100000, 20000, 100000},
		{"the flag, below it", 500, 1 << 20, 500},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := udpMaxFlows(tt.flag, tt.noFile); got != tt.want {
				t.Errorf("udpMaxFlows(%d, %d) = %d, want %d", tt.flag, tt.noFile, got, tt.want)
			}
		})
	}
}

func TestUDPPoolMax(t *testing.T) {
	for _, tt := range []struct {
		name   string
		flag   int
		noFile uint64
		want   int
	}{
		{"a large limit", 0, 1 << 20, 4096},
		{"a quarter of a small limit", 0, 4000, 1000},
		{"an unknown limit", 0, 0, 4096},
		{"a limit of one", 0, 1, 1},
		{"the flag", 10000, 4000, 10000},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := udpPoolMax(tt.flag, tt.noFile); got != tt.want {
				t.Errorf("udpPoolMax(%d, %d) = %d, want %d", tt.flag, tt.noFile, got, tt.want)
			}
		})
	}
}
