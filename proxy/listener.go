package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/service"
)

// listenerSet holds one service's listeners, one per port and family.
// A service has few, so they are scanned: a map per service held more
// memory than its listeners at scale.
type listenerSet []*listener

// get returns the listener of k, or nil.
func (ls listenerSet) get(k portKey) *listener {
	for _, l := range ls {
		if l.key == k {
			return l
		}
	}
	return nil
}

// portKey names one listener: a service port in one address family.
type portKey struct {
	name service.PortName
	v6   bool
	// slot numbers the further sockets of a shared listener that listens
	// on a range of ports (sharedRedirectPorts): slot i listens on the
	// shared listener's port + i. Zero on every other listener.
	slot int
}

func (k portKey) network() string {
	n := "tcp"
	if k.name.Protocol == v1.ProtocolUDP {
		n = "udp"
	}
	if k.v6 {
		return n + "6"
	}
	return n + "4"
}

// listener is one service port's socket in one family, or, in the shared
// layout, either a service port hosted by a shared listener (host set, no
// socket of its own) or a shared listener itself (routes set, no
// snapshot).
type listener struct {
	// Listener is the data path's part: the socket, its port, and the
	// routing it publishes (Snap, Routes).
	*datapath.Listener
	key portKey
	// portEnd, above port, is the last of the consecutive ports that a
	// shared listener listens on, itself on port and its siblings on the
	// rest; a hosted listener has its host's. Zero means port alone.
	portEnd uint16
	// siblings are a shared listener's further sockets, on port+1 to
	// portEnd (slots 1 and up), each accepted on as the listener is, with
	// the same route table.
	siblings []*listener
	// snap is what the listener's Snap was built from; nil until the
	// first sync that applies it.
	snap atomic.Pointer[snapshot]
	// host is the shared listener that receives this service port's
	// traffic; nil when the listener has its own socket.
	host *listener

	// Owned by the sync goroutine.
	affinity        *balancer.AffinityTable
	affinityTimeout time.Duration
}

// newListener returns the listener of k, without a socket.
func newListener(k portKey) *listener {
	return &listener{key: k, Listener: &datapath.Listener{
		Name: k.name, Network: k.network(), V6: k.v6,
		UDP: k.name.Protocol == v1.ProtocolUDP, Shared: k.name.IsShared(),
	}}
}

// openListener binds a listener for k on all addresses of its family (the
// kernel's REDIRECT rewrites the destination to a local address: 127.0.0.1
// or ::1 for OUTPUT, the incoming interface's address for PREROUTING) and
// starts accepting on it (startAccepting).
func (p *Proxier) openListener(ctx context.Context, k portKey) (*listener, error) {
	return p.openListenerAt(ctx, k, 0)
}

// openListenerAt is openListener on port exactly, or, when exact is zero,
// on the port that adoptOrAllocate finds.
func (p *Proxier) openListenerAt(ctx context.Context, k portKey, exact uint16) (*listener, error) {
	l, err := p.bindListener(ctx, k, exact)
	if err != nil {
		return nil, err
	}
	if err := p.startListener(l); err != nil {
		p.unbindListener(l)
		return nil, err
	}
	return l, nil
}

// unbindListener closes a listener that startListener could not start,
// and frees its port. It runs on the sync goroutine, which owns the port
// allocator.
func (p *Proxier) unbindListener(l *listener) {
	l.Close()
	p.ports.release(l.key.network(), l.Port)
}

// bindListener is the first half of openListenerAt: it binds (or adopts)
// l's socket. It runs on the sync goroutine, which owns the port
// allocator.
func (p *Proxier) bindListener(ctx context.Context, k portKey, exact uint16) (*listener, error) {
	host := "0.0.0.0"
	if k.v6 {
		host = "::"
	}
	if p.cfg.Transparent {
		// TPROXY --on-ip hands packets to the loopback listener whatever
		// their destination; nothing else can reach it.
		host = "127.0.0.1"
		if k.v6 {
			host = "::1"
		}
	}
	network := k.network()
	l := newListener(k)
	udp := l.UDP
	port, err := p.adoptOrAllocate(l, host, exact, func(port uint16) (uint16, error) {
		addr := net.JoinHostPort(host, strconv.Itoa(int(port)))
		var local net.Addr
		if udp {
			pc, err := p.dp.ListenUDP(ctx, network, addr)
			if err != nil {
				return 0, err
			}
			l.PC, local = pc, pc.LocalAddr()
		} else {
			ln, err := p.dp.Listen(ctx, network, addr)
			if err != nil {
				return 0, err
			}
			l.LN, local = ln, ln.Addr()
		}
		ap, err := netip.ParseAddrPort(local.String())
		if err != nil {
			l.Close()
			return 0, fmt.Errorf("listener address %s: %w", local, err)
		}
		return ap.Port(), nil
	})
	if err != nil {
		return nil, fmt.Errorf("listening for %s (%s): %w", k.name, network, err)
	}
	l.Port = port
	return l, nil
}

// errListenerBudget: Config.MaxListeners sockets are open.
var errListenerBudget = errors.New("the listener budget is spent")

// listenerBudget returns errListenerBudget, with the counts, when the
// listener of k would pass Config.MaxListeners. The shared listeners'
// sockets count, but are never refused: each stands for every service.
func (p *Proxier) listenerBudget(k portKey) error {
	limit := p.cfg.MaxListeners
	if limit <= 0 || k.name == service.SharedName(k.name.Protocol) {
		return nil
	}
	if n := p.ports.count(); n >= limit {
		return fmt.Errorf("%w: %d listening sockets are open, and --max-listeners is %d", errListenerBudget, n, limit)
	}
	return nil
}

// startListener is the second half of openListenerAt: it readies l's
// bound socket for accepting and starts its accept or read loop. It is
// safe to call for different listeners concurrently, and concurrently
// with bindListener. An error means that nothing accepts on l: the caller
// closes it (unbindListener), and the service port is reported and
// retried as one whose listener could not be opened.
func (p *Proxier) startListener(l *listener) error {
	k, network, port := l.key, l.key.network(), l.Port
	if p.cfg.Rules != nil && !p.cfg.Transparent {
		p.dp.Claim(l.Listener)
	}
	if err := p.dp.Prepare(l.Listener); err != nil {
		return fmt.Errorf("listening for %s (%s): %w", k.name, network, err)
	}
	adopted, err := p.startAdopted(l)
	if err == nil && !adopted {
		err = p.dp.StartAccepting(l.Listener)
	}
	if err != nil {
		return fmt.Errorf("listening for %s (%s): %w", k.name, network, err)
	}
	p.log.Info("listening", zap.Stringer("servicePort", k.name), zap.String("network", network), zap.Uint16("port", port))
	return nil
}

// closeListener stops accepting for l. Its established connections go on.
// A hosted service port only leaves its shared listener: the next route
// table no longer has it, and its UDP flows end now, as a closed socket's
// would.
func (p *Proxier) closeListener(l *listener) {
	if l.host != nil {
		p.dp.Closed(l.Listener)
		p.log.Info("removed service port from the shared listener", zap.Stringer("servicePort", l.key.name), zap.Uint16("port", l.Port))
		return
	}
	l.Close()
	p.ports.release(l.key.network(), l.Port)
	p.log.Info("closed listener", zap.Stringer("servicePort", l.key.name), zap.Uint16("port", l.Port))
}
