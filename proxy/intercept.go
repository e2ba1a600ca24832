package proxy

import (
	"context"

	"github.com/uproxy/uproxy/proxy/routing"

	"k8s.io/apimachinery/pkg/types"
)

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
	SyncRules(ctx context.Context, intercepts []routing.Intercept, full bool) (RuleStats, error)
}

// RuleSyncerFunc is a function that is a RuleSyncer, so that the command
// can wire the proxier to the kernel's rules without a type of its own.
type RuleSyncerFunc func(ctx context.Context, intercepts []routing.Intercept, full bool) (RuleStats, error)

// SyncRules calls f.
func (f RuleSyncerFunc) SyncRules(ctx context.Context, intercepts []routing.Intercept, full bool) (RuleStats, error) {
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
	// Unguarded, by family (index 0 IPv4, 1 IPv6), is true when the
	// family's rules were not written although the call returned nil
	// (the family's rule tool is missing): nothing in the kernel guards
	// its listeners' ports, so its UDP listeners must check every new
	// flow themselves.
	Unguarded [2]bool
}
