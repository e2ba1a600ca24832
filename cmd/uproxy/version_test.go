package main

import (
	"runtime/debug"
	"testing"
)

func TestFormatVersion(t *testing.T) {
	info := func() (*debug.BuildInfo, bool) {
		return &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "0123abc"}}}, true
	}
	none := func() (*debug.BuildInfo, bool) { return nil, false }
	for _, tt := range []struct {
		name, stamp string
		read        func() (*debug.BuildInfo, bool)
		want        string
	}{
		{"stamped by make", "v0.4.0-12-g0123abc", info, "v0.4.0-12-g0123abc 0123abc go1.26.8"},
		{"go build", "", info, "(devel) 0123abc go1.26.8"},
		{"no build information", "v0.4.0", none, "v0.4.0"},
		{"nothing", "", none, "(unknown)"},
	} {
		if got := formatVersion(tt.stamp, tt.read); got != tt.want {
			t.Errorf("%s: formatVersion = %q, want %q", tt.name, got, tt.want)
		}
	}
}
