package proxy

import (
	"net/netip"
	"slices"

	"github.com/uproxy/uproxy/proxy/routing"

	"github.com/uproxy/uproxy/proxy/listeners"

	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
)

// The shared listener layout (Config.SharedListeners, --listener=shared).
//
// A listener per service port costs a socket, a goroutine and a kernel
// rule per service port and family, and at 10,000 services the rules are
// what takes time to program. In the shared layout one socket per family
// and protocol (a "shared listener") receives the traffic of every service
// port of that protocol; the kernel sends it there through one rule per
// protocol that matches a set of every VIP:port (see the redirect
// package), so the rule count stays constant as services grow. The
// service ports keep their own listener values, which hold their
// snapshots, affinity tables and UDP flows as before but no socket: they
// are "hosted" by the shared listener, whose route table maps each
// original destination to its service port's listener.

// sharedFor reports whether the service ports of proto are hosted by a
// shared listener. In redirect mode UDP needs UDPOriginalDst: REDIRECT
// rewrites a datagram's destination, and no socket option recovers it
// for UDP (the kernel's getorigdst serves TCP and SCTP sockets only).
func (c *Config) sharedFor(proto v1.Protocol) bool {
	if proto == v1.ProtocolUDP && !c.Transparent && c.UDPOriginalDst == nil {
		return false
	}
	return slices.Contains(c.SharedListeners, proto)
}

// rebuildRoutes stores a new route table in every shared listener, from
// the intercepts of the listeners they host. Called by the sync goroutine
// before the rules are written, so a new destination is routed before the
// kernel sends it anything.
func (p *Proxier) rebuildRoutes() {
	shared := p.sockets.Shared()
	if len(shared) == 0 {
		return
	}
	tables := make(map[*listeners.Listener]datapath.RouteTable, len(shared))
	for _, sh := range shared {
		tables[sh] = datapath.RouteTable{}
	}
	// The claim that holds each route, for routing.CompareClaims.
	holders := map[*listeners.Listener]map[datapath.RouteKey]routing.Intercept{}
	for _, ls := range p.services {
		for _, l := range ls {
			if l.Host == nil {
				continue
			}
			t := tables[l.Host]
			held := holders[l.Host]
			if held == nil {
				held = map[datapath.RouteKey]routing.Intercept{}
				holders[l.Host] = held
			}
			for _, i := range l.intercepts(l.snap.Load()) {
				k := datapath.RouteKey{Addr: i.VIP.Unmap(), Port: i.Port}
				if i.Kind == routing.NodePort {
					k.Addr = netip.Addr{}
				}
				if prev, ok := held[k]; ok && routing.CompareClaims(prev, i) <= 0 {
					// Two services claim one address and port; the rules
					// send it to the first in the proxier's order
					// (Intercepts, redirect.ServiceRules), and so does this.
					continue
				}
				held[k] = i
				t[k] = l.Listener.Listener
			}
		}
	}
	for sh, t := range tables {
		sh.StoreRoutes(&t)
	}
}
