package load

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"unsafe"

	"github.com/spf13/cobra"
	"github.com/uproxy/uproxy/internal/uring"
	"golang.org/x/sys/unix"
)

// NewURingCommand is the benchmarks' io_uring yardstick: a TCP proxy whose
// one loop drives an io_uring, so that the report shows, in the same run as
// uproxy's epoll loops, what a Go data path on io_uring could carry
// (bench/results/history/2026-12-01-ceiling.md).
func NewURingCommand() *cobra.Command {
	return newRouteProxyCommand("uring",
		"Run the io_uring yardstick proxy: one loop, every socket operation on one ring",
		`uring proxies TCP until SIGTERM or SIGINT. Each --route LISTEN=BACKEND[,BACKEND…]
listens on LISTEN; every accepted connection connects to the next backend in turn. One goroutine,
locked to its thread, drives one io_uring: accept (multishot), connect, recv, send, shutdown
and close are ring operations, and each turn of the loop submits every operation the last
completions called for, and waits for the next, in one io_uring_enter. A receive takes a 16 KiB
buffer from a provided-buffer ring when data arrives, and gives it back once it is sent on, so
an idle connection holds none. It does not splice: bulk transfers are copied through the
buffers.`, runURing)
}

// The provided buffers: uringBufCount buffers of uringBufSize bytes.
const (
	uringBufSize  = 16 << 10
	uringBufCount = 512
)

// Operation tags, in a completion's user data below the connection's id
// (or a listener's index) and the direction.
const (
	uringTagAccept = iota
	uringTagConnect
	uringTagRecv
	uringTagSend
	uringTagShutdown
	uringTagClose
	uringTagStop
)

func uringTag(id uint64, dir, tag int) uint64 { return id<<4 | uint64(dir)<<3 | uint64(tag) }

// uringListener is a route's listening socket and the raw addresses of its
// backends, which connect operations point into.
type uringListener struct {
	fd       int
	backends []uringSockaddr
	next     int
}

// uringSockaddr is a backend's struct sockaddr_in or sockaddr_in6.
type uringSockaddr struct {
	raw [unix.SizeofSockaddrInet6]byte
	len uint32
}

func newURingSockaddr(ap netip.AddrPort) uringSockaddr {
	var s uringSockaddr
	var port *uint16
	if a := ap.Addr().Unmap(); a.Is4() {
		sa := (*unix.RawSockaddrInet4)(unsafe.Pointer(&s.raw[0]))
		sa.Family, sa.Addr, port = unix.AF_INET, a.As4(), &sa.Port
		s.len = unix.SizeofSockaddrInet4
	} else {
		sa := (*unix.RawSockaddrInet6)(unsafe.Pointer(&s.raw[0]))
		sa.Family, sa.Addr, port = unix.AF_INET6, a.As16(), &sa.Port
		s.len = unix.SizeofSockaddrInet6
	}
	b := (*[2]byte)(unsafe.Pointer(port)) // network byte order
	b[0], b[1] = byte(ap.Port()>>8), byte(ap.Port())
	return s
}

func (s *uringSockaddr) family() int {
	if s.len == unix.SizeofSockaddrInet4 {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

// uringDir is one direction of a connection: the buffer (bid, or -1 for
// none) with what it received from side d, not yet all sent to the other
// side.
type uringDir struct {
	bid      int
	len, off int
}

// uringConn is a proxied connection: fd[0] the client, fd[1] the backend.
// refs counts its operations in flight: the connection is closed and
// forgotten once it has none and both directions have ended (done == 3).
type uringConn struct {
	id   uint64
	fd   [2]int
	refs int
	done int
	dir  [2]uringDir
}

// uringProxy is the loop's state; its goroutine owns all of it.
type uringProxy struct {
	r    *uring.Ring
	bufs *uring.BufRing
	// starved are the directions whose receive found no buffer
	// (ENOBUFS); they receive again once buffers come back.
	starved   []uringStarved
	listeners []*uringListener
	accepting int // listeners whose multishot accept is in flight
	conns     map[uint64]*uringConn
	lastID    uint64
	stopFD    int
	stopBuf   [8]byte
	stopping  bool
}

// uringStarved is a direction waiting for a buffer.
type uringStarved struct {
	c *uringConn
	d int
}

// runURing serves routes until ctx ends.
func runURing(ctx context.Context, routes []ioRoute) error {
	return runURingBuffers(ctx, routes, uringBufCount)
}

// runURingBuffers is runURing with bufCount provided buffers (a power of
// two).
func runURingBuffers(ctx context.Context, routes []ioRoute, bufCount int) error {
	runtime.LockOSThread() // the ring is single-issuer: one thread enters it
	defer runtime.UnlockOSThread()
	r, err := uring.New(4096)
	if err != nil {
		return fmt.Errorf("uring: io_uring is not available here: %w", err)
	}
	p := &uringProxy{r: r, conns: map[uint64]*uringConn{}, stopFD: -1}
	defer p.close()
	if p.bufs, err = uring.NewBufRing(r, bufCount, uringBufSize); err != nil {
		return fmt.Errorf("uring: %w", err)
	}
	for _, rt := range routes {
		l, err := listenURing(rt)
		if err != nil {
			return fmt.Errorf("uring: %w", err)
		}
		p.listeners = append(p.listeners, l)
	}
	if p.stopFD, err = unix.Eventfd(0, unix.EFD_CLOEXEC); err != nil {
		return fmt.Errorf("uring: eventfd: %w", err)
	}
	// The stop signal's writer ends with ctx or when the loop returns, and
	// is waited for before p.close closes the eventfd it writes to.
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		select {
		case <-ctx.Done():
			one := [8]byte{1}
			_, _ = unix.Write(p.stopFD, one[:])
		case <-done:
		}
	})
	defer func() {
		close(done)
		wg.Wait()
	}()
	e := r.SQE()
	e.Opcode, e.Fd = uring.OpRead, int32(p.stopFD)
	e.Addr, e.Len, e.UserData = uint64(uintptr(unsafe.Pointer(&p.stopBuf[0]))), 8, uringTag(0, 0, uringTagStop)
	for i := range p.listeners {
		p.accept(i)
	}
	fmt.Fprintf(os.Stderr, "uring: %d routes\n", len(routes))
	return p.loop()
}

// listenURing opens rt's listening socket.
func listenURing(rt ioRoute) (*uringListener, error) {
	ap, err := netip.ParseAddrPort(rt.listen)
	if err != nil {
		return nil, fmt.Errorf("listen address %q: %w", rt.listen, err)
	}
	l := &uringListener{}
	for _, b := range rt.backends {
		bap, err := netip.ParseAddrPort(b)
		if err != nil {
			return nil, fmt.Errorf("backend %q: %w", b, err)
		}
		l.backends = append(l.backends, newURingSockaddr(bap))
	}
	var sa unix.Sockaddr
	family := unix.AF_INET
	if a := ap.Addr().Unmap(); a.Is4() {
		sa = &unix.SockaddrInet4{Port: int(ap.Port()), Addr: a.As4()}
	} else {
		sa, family = &unix.SockaddrInet6{Port: int(ap.Port()), Addr: a.As16()}, unix.AF_INET6
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socket: %w", err)
	}
	l.fd = fd
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("SO_REUSEADDR: %w", err)
	}
	if err := unix.Bind(fd, sa); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("bind %s: %w", rt.listen, err)
	}
	if err := unix.Listen(fd, 4096); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("listen %s: %w", rt.listen, err)
	}
	return l, nil
}

// loop enters the ring and handles what completed, until the stop
// completion has come and every connection and accept has ended.
func (p *uringProxy) loop() error {
	for !p.stopping || len(p.conns) > 0 || p.accepting > 0 {
		if err := p.r.Enter(1); err != nil {
			return fmt.Errorf("uring: %w", err)
		}
		p.r.Completions(p.complete)
		p.bufs.Flush()
		// The starved receive again once the ring has a buffer: one put
		// back this turn, or one published before their ENOBUFS came.
		if len(p.starved) > 0 && p.bufs.Held() < p.bufs.Count() {
			starved := p.starved
			p.starved = nil
			for _, w := range starved {
				if p.conns[w.c.id] == w.c && w.c.done&(1<<w.d) == 0 && w.c.done != 3 {
					p.recv(w.c, w.d)
				}
			}
		}
	}
	return nil
}

// close closes every descriptor and the ring.
func (p *uringProxy) close() {
	for _, c := range p.conns {
		unix.Close(c.fd[0])
		unix.Close(c.fd[1])
	}
	for _, l := range p.listeners {
		unix.Close(l.fd)
	}
	if p.stopFD >= 0 {
		unix.Close(p.stopFD)
	}
	p.r.Close()
	if p.bufs != nil {
		p.bufs.Close()
	}
}

func (p *uringProxy) accept(i int) {
	e := p.r.SQE()
	e.Opcode, e.Fd, e.Ioprio = uring.OpAccept, int32(p.listeners[i].fd), uring.AcceptMulti
	e.OpFlags = unix.SOCK_NONBLOCK | unix.SOCK_CLOEXEC
	e.UserData = uringTag(uint64(i), 0, uringTagAccept)
	p.accepting++
}

func (p *uringProxy) recv(c *uringConn, d int) {
	e := p.r.SQE()
	e.Opcode, e.Fd, e.Flags = uring.OpRecv, int32(c.fd[d]), uring.SQEBufSelect
	e.Len, e.BufIndex = uringBufSize, 0 // any buffer of group 0
	e.UserData = uringTag(c.id, d, uringTagRecv)
	c.refs++
}

func (p *uringProxy) send(c *uringConn, d int) {
	dr := &c.dir[d]
	e := p.r.SQE()
	e.Opcode, e.Fd = uring.OpSend, int32(c.fd[1-d])
	e.Addr, e.Len = uint64(uintptr(unsafe.Pointer(&p.bufs.Buf(uint16(dr.bid))[dr.off]))), uint32(dr.len-dr.off)
	e.OpFlags = unix.MSG_NOSIGNAL
	e.UserData = uringTag(c.id, d, uringTagSend)
	c.refs++
}

// fail ends c at once: shutting both sockets down completes every
// operation in flight, and the last completion forgets it.
func (p *uringProxy) fail(c *uringConn) {
	if c.done == 3 {
		return
	}
	c.done = 3
	_ = unix.Shutdown(c.fd[0], unix.SHUT_RDWR)
	_ = unix.Shutdown(c.fd[1], unix.SHUT_RDWR)
}

// finish closes c's sockets and forgets it once nothing is in flight.
func (p *uringProxy) finish(c *uringConn) {
	if c.refs > 0 || c.done != 3 {
		return
	}
	for _, fd := range c.fd {
		e := p.r.SQE()
		e.Opcode, e.Fd, e.UserData = uring.OpClose, int32(fd), uringTag(0, 0, uringTagClose)
	}
	delete(p.conns, c.id)
}

// stop shuts every listener and connection down; loop returns once their
// operations have all completed.
func (p *uringProxy) stop() {
	p.stopping = true
	for _, l := range p.listeners {
		_ = unix.Shutdown(l.fd, unix.SHUT_RDWR)
	}
	for _, c := range p.conns {
		p.fail(c)
		p.finish(c)
	}
}

func (p *uringProxy) complete(ev uring.CQE) {
	tag, d, id := int(ev.UserData&7), int(ev.UserData>>3&1), ev.UserData>>4
	switch tag {
	case uringTagClose:
		return
	case uringTagStop:
		p.stop()
		return
	case uringTagAccept:
		if ev.Flags&uring.CQEFMore == 0 {
			p.accepting--
			if !p.stopping {
				p.accept(int(id))
			}
		}
		switch {
		case ev.Res >= 0 && p.stopping: // accepted as the listener was shut down
			unix.Close(int(ev.Res))
		case ev.Res >= 0:
			p.connect(p.listeners[id], int(ev.Res))
		}
		return
	}
	c := p.conns[id]
	if c == nil {
		return
	}
	c.refs--
	if tag == uringTagRecv && ev.Flags&uring.CQEFBuffer != 0 {
		c.dir[d].bid = int(ev.Flags >> uring.CQEBufferShift)
		p.bufs.Took()
	}
	if c.done == 3 {
		p.release(c, d, tag)
		p.finish(c)
		return
	}
	switch tag {
	case uringTagConnect:
		if ev.Res < 0 {
			p.fail(c)
			break
		}
		p.recv(c, 0)
		p.recv(c, 1)
	case uringTagRecv:
		switch {
		case ev.Res > 0:
			c.dir[d].len, c.dir[d].off = int(ev.Res), 0
			p.send(c, d)
		case ev.Res == 0: // EOF: pass it on
			p.release(c, d, tag)
			e := p.r.SQE()
			e.Opcode, e.Fd, e.Len = uring.OpShutdown, int32(c.fd[1-d]), unix.SHUT_WR
			e.UserData = uringTag(c.id, d, uringTagShutdown)
			c.refs++
		case ev.Res == -int32(unix.ENOBUFS):
			p.starved = append(p.starved, uringStarved{c, d})
		default:
			p.release(c, d, tag)
			p.fail(c)
		}
	case uringTagSend:
		if ev.Res < 0 {
			p.release(c, d, tag)
			p.fail(c)
			break
		}
		c.dir[d].off += int(ev.Res)
		if c.dir[d].off < c.dir[d].len {
			p.send(c, d)
		} else {
			p.release(c, d, tag)
			p.recv(c, d)
		}
	case uringTagShutdown:
		c.done |= 1 << d
	}
	p.finish(c)
}

// release gives back direction d's buffer after its receive or send
// (tag) completed, if it holds one.
func (p *uringProxy) release(c *uringConn, d, tag int) {
	if (tag == uringTagRecv || tag == uringTagSend) && c.dir[d].bid >= 0 {
		p.bufs.Put(uint16(c.dir[d].bid))
		c.dir[d].bid = -1
	}
}

// connect starts a connection from the accepted client cfd to l's next
// backend.
func (p *uringProxy) connect(l *uringListener, cfd int) {
	be := &l.backends[l.next%len(l.backends)]
	l.next++
	bfd, err := unix.Socket(be.family(), unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		unix.Close(cfd)
		return
	}
	_ = unix.SetsockoptInt(cfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	_ = unix.SetsockoptInt(bfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	p.lastID++
	c := &uringConn{id: p.lastID, fd: [2]int{cfd, bfd}, dir: [2]uringDir{{bid: -1}, {bid: -1}}}
	p.conns[c.id] = c
	e := p.r.SQE()
	e.Opcode, e.Fd = uring.OpConnect, int32(bfd)
	e.Addr, e.Off = uint64(uintptr(unsafe.Pointer(&be.raw[0]))), uint64(be.len)
	e.UserData = uringTag(c.id, 0, uringTagConnect)
	c.refs++
}
