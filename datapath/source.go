package datapath

import "net/netip"

// SourceIP is a service port's choice of the address its backends see a
// connection or flow come from. The zero value is SourceAsKubeProxy.
type SourceIP uint8

const (
	// SourceAsKubeProxy: the client's own address wherever kube-proxy's
	// DNAT would leave it (KeepClient), else the node's.
	SourceAsKubeProxy SourceIP = iota
	// SourceClient: the client's own address whatever kube-proxy would
	// do, unless the client is the node itself
	// (uproxy.io/preserve-source-ip "true").
	SourceClient
	// SourceNode: always the node's address
	// (uproxy.io/preserve-source-ip "false").
	SourceNode
	numSourceIPs
)

var sourceIPNames = [numSourceIPs]string{SourceAsKubeProxy: "as kube-proxy", SourceClient: "client", SourceNode: "node"}

// String names the choice.
func (s SourceIP) String() string {
	if s >= numSourceIPs {
		return "SourceIP(?)"
	}
	return sourceIPNames[s]
}

// Clients tells the data path where a client is, by its address. The
// proxy owns it; its methods are called from every event loop and
// listener goroutine at once, so they must be safe for concurrent use
// and cheap.
type Clients interface {
	// Node reports whether addr is one of the node's own addresses,
	// loopback included.
	Node(addr netip.Addr) bool
	// Pod reports whether addr is in the cluster's pod networks, as
	// kube-proxy's --detect-local-mode tells them; known is false when
	// none is configured.
	Pod(addr netip.Addr) (pod, known bool)
}

// internal reports whether client is a pod or the node itself, which
// externalTrafficPolicy Local sends to the cluster endpoints.
func internal(c Clients, client netip.Addr) bool {
	if c == nil {
		return false
	}
	if c.Node(client) {
		return true
	}
	pod, _ := c.Pod(client)
	return pod
}

// KeepClient reports whether a connection or flow from client, sent to
// the service port's cluster IP (toClusterIP) or to one of its external
// addresses, is dialled from the client's own address: exactly where
// kube-proxy's DNAT leaves the source alone, so that NetworkPolicy and
// the backends see what they would under kube-proxy. kube-proxy
// masquerades everything with --masquerade-all (masqueradeAll), traffic
// from outside the pod networks to a cluster IP when it knows them,
// external traffic under externalTrafficPolicy Cluster (it may cross
// nodes), and the node's own (its address is the source anyway); and a
// hairpin, a client that is its own backend, which the caller checks
// once it has picked one. src overrides the rule, but never makes the
// node a transparent client. A nil c keeps no client's address. The
// data path and Explain both decide with it.
func KeepClient(src SourceIP, masqueradeAll bool, pol Policy, toClusterIP bool, client netip.Addr, c Clients) bool {
	if c == nil || !client.IsValid() || c.Node(client) {
		return false
	}
	switch src {
	case SourceNode:
		return false
	case SourceClient:
		return true
	}
	if masqueradeAll {
		return false
	}
	if toClusterIP {
		pod, known := c.Pod(client)
		return pod || !known
	}
	// externalTrafficPolicy Local: a pod's traffic short-circuits to the
	// cluster endpoints unmasqueraded, and an outside client's stays on
	// this node.
	return pol.ExternalLocal
}

// forgedLoopback reports whether a client with a loopback address sent to
// dst, a known destination that is not loopback. The kernel routes a
// loopback source to loopback destinations only (ip_route_output refuses
// the others, and ip_route_input drops them as martians), but in tproxy
// mode a pod's bridged frame re-enters through lo (the TEE path), where
// those checks do not apply: such a packet is forged, and serving it
// would send the backend's replies to the node's loopback services.
func forgedLoopback(client netip.Addr, dst netip.AddrPort) bool {
	return dst.IsValid() && client.Unmap().IsLoopback() && !dst.Addr().Unmap().IsLoopback()
}
