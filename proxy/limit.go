package proxy

import (
	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/service"
)

// portSlots returns the connection counter of the service port name,
// creating it on first use. Called by the sync goroutine only.
func (p *Proxier) portSlots(name service.PortName) *datapath.ConnSlots {
	if p.slots == nil {
		p.slots = map[service.PortName]*datapath.ConnSlots{}
	}
	s := p.slots[name]
	if s == nil {
		s = &datapath.ConnSlots{}
		p.slots[name] = s
	}
	return s
}

// warnIgnored logs, once per version of st's Service, the SCTP ports and
// annotations that uproxy ignores in it (service.Warnings). The tracker hands out a new
// object only when the Service changed, so comparing pointers tells a new
// version from the periodic full resync's replay of the same one. Called
// by the sync goroutine only.
func (p *Proxier) warnIgnored(st changes.ServiceState) {
	if st.Service == nil {
		delete(p.warned, st.Name)
		return
	}
	if p.warned[st.Name] == st.Service {
		return
	}
	errs := service.Warnings(st.Service)
	if len(errs) == 0 {
		delete(p.warned, st.Name)
		return
	}
	if p.warned == nil {
		p.warned = map[types.NamespacedName]*v1.Service{}
	}
	p.warned[st.Name] = st.Service
	for _, err := range errs {
		p.log.Warn("ignoring part of a service; the rest of it is proxied",
			zap.String("kind", "Service"), zap.Stringer("object", st.Name), zap.Error(err))
	}
}
