// Package proxy owns the Service model, its sources and change tracker,
// the sync runner, and the Proxier that publishes routing to the data path.
//
// The Proxier keeps one listener per service port and family (or hosts
// the service ports on shared listeners), and hands each one to the data
// path with an immutable snapshot of its routing, which it replaces
// whole at each sync that changes it.
//
// The package never touches the kernel's packet rules itself: the Proxier
// hands the intercepts it wants to a RuleSyncer, which the command wires to
// the redirect package.
//
// # A shared listener's ports
//
// A shared TCP listener in redirect mode listens on sharedRedirectPorts
// consecutive ports, behind one REDIRECT --to-ports range. Why more than
// one: REDIRECT rewrites every service's destination to the listener's
// address and port, so a client's connections to two services from the same
// source port have the same tuple on the node. When the endpoint closes
// first, uproxy passes its FIN on, and the node's socket keeps that tuple in
// TIME_WAIT. The client's next SYN from the port, to another service,
// carries timestamps from another offset (Linux draws the offset per address
// pair, secure_tcp_ts_off), so PAWS rejects it half of the time
// (TcpExtPAWSTimewait) and the connection waits for the client to retransmit
// it. Given a range, the kernel's NAT picks a port whose reply tuple
// conntrack does not hold (nf_nat_l4proto_unique_tuple), so the SYN finds no
// TIME_WAIT socket, as long as conntrack keeps closed connections as long as
// TCP does (nf_conntrack_tcp_timeout_time_wait, 120 s by default, against
// TIME_WAIT's 60 s). Under TPROXY the tuple keeps the service address, so
// one port does.
//
// The figures behind these choices are in docs/performance.md.
package proxy
