package proxy

import (
	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/balancer"
)

// DefaultSourceHashBytes is the bound on the source-hash balancers' Maglev
// tables when Config.SourceHashBytes is zero.
const DefaultSourceHashBytes = balancer.DefaultMaglevBudget

// hashTables are the Maglev tables of the source-hash balancers, their
// owners the services, in a budget (balancer.MaglevBudget), and the
// services whose balancers passed it, which are logged when they do and
// when they come back under it. Owned by the sync goroutine.
type hashTables struct {
	budget   balancer.MaglevBudget[types.NamespacedName]
	degraded map[types.NamespacedName]int64 // services with ports over the bound, and the bytes they wanted
}

// begin starts the apply of service name's source-hash balancers, whose
// tables may take bound bytes in all (zero: DefaultSourceHashBytes).
func (hs *hashTables) begin(name types.NamespacedName, bound int64) *balancer.MaglevRebuild[types.NamespacedName] {
	hs.budget.Bound = bound
	return hs.budget.Begin(name)
}

// end records the tables the service's new snapshots use, and logs
// when the service's balancers go past the bound or come back under it.
func (hs *hashTables) end(name types.NamespacedName, h *balancer.MaglevRebuild[types.NamespacedName], log *zap.Logger) {
	hs.budget.Commit(h)
	bound := hs.budget.Bound
	if bound <= 0 {
		bound = DefaultSourceHashBytes
	}
	_, was := hs.degraded[name]
	switch {
	case h.Fallbacks > 0:
		if hs.degraded == nil {
			hs.degraded = map[types.NamespacedName]int64{}
		}
		hs.degraded[name] = h.Wanted
		if !was {
			log.Warn("source-hash lookup tables would pass their memory bound; this service's balancers that did not fit use rendezvous hashing instead: the same client stickiness, a pick that costs more per endpoint, and a mapping that may differ from nodes where the tables fit",
				zap.Stringer("service", name), zap.Int("balancers", h.Fallbacks), zap.Int64("wantedBytes", h.Wanted),
				zap.Int64("tableBytes", hs.budget.Bytes()), zap.Int64("boundBytes", bound))
		}
	case was:
		delete(hs.degraded, name)
		log.Info("this service's source-hash balancers no longer pass the lookup tables' memory bound; none uses rendezvous hashing",
			zap.Stringer("service", name), zap.Int64("tableBytes", hs.budget.Bytes()), zap.Int64("boundBytes", bound))
	}
}
