// Package redirect puts uproxy's interception rules into the kernel and
// keeps them there.
//
// uproxy listens for each service port on a local port of the node. In the
// nat table, the chain UPROXY-SERVICES holds one REDIRECT rule per service
// port (VIP, protocol, port → local listener port), and the built-in chains
// PREROUTING (traffic from pods and routed through the node) and OUTPUT
// (traffic from the node itself) jump to it. Its last rules jump to
// UPROXY-NODEPORTS, which redirects node ports on the node's own
// addresses. The listener finds out which service a connection was for
// with OriginalDst.
//
// In tproxy mode (Rules.TProxy), the nat chains stay empty: in the mangle
// table, UPROXY-TPROXY (jumped to from PREROUTING) hands the same traffic
// by TPROXY to listeners on the loopback address with its destination
// unchanged, and UPROXY-TPROXY-OUTPUT (from OUTPUT) sends the node's own
// through lo to meet it; see "Tproxy mode" below. Mangle sees every packet, not
// only a connection's first, so there the per-service rules stand in
// UPROXY-TPROXY-SERVICES-TCP and -UDP and UPROXY-TPROXY-NODEPORTS-TCP and
// -UDP, behind lookups in the service and node-port sets of the shared
// layout, which hold the same destinations. That mode also needs the policy
// routing of Routing, which the caller installs and removes. In redirect
// mode the mangle chains exist, empty, and nothing jumps to them.
//
// In the shared layout (Rules.Shared), for a proxy with one listener per
// family and protocol, the rules do not name the services: every service
// address and port of a family is a member of one kernel set
// (uproxy-services4 or uproxy-services6, hash:ip,port), every node port
// of a bitmap:port set per family and protocol (uproxy-nodeports-tcp4
// ...), and UPROXY-SERVICES holds one REDIRECT per protocol that matches
// the service set, UPROXY-NODEPORTS one per protocol that matches the
// node-port set (tproxy mode: one TPROXY each in UPROXY-TPROXY, one MARK
// per protocol in UPROXY-TPROXY-OUTPUT). A new service is one ipset add,
// and no rule is rewritten. Intercepts that a Firewall guards keep a
// rule per allowed source prefix, before the set's rule; see "The shared
// layout" below.
//
// In the filter table, the chain UPROXY-FIREWALL, jumped to from INPUT,
// FORWARD and OUTPUT by each connection's first packet (conntrack state
// NEW or UNTRACKED), drops what a LoadBalancer's source ranges exclude
// and every connection that reaches a listener port without having been
// redirected. The listener ports are members of kernel sets (ipset
// bitmap:port), one per family and protocol, so that this guard is one
// rule per protocol however many listeners there are.
//
// Render turns the wanted Rules into iptables-restore --noflush input, a
// pure function, and RenderSetUpdate the changes of the sets (listener
// ports, and the shared layout's services and node ports) into ipset
// restore input. A Syncer writes only what differs from the last
// successful write, and on a full (periodic) sync reads the kernel back
// with iptables-save and ipset save and repairs drift. Cleanup removes
// everything uproxy created. Every chain uproxy owns is described once, in
// the chain table in render.go, and every set in the set table in sets.go;
// Render, Sync and Cleanup all walk them.
//
// ServiceRules builds the Rules from the destinations that the proxy's
// service ports claim, and decides which of two claims on one
// destination wins. MatchingRules reads back which of the rules in the
// kernel, and which set memberships, catch a given destination, for
// uproxy explain.
//
// The package is Linux-only: it drives iptables and ipset and reads
// conntrack.
//
// # Syncing
//
// The listener ports are members of kernel sets, one per protocol (see
// the set table in sets.go), which the listener guards match, and so, in
// the shared layout (Rules.Shared), are the service addresses and ports
// and the node ports, which the shared rules match; a set exists only
// while it has members. Syncer.Sync writes the sets with ipset restore
// before iptables-restore, so that every set a rule names exists, and
// destroys a set that is no longer needed after it, once no rule names
// it. In the shared layout, a change of services alone is an ipset
// restore of exactly the members added and deleted, and no
// iptables-restore: the rules change only when a protocol gains its first
// or loses its last member.
//
// A sync that is not full, when the rendering of the rules and the sets
// they ask for equal the last successful write, runs nothing at all.
// When they differ, it runs one ipset restore with exactly the creates,
// adds and deletes between the last write and the new rules
// (RenderSetUpdate) if the sets differ, one iptables-restore --noflush if
// the rendering differs, and one ipset destroy per set no longer needed.
//
// A full sync (the periodic resync) reads uproxy's chains back with
// iptables-save and its sets with ipset save, and writes only what
// differs, so a resync of an unchanged kernel writes nothing: a set
// destroyed or emptied by hand is created or filled again, stray members
// are deleted. Then it inserts any missing jump rule at position 1 of its
// built-in chain (never a second copy), and deletes the jumps of earlier
// versions and, in redirect mode, those to tproxy mode's mangle chains.
//
// Families is the proxier's rule syncer: it turns the service ports'
// claims into Rules (ServiceRules), and syncs them with one Syncer per
// family, side by side, each after its family's TPROXY policy routing in
// tproxy mode.
//
// # The firewall chain
//
// The filter hooks run after nat's (NF_IP_PRI_FILTER 0 after
// NF_IP_PRI_NAT_DST -100 at PREROUTING and OUTPUT), so UPROXY-FIREWALL
// sees a redirected packet with its new, local destination. INPUT sees
// what is addressed to the node, FORWARD what a pod sends to a guarded
// address that is routed on, OUTPUT what the node itself sends.
//
// Only a connection's first packet jumps, as in kube-proxy's
// KUBE-PROXY-FIREWALL: every rule of the chain drops a packet that starts
// a connection, and a connection whose first packet was dropped never
// gets further (a dropped packet's conntrack entry is never confirmed, so
// the next one is NEW again). Untracked packets, which no REDIRECT can
// have rewritten, jump too. Every other packet that enters, crosses or
// leaves the node, pod traffic included, then costs one native "ct state"
// comparison instead of the set lookup and compat matches of the chain.
//
// A firewall's DROP matches its own destination. A packet that
// UPROXY-SERVICES redirected has had its destination rewritten to a local
// address by the time the filter hooks see it, so only the packets that
// no allowed source prefix redirected still carry it.
//
// The listener guard of a protocol drops a packet whose destination port
// is in the protocol's listener set, on a local address, unless its
// conntrack entry records a destination NAT: REDIRECT is a DNAT to an
// address of the incoming interface (127.0.0.1 or ::1 from OUTPUT;
// nf_nat_redirect.c) and sets IPS_DST_NAT on the connection, which
// "--ctstate DNAT" tests for every packet of it. "--dst-type LOCAL" keeps
// the guard away from traffic that only passes through (FORWARD) or
// leaves (OUTPUT) the node, such as a pod's connection to another pod
// that listens on the same port number. Replies to the node's own
// connections are not caught either: the kernel picks no ephemeral port
// that a bound socket holds. The guard is one rule per protocol, whose
// set lookup costs the same for one listener or thousands. Its matches
// are in the order iptables-save prints them; the set match tests the
// cheap port bit before addrtype's route lookup and conntrack's state.
//
// # The shared layout
//
// The shared layout keeps the number of rules constant as services come
// and go: the proxy has one listener per family and protocol, so every
// service address and port of a family goes into one kernel set
// (hash:ip,port, matched "dst,dst": destination address, protocol and
// destination port), every node port into a bitmap:port set per family
// and protocol, and one rule per protocol and set sends what the set
// matches to the protocol's listener. Adding or removing a service is
// then one ipset add or del, and iptables-restore runs only when a
// protocol gains its first or loses its last member.
//
// An intercept that a Firewall guards stays out of the set and keeps its
// rules of the per-service layout, one per allowed source prefix, before
// the set's rule: a set member would redirect every source, and the
// allowed sources of each guarded address differ. Such intercepts are
// LoadBalancer addresses with loadBalancerSourceRanges, few next to the
// services, so the rules stay nearly constant. (A hash:ip,port,net set of
// allowed sources would make them constant too, at the price of a second
// set lookup for every intercepted packet and of keeping the guarded and
// unguarded members apart.)
//
// # Tproxy mode
//
// In PREROUTING (mangle), UPROXY-TPROXY hands each intercepted
// destination and node port by TPROXY to its listener on the loopback
// address (127.0.0.1 or ::1), with the packet's destination unchanged and
// the routing mark set, so the policy routing of Routing delivers it
// locally. A listener sees the original destination as its connection's
// local address (getsockname), or, for UDP, in each datagram's
// IP_ORIGDSTADDR. Being on loopback, the listeners cannot be reached
// directly from pods.
//
// A Firewall's allowed source prefixes get one TPROXY rule each, and every
// other packet to its destination is dropped right after them: the
// destination stays the same, so the filter table could not tell the
// handed-over packets from the others, and UPROXY-FIREWALL holds no
// firewall rule in tproxy mode.
//
// Packets that belong to the proxy's transparent sockets get the mark too
// (UPROXY-TPROXY-DIVERT), and reach them instead of being routed on: the
// packets of established connections, and the replies to connections
// dialled from a client's own address. For TCP this comes first, and the
// packets leave UPROXY-TPROXY there, by goto, as in the kernel's TPROXY
// recipe (Documentation/networking/tproxy.rst: "-m socket -j DIVERT"
// first): mangle's PREROUTING sees every packet, not only a connection's
// first as nat's does, and with the socket match last each packet of an
// established connection would walk the rules of the service ports before
// its own. SYNs still go to TPROXY: TPROXY hands a SYN that meets the
// TIME_WAIT socket of an earlier connection to the listener
// (nf_tproxy_handle_time_wait4), where local delivery would leave it to
// the TIME_WAIT socket, which no listener on the service's address backs
// (the listeners are on loopback). For UDP the socket match stays last:
// the proxy's reply sockets are bound to the service address and
// connected to the client, so the clients' datagrams would match them,
// and a datagram needs TPROXY every time anyway.
//
// With per-service listeners, those rules do not stand in UPROXY-TPROXY
// itself but behind gates, kernel sets that a packet is looked up in once:
// the service set of the family (hash:ip,port) holds the destination,
// protocol and port of every intercept and firewall, and sends what it
// matches to UPROXY-TPROXY-SERVICES-TCP or -UDP, which hold the protocol's
// rules; the node-port sets (bitmap:port, one per protocol) hold the node
// ports, and send what they match to UPROXY-TPROXY-NODEPORTS-TCP or -UDP.
// A packet for no service, such as a backend's reply to a connection the
// proxy dialled from the node's address, or a pod's packet that the node
// routes on, then costs a few set lookups instead of a walk of one rule
// per service port, which would slow all of the node's traffic as
// services are added. A service's datagram walks the rules of its
// protocol only, so that the UDP services, which are few in most
// clusters, do not pay for the TCP ones. A packet of an intercept or
// firewall always ends in its protocol's services chain (a TPROXY or a
// DROP), so the intercepts keep their precedence over the node ports. In
// the shared layout the sets send their members to the shared listeners
// instead.
//
// In OUTPUT (mangle), UPROXY-TPROXY-OUTPUT marks the node's own packets to
// intercepted and guarded destinations (with per-service listeners, one
// rule per protocol that matches the service set), which reroutes them
// through lo (mangle OUTPUT re-routes a packet whose mark changed), so
// they come back in through PREROUTING and meet TPROXY, or a firewall's
// DROP, there: TPROXY works only in PREROUTING.
//
// Bridged clients. A plain TPROXY loses the packets that reach the node
// through a Linux bridge while br_netfilter hands bridged traffic to
// iptables (net.bridge.bridge-nf-call-iptables or -ip6tables set to 1, as
// bridge CNIs and kubeadm require): br_nf_pre_routing runs PREROUTING
// while the frame is still on the bridge, ip_rcv_core (ip6_rcv_core) then
// orphans the packet, dropping the socket TPROXY chose, and ip_sabotage_in
// keeps PREROUTING from running again, so the stack finds no socket for
// the packet, which keeps its destination. UPROXY-TPROXY therefore has a
// second set of gates, after the transparent-socket rule, that match only
// there (-m physdev --physdev-is-in): what they would intercept goes to
// UPROXY-TPROXY-BRIDGED, whose TEE sends a copy from the IP layer towards
// loopback (nf_dup_ipv4, nf_dup_ipv6: untracked, through OUTPUT) and whose
// DROP ends the frame. UPROXY-TPROXY-OUTPUT marks the copy as the node's
// own traffic to a service, so it comes back through lo into PREROUTING,
// where TPROXY works; the gates skip lo, since the copy keeps the frame's
// bridge information. The later packets of a connection find its socket
// through the transparent-socket rule, before the gates. docs/modes.md
// ("Bridge CNIs") describes the choice for operators.
package redirect
