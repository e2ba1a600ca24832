package proxy

import (
	"net/netip"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/types"
)

// healthPorts are the health-check node ports and ready local endpoint
// counts of the services with externalTrafficPolicy Local, kept per
// applied service so that a sync hands them to the ServiceHealth server
// only when they change. Owned by the sync goroutine.
type healthPorts struct {
	syncer ServiceHealthSyncer // nil: not served
	log    *zap.Logger
	ports  map[types.NamespacedName]uint16
	local  map[types.NamespacedName]int
	dirty  bool // changed, or the last hand-over failed
}

// update records service name's health-check port and
// ready local endpoints, as its listeners now have them, and marks them
// for the ServiceHealth server if they changed. It looks at that one
// service, so that an endpoint change costs the same however many
// services there are.
func (h *healthPorts) update(name types.NamespacedName, ls listenerSet) {
	if h.syncer == nil {
		return
	}
	var (
		port  uint16
		local map[netip.Addr]bool
	)
	for _, l := range ls {
		s := l.snap.Load()
		if s.ServicePort.HealthCheckNodePort == 0 {
			continue
		}
		port = s.ServicePort.HealthCheckNodePort
		for _, e := range s.Sets.Local {
			if e.Ready {
				if local == nil {
					local = map[netip.Addr]bool{}
				}
				local[e.Addr.Addr()] = true
			}
		}
	}
	oldPort, had := h.ports[name]
	if port == 0 {
		if had {
			delete(h.ports, name)
			delete(h.local, name)
			h.dirty = true
		}
		return
	}
	if !had || oldPort != port || h.local[name] != len(local) {
		h.ports[name], h.local[name] = port, len(local)
		h.dirty = true
	}
}

// sync hands the health-check ports and local endpoint counts
// to the ServiceHealth server when they have changed, when its last
// SyncServices failed (it retries the ports it could not bind), and on
// every full sync.
func (h *healthPorts) sync(full bool) {
	if h.syncer == nil || !h.dirty && !full {
		return
	}
	h.dirty = false
	if err := h.syncer.SyncServices(h.ports); err != nil {
		h.dirty = true
		h.log.Error("serving health-check node ports", zap.Error(err))
	}
	if err := h.syncer.SyncEndpoints(h.local); err != nil {
		h.dirty = true
		h.log.Error("updating health-check node ports", zap.Error(err))
	}
}
