package main

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
)

// newURingCommand is the benchmarks' io_uring yardstick: a TCP proxy whose
// one loop drives an io_uring, so that the report shows, in the same run as
// uproxy's epoll loops, what a Go data path on io_uring could carry
// (bench/results/2026-12-01-ceiling.md).
func newURingCommand() *cobra.Command {
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

// io_uring's ABI (include/uapi/linux/io_uring.h); golang.org/x/sys/unix
// has only the system call numbers.
const (
	uringOpRead     = 22
	uringOpAccept   = 13
	uringOpConnect  = 16
	uringOpClose    = 19
	uringOpSend     = 26
	uringOpRecv     = 27
	uringOpShutdown = 34

	uringSetupCoopTaskrun  = 1 << 8
	uringSetupSingleIssuer = 1 << 12
	uringSetupDeferTaskrun = 1 << 13

	uringOffSQRing = 0
	uringOffSQEs   = 0x10000000

	uringFeatSingleMmap = 1 << 0
	uringEnterGetEvents = 1 << 0
	uringAcceptMulti    = 1 << 0
	uringCQEFBuffer     = 1 << 0
	uringCQEFMore       = 1 << 1
	uringCQEBufferShift = 16
	uringSQEBufSelect   = 1 << 5

	uringRegisterPbufRing = 22
)

type uringSQOffsets struct {
	Head, Tail, RingMask, RingEntries, Flags, Dropped, Array, Resv1 uint32
	UserAddr                                                        uint64
}

type uringCQOffsets struct {
	Head, Tail, RingMask, RingEntries, Overflow, CQEs, Flags, Resv1 uint32
	UserAddr                                                        uint64
}

type uringParams struct {
	SQEntries, CQEntries, Flags, SQThreadCPU, SQThreadIdle, Features, WQFd uint32
	Resv                                                                   [3]uint32
	SQOff                                                                  uringSQOffsets
	CQOff                                                                  uringCQOffsets
}

// uringSQE is struct io_uring_sqe, 64 bytes.
type uringSQE struct {
	Opcode      uint8
	Flags       uint8
	Ioprio      uint16
	Fd          int32
	Off         uint64
	Addr        uint64
	Len         uint32
	OpFlags     uint32
	UserData    uint64
	BufIndex    uint16
	Personality uint16
	SpliceFdIn  int32
	Addr3       uint64
	_           uint64
}

// uringCQE is struct io_uring_cqe, 16 bytes.
type uringCQE struct {
	UserData uint64
	Res      int32
	Flags    uint32
}

// uring is one io_uring with its rings mapped. Not safe for concurrent
// use: its loop owns it.
type uring struct {
	fd             int
	sqRing, sqeMem []byte
	sqHead, sqTail *uint32
	sqMask         uint32
	sqArray        []uint32
	sqes           []uringSQE
	cqHead, cqTail *uint32
	cqMask         uint32
	cqes           []uringCQE
	tail, unsubmit uint32 // the local SQ tail; SQEs not yet submitted
}

// newURing sets up a ring of entries SQEs, which completes operations
// only when the loop enters it (DEFER_TASKRUN, single issuer), so that
// the kernel's completion work runs on the loop's thread, in its turn.
// Kernels before 6.1 lack those flags (EINVAL), and get a plain ring.
func newURing(entries uint32) (*uring, error) {
	var p uringParams
	p.Flags = uringSetupSingleIssuer | uringSetupDeferTaskrun | uringSetupCoopTaskrun
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno == unix.EINVAL {
		p = uringParams{}
		fd, _, errno = unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	}
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", errno)
	}
	r := &uring{fd: int(fd)}
	if p.Features&uringFeatSingleMmap == 0 {
		r.close()
		return nil, errors.New("io_uring_setup: the kernel maps the rings apart (no IORING_FEAT_SINGLE_MMAP)")
	}
	size := max(int(p.SQOff.Array)+int(p.SQEntries)*4, int(p.CQOff.CQEs)+int(p.CQEntries)*int(unsafe.Sizeof(uringCQE{})))
	var err error
	if r.sqRing, err = unix.Mmap(r.fd, uringOffSQRing, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		r.close()
		return nil, fmt.Errorf("mmap io_uring rings: %w", err)
	}
	if r.sqeMem, err = unix.Mmap(r.fd, uringOffSQEs, int(p.SQEntries)*int(unsafe.Sizeof(uringSQE{})), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		r.close()
		return nil, fmt.Errorf("mmap io_uring SQEs: %w", err)
	}
	ring := r.sqRing // one mapping holds both rings
	u32 := func(off uint32) *uint32 { return (*uint32)(unsafe.Pointer(&ring[off])) }
	r.sqHead, r.sqTail, r.sqMask = u32(p.SQOff.Head), u32(p.SQOff.Tail), *u32(p.SQOff.RingMask)
	r.sqArray = unsafe.Slice(u32(p.SQOff.Array), p.SQEntries)
	r.sqes = unsafe.Slice((*uringSQE)(unsafe.Pointer(&r.sqeMem[0])), p.SQEntries)
	r.cqHead, r.cqTail, r.cqMask = u32(p.CQOff.Head), u32(p.CQOff.Tail), *u32(p.CQOff.RingMask)
	r.cqes = unsafe.Slice((*uringCQE)(unsafe.Pointer(&ring[p.CQOff.CQEs])), p.CQEntries)
	r.tail = atomic.LoadUint32(r.sqTail)
	return r, nil
}

// close unmaps the rings and closes the ring, which cancels what is still
// in flight.
func (r *uring) close() {
	for _, m := range [][]byte{r.sqeMem, r.sqRing} {
		if m != nil {
			_ = unix.Munmap(m)
		}
	}
	unix.Close(r.fd)
}

// sqe returns a zeroed SQE to fill in, submitting what is queued first if
// the ring is full.
func (r *uring) sqe() *uringSQE {
	if r.tail-atomic.LoadUint32(r.sqHead) >= uint32(len(r.sqes)) {
		if err := r.enter(0); err != nil {
			panic(err) // only a bug makes io_uring_enter fail here
		}
	}
	i := r.tail & r.sqMask
	r.sqArray[i] = i
	r.tail++
	r.unsubmit++
	e := &r.sqes[i]
	*e = uringSQE{}
	return e
}

// enter submits the queued SQEs and, with wait above zero, waits for that
// many completions.
func (r *uring) enter(wait uint32) error {
	atomic.StoreUint32(r.sqTail, r.tail) // publishes the SQEs written before
	var flags uintptr
	if wait > 0 {
		flags = uringEnterGetEvents
	}
	for {
		n, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.unsubmit), uintptr(wait), flags, 0, 0)
		switch errno {
		case 0:
			r.unsubmit -= uint32(n)
			return nil
		case unix.EINTR:
			continue
		}
		return fmt.Errorf("io_uring_enter: %w", errno)
	}
}

// completions calls f for each completion the ring holds, then frees
// their slots.
func (r *uring) completions(f func(uringCQE)) {
	head, tail := atomic.LoadUint32(r.cqHead), atomic.LoadUint32(r.cqTail)
	for ; head != tail; head++ {
		f(r.cqes[head&r.cqMask])
	}
	atomic.StoreUint32(r.cqHead, head)
}

// uringBufReg is struct io_uring_buf_reg.
type uringBufReg struct {
	RingAddr    uint64
	RingEntries uint32
	Bgid        uint16
	Flags       uint16
	Resv        [3]uint64
}

// uringBuf is struct io_uring_buf, an entry of a provided-buffer ring. The
// ring's tail is entry 0's Resv.
type uringBuf struct {
	Addr uint64
	Len  uint32
	Bid  uint16
	Resv uint16
}

// The provided buffers: uringBufCount buffers of uringBufSize bytes, in
// group 0.
const (
	uringBufSize  = 16 << 10
	uringBufCount = 512
)

// uringBufRing is a provided-buffer ring (IORING_REGISTER_PBUF_RING): the
// kernel takes a buffer from it when a receive has data, so a connection
// that waits for data holds no buffer. The loop returns a buffer (put)
// once its bytes have been sent on, and publishes the returned ones at
// the end of its turn.
type uringBufRing struct {
	count   int // a power of two
	entries []uringBuf
	mem     []byte // the ring's mapping
	bufs    []byte // uringBufCount buffers
	tail    uint16 // the local tail; publish is what the kernel sees
	publish uint16
	held    int // buffers taken by receives and not put back
}

// newURingBufRing maps and registers r's buffer ring of count buffers (a
// power of two), full.
func newURingBufRing(r *uring, count int) (*uringBufRing, error) {
	b := &uringBufRing{count: count, held: count} // none in the ring yet
	var err error
	if b.mem, err = unix.Mmap(-1, 0, count*int(unsafe.Sizeof(uringBuf{})), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANONYMOUS|unix.MAP_PRIVATE); err != nil {
		return nil, fmt.Errorf("mmap buffer ring: %w", err)
	}
	if b.bufs, err = unix.Mmap(-1, 0, count*uringBufSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANONYMOUS|unix.MAP_PRIVATE); err != nil {
		b.close()
		return nil, fmt.Errorf("mmap buffers: %w", err)
	}
	b.entries = unsafe.Slice((*uringBuf)(unsafe.Pointer(&b.mem[0])), count)
	reg := uringBufReg{RingAddr: uint64(uintptr(unsafe.Pointer(&b.mem[0]))), RingEntries: uint32(count)}
	if _, _, errno := unix.Syscall6(unix.SYS_IO_URING_REGISTER, uintptr(r.fd), uringRegisterPbufRing, uintptr(unsafe.Pointer(&reg)), 1, 0, 0); errno != 0 {
		b.close()
		return nil, fmt.Errorf("io_uring_register IORING_REGISTER_PBUF_RING: %w", errno)
	}
	for bid := range count {
		b.put(uint16(bid))
	}
	b.flush()
	return b, nil
}

// buf returns buffer bid.
func (b *uringBufRing) buf(bid uint16) []byte {
	return b.bufs[int(bid)*uringBufSize : (int(bid)+1)*uringBufSize]
}

// put gives buffer bid back, to be published by flush.
func (b *uringBufRing) put(bid uint16) {
	e := &b.entries[int(b.tail)&(b.count-1)]
	e.Addr, e.Len, e.Bid = uint64(uintptr(unsafe.Pointer(&b.buf(bid)[0]))), uringBufSize, bid
	b.tail++
	b.held--
}

// flush publishes the buffers put since the last flush. The tail shares a 32-bit word with entry 0's
// Bid, which is stored with it unchanged: Go has no 16-bit atomic store,
// and the kernel reads the tail with acquire semantics
// (io_uring/kbuf.c), so the entries must be written before it.
func (b *uringBufRing) flush() {
	if b.tail == b.publish {
		return
	}
	word := (*uint32)(unsafe.Pointer(&b.entries[0].Bid))
	atomic.StoreUint32(word, uint32(b.entries[0].Bid)|uint32(b.tail)<<16)
	b.publish = b.tail
}

func (b *uringBufRing) close() {
	for _, m := range [][]byte{b.mem, b.bufs} {
		if m != nil {
			_ = unix.Munmap(m)
		}
	}
}

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
	r    *uring
	bufs *uringBufRing
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
	r, err := newURing(4096)
	if err != nil {
		return fmt.Errorf("uring: io_uring is not available here: %w", err)
	}
	p := &uringProxy{r: r, conns: map[uint64]*uringConn{}, stopFD: -1}
	defer p.close()
	if p.bufs, err = newURingBufRing(r, bufCount); err != nil {
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
	e := r.sqe()
	e.Opcode, e.Fd = uringOpRead, int32(p.stopFD)
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
		if err := p.r.enter(1); err != nil {
			return fmt.Errorf("uring: %w", err)
		}
		p.r.completions(p.complete)
		p.bufs.flush()
		// The starved receive again once the ring has a buffer: one put
		// back this turn, or one published before their ENOBUFS came.
		if len(p.starved) > 0 && p.bufs.held < p.bufs.count {
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
	p.r.close()
	if p.bufs != nil {
		p.bufs.close()
	}
}

func (p *uringProxy) accept(i int) {
	e := p.r.sqe()
	e.Opcode, e.Fd, e.Ioprio = uringOpAccept, int32(p.listeners[i].fd), uringAcceptMulti
	e.OpFlags = unix.SOCK_NONBLOCK | unix.SOCK_CLOEXEC
	e.UserData = uringTag(uint64(i), 0, uringTagAccept)
	p.accepting++
}

func (p *uringProxy) recv(c *uringConn, d int) {
	e := p.r.sqe()
	e.Opcode, e.Fd, e.Flags = uringOpRecv, int32(c.fd[d]), uringSQEBufSelect
	e.Len, e.BufIndex = uringBufSize, 0 // any buffer of group 0
	e.UserData = uringTag(c.id, d, uringTagRecv)
	c.refs++
}

func (p *uringProxy) send(c *uringConn, d int) {
	dr := &c.dir[d]
	e := p.r.sqe()
	e.Opcode, e.Fd = uringOpSend, int32(c.fd[1-d])
	e.Addr, e.Len = uint64(uintptr(unsafe.Pointer(&p.bufs.buf(uint16(dr.bid))[dr.off]))), uint32(dr.len-dr.off)
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
		e := p.r.sqe()
		e.Opcode, e.Fd, e.UserData = uringOpClose, int32(fd), uringTag(0, 0, uringTagClose)
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

func (p *uringProxy) complete(ev uringCQE) {
	tag, d, id := int(ev.UserData&7), int(ev.UserData>>3&1), ev.UserData>>4
	switch tag {
	case uringTagClose:
		return
	case uringTagStop:
		p.stop()
		return
	case uringTagAccept:
		if ev.Flags&uringCQEFMore == 0 {
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
	if tag == uringTagRecv && ev.Flags&uringCQEFBuffer != 0 {
		c.dir[d].bid = int(ev.Flags >> uringCQEBufferShift)
		p.bufs.held++
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
			e := p.r.sqe()
			e.Opcode, e.Fd, e.Len = uringOpShutdown, int32(c.fd[1-d]), unix.SHUT_WR
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
		p.bufs.put(uint16(c.dir[d].bid))
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
	e := p.r.sqe()
	e.Opcode, e.Fd = uringOpConnect, int32(bfd)
	e.Addr, e.Off = uint64(uintptr(unsafe.Pointer(&be.raw[0]))), uint64(be.len)
	e.UserData = uringTag(c.id, 0, uringTagConnect)
	c.refs++
}

// uringAvailable says why io_uring cannot be used here, or nil.
func uringAvailable() error {
	r, err := newURing(8)
	if err != nil {
		return err
	}
	r.close()
	return nil
}
