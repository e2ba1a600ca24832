package main

import (
	"io/fs"
	"path/filepath"
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
