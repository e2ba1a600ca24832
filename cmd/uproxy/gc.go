package main

import (
	"os"
	"runtime/debug"
)

// startupGCPercent is the collector's target (GOGC) until the first sync
// has ended. Until then the heap grows from nothing to its working size,
// and at the default target of 100 the collector runs all along: a
// higher target shortens a large first sync for a little more peak
// memory (see docs/performance.md).
const startupGCPercent = 400

// startupGC raises the collector's target to startupGCPercent and returns
// the function that puts the previous one back, to be called once the
// first sync has ended. A GOGC in the environment is the operator's
// choice, and left alone.
//
// Putting the target back also calls release (debug.FreeOSMemory) on a
// goroutine of its own, which ends when release returns. The higher
// target let the heap grow to several times the working set during the
// first sync, and the runtime's scavenger hands such idle memory back
// to the kernel only slowly: without release, the node agent would hold
// its startup peak long after it (#31). The sync goroutine that calls
// restore does not wait for the collection.
func startupGC(release func()) (restore func()) {
	if _, set := os.LookupEnv("GOGC"); set {
		return func() {}
	}
	prev := debug.SetGCPercent(startupGCPercent)
	return func() {
		debug.SetGCPercent(prev)
		go release()
	}
}
