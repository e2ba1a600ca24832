// Package introspect is what uproxy shows of itself: the Inspector answers
// `uproxy status` (Status) and `uproxy explain` (Explain) from the entries
// each sync stores per service (Table), and Metrics keeps the Prometheus
// metrics, kube-proxy's names among them, that /metrics serves.
//
// It reads the routing the proxier built (package routing) and the data
// path's live counters; it changes neither.
package introspect
