// Package changes records what the sources report and runs the syncs that
// apply it: the Tracker keeps the valid Services and EndpointSlices and the
// names of those changed since the last sync (Take), and the Runner calls
// the sync function within its minimum and maximum intervals, retrying a
// failed run as a full one with backoff.
//
// Event handlers only record; only the Runner's goroutine syncs, and never
// before both initial lists have arrived (Tracker.Synced).
package changes
