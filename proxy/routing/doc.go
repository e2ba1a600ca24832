// Package routing holds what a listener serves, as the proxier built it at
// its last sync: a Snapshot (the data path's routing, with the service port
// and endpoints it came from) and the Intercepts, the destinations whose
// traffic the kernel's rules must deliver to the listener.
//
// Snapshots are immutable and replaced whole; the proxier builds them,
// the data path and the introspection read them.
package routing
