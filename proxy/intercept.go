package proxy

import (
	"context"

	"net/netip"

	"github.com/uproxy/uproxy/proxy/service"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

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
	// sharedRedirectPorts): the kernel may send each connection to any of
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

// ServiceHealthSyncer serves the health-check node ports of services with
// externalTrafficPolicy Local (healthcheck.ServiceHealth implements it).
// The Proxier calls it from its sync goroutine only, with the complete
// state: after a sync that changed a port or a count, after one whose
// SyncServices failed, and after every full sync. The maps belong to the
// Proxier: read them during the call only.
type ServiceHealthSyncer interface {
	// SyncServices sets which services have a health-check port, and which.
	SyncServices(ports map[types.NamespacedName]uint16) error
	// SyncEndpoints sets each service's number of ready local endpoints.
	SyncEndpoints(counts map[types.NamespacedName]int) error
}

// RuleSyncer programs the kernel so that each intercept reaches its
// listener. The Proxier calls it only from its sync goroutine, never
// concurrently, always with the complete list. full is true on periodic
// resyncs and after a failure: the syncer should then verify the kernel's
// state instead of trusting what it wrote last. A nil error promises that
// the kernel drops datagrams sent to a listener port of intercepts without
// a redirect (redirect mode's listener guard), so that the data path may
// skip its own check (datapath.Listener.Guarded); in tproxy mode the data
// path does not rely on it.
type RuleSyncer interface {
	SyncRules(ctx context.Context, intercepts []Intercept, full bool) (RuleStats, error)
}

// RuleSyncerFunc is a function that is a RuleSyncer, so that the command
// can wire the proxier to the kernel's rules without a type of its own.
type RuleSyncerFunc func(ctx context.Context, intercepts []Intercept, full bool) (RuleStats, error)

// SyncRules calls f.
func (f RuleSyncerFunc) SyncRules(ctx context.Context, intercepts []Intercept, full bool) (RuleStats, error) {
	return f(ctx, intercepts, full)
}

// RuleStats is what one SyncRules call did, for the sync's log line.
type RuleStats struct {
	// Rules is the number of kernel rules the intercepts render to.
	Rules int
	// Written is the number of rules written to the kernel by this call:
	// zero when the kernel already held them, Rules when they were
	// (re)written.
	Written int
	// Commands is the number of processes (iptables, ipset) this call
	// ran: zero when the kernel already held the rules and sets.
	Commands int
}
