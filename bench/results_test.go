package main

import (
	"io/fs"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestResultsFileTypes keeps bench/results to reports, raw results and
// charts: a process log or a configuration kept there is either text the
// Markdown should quote or a record the JSON should hold.
func TestResultsFileTypes(t *testing.T) {
	var other []string
	err := filepath.WalkDir("results", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		switch filepath.Ext(path) {
		case ".md", ".json", ".png":
		default:
			other = append(other, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string(nil), other); diff != "" {
		t.Errorf("files in bench/results that are not .md, .json or .png (-want +got):\n%s", diff)
	}
}

// TestLogDirOutsideResults keeps a timed-out proxy's log out of the
// results folder and out of the report's data folder.
func TestLogDirOutsideResults(t *testing.T) {
	results, err := filepath.Abs("results")
	if err != nil {
		t.Fatal(err)
	}
	for _, out := range []string{results, t.TempDir()} {
		cfg := Config{Out: out, Stem: "2026-12-01-vm"}
		for _, dir := range []string{cfg.Out, cfg.dataDir()} {
			if rel, err := filepath.Rel(dir, logDir(cfg)); err != nil || !strings.HasPrefix(rel, "..") {
				t.Errorf("--out %s: the logs go to %s, inside %s (%v)", out, logDir(cfg), dir, err)
			}
		}
		if !strings.Contains(logDir(cfg), cfg.Stem) {
			t.Errorf("--out %s: the logs' folder %s does not name the report %s", out, logDir(cfg), cfg.Stem)
		}
	}
}
