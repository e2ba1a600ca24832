package controlplane

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/bench/internal/harness"
)

// TestLogDirOutsideResults keeps a timed-out proxy's log out of the
// results folder and out of the report's data folder.
func TestLogDirOutsideResults(t *testing.T) {
	results, err := filepath.Abs("results")
	if err != nil {
		t.Fatal(err)
	}
	for _, out := range []string{results, t.TempDir()} {
		cfg := harness.Config{Out: out, Stem: "2026-12-01-vm"}
		for _, dir := range []string{cfg.Out, cfg.DataDir()} {
			if rel, err := filepath.Rel(dir, logDir(cfg)); err != nil || !strings.HasPrefix(rel, "..") {
				t.Errorf("--out %s: the logs go to %s, inside %s (%v)", out, logDir(cfg), dir, err)
			}
		}
		if !strings.Contains(logDir(cfg), cfg.Stem) {
			t.Errorf("--out %s: the logs' folder %s does not name the report %s", out, logDir(cfg), cfg.Stem)
		}
	}
}
