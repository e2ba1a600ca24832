package listeners

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
)

// Handing listeners over from one process to the next (hitless upgrade).
//
// The old process exports a duplicate of every listener's socket
// (ExportListeners), keyed by what the listener serves; the new process
// adopts them (Config.Inherited) instead of binding new sockets, so it
// serves the very same ports, the kernel's rules need no change, and
// connections that arrive meanwhile wait in the sockets' shared queues
// rather than being refused. Moving the descriptors between the processes
// (SCM_RIGHTS over a unix socket) is the caller's business.
//
// A socket lives as long as any process holds a descriptor of it: closing
// the old process's copies (StopListening) only stops that process from
// accepting; neither net.TCPListener.Close nor net.UDPConn.Close calls
// shutdown(2), which would end the socket for both.

// HandoverSocket is one listener's socket on its way from one process to
// the next.
type HandoverSocket struct {
	// Key names the listener stably across processes: its network and its
	// service port, as "tcp4 default/web:http". It is what the new process
	// adopts the socket by.
	Key string
	// Port is the socket's local port, for logs; the adopter reads the
	// port from the socket itself.
	Port uint16
	// File is a duplicate of the socket's descriptor, owned by whoever
	// holds the HandoverSocket: they close it. (Never call Fd on a File
	// that package net's File methods made: it makes the socket blocking
	// for every process that shares it. SocketFile makes safe ones.)
	File *os.File
}

// handoverKey is the key of k's listener in HandoverSocket.Key.
func (k Key) handoverKey() string {
	if k.Slot > 0 {
		return fmt.Sprintf("%s %s #%d", k.Network(), k.Name, k.Slot)
	}
	return k.Network() + " " + k.Name.String()
}

// SocketFile returns a duplicate of c's socket descriptor, close-on-exec,
// as a File named name (datapath.SocketFile).
func SocketFile(c syscall.Conn, name string) (*os.File, error) {
	return datapath.SocketFile(c, name)
}

// CloseHandoverSockets closes the Files of socks.
func CloseHandoverSockets(socks []HandoverSocket) {
	for _, s := range socks {
		if s.File != nil {
			s.File.Close()
		}
	}
}

// Inherited holds the sockets a Proxier received from the process it
// replaces (see ExportListeners). One Inherited serves one Proxier.
//
// When the Proxier opens a listener whose key has a socket here, it adopts
// that socket instead of binding a new one, provided the socket is what it
// would have bound (protocol, family, address, a port within PortRange).
// An adopted listener starts accepting only at the end of the first
// successful sync, when its service's state is in place: connections
// arriving before that wait in the socket's queue, which the previous
// process goes on serving until it is told the new one is ready. The same
// sync closes the sockets that no listener adopted: services the new
// process does not have (any more). Shutdown or StopListening before that
// sync closes them too.
type Inherited struct {
	mu      sync.Mutex
	sockets map[string]HandoverSocket // not adopted yet
	adopted map[*Listener]bool        // waiting for ready
	done    bool                      // first sync over (or stopped): nothing more is adopted
	ready   chan struct{}             // closed at the end of the first successful sync
	stopped chan struct{}             // closed when the Proxier stops before that
}

// NewInherited takes ownership of socks: each is adopted by a listener, or
// closed.
func NewInherited(socks []HandoverSocket) *Inherited {
	in := &Inherited{
		sockets: map[string]HandoverSocket{},
		adopted: map[*Listener]bool{},
		ready:   make(chan struct{}),
		stopped: make(chan struct{}),
	}
	for _, s := range socks {
		if old, dup := in.sockets[s.Key]; dup {
			old.File.Close()
		}
		in.sockets[s.Key] = s
	}
	return in
}

// Len returns how many sockets are still waiting to be adopted.
func (in *Inherited) Len() int {
	if in == nil {
		return 0
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	return len(in.sockets)
}

// take removes and returns the socket of key, if it is still adoptable.
func (in *Inherited) take(key string) (HandoverSocket, bool) {
	if in == nil {
		return HandoverSocket{}, false
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	s, ok := in.sockets[key]
	if !ok || in.done {
		return HandoverSocket{}, false
	}
	delete(in.sockets, key)
	return s, true
}

// Synced ends adoption at the end of the first successful sync: the
// adopted listeners start, the rest is closed.
func (in *Inherited) Synced(log *zap.Logger) {
	if adopted, ok := in.finish(log); ok {
		log.Info("inherited listeners adopted", zap.Int("adopted", adopted))
		close(in.ready)
	}
}

// forget takes l off the adopted listeners, when it is closed instead of
// started (startAdopted).
func (in *Inherited) forget(l *Listener) {
	in.mu.Lock()
	defer in.mu.Unlock()
	delete(in.adopted, l)
}

// Stop ends adoption without starting the adopted listeners, whose
// sockets their owner closes.
func (in *Inherited) Stop(log *zap.Logger) {
	if _, ok := in.finish(log); ok {
		close(in.stopped)
	}
}

// finish closes the sockets nobody adopted and returns how many were;
// false if already finished.
func (in *Inherited) finish(log *zap.Logger) (adopted int, ok bool) {
	if in == nil {
		return 0, false
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.done {
		return 0, false
	}
	in.done = true
	adopted = len(in.adopted)
	for key, s := range in.sockets {
		log.Info("closing an inherited socket that no service claims", zap.String("listener", key), zap.Uint16("port", s.Port))
		s.File.Close()
		delete(in.sockets, key)
	}
	in.adopted = nil
	return adopted, true
}

// adoptOrAllocate gives l the inherited socket of its key, if there is a
// fitting one, and returns its port; otherwise it allocates a port and
// binds with try, as Open always did. host is the address
// Open would bind. A non-zero exact is the only port l may have.
func (m *Manager) adoptOrAllocate(l *Listener, host string, exact uint16, try func(port uint16) (uint16, error)) (uint16, error) {
	network := l.Key.Network()
	if s, ok := m.cfg.Inherited.take(l.Key.handoverKey()); ok {
		port, err := m.adopt(l, host, s)
		if err == nil && exact != 0 && port != exact {
			l.Close()
			err = fmt.Errorf("its port is %d, not %d", port, exact)
		}
		if err == nil {
			return port, nil
		}
		m.log.Warn("cannot adopt the inherited socket; binding a new one, so its rules change",
			zap.Stringer("servicePort", l.Key.Name), zap.String("network", network), zap.Error(err))
	}
	if err := m.admit(l.Key); err != nil {
		return 0, err
	}
	if exact != 0 {
		return m.ports.allocateExact(network, exact, try)
	}
	if m.cfg.PreviousPort != nil {
		if want := m.cfg.PreviousPort(l.Key.Name, network); want != 0 {
			port, err := m.ports.allocatePreferred(network, want, try)
			if err == nil && port != want {
				m.log.Info("the previous instance's listener port is taken; its rules change",
					zap.Stringer("servicePort", l.Key.Name), zap.String("network", network), zap.Uint16("previous", want))
			}
			return port, err
		}
	}
	return m.ports.allocate(network, try)
}

// adopt makes s l's socket after checking it is the socket Open
// would have bound on host. It consumes s.File either way.
func (m *Manager) adopt(l *Listener, host string, s HandoverSocket) (uint16, error) {
	defer s.File.Close() // the listener holds its own duplicate
	udp := l.Key.Name.Protocol == v1.ProtocolUDP
	var local net.Addr
	if udp {
		pc, err := net.FilePacketConn(s.File)
		if err != nil {
			return 0, err
		}
		uc, ok := pc.(*net.UDPConn)
		if !ok {
			pc.Close()
			return 0, fmt.Errorf("not a UDP socket but %T", pc)
		}
		l.PC, local = uc, uc.LocalAddr()
	} else {
		ln, err := net.FileListener(s.File)
		if err != nil {
			return 0, err
		}
		tl, ok := ln.(*net.TCPListener)
		if !ok {
			ln.Close()
			return 0, fmt.Errorf("not a TCP listener but %T", ln)
		}
		l.LN, local = tl, tl.Addr()
	}
	port, err := m.checkAdopted(l, host, local)
	if err != nil {
		l.Close()
		l.LN, l.PC = nil, nil
		return 0, err
	}
	m.ports.mark(l.Key.Network(), port)
	m.cfg.Inherited.mu.Lock()
	m.cfg.Inherited.adopted[l] = true
	m.cfg.Inherited.mu.Unlock()
	m.log.Info("adopted an inherited socket", zap.Stringer("servicePort", l.Key.Name), zap.String("network", l.Key.Network()), zap.Uint16("port", port))
	return port, nil
}

// checkAdopted checks that an adopted socket is bound where Open
// would bind it, within the port range, and for TCP listening.
func (m *Manager) checkAdopted(l *Listener, host string, local net.Addr) (uint16, error) {
	ap, err := netip.ParseAddrPort(local.String())
	if err != nil {
		return 0, fmt.Errorf("socket address %s: %w", local, err)
	}
	if want := netip.MustParseAddr(host); ap.Addr() != want {
		return 0, fmt.Errorf("socket bound to %s, not %s (another mode or family)", local, host)
	}
	if r := m.cfg.PortRange; r.Size > 0 && (ap.Port() < r.Base || int(ap.Port()) >= int(r.Base)+r.Size) {
		return 0, fmt.Errorf("socket port %d is outside --proxy-port-range %s", ap.Port(), r)
	}
	if l.LN != nil {
		rc, err := l.LN.(*net.TCPListener).SyscallConn()
		if err != nil {
			return 0, err
		}
		var listening int
		var serr error
		if err := rc.Control(func(fd uintptr) {
			listening, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
		}); err != nil {
			return 0, err
		}
		if serr != nil {
			return 0, fmt.Errorf("SO_ACCEPTCONN: %w", serr)
		}
		if listening == 0 {
			return 0, errors.New("TCP socket is not listening")
		}
	}
	return ap.Port(), nil
}

// Adopted reports whether l's socket is an inherited one.
func (m *Manager) Adopted(l *Listener) bool {
	in := m.cfg.Inherited
	if in == nil {
		return false
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.adopted[l]
}

// startAdopted starts accepting or reading on an adopted listener once
// the first sync is over (Engine.StartAccepting), and reports whether l was
// adopted; Start starts the others at once. The goroutine waits
// for that sync, then becomes the listener's accept or read loop, or
// exits once the event loops accept on it; it exits at once if the
// Proxier stops before that sync.
//
// A listener for the event loops fails here, and is not adopted, when
// no loop can start (no descriptor left for an epoll instance): the sync
// that adopts the socket can still report the service port and retry it,
// as for a listener that could not be opened, while the goroutine, after
// that sync, could only log the failure, and the rules would send
// connections into a queue that nothing accepts from.
func (m *Manager) startAdopted(l *Listener) (bool, error) {
	if !m.Adopted(l) {
		return false, nil
	}
	in := m.cfg.Inherited
	if err := m.dp.StartAfter(l.Listener, in.ready, in.stopped); err != nil {
		in.forget(l)
		return false, err
	}
	return true, nil
}

// Export returns a duplicate of the sockets of ls (the service ports'
// own listeners; hosted ones are skipped, as their host is exported) and
// of every shared listener, keyed for Inherited and sorted by key. The
// caller closes the Files.
func (m *Manager) Export(ls []*Listener) ([]HandoverSocket, error) {
	var out []HandoverSocket
	var all []*Listener
	for _, l := range ls {
		if l.Host == nil {
			all = append(all, l)
		}
	}
	for _, sh := range m.shared {
		all = append(all, sh)
		all = append(all, sh.siblings...)
	}
	for _, l := range all {
		f, err := l.File(l.Key.handoverKey())
		if err != nil {
			CloseHandoverSockets(out)
			return nil, fmt.Errorf("exporting the %s listener of %s: %w", l.Key.Network(), l.Key.Name, err)
		}
		out = append(out, HandoverSocket{Key: l.Key.handoverKey(), Port: l.Port, File: f})
	}
	slices.SortFunc(out, func(a, b HandoverSocket) int { return strings.Compare(a.Key, b.Key) })
	return out, nil
}
