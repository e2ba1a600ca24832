package proxy

import (
	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/balancer"
)

// DefaultSourceHashBytes is the bound on the source-hash balancers' Maglev
// tables when Config.SourceHashBytes is zero.
const DefaultSourceHashBytes = 64 << 20

func (c *Config) sourceHashBytes() int64 {
	if c.SourceHashBytes <= 0 {
		return DefaultSourceHashBytes
	}
	return c.SourceHashBytes
}

// hashTables are the Maglev tables of the source-hash balancers, per
// service, and their total size. A Maglev table is sized by its backends,
// and the balancers of a service's ports, families and endpoint sets share
// one whenever their backends have the same addresses; still, a service
// with thousands of ports, each with endpoints of its own, would hold a
// table for each. So their total is bounded: a balancer whose table
// would pass the bound uses rendezvous hashing instead, which needs no
// table (balancer.NewSourceHash). Owned by the sync goroutine.
type hashTables struct {
	byService map[types.NamespacedName]map[string]*balancer.MaglevTable
	bytes     int64                          // the total of every table in byService
	degraded  map[types.NamespacedName]int64 // services with ports over the bound, and the bytes they wanted
}

// serviceHashing builds the source-hash balancers of one service during
// its apply: it reuses the tables of the service's previous snapshots, and
// shares new ones between the service's balancers.
type serviceHashing struct {
	prev, next map[string]*balancer.MaglevTable
	prevBytes  int64
	nextBytes  int64
	others     int64 // the tables of every other service
	bound      int64
	fallbacks  int   // balancers that use rendezvous hashing
	wanted     int64 // the bytes their tables would have taken
}

// beginHashing starts the apply of service name's source-hash balancers.
func (p *Proxier) beginHashing(name types.NamespacedName) *serviceHashing {
	prev := p.hash.byService[name]
	h := &serviceHashing{prev: prev, bound: p.cfg.sourceHashBytes()}
	for _, t := range prev {
		h.prevBytes += t.Bytes()
	}
	h.others = p.hash.bytes - h.prevBytes
	return h
}

// balancer returns a source-hash balancer over bs.
func (h *serviceHashing) balancer(bs []*balancer.Backend) balancer.Balancer {
	if len(bs) == 0 {
		return balancer.New(balancer.SourceHash, nil)
	}
	key := balancer.MaglevKey(bs)
	t := h.next[key]
	if t == nil {
		t = h.prev[key]
		size := balancer.MaglevTableBytes(len(bs))
		if t != nil {
			size = t.Bytes()
		}
		// The service's previous tables are still in use until its new
		// snapshots replace them; the bound counts what stays after.
		if h.others+h.nextBytes+size > h.bound {
			h.fallbacks++
			h.wanted += size
			return balancer.NewSourceHash(bs, nil)
		}
		if t == nil {
			t = balancer.NewMaglevTable(bs)
		}
		if h.next == nil {
			h.next = map[string]*balancer.MaglevTable{}
		}
		h.next[key] = t
		h.nextBytes += size
	}
	return balancer.NewSourceHash(bs, t)
}

// endHashing records the tables the service's new snapshots use, and logs
// when the service's balancers go past the bound or come back under it.
func (p *Proxier) endHashing(name types.NamespacedName, h *serviceHashing) {
	hs := &p.hash
	hs.bytes = h.others + h.nextBytes
	if len(h.next) == 0 {
		delete(hs.byService, name)
	} else {
		if hs.byService == nil {
			hs.byService = map[types.NamespacedName]map[string]*balancer.MaglevTable{}
		}
		hs.byService[name] = h.next
	}
	_, was := hs.degraded[name]
	switch {
	case h.fallbacks > 0:
		if hs.degraded == nil {
			hs.degraded = map[types.NamespacedName]int64{}
		}
		hs.degraded[name] = h.wanted
		if !was {
			p.log.Warn("source-hash lookup tables would pass their memory bound; this service's balancers that did not fit use rendezvous hashing instead: the same client stickiness, a pick that costs more per endpoint, and a mapping that may differ from nodes where the tables fit",
				zap.Stringer("service", name), zap.Int("balancers", h.fallbacks), zap.Int64("wantedBytes", h.wanted),
				zap.Int64("tableBytes", hs.bytes), zap.Int64("boundBytes", h.bound))
		}
	case was:
		delete(hs.degraded, name)
		p.log.Info("this service's source-hash balancers no longer pass the lookup tables' memory bound; none uses rendezvous hashing",
			zap.Stringer("service", name), zap.Int64("tableBytes", hs.bytes), zap.Int64("boundBytes", h.bound))
	}
}
