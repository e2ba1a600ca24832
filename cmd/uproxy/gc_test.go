package main

import (
	"os"
	"runtime/debug"
	"testing"
)

// gcPercent returns the collector's current target.
func gcPercent() int {
	p := debug.SetGCPercent(100)
	debug.SetGCPercent(p)
	return p
}

func TestStartupGC(t *testing.T) {
	before := gcPercent()
	t.Setenv("GOGC", "")
	os.Unsetenv("GOGC") // t.Setenv restores it afterwards
	restore := startupGC()
	if got := gcPercent(); got != startupGCPercent {
		t.Errorf("during the first sync the target is %d, want %d", got, startupGCPercent)
	}
	restore()
	if got := gcPercent(); got != before {
		t.Errorf("after the first sync the target is %d, want %d back", got, before)
	}

	t.Setenv("GOGC", "50")
	restore = startupGC()
	if got := gcPercent(); got != before {
		t.Errorf("with GOGC set, the target became %d; want it left at %d", got, before)
	}
	restore()
	if got := gcPercent(); got != before {
		t.Errorf("with GOGC set, restoring made the target %d; want %d", got, before)
	}
}
