//go:build !race

package proxy

// raceEnabled: the race detector is on (see race_test.go).
const raceEnabled = false
