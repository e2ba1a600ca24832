// Package controlplane is the control-plane part of the bench (Run):
// services × endpoints in a real API server, programmed by uproxy, by
// kube-proxy in iptables and nftables modes, and by the harness's own
// iptables-restore of the same rules, for the time to program them all,
// endpoint changes timed to traffic, the rules and the proxies' memory.
package controlplane
