// Package upgrade owns uproxy's hitless upgrade: the protocol by which a
// new `uproxy run` takes the running one's listening sockets over.
//
// As with HAProxy's -x and Envoy's hot restart, the kernel's rules name
// the same ports before and after, so that no connection attempt is
// refused while the binary changes.
//
// The protocol, in brief (docs/upgrade-protocol.md has it in full, with
// its failure handling, and changes with this package):
//
//   - The running ("old") process listens on a SOCK_SEQPACKET socket, mode
//     0600. Each packet is one JSON Message of at most maxMessage bytes; descriptors
//     travel as SCM_RIGHTS on the packet that lists them, at most 64 each.
//   - The starting ("new") process connects and sends hello (its version,
//     pid, network namespace and mode). Old checks the peer's uid and
//     network namespace as the kernel gives them (SO_PEERCRED and
//     /proc/<pid>/ns/net), not as the hello claims: a peer of another user
//     gets no answer, one of another namespace an offer refusing it.
//   - Old pauses its sync loop, so that its listeners stay the ones it
//     exports, and answers offer with the count of sockets to come, then
//     sockets messages: the service listeners, the HTTP servers' sockets
//     and the upgrade socket itself. An offer with an error, or another
//     version or mode, makes new ask for a release and start cold; old
//     answers released once its sockets are closed.
//   - New adopts the sockets, and sends ready after its first sync. Old
//     then closes its descriptors and drains. Past its ready time-out old
//     sends abort, closes the connection and syncs again; new, seeing the
//     abort, exits. The connection's end without an abort (old was killed,
//     or stopped on a signal) leaves new serving: old's offer says it
//     sends aborts, and an offer of an older version, which does not, makes
//     new take any end for an abort.
//
// The handshake time-out bounds the exchange up to the sockets' arrival.
// An Upgrader runs both sides; SyncLoop lets it pause the proxier's sync
// loop.
package upgrade
