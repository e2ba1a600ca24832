package datapath

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"syscall"

	proxyproto "github.com/pires/go-proxyproto"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/balancer"
)

// errNoEndpoints is returned when a service port has no usable endpoint.
var errNoEndpoints = errors.New("no usable endpoints")

// session is one proxied TCP connection, until an event loop carries it.
// Its conns are plain *net.TCPConn values, never wrapped: their
// descriptors are what the loop takes over.
type session struct {
	// client is the accepted connection, or nil when an event loop
	// accepted it (newLoopListener): then fd is its socket, owned by the
	// session until startTCP hands it to the loop, and -1 from then on.
	client *net.TCPConn
	fd     int

	mu      sync.Mutex
	backend *net.TCPConn // nil until dialled
	aborted bool

	// loop carries the session once carry has handed its sockets over
	// (ls is its state there); client and backend are closed then.
	loop *eventLoop
	ls   *loopSession
}

// errAborted: the session was aborted before its sockets could be handed
// to an event loop.
var errAborted = errors.New("session aborted")

// carry hands the session's sockets, both connected, to one of g's loops,
// which calls finish once both are closed. On an error other than
// errAborted nothing has changed: the caller resets the session.
func (s *session) carry(g *loopGroup, finish func(up, down int64)) error {
	l, err := g.loopFor()
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.aborted {
		return errAborted
	}
	ls := &loopSession{finish: finish}
	if ls.side[0].fd, err = dupFD(s.client); err != nil {
		return err
	}
	if ls.side[1].fd, err = dupFD(s.backend); err != nil {
		unix.Close(ls.side[0].fd)
		return err
	}
	// Posted under s.mu, so that an abort, which posts under it too, is
	// queued after the session's registration.
	tcpPipes.enter() // left in eventLoop.end
	if !l.post(func() { l.add(ls) }) {
		tcpPipes.leave()
		unix.Close(ls.side[0].fd)
		unix.Close(ls.side[1].fd)
		return errLoopStopped
	}
	// Closing the originals takes them out of the runtime's poller; the
	// duplicates are the sockets' only descriptors from here on.
	s.client.Close()
	s.backend.Close()
	s.loop, s.ls = l, ls
	return nil
}

// setBackend attaches the dialled backend; false if the session was
// aborted meanwhile (the caller then closes bc).
func (s *session) setBackend(bc *net.TCPConn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.aborted {
		return false
	}
	s.backend = bc
	return true
}

// abort ends the session at once: it resets and closes both sides, or has
// the loop that carries them do it. Used on errors and forced shutdown.
func (s *session) abort() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.aborted {
		return
	}
	s.aborted = true
	if s.loop != nil {
		l, ls := s.loop, s.ls
		l.post(func() { l.abort(ls) })
		return
	}
	if s.fd >= 0 {
		_ = unix.SetsockoptLinger(s.fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1})
		_ = unix.Close(s.fd)
		s.fd = -1
	}
	for _, c := range []*net.TCPConn{s.client, s.backend} {
		if c != nil {
			// Linger 0 makes close send RST, so the peer learns at once that
			// the stream was cut rather than cleanly finished.
			_ = c.SetLinger(0)
			_ = c.Close()
		}
	}
}

// serveTCP carries one accepted connection on a goroutine of its own:
// check its original destination, pick and dial a backend, then hand both
// sockets to an event loop. With the default dialer the loops accept
// instead, and the loop that accepted dials (startTCP).
func (tp *tcpProxy) serveTCP(l *Listener, c *net.TCPConn, s *session) {
	rc, err := c.SyscallConn()
	if err != nil {
		s.abort()
		tp.endSession(s)
		return
	}
	d := tp.admitTCP(l, accepted{rc: rc, client: remoteAddr(c)}, s)
	if d == nil {
		tp.endSession(s)
		return
	}
	tp.connectTCP(s, d)
}

// connectTCP dials d's backend from the calling goroutine, sends the
// PROXY header, and carries the session to its end.
func (tp *tcpProxy) connectTCP(s *session, d *tcpDial) {
	p := tp.e
	finish := func(up, down int64) {
		d.done(up, down)
		tp.endSession(s)
	}
	bc, err := tp.dialBackend(d)
	if err != nil {
		d.refused(err)
		s.abort()
		finish(0, 0)
		return
	}
	if hdr, err := d.header(); err != nil || len(hdr) > 0 {
		if err == nil {
			_, err = bc.Write(hdr)
		}
		if err != nil {
			p.connLog.Warn("sending the PROXY protocol header failed", zap.Stringer("servicePort", d.name), zap.Error(err))
			bc.Close()
			s.abort()
			finish(0, 0)
			return
		}
	}
	if !s.setBackend(bc) {
		bc.Close()
		finish(0, 0)
		return
	}
	err = s.carry(&p.loops, finish)
	switch {
	case err == nil:
		return
	case !errors.Is(err, errAborted):
		// No loop can start (no descriptor left for an epoll instance)
		// or the loops are stopping: the connection is reset, as one
		// the loops accepted would be.
		p.connLog.Error("no event loop to carry a connection; it is reset",
			zap.Stringer("servicePort", d.name), zap.Error(err))
		s.abort()
	}
	finish(0, 0)
}

// startTCP starts a connection that event loop el accepted (newLoopListener),
// on el: it checks the connection, and el dials the backend
// (eventLoop.connect) and carries the session.
func (tp *tcpProxy) startTCP(el *eventLoop, l *Listener, a accepted, s *session) {
	d := tp.admitTCP(l, a, s)
	if d == nil {
		tp.endSession(s)
		return
	}
	finish := func(up, down int64) {
		d.done(up, down)
		tp.endSession(s)
	}
	s.mu.Lock()
	if s.aborted {
		// Shutdown came first; abort closed the socket.
		s.mu.Unlock()
		finish(0, 0)
		return
	}
	ls := &loopSession{finish: finish, dial: d}
	d.loop, d.ls = el, ls
	ls.side[0].fd, ls.side[1].fd = s.fd, -1
	s.fd = -1
	s.loop, s.ls = el, ls
	s.mu.Unlock()
	// An abort from here on is posted to el, and runs after add.
	tcpPipes.enter() // left in eventLoop.end
	el.add(ls)
}

// accepted is an accepted connection as admitTCP sees it: its socket,
// for OriginalDst, and the client's address.
type accepted struct {
	rc     syscall.RawConn
	client netip.AddrPort
}

// admitTCP does what comes before dialling: it finds the connection's
// service port and balancer, and takes a connection slot. Nil means the
// connection was refused and aborted; only the session remains to end.
func (tp *tcpProxy) admitTCP(l *Listener, a accepted, s *session) *tcpDial {
	p := tp.e
	var dst netip.AddrPort
	known := p.cfg.OriginalDst != nil
	if l.Shared {
		// A shared listener: the original destination says which service
		// port the connection is for (proxy/listeners/shared.go).
		var err error
		if known {
			dst, err = p.cfg.OriginalDst(a.rc, l.V6)
		}
		svc := l.Route(dst)
		if svc == nil || err != nil {
			p.sharedRefused(l, dst, err)
			s.abort()
			return nil
		}
		l = svc
	}
	snap := l.Snap.Load()
	if snap == nil {
		// The listener is open but its first snapshot not stored yet. Only
		// a port that someone already sends traffic to can see this: a
		// restarted uproxy taking back its --proxy-port-range port while
		// the previous process's rules still point at it.
		s.abort()
		return nil
	}
	pm := snap.Metrics
	if known && !dst.IsValid() {
		var err error
		if dst, err = p.cfg.OriginalDst(a.rc, l.V6); err != nil {
			p.connLog.Warn("dropping connection without an original destination (not redirected)",
				zap.Stringer("servicePort", l.Name), zap.Error(err))
			pm.refusedDestination()
			s.abort()
			return nil
		}
	}
	client := a.client
	var bal balancer.Balancer
	if !(p.cfg.Transparent && forgedLoopback(client.Addr(), dst)) {
		bal = snap.Route(dst, known, client.Addr(), p.internalClient)
	}
	if bal == nil {
		p.connLog.Warn("dropping connection not addressed to this listener's service",
			zap.Stringer("servicePort", l.Name), zap.Stringer("originalDst", dst))
		pm.refusedDestination()
		s.abort()
		return nil
	}
	// Over the limit, the connection is reset before any backend is dialled:
	// abort's linger 0 makes the close send RST, so the client fails at
	// once instead of waiting on a connection nobody serves.
	if !snap.Slots.acquire(snap.MaxConnections) {
		p.connLog.Warn("refusing connection: the service port is at its connection limit",
			zap.Stringer("servicePort", l.Name), zap.Int("maxConnections", snap.MaxConnections))
		pm.limited()
		s.abort()
		return nil
	}
	d := &tcpDial{p: p, name: l.Name, snap: snap, bal: bal, client: client, dst: dst}
	if p.keepClient(snap, snap.ToClusterIP(dst, known), client.Addr()) {
		d.src.keep = netip.AddrPortFrom(client.Addr().Unmap(), client.Port())
	}
	return d
}

func remoteAddr(c net.Conn) netip.AddrPort {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		ap := a.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	return netip.AddrPort{}
}

// dialBackend connects to d's backend from the calling goroutine, trying
// backends as d's attempts allow (tcpDial.next).
func (tp *tcpProxy) dialBackend(d *tcpDial) (*net.TCPConn, error) {
	for {
		addr, err := d.next()
		if err != nil {
			return nil, err
		}
		c, err := tp.dialOnce(addr, d.from.Addr())
		if err == nil {
			d.connected()
			return c, nil
		}
		d.failed(err)
	}
}

// dialOnce connects to addr, from the address from when it is valid
// (the client's, KeepClient), on the calling
// goroutine: it exits once an event loop has the sockets, stack and all.
func (tp *tcpProxy) dialOnce(addr netip.AddrPort, from netip.Addr) (*net.TCPConn, error) {
	c, err := dialAs[*net.TCPConn](tp.dial("tcp", addr, from))
	return c, err
}

// dial connects to addr over network ("tcp" or "udp") within the dial
// timeout: from the address from when it is valid, else with the
// configured or default dialer. Its own dialers mark the socket with
// Config.OwnMark; Config.Dial's are the caller's.
func (tp *tcpProxy) dial(network string, addr netip.AddrPort, from netip.Addr) (net.Conn, error) {
	p := tp.e
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.dialTimeout())
	defer cancel()
	switch {
	case from.IsValid():
		var c net.Conn
		err := asClientSocketOwner(func() (err error) {
			c, err = transparentDialer(from, network == "udp", p.cfg.OwnMark).DialContext(ctx, network, addr.String())
			return err
		})
		return c, err
	case p.cfg.Dial != nil:
		return p.cfg.Dial(ctx, network, addr.String())
	}
	d := net.Dialer{Control: markControl(p.cfg.OwnMark)}
	return d.DialContext(ctx, network, addr.String())
}

// dialAs returns c as the concrete type the data path needs (a bare
// *net.TCPConn splices; a wrapper would not), closing anything else.
func dialAs[T net.Conn](c net.Conn, err error) (T, error) {
	var zero T
	if err != nil {
		return zero, err
	}
	t, ok := c.(T)
	if !ok {
		c.Close()
		return zero, fmt.Errorf("dialer returned %T, not %T", c, zero)
	}
	return t, nil
}

// newSession registers a connection accepted on l, c or its socket fd,
// so that Shutdown can find it. Once shutdown has begun, or while
// Config.MaxConnections are in progress (counted in overMax), it refuses
// the connection instead: it resets and closes it (abort), so that the
// client fails at once, and returns nil. The bound is checked under the
// lock that registration takes anyway, so that an admitted connection
// costs nothing more.
func (tp *tcpProxy) newSession(l *Listener, c *net.TCPConn, fd int) *session {
	p := tp.e
	s := &session{client: c, fd: fd}
	tp.sessMu.Lock()
	closing := p.closing
	full := p.cfg.MaxConnections > 0 && len(tp.sessions) >= p.cfg.MaxConnections
	if !closing && !full {
		tp.sessions[s] = struct{}{}
		p.wg.Add(1)
		tp.sessMu.Unlock()
		return s
	}
	tp.sessMu.Unlock()
	if !closing {
		tp.overMax.Add(1)
		p.connLog.Warn("refusing connection: the proxy carries its most connections at once",
			zap.Stringer("servicePort", l.Name), zap.Int("maxConnections", p.cfg.MaxConnections))
	}
	s.abort()
	return nil
}

func (tp *tcpProxy) endSession(s *session) {
	p := tp.e
	tp.sessMu.Lock()
	delete(tp.sessions, s)
	tp.sessMu.Unlock()
	p.wg.Done()
}

// proxyHeader returns a PROXY protocol header (version 1 or 2) telling
// the backend the client's address and the address it connected to, for
// backends that cannot see the client's address otherwise (redirect mode).
func proxyHeader(version int, client, dst netip.AddrPort) ([]byte, error) {
	proto := proxyproto.TCPv4
	if client.Addr().Is6() || dst.Addr().Is6() {
		proto = proxyproto.TCPv6
		client = netip.AddrPortFrom(netip.AddrFrom16(client.Addr().As16()), client.Port())
		dst = netip.AddrPortFrom(netip.AddrFrom16(dst.Addr().As16()), dst.Port())
	}
	h := &proxyproto.Header{
		Version:           byte(version),
		Command:           proxyproto.PROXY,
		TransportProtocol: proto,
		SourceAddr:        net.TCPAddrFromAddrPort(client),
		DestinationAddr:   net.TCPAddrFromAddrPort(dst),
	}
	return h.Format()
}

// fdConn is a raw socket's syscall.RawConn, for OriginalDst: Control runs
// f on the descriptor; Read and Write, which would have to wait for the
// socket, are not supported.
type fdConn int

var _ syscall.RawConn = fdConn(0)

func (c fdConn) Control(f func(fd uintptr)) error { f(uintptr(c)); return nil }

func (fdConn) Read(func(fd uintptr) bool) error { return errors.ErrUnsupported }

func (fdConn) Write(func(fd uintptr) bool) error { return errors.ErrUnsupported }

// setAcceptOptions sets, on a listening socket, what the sockets it
// accepts inherit (the kernel clones the listener's options): TCP
// keep-alive with Go's default timing (15s idle, 15s between probes, 9
// probes) and TCP_NODELAY. Set once per listener, by listeners.Manager.Start, they
// spare the five setsockopt calls per accepted connection that Go's
// Accept, or the event loops' accept, would otherwise make.
func setAcceptOptions(rc syscall.RawConn) error {
	var serr error
	if err := rc.Control(func(fd uintptr) {
		if serr = setKeepAliveFD(int(fd)); serr == nil {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
		}
	}); err != nil {
		return err
	}
	return serr
}

// listenConfig returns the ListenConfig of TCP and UDP listeners. Go's
// Accept sets no keep-alive (KeepAlive -1): the accepted sockets inherit
// the listener's (setAcceptOptions).
func (p *Engine) listenConfig() net.ListenConfig {
	lc := net.ListenConfig{KeepAlive: -1}
	if p.cfg.Transparent {
		lc = transparentListenConfig()
		lc.KeepAlive = -1
	}
	return lc
}

// setKeepAliveFD turns TCP keep-alive on for fd with Go's default timing:
// 15s idle, 15s between probes, 9 probes.
func setKeepAliveFD(fd int) error {
	for _, o := range []struct{ level, opt, v int }{
		{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
		{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, 15},
		{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, 15},
		{unix.IPPROTO_TCP, unix.TCP_KEEPCNT, 9},
	} {
		if err := unix.SetsockoptInt(fd, o.level, o.opt, o.v); err != nil {
			return fmt.Errorf("setsockopt %d/%d: %w", o.level, o.opt, err)
		}
	}
	return nil
}
