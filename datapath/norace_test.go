//go:build !race

package datapath

// raceEnabled: the race detector is on (see race_test.go).
const raceEnabled = false
