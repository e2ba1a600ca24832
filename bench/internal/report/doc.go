// Package report writes the bench's report (Write): the summary tables,
// each figure next to its ratio to a yardstick measured in the same run,
// the charts, the CPU profiles, "Before and after" against a baseline
// binary (compare.go), and the targets of targets.json, each read from the
// run's own figures (targets.go). It reads the parts' results (package
// results) and measures nothing itself.
package report
