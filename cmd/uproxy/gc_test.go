package main

import (
	"os"
	"runtime/debug"
	"testing"
	"time"
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
	released := make(chan struct{}, 2)
	release := func() { released <- struct{}{} }
	restore := startupGC(release)
	if got := gcPercent(); got != startupGCPercent {
		t.Errorf("during the first sync the target is %d, want %d", got, startupGCPercent)
	}
	select {
	case <-released:
		t.Errorf("the startup heap was released before the first sync ended")
	default:
	}
	restore()
	if got := gcPercent(); got != before {
		t.Errorf("after the first sync the target is %d, want %d back", got, before)
	}
	select {
	case <-released:
	case <-time.After(10 * time.Second):
		t.Errorf("after the first sync the startup heap was not released")
	}

	t.Setenv("GOGC", "50")
	restore = startupGC(release)
	if got := gcPercent(); got != before {
		t.Errorf("with GOGC set, the target became %d; want it left at %d", got, before)
	}
	select {
	case <-released:
		t.Errorf("with GOGC set, the startup heap was released before the first sync ended")
	default:
	}
	restore()
	if got := gcPercent(); got != before {
		t.Errorf("with GOGC set, restoring made the target %d; want %d", got, before)
	}
	// The operator's target still lets the first sync's heap grow past
	// the working set, which the runtime would keep for long.
	select {
	case <-released:
	case <-time.After(10 * time.Second):
		t.Errorf("with GOGC set, the startup heap was not released after the first sync")
	}
}
