package service

import (
	"fmt"
	"net/netip"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
)

// Annotations uproxy reads from Services.
const (
	// AnnotationBalancer selects the balancing algorithm of every port of
	// the service: one of balancer.Kinds.
	AnnotationBalancer = "uproxy.io/balancer"
	// AnnotationWeights gives endpoint weights for the weighted balancers,
	// as "10.244.0.11=3,10.244.0.12=1". Unlisted endpoints weigh 1.
	AnnotationWeights = "uproxy.io/weights"
	// AnnotationPreserveSourceIP overrides, in both directions, which
	// address backends see: without it, the client's own wherever
	// kube-proxy would leave it (datapath.KeepClient), else the node's;
	// "true", the client's wherever its replies can come back; "false",
	// always the node's.
	AnnotationPreserveSourceIP = "uproxy.io/preserve-source-ip"
	// AnnotationProxyProtocol, "v1" or "v2", sends a PROXY protocol header
	// with the client's address to the backend at the start of every TCP
	// connection. UDP ports of the service are proxied without it.
	AnnotationProxyProtocol = "uproxy.io/proxy-protocol"
	// AnnotationMaxConnections, a positive integer, bounds the TCP
	// connections that each port of the service proxies at once, over both
	// IP families. A connection past it is reset before any endpoint is
	// dialled. UDP flows are not limited.
	AnnotationMaxConnections = "uproxy.io/max-connections"
	// AnnotationMaxConnectionsPerEndpoint, a positive integer, bounds the
	// TCP connections that each port of the service proxies at once to any
	// one endpoint. A full endpoint is skipped; when every endpoint is
	// full, the connection is reset.
	AnnotationMaxConnectionsPerEndpoint = "uproxy.io/max-connections-per-endpoint"
	// AnnotationUDPMode chooses how the service's UDP ports carry their
	// clients: "request-reply" sends each datagram through a pooled
	// socket that returns to its pool with the first reply, "flow" gives
	// each client a socket of its own for as long as it sends, and "auto"
	// starts a client as request-reply and makes it a flow once it sends
	// again. Ports numbered 53 (DNS) default to request-reply, the others
	// to flow.
	AnnotationUDPMode = "uproxy.io/udp-mode"
)

// UDPMode is how a UDP service port carries its clients
// (AnnotationUDPMode): the data path's type, which carries it out. The
// zero value is UDPFlow.
type UDPMode = datapath.UDPMode

// The UDP modes, as AnnotationUDPMode names them: "flow",
// "request-reply" and "auto".
const (
	UDPFlow         = datapath.UDPFlow
	UDPRequestReply = datapath.UDPRequestReply
	UDPAuto         = datapath.UDPAuto
)

// Labels uproxy honours, with the meaning kube-proxy gives them.
const (
	// LabelServiceName joins an EndpointSlice to its Service.
	LabelServiceName = "kubernetes.io/service-name"
	// LabelServiceProxyName marks a Service handled by another proxy.
	LabelServiceProxyName = "service.kubernetes.io/service-proxy-name"
	// LabelHeadless marks the EndpointSlices of a headless Service.
	LabelHeadless = "service.kubernetes.io/headless"
)

// DefaultAffinityTimeout is the ClientIP affinity timeout when a Service
// does not set one: 10800s, the API's default.
const DefaultAffinityTimeout = 10800 * time.Second

// PortName identifies one port of one Service, the way kube-proxy
// names it in logs and rule comments.
type PortName struct {
	types.NamespacedName
	// Port is the port's name; empty for an unnamed single port.
	Port string
	// Protocol is the port's protocol.
	Protocol v1.Protocol
}

// String returns "namespace/name:port", or "namespace/name" for an unnamed
// port; a shared listener's name is "shared TCP listener".
func (n PortName) String() string {
	if n.IsShared() {
		return sharedString(n)
	}
	if n.Port == "" {
		return n.NamespacedName.String()
	}
	return fmt.Sprintf("%s:%s", n.NamespacedName, n.Port)
}

// Port is one validated port of a Service: what uproxy listens for.
// It is immutable once built; a change builds a new one.
type Port struct {
	Name PortName
	// ClusterIPs holds at most one address per family.
	ClusterIPs []netip.Addr
	// Port is the service port that clients connect to.
	Port uint16
	// NodePort is the port on the node's addresses; zero means none.
	NodePort uint16
	// ExternalIPs are spec.externalIPs: addresses routed to the node that
	// are proxied like the cluster IP, at Port.
	ExternalIPs []netip.Addr
	// LoadBalancerIPs are the status.loadBalancer.ingress IPs whose ipMode
	// is not Proxy (those the load balancer delivers to the node unchanged).
	LoadBalancerIPs []netip.Addr
	// SourceRanges are spec.loadBalancerSourceRanges: when set, only these
	// clients may reach the LoadBalancer IPs.
	SourceRanges []netip.Prefix
	// ExternalPolicyLocal: externalTrafficPolicy Local. External traffic
	// (node ports, external and load-balancer IPs) goes only to endpoints
	// on this node.
	ExternalPolicyLocal bool
	// InternalPolicyLocal: internalTrafficPolicy Local. Cluster-IP traffic
	// goes only to endpoints on this node.
	InternalPolicyLocal bool
	// HealthCheckNodePort serves the service's local-endpoint health for
	// external load balancers; zero means none.
	HealthCheckNodePort uint16
	// Balancer is the algorithm for this port: the Service's annotation,
	// else the proxy's default.
	Balancer balancer.Kind
	// Weights maps an endpoint IP to its weight; nil when none were given.
	Weights map[netip.Addr]int
	// AffinityTimeout is the ClientIP session affinity timeout; zero means
	// no session affinity.
	AffinityTimeout time.Duration
	// SourceIP chooses the address backends see (the annotation
	// AnnotationPreserveSourceIP); the zero value keeps the client's
	// wherever kube-proxy would.
	SourceIP datapath.SourceIP
	// ProxyProtocol is the PROXY protocol version sent to the backend: 0
	// (none), 1 or 2.
	ProxyProtocol int
	// MaxConnections bounds the TCP connections proxied at once for this
	// port, its listeners of both families together; zero means no limit.
	MaxConnections int
	// MaxConnectionsPerEndpoint bounds the TCP connections proxied at once
	// to any one endpoint of this port; zero means no limit.
	MaxConnectionsPerEndpoint int
	// UDPMode is how a UDP port carries its clients: the annotation, else
	// request-reply for port 53 and flow for the others.
	UDPMode UDPMode
}

// ExternallyAccessible reports whether the port takes traffic from outside
// the cluster (kube-proxy's definition): a node port, external IPs or
// load-balancer IPs.
func (sp *Port) ExternallyAccessible() bool {
	return sp.NodePort != 0 || len(sp.ExternalIPs) > 0 || len(sp.LoadBalancerIPs) > 0
}

// UsesClusterEndpoints reports whether any traffic to the port may go to
// endpoints on other nodes. Even with externalTrafficPolicy Local, pods and
// the node itself reaching an external address are sent to the cluster
// endpoints (kube-proxy's short circuit), so only internal Local without
// external access avoids them.
func (sp *Port) UsesClusterEndpoints() bool {
	return !sp.InternalPolicyLocal || sp.ExternallyAccessible()
}

// UsesLocalEndpoints reports whether some traffic to the port is limited
// to endpoints on this node.
func (sp *Port) UsesLocalEndpoints() bool {
	return sp.InternalPolicyLocal || (sp.ExternalPolicyLocal && sp.ExternallyAccessible())
}

// Endpoint is one endpoint of a service port, with its slice's port
// already resolved.
type Endpoint struct {
	Addr        netip.AddrPort
	Ready       bool
	Serving     bool
	Terminating bool
	NodeName    string
	Zone        string
	// Hints are the slice's topology hints, set by the EndpointSlice
	// controller for trafficDistribution and topology-aware routing; nil
	// when there are none, as for most endpoints: a pointer keeps an
	// endpoint small.
	Hints *EndpointHints
}

// EndpointHints are an endpoint's topology hints: the zones (forZones)
// and nodes (forNodes) it is meant for.
type EndpointHints struct {
	Zones, Nodes []string
}

// zones returns the zone hints; nil for none.
func (h *EndpointHints) zones() []string {
	if h == nil {
		return nil
	}
	return h.Zones
}

// nodes returns the node hints; nil for none.
func (h *EndpointHints) nodes() []string {
	if h == nil {
		return nil
	}
	return h.Nodes
}

// SharedName is the name a shared listener goes by in the logs, in its
// handover key and for Config.PreviousPort: no Service, the port name
// "shared", and the protocol.
func SharedName(proto v1.Protocol) PortName {
	return PortName{Port: SharedPortName, Protocol: proto}
}

// SharedPortName is the port name of a shared listener's PortName,
// which has no namespace and no name: PreviousPort sees it for the shared
// listeners.
const SharedPortName = "shared"

// IsShared reports whether n names a shared listener rather than the port
// of a Service.
func (n PortName) IsShared() bool {
	return n.Namespace == "" && n.Name == "" && n.Port == SharedPortName
}

// String of a shared listener's name.
func sharedString(n PortName) string {
	return fmt.Sprintf("shared %s listener", n.Protocol)
}
