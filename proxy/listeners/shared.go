package listeners

import (
	"context"
	"errors"

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

// HostOn returns a listener for k hosted by the shared listener of k's
// network, opening that first if need be.
func (m *Manager) HostOn(ctx context.Context, k Key) (*Listener, error) {
	sk := Key{Name: service.SharedName(k.Name.Protocol), V6: k.V6}
	sh := m.shared[sk]
	if sh == nil {
		for attempt := 1; ; attempt++ {
			var err error
			if sh, err = m.Open(ctx, sk); err != nil {
				return nil, err
			}
			// An empty table until the first sync routes anything: traffic
			// that arrives before then (rules a previous instance left) is
			// refused, not misrouted.
			sh.Routes.Store(&datapath.RouteTable{})
			all := m.openSiblings(ctx, sh)
			// A port of the range is taken: a new first port, which the
			// kernel or the port range picks elsewhere, may find a free
			// range. An adopted socket stays: connections wait in it.
			if all || attempt == sharedRangeAttempts || m.Adopted(sh) {
				if 1+len(sh.siblings) < SharedRedirectPorts {
					m.log.Warn("the shared listener has fewer ports than it should: the next ones are taken or out of range",
						zap.Stringer("servicePort", sk.Name), zap.Uint16("first", sh.Port), zap.Int("ports", 1+len(sh.siblings)))
				}
				break
			}
			m.closeSiblings(sh)
			m.Close(sh)
		}
		if m.shared == nil {
			m.shared = map[Key]*Listener{}
		}
		m.shared[sk] = sh
	}
	l := newListener(k)
	l.Port, l.PortEnd, l.Host = sh.Port, sh.PortEnd, sh
	return l, nil
}

// SharedRedirectPorts is how many consecutive ports a shared TCP listener
// listens on in redirect mode, one socket each, behind one REDIRECT
// --to-ports range.
//
// More than one, so that the kernel's NAT can pick a port whose tuple no
// TIME_WAIT socket holds, and a client's SYN to one service is not
// dropped by PAWS for meeting the TIME_WAIT of its connection to another:
// docs/modes.md says why, with the kernel functions behind it.
const SharedRedirectPorts = 16

// sharedRangeAttempts is how many first ports HostOn tries for a shared
// listener whose range has a taken port: listening ports from the
// kernel's range sit among the ports of outgoing connections.
const sharedRangeAttempts = 8

// openSiblings opens the further sockets of sh, a new shared TCP listener
// in redirect mode, on the ports after its own (SharedRedirectPorts), and
// sets sh.PortEnd. A port that cannot be had ends the range there;
// openSiblings reports false when that port was taken, which a range from
// another first port may not be, and true when the ports ran out (the end
// of the proxy port range, or 65535), which would end any range.
func (m *Manager) openSiblings(ctx context.Context, sh *Listener) bool {
	if sh.Key.Name.Protocol != v1.ProtocolTCP || m.cfg.Transparent {
		return true
	}
	all := true
	for slot := 1; slot < SharedRedirectPorts && int(sh.Port)+slot <= 0xffff; slot++ {
		k := sh.Key
		k.Slot = slot
		l, err := m.OpenAt(ctx, k, sh.Port+uint16(slot))
		if errors.Is(err, errOutsideRange) {
			break
		}
		if err != nil {
			m.log.Debug("a port of the shared listener's range is taken",
				zap.Stringer("servicePort", sh.Key.Name), zap.Uint16("first", sh.Port), zap.Int("slot", slot), zap.Error(err))
			all = false
			break
		}
		l.Routes.Store(sh.Routes.Load())
		sh.siblings = append(sh.siblings, l)
	}
	sh.PortEnd = 0
	if n := len(sh.siblings); n > 0 {
		sh.PortEnd = sh.Port + uint16(n)
	}
	return all
}

// closeSiblings closes the further sockets of shared listener sh.
func (m *Manager) closeSiblings(sh *Listener) {
	for _, l := range sh.siblings {
		m.Close(l)
	}
	sh.siblings, sh.PortEnd = nil, 0
}

// CloseShared closes every shared listener.
func (m *Manager) CloseShared() {
	for k, sh := range m.shared {
		m.closeSiblings(sh)
		m.Close(sh)
		delete(m.shared, k)
	}
}

// Shared returns the shared listeners, in no order.
func (m *Manager) Shared() []*Listener {
	out := make([]*Listener, 0, len(m.shared))
	for _, sh := range m.shared {
		out = append(out, sh)
	}
	return out
}

// StoreRoutes publishes t as the route table of shared listener sh and of
// its further sockets.
func (sh *Listener) StoreRoutes(t *datapath.RouteTable) {
	sh.Routes.Store(t)
	for _, l := range sh.siblings {
		l.Routes.Store(t)
	}
}
