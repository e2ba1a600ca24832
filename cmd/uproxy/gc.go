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
// restore also calls release (debug.FreeOSMemory) on a goroutine of its
// own, which ends when release returns, whether or not GOGC is set. The
// first sync builds the whole model at once, and at any target the heap
// then grows past the working set: the objects as the API server sends
// them, before they are trimmed, and the previous collections' garbage.
// The runtime's scavenger hands such idle memory back to the kernel only
// slowly: without release, the node agent would hold its startup peak
// long after it. The sync goroutine that calls restore does not
// wait for the collection.
func startupGC(release func()) (restore func()) {
	if _, set := os.LookupEnv("GOGC"); set {
		return func() { go release() }
	}
	prev := debug.SetGCPercent(startupGCPercent)
	return func() {
		debug.SetGCPercent(prev)
		go release()
	}
}
