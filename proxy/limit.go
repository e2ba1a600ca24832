package proxy

import (
	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/service"
)

// connSlots are the connection counters of the service ports, each shared
// by the port's listeners of both families. Owned by the sync goroutine.
type connSlots map[service.PortName]*datapath.ConnSlots

// get returns the counter of the service port name, creating it on first
// use.
func (cs connSlots) get(name service.PortName) *datapath.ConnSlots {
	s := cs[name]
	if s == nil {
		s = &datapath.ConnSlots{}
		cs[name] = s
	}
	return s
}

// ignoredParts logs, once per version of st's Service, the SCTP ports and
// annotations that uproxy ignores in it (service.Warnings). The tracker hands out a new
// object only when the Service changed, so comparing pointers tells a new
// version from the periodic full resync's replay of the same one. Called
// by the sync goroutine only.
type ignoredParts struct {
	warned map[types.NamespacedName]*v1.Service // the version whose ignored parts were logged
	log    *zap.Logger
}

// warn logs the parts of st's Service that uproxy ignores, if it has not
// for this version of it.
func (ig *ignoredParts) warn(st changes.ServiceState) {
	if st.Service == nil {
		delete(ig.warned, st.Name)
		return
	}
	if ig.warned[st.Name] == st.Service {
		return
	}
	errs := service.Warnings(st.Service)
	if len(errs) == 0 {
		delete(ig.warned, st.Name)
		return
	}
	if ig.warned == nil {
		ig.warned = map[types.NamespacedName]*v1.Service{}
	}
	ig.warned[st.Name] = st.Service
	for _, err := range errs {
		ig.log.Warn("ignoring part of a service; the rest of it is proxied",
			zap.String("kind", "Service"), zap.Stringer("object", st.Name), zap.Error(err))
	}
}
