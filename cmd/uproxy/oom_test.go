package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestSetOOMScoreAdj checks that the OOM score adjustment is written as
// kube-proxy writes it, and that the default is kube-proxy's.
func TestSetOOMScoreAdj(t *testing.T) {
	tests := []struct {
		v       int32
		want    string
		wantErr string
	}{
		{-999, "-999", ""},
		{0, "0", ""},
		{1000, "1000", ""},
		{-1000, "-1000", ""},
		{-1001, "", "oom_score_adj -1001 is not in [-1000, 1000]"},
	}
	for _, tt := range tests {
		path := filepath.Join(t.TempDir(), "oom_score_adj")
		os.WriteFile(path, []byte("0\n"), 0o644)
		err := setOOMScoreAdj(path, tt.v)
		gotErr := ""
		if err != nil {
			gotErr = err.Error()
		}
		if diff := cmp.Diff(tt.wantErr, gotErr); diff != "" {
			t.Errorf("setOOMScoreAdj(%d) error (-want +got):\n%s", tt.v, diff)
		}
		if tt.wantErr != "" {
			continue
		}
		b, _ := os.ReadFile(path)
		if diff := cmp.Diff(tt.want, string(b)); diff != "" {
			t.Errorf("setOOMScoreAdj(%d) wrote (-want +got):\n%s", tt.v, diff)
		}
	}
	got, err := completeArgs(t)
	if err != nil {
		t.Fatal(err)
	}
	if got.OOM != -999 {
		t.Errorf("default OOM score adjustment %d, want kube-proxy's -999", got.OOM)
	}
}

// TestApplyOOMScoreAdjToProcess sets this process's own score through
// the kernel, as uproxy run does at startup. Without CAP_SYS_RESOURCE the
// kernel refuses a lower value, so the test raises it, which any process
// may do.
func TestApplyOOMScoreAdjToProcess(t *testing.T) {
	old, err := os.ReadFile(oomScoreAdjPath)
	if err != nil {
		t.Skipf("no %s: %v", oomScoreAdjPath, err)
	}
	cur, err := strconv.Atoi(strings.TrimSpace(string(old)))
	if err != nil {
		t.Fatal(err)
	}
	want := int32(min(cur+1, 1000))
	// Restores the old value where the kernel lets it.
	t.Cleanup(func() { os.WriteFile(oomScoreAdjPath, old, 0o644) })
	core, logs := observer.New(zap.InfoLevel)
	applyOOMScoreAdj(oomScoreAdjPath, want, zap.New(core))
	b, err := os.ReadFile(oomScoreAdjPath)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(string(b)); got != strconv.Itoa(int(want)) {
		t.Errorf("%s = %s after applyOOMScoreAdj(%d); logs: %v", oomScoreAdjPath, got, want, logs.All())
	}
	if n := logs.FilterMessage("OOM score adjustment set").Len(); n != 1 {
		t.Errorf("%d lines saying the score was set, want 1: %v", n, logs.All())
	}
	// A refused write is logged, not fatal, as in kube-proxy.
	core, logs = observer.New(zap.InfoLevel)
	applyOOMScoreAdj(filepath.Join(t.TempDir(), "missing", "oom_score_adj"), -999, zap.New(core))
	if n := logs.FilterMessage("cannot set the OOM score adjustment").Len(); n != 1 {
		t.Errorf("%d warnings for a refused write, want 1: %v", n, logs.All())
	}
}
