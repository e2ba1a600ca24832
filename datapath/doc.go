// Package datapath owns the data path: the event loops (epoll, io_uring),
// TCP sessions and UDP flows, routed by the snapshots the proxier
// publishes.
//
// The control plane (package proxy) binds each listener, hands it to an
// Engine and publishes its routing in it: a Snapshot, immutable, replaced
// whole, which the data path reads without locks and decides with
// (Snapshot.Route). The package imports nothing of Kubernetes.
// docs/datapath.md explains the loops, their accept and their io_uring.
//
// Where to look:
//   - engine.go: Engine and Config, the data path's knobs and test seams;
//     the Engine's TCP part is tcpProxy (tcp.go), its UDP part udpRelay
//     (udp.go, udppool.go).
//   - snapshot.go: Snapshot, a service port's routing, and Policy.
//   - loop.go: the event loops and their poller (epoll, or the loop's
//     io_uring in loopring.go, which also carries small messages); a
//     loop's parts are loopTCP (loopsession.go), loopFlows (loopflow.go)
//     and loopAccept (accept.go).
//   - tcp.go: accepting a TCP connection and handing it to a loop;
//     loopsession.go and splice.go: the copying (splice(2) and a pooled
//     pipe for bulk, a buffer for small messages).
//   - dial.go, dialerr.go: the dial to a backend, and whose fault a
//     failed attempt is.
//   - udp.go, udpsock.go, udppool.go: UDP listeners, flows, and the
//     request-reply pool.
//   - listener.go: Listener, and the shared layout's routing table.
//   - transparent.go, srcfallback.go: IP_TRANSPARENT, and dialling from
//     the client's own address.
//   - rawsock.go, rawsys.go: sockets outside the runtime's poller.
//   - limit.go, metrics.go: connection limits and the counters.
package datapath
