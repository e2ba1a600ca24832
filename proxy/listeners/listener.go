package listeners

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"

	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/service"
)

// Key names one listener: a service port in one address family.
type Key struct {
	Name service.PortName
	V6   bool
	// Slot numbers the further sockets of a shared listener that listens
	// on a range of ports (SharedRedirectPorts): slot i listens on the
	// shared listener's port + i. Zero on every other listener.
	Slot int
}

// Network is the key's network, as package net names it: "tcp4", "udp6", ….
func (k Key) Network() string {
	n := "tcp"
	if k.Name.Protocol == v1.ProtocolUDP {
		n = "udp"
	}
	if k.V6 {
		return n + "6"
	}
	return n + "4"
}

// Listener is one service port's socket in one family, or, in the shared
// layout, either a service port hosted by a shared listener (Host set, no
// socket of its own) or a shared listener itself (routes set).
type Listener struct {
	// Listener is the data path's part: the socket, its port, and the
	// routing it publishes (Snap, Routes).
	*datapath.Listener
	Key Key
	// PortEnd, above Port, is the last of the consecutive ports that a
	// shared listener listens on, itself on Port and its siblings on the
	// rest; a hosted listener has its host's. Zero means Port alone.
	PortEnd uint16
	// Host is the shared listener that receives this service port's
	// traffic; nil when the listener has its own socket.
	Host *Listener
	// siblings are a shared listener's further sockets, on Port+1 to
	// PortEnd (slots 1 and up), each accepted on as the listener is, with
	// the same route table.
	siblings []*Listener
}

// newListener returns the listener of k, without a socket.
func newListener(k Key) *Listener {
	return &Listener{Key: k, Listener: &datapath.Listener{
		Name: k.Name, Network: k.Network(), V6: k.V6,
		UDP: k.Name.Protocol == v1.ProtocolUDP, Shared: k.Name.IsShared(),
	}}
}

// Engine is what the listeners need of the data path (datapath.Engine):
// sockets opened its way, and their accept and read loops. The Manager
// calls it from its owner's goroutine, and Prepare and StartAccepting from
// Start's callers.
type Engine interface {
	Listen(ctx context.Context, network, addr string) (net.Listener, error)
	ListenUDP(ctx context.Context, network, addr string) (*net.UDPConn, error)
	// Claim marks a listener whose traffic the kernel REDIRECTs to it.
	Claim(l *datapath.Listener)
	Prepare(l *datapath.Listener) error
	StartAccepting(l *datapath.Listener) error
	StartAfter(l *datapath.Listener, ready, stopped <-chan struct{}) error
	// Closed ends a hosted service port's UDP flows, as a closed socket's.
	Closed(l *datapath.Listener)
}

// Config configures a Manager. The zero value of each field is documented.
type Config struct {
	// Transparent binds listeners on loopback for TPROXY (tproxy mode);
	// false binds them on every address, for REDIRECT.
	Transparent bool
	// Redirected says that the kernel's rules REDIRECT traffic to the
	// listeners (redirect mode with rules): each listener is claimed
	// (Engine.Claim). False claims none.
	Redirected bool
	// MaxListeners bounds the listening sockets of the service ports' own
	// listeners (see Manager.Open); zero means no bound.
	MaxListeners int
	// MaxPerService bounds the listening sockets of one Service's ports
	// (see quota.go); zero means DefaultServiceQuota of the budget,
	// negative no bound.
	MaxPerService int
	// MaxPerNamespace bounds the listening sockets of the Services of one
	// namespace; zero means DefaultNamespaceQuota of the budget,
	// negative no bound.
	MaxPerNamespace int
	// PortRange limits listener ports; zero means the ports the kernel
	// assigns to bind(0), chosen by uproxy (portAllocator).
	PortRange PortRange
	// Inherited holds the sockets handed over by the process this one
	// replaces; nil means every listener is bound anew.
	Inherited *Inherited
	// PreviousPort returns the listener port that a previous instance's
	// rules send a service port's traffic to, or 0; nil means none.
	PreviousPort func(name service.PortName, network string) uint16
	// Logger takes the listeners' logs; nil means none.
	Logger *zap.Logger
}

// Manager opens and closes the listeners' sockets: it allocates their
// ports, adopts inherited sockets, bounds their number and hosts service
// ports on shared listeners. Its owner (the proxier's sync goroutine)
// calls it from one goroutine at a time; only Start may run concurrently,
// for different listeners.
type Manager struct {
	cfg    Config
	dp     Engine
	log    *zap.Logger
	ports  portAllocator
	shared map[Key]*Listener // the shared listeners, by family and protocol
	held   holdings          // the sockets by Service and namespace, for the quotas
	// perService and perNamespace are the quotas, set on first use
	// (quotasSet, quotas).
	perService, perNamespace int
	quotasSet                bool
}

// NewManager returns a Manager that opens sockets through dp.
func NewManager(cfg Config, dp Engine) *Manager {
	m := &Manager{cfg: cfg, dp: dp, log: cfg.Logger, ports: portAllocator{r: cfg.PortRange}}
	if m.log == nil {
		m.log = zap.NewNop()
	}
	m.ports.warn = func(err error) {
		m.log.Warn("cannot read the kernel's local port range; listeners bind port 0, which is slower with thousands of them", zap.Error(err))
	}
	return m
}

// Sockets returns how many listening sockets are open.
func (m *Manager) Sockets() int { return m.ports.count() }

// InUse reports whether port is a listener's port of network ("tcp4",
// "udp6", …).
func (m *Manager) InUse(network string, port uint16) bool { return m.ports.inUse(network, port) }

// Open binds a listener for k on all addresses of its family (the
// kernel's REDIRECT rewrites the destination to a local address: 127.0.0.1
// or ::1 for OUTPUT, the incoming interface's address for PREROUTING) and
// starts accepting on it (Start).
func (m *Manager) Open(ctx context.Context, k Key) (*Listener, error) {
	return m.OpenAt(ctx, k, 0)
}

// OpenAt is Open on port exactly, or, when exact is zero,
// on the port that adoptOrAllocate finds.
func (m *Manager) OpenAt(ctx context.Context, k Key, exact uint16) (*Listener, error) {
	l, err := m.Bind(ctx, k, exact)
	if err != nil {
		return nil, err
	}
	if err := m.Start(l); err != nil {
		m.Unbind(l)
		return nil, err
	}
	return l, nil
}

// Unbind closes a listener that Start could not start,
// and frees its port. It runs on the sync goroutine, which owns the port
// allocator.
func (m *Manager) Unbind(l *Listener) {
	l.Close()
	m.ports.release(l.Key.Network(), l.Port)
	m.held.add(l.Key, -1)
}

// Bind is the first half of OpenAt: it binds (or adopts)
// l's socket. It runs on the sync goroutine, which owns the port
// allocator.
func (m *Manager) Bind(ctx context.Context, k Key, exact uint16) (*Listener, error) {
	host := "0.0.0.0"
	if k.V6 {
		host = "::"
	}
	if m.cfg.Transparent {
		// TPROXY --on-ip hands packets to the loopback listener whatever
		// their destination; nothing else can reach it.
		host = "127.0.0.1"
		if k.V6 {
			host = "::1"
		}
	}
	network := k.Network()
	l := newListener(k)
	udp := l.UDP
	port, err := m.adoptOrAllocate(l, host, exact, func(port uint16) (uint16, error) {
		addr := net.JoinHostPort(host, strconv.Itoa(int(port)))
		var local net.Addr
		if udp {
			pc, err := m.dp.ListenUDP(ctx, network, addr)
			if err != nil {
				return 0, err
			}
			l.PC, local = pc, pc.LocalAddr()
		} else {
			ln, err := m.dp.Listen(ctx, network, addr)
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
		return nil, fmt.Errorf("listening for %s (%s): %w", k.Name, network, err)
	}
	l.Port = port
	m.held.add(k, 1)
	return l, nil
}

// ErrBudget says that Config.MaxListeners sockets are open.
var ErrBudget = errors.New("the listener budget is spent")

// listenerBudget returns ErrBudget, with the counts, when the
// listener of k would pass Config.MaxListeners. The shared listeners'
// sockets count, but are never refused: each stands for every service.
func (m *Manager) listenerBudget(k Key) error {
	limit := m.cfg.MaxListeners
	if limit <= 0 || k.Name.IsShared() {
		return nil
	}
	if n := m.ports.count(); n >= limit {
		return fmt.Errorf("%w: %d listening sockets are open, and --max-listeners is %d", ErrBudget, n, limit)
	}
	return nil
}

// Start is the second half of OpenAt: it readies l's
// bound socket for accepting and starts its accept or read loop. It is
// safe to call for different listeners concurrently, and concurrently
// with Bind. An error means that nothing accepts on l: the caller
// closes it (Unbind), and the service port is reported and
// retried as one whose listener could not be opened.
func (m *Manager) Start(l *Listener) error {
	k, network, port := l.Key, l.Key.Network(), l.Port
	if m.cfg.Redirected {
		m.dp.Claim(l.Listener)
	}
	if err := m.dp.Prepare(l.Listener); err != nil {
		return fmt.Errorf("listening for %s (%s): %w", k.Name, network, err)
	}
	adopted, err := m.startAdopted(l)
	if err == nil && !adopted {
		err = m.dp.StartAccepting(l.Listener)
	}
	if err != nil {
		return fmt.Errorf("listening for %s (%s): %w", k.Name, network, err)
	}
	m.log.Info("listening", zap.Stringer("servicePort", k.Name), zap.String("network", network), zap.Uint16("port", port))
	return nil
}

// Close stops accepting for l. Its established connections go on.
// A hosted service port only leaves its shared listener: the next route
// table no longer has it, and its UDP flows end now, as a closed socket's
// would.
func (m *Manager) Close(l *Listener) {
	if l.Host != nil {
		m.dp.Closed(l.Listener)
		m.log.Info("removed service port from the shared listener", zap.Stringer("servicePort", l.Key.Name), zap.Uint16("port", l.Port))
		return
	}
	l.Close()
	m.ports.release(l.Key.Network(), l.Port)
	m.held.add(l.Key, -1)
	m.log.Info("closed listener", zap.Stringer("servicePort", l.Key.Name), zap.Uint16("port", l.Port))
}
