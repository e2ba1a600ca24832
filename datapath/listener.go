package datapath

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"

	"go.uber.org/zap"
)

// Listener is one service port's socket in one family, or, in the shared
// layout, either a service port hosted by a shared listener (no socket of
// its own; the host routes to it) or a shared listener itself (Routes
// set, no snapshot). The control plane creates it, binds LN or PC, and
// hands it to an Engine (Prepare, StartAccepting); it publishes the
// listener's routing in Snap, and a shared listener's in Routes.
type Listener struct {
	// Name is the service port, or the shared listener, for logs.
	Name fmt.Stringer
	// Network is the listener's network: "tcp4", "udp6", …
	Network string
	// V6 is set for an IPv6 listener, UDP for a UDP one.
	V6, UDP bool
	// Shared is set for a shared listener, which routes each connection
	// or datagram by its original destination (Routes).
	Shared bool
	// Port is the port the socket listens on.
	Port uint16

	LN net.Listener // TCP
	PC *net.UDPConn // UDP
	// raw is the listening socket when the event loops accept on it
	// (accept.go); LN or PC is then nil.
	raw *loopListener
	// Snap is the service port's routing; nil until the first sync that
	// applies it.
	Snap atomic.Pointer[Snapshot]
	// Routes is a shared listener's route table; nil on every other
	// listener.
	Routes atomic.Pointer[RouteTable]
	// Guarded is set by the control plane while the kernel drops
	// datagrams sent to the port without a redirect (the listener guard
	// of redirect mode, once a rules write put the port in its set), and
	// cleared when it may not: a new UDP flow then needs no conntrack
	// lookup to be told from a stray datagram. False, the zero value,
	// keeps the lookup.
	Guarded atomic.Bool
}

// Close closes l's socket, which ends its accept or read loop.
func (l *Listener) Close() {
	if l.raw != nil {
		l.raw.close()
	}
	if l.LN != nil {
		l.LN.Close()
	}
	if l.PC != nil {
		l.PC.Close()
	}
}

// File duplicates l's socket descriptor, as a File named name.
func (l *Listener) File(name string) (*os.File, error) {
	var c syscall.Conn
	if l.raw != nil {
		fd, err := l.raw.dup()
		if err != nil {
			return nil, fmt.Errorf("duplicating the socket descriptor: %w", err)
		}
		return os.NewFile(uintptr(fd), name), nil
	}
	if l.PC != nil {
		c = l.PC
	} else if sc, ok := l.LN.(syscall.Conn); ok {
		c = sc
	} else {
		return nil, fmt.Errorf("%T has no socket descriptor", l.LN)
	}
	return SocketFile(c, name)
}

// SocketFile returns a duplicate of c's socket descriptor, close-on-exec,
// as a File named name. Unlike the File methods of package net's types,
// whose Fd method puts the socket into blocking mode, for every process
// sharing it, the duplicate's Fd leaves the socket's mode alone.
func SocketFile(c syscall.Conn, name string) (*os.File, error) {
	nfd, err := dupFD(c)
	if err != nil {
		return nil, fmt.Errorf("duplicating the socket descriptor: %w", err)
	}
	return os.NewFile(uintptr(nfd), name), nil
}

// RouteKey is an original destination as a shared listener's route table
// keys it: an address and port, or, for a node port, only the port (the
// kernel sends a node port there whichever local address it was sent to).
type RouteKey struct {
	Addr netip.Addr // unmapped; the zero Addr for a node port
	Port uint16
}

// RouteTable maps the original destinations of a shared listener's
// traffic to the service port listeners they belong to. Immutable once
// stored; replaced whole after each sync that changed a destination.
type RouteTable map[RouteKey]*Listener

// lookup returns the listener of dst: an exact address and port first,
// then a node port; nil when dst is no service's.
func (t RouteTable) lookup(dst netip.AddrPort) *Listener {
	if l := t[RouteKey{dst.Addr().Unmap(), dst.Port()}]; l != nil {
		return l
	}
	return t[RouteKey{Port: dst.Port()}]
}

// Route returns the service port listener of a connection or datagram
// that the shared listener l received for dst, or nil.
func (l *Listener) Route(dst netip.AddrPort) *Listener {
	t := l.Routes.Load()
	if t == nil {
		return nil
	}
	return t.lookup(dst)
}

// sharedRefused logs a connection or datagram that a shared listener
// received for a destination no service has.
func (p *Engine) sharedRefused(sh *Listener, dst netip.AddrPort, err error) {
	if err != nil {
		p.connLog.Warn("dropping traffic without an original destination (not redirected)",
			zap.Stringer("listener", sh.Name), zap.String("network", sh.Network), zap.Error(err))
		return
	}
	p.connLog.Warn("dropping traffic for a destination no service has",
		zap.Stringer("listener", sh.Name), zap.String("network", sh.Network), zap.Stringer("originalDst", dst))
}

// Claim makes a redirect-mode listener's socket transparent
// (IP_TRANSPARENT, which takes CAP_NET_ADMIN or CAP_NET_RAW): the kernel
// rules (UPROXY-LISTENERS) hand what they redirect only to a transparent
// socket, so a local process that binds a listener port the proxy has
// let go, or left behind when it died, receives none of a Service's
// traffic. An inherited socket gets it too, as an older version
// did not set it. Tproxy-mode listeners are transparent already.
func (p *Engine) Claim(l *Listener) {
	var rc syscall.RawConn
	switch {
	case l.LN != nil:
		rc = ListenerRawConn(l.LN)
	case l.PC != nil:
		rc, _ = l.PC.SyscallConn()
	}
	if rc == nil {
		return
	}
	if err := setTransparent(l.Network, rc, false); err != nil {
		p.log.Warn("cannot make the listener transparent; the kernel rules refuse the connections redirected to it",
			zap.Stringer("servicePort", l.Name), zap.Uint16("port", l.Port), zap.Error(err))
	}
}
