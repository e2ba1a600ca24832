package main

import (
	"fmt"
	"net/netip"
	"slices"

	v1 "k8s.io/api/core/v1"
)

// nodeWatch holds what uproxy read of this node's Node object at start and
// uses: its IPs, for the nodeport keyword 'primary', and its podCIDRs,
// for detect-local mode NodeCIDR. Either is nil when uproxy does not use
// it. kube-proxy exits when either changes, so that its DaemonSet restarts
// it with the new ones; uproxy does the same, after draining.
type nodeWatch struct {
	ips                     []netip.Addr   // nil: not watched
	podCIDRs                []netip.Prefix // nil: not watched
	watchIPs, watchPodCIDRs bool
}

// changed returns why n no longer matches what uproxy started with, or
// nil. A nil n (the Node deleted) changes nothing here: /healthz reports
// it.
func (w *nodeWatch) changed(n *v1.Node) error {
	if n == nil {
		return nil
	}
	if w.watchPodCIDRs {
		var now []netip.Prefix
		for _, c := range n.Spec.PodCIDRs {
			if p, err := netip.ParsePrefix(c); err == nil {
				now = append(now, p.Masked())
			}
		}
		if !slices.Equal(now, w.podCIDRs) {
			return fmt.Errorf("this node's podCIDRs changed from %v to %v (detect-local mode NodeCIDR): exiting so that uproxy restarts with them, as kube-proxy does", w.podCIDRs, now)
		}
	}
	if w.watchIPs {
		if now := nodeIPs(n); !slices.Equal(now, w.ips) {
			return fmt.Errorf("this node's IPs changed from %v to %v (--nodeport-addresses primary): exiting so that uproxy restarts with them, as kube-proxy does", w.ips, now)
		}
	}
	return nil
}
