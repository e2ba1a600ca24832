// Package proxy holds uproxy's service model, the change tracker that
// sources feed, the bounded-frequency sync runner, and the data path: one
// listener per service port and family, carrying TCP connections to the
// endpoints a balancer picks.
//
// The package never touches the kernel's packet rules itself: the Proxier
// hands the intercepts it wants to a RuleSyncer, which the command wires to
// the redirect package.
package proxy

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/balancer"
)

// Annotations uproxy reads from Services.
const (
	// AnnotationBalancer selects the balancing algorithm of every port of
	// the service: one of balancer.Kinds.
	AnnotationBalancer = "uproxy.io/balancer"
	// AnnotationWeights gives endpoint weights for the weighted balancers,
	// as "10.244.0.11=3,10.244.0.12=1". Unlisted endpoints weigh 1.
	AnnotationWeights = "uproxy.io/weights"
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

// ServicePortName identifies one port of one Service, the way kube-proxy
// names it in logs and rule comments.
type ServicePortName struct {
	types.NamespacedName
	// Port is the port's name; empty for an unnamed single port.
	Port string
	// Protocol is the port's protocol.
	Protocol v1.Protocol
}

// String returns "namespace/name:port", or "namespace/name" for an unnamed port.
func (n ServicePortName) String() string {
	if n.Port == "" {
		return n.NamespacedName.String()
	}
	return fmt.Sprintf("%s:%s", n.NamespacedName, n.Port)
}

// ServicePort is one validated port of a Service: what uproxy listens for.
// It is immutable once built; a change builds a new one.
type ServicePort struct {
	Name ServicePortName
	// ClusterIPs holds at most one address per family.
	ClusterIPs []netip.Addr
	// Port is the service port that clients connect to.
	Port uint16
	// Balancer is the algorithm for this port: the Service's annotation,
	// else the proxy's default.
	Balancer balancer.Kind
	// Weights maps an endpoint IP to its weight; nil when none were given.
	Weights map[netip.Addr]int
	// AffinityTimeout is the ClientIP session affinity timeout; zero means
	// no session affinity.
	AffinityTimeout time.Duration
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
}

// Intercept is one destination whose traffic the kernel must deliver to a
// local listener.
type Intercept struct {
	Service  ServicePortName
	Protocol v1.Protocol
	// VIP and Port are the destination clients use.
	VIP  netip.Addr
	Port uint16
	// ListenPort is the local listener's port (same family as VIP).
	ListenPort uint16
}

// RuleSyncer programs the kernel so that each intercept reaches its
// listener. The Proxier calls it only from its sync goroutine, never
// concurrently, always with the complete list. full is true on periodic
// resyncs and after a failure: the syncer should then verify the kernel's
// state instead of trusting what it wrote last.
type RuleSyncer interface {
	SyncRules(ctx context.Context, intercepts []Intercept, full bool) error
}
