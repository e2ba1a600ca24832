package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"go.uber.org/zap"
)

// oomScoreAdjPath is where a process sets its own OOM score adjustment.
const oomScoreAdjPath = "/proc/self/oom_score_adj"

// setOOMScoreAdj writes v to path (an oom_score_adj file) and reads it
// back: the kernel clamps nothing in [-1000, 1000], but lowering the value
// needs CAP_SYS_RESOURCE, and a write it refuses fails with EACCES.
func setOOMScoreAdj(path string, v int32) error {
	if v < -1000 || v > 1000 {
		return fmt.Errorf("oom_score_adj %d is not in [-1000, 1000]", v)
	}
	if err := os.WriteFile(path, []byte(strconv.Itoa(int(v))), 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("reading %s back: %w", path, err)
	}
	if got := strings.TrimSpace(string(b)); got != strconv.Itoa(int(v)) {
		return fmt.Errorf("%s is %s after writing %d", path, got, v)
	}
	return nil
}

// applyOOMScoreAdj sets uproxy's OOM score adjustment, as kube-proxy does
// (-999 by default): under memory pressure the kernel should kill a pod
// before the proxy that every pod's Services depend on. A failure is
// logged, not fatal, as in kube-proxy: an unprivileged test run must
// still work.
func applyOOMScoreAdj(path string, v int32, log *zap.Logger) {
	if err := setOOMScoreAdj(path, v); err != nil {
		log.Warn("cannot set the OOM score adjustment", zap.Int32("oomScoreAdj", v), zap.Error(err))
		return
	}
	log.Info("OOM score adjustment set", zap.Int32("oomScoreAdj", v))
}
