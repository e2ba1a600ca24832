// Package redirect puts uproxy's interception rules into the kernel and
// keeps them there: iptables chains of its own (UPROXY-*), ipset sets, the
// TPROXY policy route, and reads and deletions of conntrack entries. It
// knows nothing of Kubernetes. docs/rules.md explains the chains, the
// layouts and the kernel behaviour each rule relies on.
//
// Where to look:
//   - redirect.go: Rules, the wanted state (InterceptRule, NodePort, Firewall,
//     Reject, Listener), and its validation.
//   - services.go: ServiceRules, from the destinations the proxy's service
//     ports claim (Intercept) to Rules, and which of two claims wins.
//   - render.go: Render, Rules to iptables-restore input, a pure function
//     with golden files in testdata; the chain table every chain is
//     described in once.
//   - sets.go, shared.go: the kernel sets, RenderSetUpdate, and the shared
//     layout's constant rules.
//   - tproxy.go, routing.go: tproxy mode's mangle rules and its policy
//     routing (TProxy, Routing).
//   - sync.go, readahead.go, memo.go: Syncer, which writes only what
//     changed and repairs drift on a full sync; Cleanup.
//   - families.go: Families, one Syncer per IP family.
//   - origdst.go, conntrack.go: a connection's original destination
//     (OriginalDst, TProxyDst, ConntrackLookup).
//   - stale.go, conntrack_netlink.go: StaleConntrack, which deletes the UDP
//     conntrack entries that keep flows from the rules (NetlinkConntrack).
//   - explain.go: MatchingRules, the rules that catch a destination.
//   - previous.go, kubeproxy.go: reading a previous uproxy's rules, and
//     removing kube-proxy's.
//
// Everything here is Linux-only.
package redirect
