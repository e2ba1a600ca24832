package routing

import (
	"net/netip"
	"slices"
	"strings"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/service"
	v1 "k8s.io/api/core/v1"
)

// Snapshot is a listener's state as the sync goroutine built it: the
// data path's routing (datapath.Snapshot), which the listener publishes
// to the data path, with the model it was built from, for Status and
// Explain. Immutable, replaced whole.
type Snapshot struct {
	*datapath.Snapshot
	ServicePort *service.Port
	Endpoints   []service.Endpoint // all endpoints of the listener's family
	Sets        service.EndpointSets
}

// InterceptKind says which kind of service address an intercept catches.
type InterceptKind int

// The kinds of intercepted addresses.
const (
	ClusterIP InterceptKind = iota
	ExternalIP
	LoadBalancerIP
	NodePort
)

var interceptKindNames = [...]string{"ClusterIP", "ExternalIP", "LoadBalancerIP", "NodePort"}

// String is the kind as Services name it.
func (k InterceptKind) String() string { return interceptKindNames[k] }

// Intercept is one destination whose traffic the kernel must deliver to a
// local listener.
type Intercept struct {
	Service  service.PortName
	Kind     InterceptKind
	Protocol v1.Protocol
	// VIP and Port are the destination clients use. For a NodePort, VIP is
	// the unspecified address of the family (any local address, as
	// --nodeport-addresses admits) and Port the node port.
	VIP  netip.Addr
	Port uint16
	// ListenPort is the local listener's port (same family as VIP).
	ListenPort uint16
	// ListenPortEnd, when above ListenPort, is the last of the listener's
	// consecutive ports (a shared TCP listener in redirect mode; see
	// listeners.SharedRedirectPorts): the kernel may send each connection to any of
	// ListenPort-ListenPortEnd. Zero means ListenPort alone.
	ListenPortEnd uint16
	// SourceRanges, for a LoadBalancerIP, are the only clients allowed; nil
	// means all.
	SourceRanges []netip.Prefix
	// Reject is true when the service port has no endpoint to send to:
	// the rules should refuse new connections to it in the kernel, as
	// kube-proxy does, rather than send them to a listener that could only
	// accept them and then reset them.
	Reject bool
}

// Intercepts returns the intercepts of a listener of family v6 on
// port (to portEnd), given its snapshot s.
func Intercepts(s *Snapshot, port, portEnd uint16, v6 bool) []Intercept {
	proto := s.ServicePort.Name.Protocol
	base := Intercept{Service: s.ServicePort.Name, Protocol: proto, Port: s.ServicePort.Port, ListenPort: port, ListenPortEnd: portEnd,
		Reject: len(s.Sets.Cluster) == 0 && len(s.Sets.Local) == 0}
	out := []Intercept{with(base, ClusterIP, s.VIP.Addr())}
	for _, ip := range s.ServicePort.ExternalIPs {
		if ip.Is6() == v6 {
			out = append(out, with(base, ExternalIP, ip))
		}
	}
	for _, ip := range s.ServicePort.LoadBalancerIPs {
		if ip.Is6() == v6 {
			i := with(base, LoadBalancerIP, ip)
			i.SourceRanges = s.ServicePort.SourceRanges
			out = append(out, i)
		}
	}
	if s.NodePort != 0 {
		any := netip.IPv4Unspecified()
		if v6 {
			any = netip.IPv6Unspecified()
		}
		i := with(base, NodePort, any)
		i.Port = s.NodePort
		out = append(out, i)
	}
	return out
}

// with is i for the address ip of kind k.
func with(i Intercept, k InterceptKind, ip netip.Addr) Intercept {
	i.Kind, i.VIP = k, ip
	return i
}

// CompareClaims orders two intercepts that catch the same traffic (the
// same address, port and protocol): the one ordered first gets it, in
// the rules and in a shared listener's routes alike. A cluster IP comes
// first, then an external IP, a load-balancer IP and a node port, as
// kube-proxy's rules match a cluster IP first; then the service port's
// name, which only settles two claims of one kind, which the API server
// does not prevent for external addresses.
func CompareClaims(a, b Intercept) int {
	if a.Kind != b.Kind {
		return int(a.Kind) - int(b.Kind)
	}
	return strings.Compare(a.Service.String(), b.Service.String())
}

// SameIntercept reports whether a and b catch the same traffic for the
// same listener: the rules that render them are the same.
func SameIntercept(a, b Intercept) bool {
	return a.Service == b.Service && a.Kind == b.Kind && a.Protocol == b.Protocol && a.VIP == b.VIP &&
		a.Port == b.Port && a.ListenPort == b.ListenPort && a.ListenPortEnd == b.ListenPortEnd &&
		a.Reject == b.Reject && slices.Equal(a.SourceRanges, b.SourceRanges)
}

// NotReady counts the endpoints of s that are not ready.
func NotReady(s *Snapshot) int {
	n := 0
	for _, e := range s.Endpoints {
		if !e.Ready {
			n++
		}
	}
	return n
}
