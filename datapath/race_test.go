//go:build race

package datapath

// raceEnabled: the race detector is on. sync.Pool then drops a quarter
// of what is put back, at random, so counts of allocations around a
// pool say nothing.
const raceEnabled = true
