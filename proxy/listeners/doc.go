// Package listeners opens, adopts and closes the listening sockets of the
// service ports: one per service port and family (Key), or, in the shared
// layout, one per protocol and family that hosts every service port of it.
//
// Where to look:
//   - listener.go: Listener, and the Manager that opens them (Bind, then
//     Start, which may run on other goroutines), bounds their number
//     (Config.MaxListeners) and closes them;
//   - quota.go: the quotas per Service and per namespace that share the
//     budget out (Config.MaxPerService, Config.MaxPerNamespace);
//   - ports.go: the ports they bind, from --proxy-port-range or the
//     kernel's own range, of which they hold at most half (PortRange,
//     ParsePortRange);
//   - shared.go: the shared listeners and their range of ports under
//     REDIRECT (docs/modes.md says why a range);
//   - handover.go: sockets exported to, and adopted from, the process
//     before or after this one (HandoverSocket, Inherited).
//
// The package knows sockets, not routing: the proxier builds what each
// listener serves and publishes it through the data path's Listener.
package listeners
