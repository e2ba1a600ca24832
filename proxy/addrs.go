package proxy

import (
	"net"
	"net/netip"
	"slices"
	"sync/atomic"

	"go.uber.org/zap"
)

// nodeAddrs are the node's own addresses, re-read at every sync, and the
// pod networks: what tells a pod or the node from an outside client.
// refresh runs on the sync goroutine; the rest is safe for concurrent use.
type nodeAddrs struct {
	// list returns the node's addresses; nil means those of
	// net.InterfaceAddrs (Config.LocalAddrs).
	list         func() ([]netip.Addr, error)
	clusterCIDRs []netip.Prefix
	// podNetworks are the whole cluster's pod networks (Config.PodNetworks).
	podNetworks []netip.Prefix
	log         *zap.Logger
	addrs       atomic.Pointer[[]netip.Addr] // sorted
}

// refresh re-reads the node's addresses.
func (a *nodeAddrs) refresh() {
	var addrs []netip.Addr
	if a.list != nil {
		var err error
		if addrs, err = a.list(); err != nil {
			a.log.Warn("cannot list the node's addresses", zap.Error(err))
			return
		}
	} else {
		ifAddrs, err := net.InterfaceAddrs()
		if err != nil {
			a.log.Warn("cannot list the node's addresses", zap.Error(err))
			return
		}
		for _, ia := range ifAddrs {
			if n, ok := ia.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(n.IP); ok {
					addrs = append(addrs, ip.Unmap())
				}
			}
		}
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	a.addrs.Store(&addrs)
}

// internal reports whether a client is a pod or the node itself, which
// kube-proxy sends to the cluster endpoints even when they reach a service
// through an external address with externalTrafficPolicy Local.
func (a *nodeAddrs) internal(ip netip.Addr) bool {
	pod, _ := a.Pod(ip)
	return pod || a.Node(ip)
}

// Node reports whether ip is one of the node's addresses (as of the last
// sync) or loopback (datapath.Clients).
func (a *nodeAddrs) Node(ip netip.Addr) bool {
	if ip.IsLoopback() {
		return true
	}
	if addrs := a.addrs.Load(); addrs != nil {
		_, found := slices.BinarySearchFunc(*addrs, ip, netip.Addr.Compare)
		return found
	}
	return false
}

// Pod reports whether ip is in the pod networks; known is false when
// none is configured (datapath.Clients).
func (a *nodeAddrs) Pod(ip netip.Addr) (pod, known bool) {
	for _, c := range a.clusterCIDRs {
		if c.Contains(ip) {
			return true, true
		}
	}
	return false, len(a.clusterCIDRs) > 0
}

// has reports whether ip is one of the node's addresses, as the
// last sync read them.
func (a *nodeAddrs) has(ip netip.Addr) bool {
	if addrs := a.addrs.Load(); addrs != nil {
		_, found := slices.BinarySearchFunc(*addrs, ip, netip.Addr.Compare)
		return found
	}
	return false
}

// inPodNetworks reports whether ip is in the cluster's pod networks
// (Config.PodNetworks), and whether they are known at all.
func (a *nodeAddrs) inPodNetworks(ip netip.Addr) (in, known bool) {
	for _, p := range a.podNetworks {
		if p.Contains(ip) {
			return true, true
		}
	}
	return false, len(a.podNetworks) > 0
}
