package proxy

import (
	"context"
	"errors"
	"net/netip"
	"slices"

	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/service"
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

// hostOn returns a listener for k hosted by the shared listener of k's
// network, opening that first if need be.
func (p *Proxier) hostOn(ctx context.Context, k portKey) (*listener, error) {
	sk := portKey{name: service.SharedName(k.name.Protocol), v6: k.v6}
	sh := p.shared[sk]
	if sh == nil {
		for attempt := 1; ; attempt++ {
			var err error
			if sh, err = p.openListener(ctx, sk); err != nil {
				return nil, err
			}
			// An empty table until the first sync routes anything: traffic
			// that arrives before then (rules a previous instance left) is
			// refused, not misrouted.
			sh.Routes.Store(&datapath.RouteTable{})
			all := p.openSiblings(ctx, sh)
			// A port of the range is taken: a new first port, which the
			// kernel or the port range picks elsewhere, may find a free
			// range. An adopted socket stays: connections wait in it.
			if all || attempt == sharedRangeAttempts || p.adopted(sh) {
				if 1+len(sh.siblings) < sharedRedirectPorts {
					p.log.Warn("the shared listener has fewer ports than it should: the next ones are taken or out of range",
						zap.Stringer("servicePort", sk.name), zap.Uint16("first", sh.Port), zap.Int("ports", 1+len(sh.siblings)))
				}
				break
			}
			p.closeSiblings(sh)
			p.closeListener(sh)
		}
		if p.shared == nil {
			p.shared = map[portKey]*listener{}
		}
		p.shared[sk] = sh
	}
	l := newListener(k)
	l.Port, l.portEnd, l.host = sh.Port, sh.portEnd, sh
	return l, nil
}

// sharedRedirectPorts is how many consecutive ports a shared TCP listener
// listens on in redirect mode, one socket each, behind one REDIRECT
// --to-ports range.
//
// More than one, so that the kernel's NAT can pick a port whose tuple no
// TIME_WAIT socket holds, and a client's SYN to one service is not
// dropped by PAWS for meeting the TIME_WAIT of its connection to another:
// see "A shared listener's ports" in the package documentation.
const sharedRedirectPorts = 16

// sharedRangeAttempts is how many first ports hostOn tries for a shared
// listener whose range has a taken port: listening ports from the
// kernel's range sit among the ports of outgoing connections.
const sharedRangeAttempts = 8

// openSiblings opens the further sockets of sh, a new shared TCP listener
// in redirect mode, on the ports after its own (sharedRedirectPorts), and
// sets sh.portEnd. A port that cannot be had ends the range there;
// openSiblings reports false when that port was taken, which a range from
// another first port may not be, and true when the ports ran out (the end
// of the proxy port range, or 65535), which would end any range.
func (p *Proxier) openSiblings(ctx context.Context, sh *listener) bool {
	if sh.key.name.Protocol != v1.ProtocolTCP || p.cfg.Transparent {
		return true
	}
	all := true
	for slot := 1; slot < sharedRedirectPorts && int(sh.Port)+slot <= 0xffff; slot++ {
		k := sh.key
		k.slot = slot
		l, err := p.openListenerAt(ctx, k, sh.Port+uint16(slot))
		if errors.Is(err, errOutsideRange) {
			break
		}
		if err != nil {
			p.log.Debug("a port of the shared listener's range is taken",
				zap.Stringer("servicePort", sh.key.name), zap.Uint16("first", sh.Port), zap.Int("slot", slot), zap.Error(err))
			all = false
			break
		}
		l.Routes.Store(sh.Routes.Load())
		sh.siblings = append(sh.siblings, l)
	}
	sh.portEnd = 0
	if n := len(sh.siblings); n > 0 {
		sh.portEnd = sh.Port + uint16(n)
	}
	return all
}

// closeSiblings closes the further sockets of shared listener sh.
func (p *Proxier) closeSiblings(sh *listener) {
	for _, l := range sh.siblings {
		p.closeListener(l)
	}
	sh.siblings, sh.portEnd = nil, 0
}

// rebuildRoutes stores a new route table in every shared listener, from
// the intercepts of the listeners they host. Called by the sync goroutine
// before the rules are written, so a new destination is routed before the
// kernel sends it anything.
func (p *Proxier) rebuildRoutes() {
	if len(p.shared) == 0 {
		return
	}
	tables := make(map[*listener]datapath.RouteTable, len(p.shared))
	for _, sh := range p.shared {
		tables[sh] = datapath.RouteTable{}
	}
	for _, ls := range p.services {
		for _, l := range ls {
			if l.host == nil {
				continue
			}
			t := tables[l.host]
			for _, i := range l.intercepts(l.snap.Load()) {
				k := datapath.RouteKey{Addr: i.VIP.Unmap(), Port: i.Port}
				if i.Kind == NodePort {
					k.Addr = netip.Addr{}
				}
				if prev := t[k]; prev != nil && prev != l.Listener {
					// Two services claim one external address and port;
					// the rules send it to the first in the proxier's
					// order (redirect.ServiceRules), and so does this.
					if servicePortLess(prev.Name.(service.PortName), l.key.name) {
						continue
					}
				}
				t[k] = l.Listener
			}
		}
	}
	for sh, t := range tables {
		sh.Routes.Store(&t)
		for _, l := range sh.siblings {
			l.Routes.Store(&t)
		}
	}
}

// servicePortLess orders service port names as strings, the tie-break of
// two services claiming one destination.
func servicePortLess(a, b service.PortName) bool { return a.String() < b.String() }

// closeShared closes every shared listener (Shutdown, StopListening).
func (p *Proxier) closeShared() {
	for k, sh := range p.shared {
		p.closeSiblings(sh)
		p.closeListener(sh)
		delete(p.shared, k)
	}
}
