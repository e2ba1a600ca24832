// Package results is the bench's record of a run: the figures of each
// part (DataPathResults, ControlPlaneResults, GoBenchResults) as series of
// per-run values (Series) per metric and subject, the profiles, the
// machine they were measured on (sysinfo.go) and the charts drawn from
// them (charts.go). The parts fill them in; the report reads them back
// from the JSON files they are saved as.
package results
