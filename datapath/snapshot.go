package datapath

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/uproxy/uproxy/balancer"
)

// Snapshot is a service port listener's routing state, which the control
// plane builds at each sync that changes it and publishes whole in the
// listener (Listener.Snap): immutable once published, read by the data
// path without locks.
type Snapshot struct {
	// Name is the service port, for logs and errors.
	Name fmt.Stringer
	// Service is the service's "namespace/name", which logs that are
	// written once per service go by; empty means none.
	Service string
	// VIP is the cluster IP and port of the listener's family.
	VIP netip.AddrPort
	// External are the external and load-balancer IPs of the family, at
	// VIP's port.
	External []netip.Addr
	// NodePort is the service port's node port; zero means none.
	NodePort uint16
	// Policy holds the traffic policies that choose between Cluster and
	// Local (Route).
	Policy Policy
	// Backends holds every backend of Cluster and Local.
	Backends []*balancer.Backend
	// Cluster and Local balance the two endpoint sets; a balancer over an
	// empty set picks nothing.
	Cluster, Local                 balancer.Balancer
	ClusterBackends, LocalBackends []*balancer.Backend
	// Metrics are the counters of the service port and of each backend;
	// nil when metrics are disabled.
	Metrics *PortMetrics
	// Affinity is the ClientIP affinity table the balancers wrap; nil
	// without session affinity. Read by Explain (Lookup has no effects).
	Affinity *balancer.AffinityTable
	// Slots counts the service port's TCP connections against
	// MaxConnections, and its UDP queries and flows for its fair share
	// of the engine's bounds; shared with the port's other listener and
	// with the snapshots before and after this one. Nil counts no
	// connections, and shares the engine's UDP bounds with every other
	// port without Slots as one port.
	Slots *ConnSlots
	// MaxConnections bounds the TCP connections of the service port,
	// MaxConnectionsPerEndpoint those to any one backend; zero means no
	// limit.
	MaxConnections, MaxConnectionsPerEndpoint int
	// ProxyProtocol is the PROXY protocol version sent to the backend
	// first: 0 (none), 1 or 2.
	ProxyProtocol int
	// SourceIP chooses the address the backends see connections and
	// flows come from (KeepClient); the zero value keeps the client's
	// where kube-proxy would.
	SourceIP SourceIP
	// UDPMode is how a UDP port carries its clients (udppool.go); the
	// zero value, UDPFlow, gives each a flow.
	UDPMode UDPMode
}

// UDPMode is how a UDP service port carries its clients. The zero
// value is UDPFlow.
type UDPMode uint8

const (
	// UDPFlow: a socket connected to the backend per client, in the flow
	// table until the UDP timeout.
	UDPFlow UDPMode = iota
	// UDPRequestReply: each datagram is a query that checks a socket out
	// of the endpoint's pool until the first reply.
	UDPRequestReply
	// UDPAuto: request-reply until the client sends a second datagram
	// from the same port soon after its first: then a flow.
	UDPAuto
	numUDPModes
)

var udpModeNames = [numUDPModes]string{UDPFlow: "flow", UDPRequestReply: "request-reply", UDPAuto: "auto"}

// String returns the mode's name, as the uproxy.io/udp-mode annotation
// spells it.
func (m UDPMode) String() string {
	if m >= numUDPModes {
		return fmt.Sprintf("UDPMode(%d)", m)
	}
	return udpModeNames[m]
}

// ParseUDPMode returns the mode that String names.
func ParseUDPMode(s string) (UDPMode, bool) {
	for m, name := range udpModeNames {
		if s == name {
			return UDPMode(m), true
		}
	}
	return UDPFlow, false
}

// Policy is a service port's traffic policies.
type Policy struct {
	// InternalLocal: internalTrafficPolicy Local. Cluster-IP traffic
	// goes only to endpoints on this node.
	InternalLocal bool
	// ExternalLocal: externalTrafficPolicy Local. External traffic
	// (node ports, external and load-balancer IPs) goes only to endpoints
	// on this node.
	ExternalLocal bool
}

// Route returns the balancer for a connection that was originally sent to
// dst by client, applying the traffic policies; nil when dst is not one of
// this service port's addresses. known is false when the original
// destination is unknown (no OriginalDst configured): the cluster IP is
// assumed.
func (s *Snapshot) Route(dst netip.AddrPort, known bool, client netip.Addr, internal func(netip.Addr) bool) balancer.Balancer {
	toClusterIP := s.ToClusterIP(dst, known)
	if !toClusterIP {
		external := (s.NodePort != 0 && dst.Port() == s.NodePort) ||
			(dst.Port() == s.VIP.Port() && slices.Contains(s.External, dst.Addr().Unmap()))
		if !external {
			return nil
		}
	}
	if PolicySet(s.Policy, toClusterIP, client, internal).Local() {
		return s.Local
	}
	return s.Cluster
}

// ToClusterIP reports whether a connection originally sent to dst was
// sent to the cluster IP, which an unknown destination (known false) is
// taken to be.
func (s *Snapshot) ToClusterIP(dst netip.AddrPort, known bool) bool {
	return !known || (dst.Addr().Unmap() == s.VIP.Addr() && dst.Port() == s.VIP.Port())
}

// RoutesAlike reports whether Route picks the same balancer, and
// KeepClient the same source address, for every address of the service
// port, whatever the client, so that a flow's original destination need
// not be known: with only a cluster IP (no node port, external or
// load-balancer IP) there is one address to route; else, without a
// Local policy every address routes to Cluster, and the source is the
// same for all when the service's annotation chooses it. Otherwise a
// pod keeps its address to the cluster IP but not to a node port.
func (s *Snapshot) RoutesAlike() bool {
	return (s.NodePort == 0 && len(s.External) == 0) || (s.Policy == (Policy{}) && s.SourceIP != SourceAsKubeProxy)
}

// EndpointSet is the traffic policies' choice of a service port's
// endpoints for one flow, with the reason for it.
type EndpointSet uint8

const (
	// ClusterSet: no Local policy applies to the flow.
	ClusterSet EndpointSet = iota
	// LocalInternal: internalTrafficPolicy Local, for traffic to the
	// cluster IP.
	LocalInternal
	// LocalExternal: externalTrafficPolicy Local, for external traffic
	// from a client outside the cluster.
	LocalExternal
	// ClusterShortCircuit: externalTrafficPolicy Local, but the client is
	// a pod or the node, which kube-proxy sends to the cluster set so that
	// a pod can reach a service whose endpoints are all on other nodes.
	ClusterShortCircuit
)

// Local reports whether the choice is the local endpoint set.
func (e EndpointSet) Local() bool { return e == LocalInternal || e == LocalExternal }

// PolicySet applies the traffic policies pol to a flow from client, sent
// to the cluster IP (toClusterIP) or to one of the external addresses (an
// external or load-balancer IP, or a node port). internal reports whether
// a client is a pod or the node; it is called only under
// externalTrafficPolicy Local. The data path (Snapshot.Route) and the
// control plane's Explain both decide with it, so that Explain reports
// what the data path does.
func PolicySet(pol Policy, toClusterIP bool, client netip.Addr, internal func(netip.Addr) bool) EndpointSet {
	switch {
	case toClusterIP && pol.InternalLocal:
		return LocalInternal
	case toClusterIP || !pol.ExternalLocal:
		return ClusterSet
	case internal(client):
		return ClusterShortCircuit
	}
	return LocalExternal
}

// serves reports whether b is one of the backends that balancer set picks
// from (the snapshot's cluster or local balancer).
func (s *Snapshot) serves(set balancer.Balancer, b *balancer.Backend) bool {
	bs := s.ClusterBackends
	if set == s.Local {
		bs = s.LocalBackends
	}
	return slices.Contains(bs, b)
}

// Backend returns the backend at addr, or nil.
func (s *Snapshot) Backend(addr netip.AddrPort) *balancer.Backend {
	for _, b := range s.Backends {
		if b.Addr == addr {
			return b
		}
	}
	return nil
}
