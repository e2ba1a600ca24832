package proxy

import (
	"errors"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/proxy/listeners"
)

// listenerRefusal is a reason for which the listeners.Manager refuses a
// service port's listener while nothing failed: a budget or a quota is
// spent. The port gets no listener and no rule, and is retried at each
// sync.
type listenerRefusal int

const (
	refusedBudget     listenerRefusal = iota // --max-listeners
	refusedPortsSpent                        // --proxy-port-range, or the share of the kernel's range
	refusedService                           // --max-listeners-per-service
	refusedNamespace                         // --max-listeners-per-namespace
	numRefusals
)

// refusalOf returns the reason for which err refused a listener; false
// when err is a failure.
func refusalOf(err error) (listenerRefusal, bool) {
	switch {
	case errors.Is(err, listeners.ErrBudget):
		return refusedBudget, true
	case errors.Is(err, listeners.ErrPorts):
		return refusedPortsSpent, true
	case errors.Is(err, listeners.ErrServiceQuota):
		return refusedService, true
	case errors.Is(err, listeners.ErrNamespaceQuota):
		return refusedNamespace, true
	}
	return 0, false
}

// refusedListeners collects the service ports whose listeners a sync's
// budget or quotas refused, to say them in one line per reason at the end
// of the sync rather than one per port: they are refused again at every
// sync until something changes. Owned by the sync goroutine.
type refusedListeners [numRefusals]refusedGroup

// refusedGroup are the service ports refused for one reason.
type refusedGroup struct {
	ports int
	// services are the Services refused, each once, in the order of
	// refusal.
	services []types.NamespacedName
	// err is the first refusal's, which gives the counts.
	err error
}

// maxRefusedNames is how many Services a line names; it counts the rest.
const maxRefusedNames = 20

// add records a port of service refused for the reason why.
func (r *refusedListeners) add(why listenerRefusal, service types.NamespacedName, err error) {
	e := &r[why]
	if e.ports == 0 {
		e.err = err
	}
	e.ports++
	// applyService refuses a Service's ports one after the other.
	if n := len(e.services); n == 0 || e.services[n-1] != service {
		e.services = append(e.services, service)
	}
}

// refusalMessages say, by reason, why service ports have no listener and
// what would let them listen: the shared layout always would, as its
// listeners serve every Service. Each says that the listener budget is
// spent, what tools watching the log look for.
var refusalMessages = [numRefusals]string{
	refusedBudget:     "service ports have no listener: the listener budget is spent; they are retried at each sync (raise the open-files limit, or --max-listeners, or use --listener=shared)",
	refusedPortsSpent: "service ports have no listener: the listener budget is spent: listeners hold half of the kernel's local port range, all they may take so that the node's own connections keep ports; they are retried at each sync (set a --proxy-port-range outside net.ipv4.ip_local_port_range, or use --listener=shared)",
	refusedService:    "service ports have no listener: the listener budget is spent for their Service (--max-listeners-per-service); they are retried at each sync (raise --max-listeners-per-service, or use --listener=shared)",
	refusedNamespace:  "service ports have no listener: the listener budget is spent for their namespace (--max-listeners-per-namespace); they are retried at each sync (raise --max-listeners-per-namespace, or use --listener=shared)",
}

// rangeSpentMessage is refusalMessages[refusedPortsSpent] with a
// --proxy-port-range.
const rangeSpentMessage = "service ports have no listener: the listener budget is spent: every port of --proxy-port-range is taken; they are retried at each sync (widen --proxy-port-range, or use --listener=shared)"

// log says, in one line per reason, the service ports refused since the
// last call and the Services they belong to, and forgets them. sockets
// is how many listening sockets are open; portRange says whether
// --proxy-port-range is set.
func (r *refusedListeners) log(log *zap.Logger, sockets, maxListeners int, portRange bool) {
	for why := range numRefusals {
		e := &r[why]
		if e.ports == 0 {
			continue
		}
		msg := refusalMessages[why]
		if why == refusedPortsSpent && portRange {
			msg = rangeSpentMessage
		}
		names := make([]string, 0, min(len(e.services), maxRefusedNames))
		for _, s := range e.services[:cap(names)] {
			names = append(names, s.String())
		}
		fields := []zap.Field{zap.Int("servicePorts", e.ports), zap.Strings("services", names)}
		if more := len(e.services) - len(names); more > 0 {
			fields = append(fields, zap.Int("moreServices", more))
		}
		fields = append(fields, zap.Int("listeningSockets", sockets), zap.Int("maxListeners", maxListeners), zap.Error(e.err))
		log.Error(msg, fields...)
		clear(e.services)
		*e = refusedGroup{services: e.services[:0]}
	}
}
