//go:build ignore

// gouring is uring.c in Go: a minimal single-threaded io_uring TCP proxy, as
// a yardstick for what a Go data path on io_uring could carry. It drives the
// ring with raw system calls (golang.org/x/sys/unix has the numbers, and no
// library the project uses wraps io_uring). It listens on :18080
// (SO_REUSEPORT) and connects each client to BACKEND:8080.
//
//	go build -o gouring bench/results/2026-12-01-ceiling/gouring.go
package main

import (
	"fmt"
	"os"
	"runtime"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	entries = 4096
	bufSize = 16384

	opAccept   = 13
	opConnect  = 16
	opClose    = 19
	opSend     = 26
	opRecv     = 27
	opShutdown = 34

	setupCoopTaskrun  = 1 << 8
	setupSingleIssuer = 1 << 12
	setupDeferTaskrun = 1 << 13

	offSQRing = 0
	offCQRing = 0x8000000
	offSQEs   = 0x10000000

	enterGetEvents  = 1
	acceptMultishot = 1
	cqeFMore        = 1 << 1
)

type sqringOffsets struct {
	Head, Tail, RingMask, RingEntries, Flags, Dropped, Array, Resv1 uint32
	UserAddr                                                        uint64
}

type cqringOffsets struct {
	Head, Tail, RingMask, RingEntries, Overflow, Cqes, Flags, Resv1 uint32
	UserAddr                                                        uint64
}

type params struct {
	SQEntries, CQEntries, Flags, SQThreadCPU, SQThreadIdle, Features, WQFd uint32
	Resv                                                                   [3]uint32
	SQOff                                                                  sqringOffsets
	CQOff                                                                  cqringOffsets
}

type sqe struct {
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

type cqe struct {
	UserData uint64
	Res      int32
	Flags    uint32
}

type ring struct {
	fd             int
	sqHead, sqTail *uint32
	sqMask         uint32
	sqArray        []uint32
	sqes           []sqe
	cqHead, cqTail *uint32
	cqMask         uint32
	cqes           []cqe
	tail           uint32 // local SQ tail
	pending        uint32
}

func newRing() (*ring, error) {
	var p params
	p.Flags = setupSingleIssuer | setupDeferTaskrun | setupCoopTaskrun
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, entries, uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", errno)
	}
	r := &ring{fd: int(fd)}
	sqLen := int(p.SQOff.Array) + int(p.SQEntries)*4
	cqLen := int(p.CQOff.Cqes) + int(p.CQEntries)*int(unsafe.Sizeof(cqe{}))
	sq, err := unix.Mmap(r.fd, offSQRing, max(sqLen, cqLen), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("mmap sq ring: %w", err)
	}
	cq := sq // IORING_FEAT_SINGLE_MMAP: one mapping holds both rings
	sqesMem, err := unix.Mmap(r.fd, offSQEs, int(p.SQEntries)*int(unsafe.Sizeof(sqe{})), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("mmap sqes: %w", err)
	}
	r.sqHead = (*uint32)(unsafe.Pointer(&sq[p.SQOff.Head]))
	r.sqTail = (*uint32)(unsafe.Pointer(&sq[p.SQOff.Tail]))
	r.sqMask = *(*uint32)(unsafe.Pointer(&sq[p.SQOff.RingMask]))
	r.sqArray = unsafe.Slice((*uint32)(unsafe.Pointer(&sq[p.SQOff.Array])), p.SQEntries)
	r.sqes = unsafe.Slice((*sqe)(unsafe.Pointer(&sqesMem[0])), p.SQEntries)
	r.cqHead = (*uint32)(unsafe.Pointer(&cq[p.CQOff.Head]))
	r.cqTail = (*uint32)(unsafe.Pointer(&cq[p.CQOff.Tail]))
	r.cqMask = *(*uint32)(unsafe.Pointer(&cq[p.CQOff.RingMask]))
	r.cqes = unsafe.Slice((*cqe)(unsafe.Pointer(&cq[p.CQOff.Cqes])), p.CQEntries)
	r.tail = atomic.LoadUint32(r.sqTail)
	return r, nil
}

// get returns the next free SQE, submitting what is queued when the ring is full.
func (r *ring) get() *sqe {
	if r.tail-atomic.LoadUint32(r.sqHead) >= uint32(len(r.sqes)) {
		r.enter(0)
	}
	i := r.tail & r.sqMask
	r.sqArray[i] = i
	r.tail++
	r.pending++
	e := &r.sqes[i]
	*e = sqe{}
	return e
}

// enter submits the queued SQEs and waits for wait completions.
func (r *ring) enter(wait uint32) {
	atomic.StoreUint32(r.sqTail, r.tail)
	flags := uintptr(0)
	if wait > 0 {
		flags = enterGetEvents
	}
	for {
		var n uintptr
		var errno unix.Errno
		if rawEnter {
			n, _, errno = unix.RawSyscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.pending), uintptr(wait), flags, 0, 0)
		} else {
			n, _, errno = unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.pending), uintptr(wait), flags, 0, 0)
		}
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			panic(fmt.Sprintf("io_uring_enter: %v", errno))
		}
		r.pending -= uint32(n)
		return
	}
}

// rawEnter (GOURING_RAW=1) enters the ring without telling the runtime
// (RawSyscall6): the thread keeps its P while it waits, so no other thread
// takes the P over and hands it back.
var rawEnter = os.Getenv("GOURING_RAW") == "1"

type dir struct {
	c        *conn
	d        int
	len, off int
	buf      [bufSize]byte
}

type conn struct {
	id   uint64
	fd   [2]int
	refs int
	done int
	dirs [2]dir
}

const (
	tAccept = iota
	tConnect
	tRecv
	tSend
	tShut
	tClose
)

type proxy struct {
	r     *ring
	ln    int
	be    unix.RawSockaddrInet4
	conns map[uint64]*conn
	next  uint64
}

func tag(id uint64, d, t int) uint64 { return id<<4 | uint64(d)<<3 | uint64(t) }

func (p *proxy) postAccept() {
	e := p.r.get()
	e.Opcode, e.Fd, e.Ioprio = opAccept, int32(p.ln), acceptMultishot
	e.OpFlags = unix.SOCK_NONBLOCK
	e.UserData = tag(0, 0, tAccept)
}

func (p *proxy) postRecv(d *dir) {
	e := p.r.get()
	e.Opcode, e.Fd = opRecv, int32(d.c.fd[d.d])
	e.Addr, e.Len = uint64(uintptr(unsafe.Pointer(&d.buf[0]))), bufSize
	e.UserData = tag(d.c.id, d.d, tRecv)
	d.c.refs++
}

func (p *proxy) postSend(d *dir) {
	e := p.r.get()
	e.Opcode, e.Fd = opSend, int32(d.c.fd[1-d.d])
	e.Addr, e.Len = uint64(uintptr(unsafe.Pointer(&d.buf[d.off]))), uint32(d.len-d.off)
	e.OpFlags = unix.MSG_NOSIGNAL
	e.UserData = tag(d.c.id, d.d, tSend)
	d.c.refs++
}

func (p *proxy) finish(c *conn) {
	if c.refs > 0 {
		return
	}
	for i := range 2 {
		e := p.r.get()
		e.Opcode, e.Fd, e.UserData = opClose, int32(c.fd[i]), tag(0, 0, tClose)
	}
	delete(p.conns, c.id)
}

func (p *proxy) fail(c *conn) {
	if c.done == 3 {
		return
	}
	c.done = 3
	unix.Shutdown(c.fd[0], unix.SHUT_RDWR)
	unix.Shutdown(c.fd[1], unix.SHUT_RDWR)
}

func (p *proxy) complete(ev cqe) {
	t, d := int(ev.UserData&7), int(ev.UserData>>3&1)
	id := ev.UserData >> 4
	switch t {
	case tClose:
		return
	case tAccept:
		if ev.Flags&cqeFMore == 0 {
			p.postAccept()
		}
		if ev.Res < 0 {
			return
		}
		bfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			unix.Close(int(ev.Res))
			return
		}
		unix.SetsockoptInt(int(ev.Res), unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
		unix.SetsockoptInt(bfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
		p.next++
		c := &conn{id: p.next, fd: [2]int{int(ev.Res), bfd}}
		for i := range 2 {
			c.dirs[i].c, c.dirs[i].d = c, i
		}
		p.conns[c.id] = c
		e := p.r.get()
		e.Opcode, e.Fd = opConnect, int32(bfd)
		e.Addr, e.Off = uint64(uintptr(unsafe.Pointer(&p.be))), uint64(unsafe.Sizeof(p.be))
		e.UserData = tag(c.id, 0, tConnect)
		c.refs++
		return
	}
	c := p.conns[id]
	if c == nil {
		return
	}
	c.refs--
	if t == tConnect {
		if ev.Res < 0 {
			p.fail(c)
			p.finish(c)
			return
		}
		p.postRecv(&c.dirs[0])
		p.postRecv(&c.dirs[1])
		return
	}
	if c.done == 3 {
		p.finish(c)
		return
	}
	dr := &c.dirs[d]
	switch t {
	case tRecv:
		switch {
		case ev.Res > 0:
			dr.len, dr.off = int(ev.Res), 0
			p.postSend(dr)
		case ev.Res == 0:
			e := p.r.get()
			e.Opcode, e.Fd, e.Len = opShutdown, int32(c.fd[1-d]), unix.SHUT_WR
			e.UserData = tag(c.id, d, tShut)
			c.refs++
		default:
			p.fail(c)
		}
	case tSend:
		if ev.Res < 0 {
			p.fail(c)
			break
		}
		dr.off += int(ev.Res)
		if dr.off < dr.len {
			p.postSend(dr)
		} else {
			p.postRecv(dr)
		}
	case tShut:
		c.done |= 1 << d
	}
	if c.done == 3 {
		p.finish(c)
	}
}

func main() {
	runtime.LockOSThread()
	backend := "10.244.0.10"
	if len(os.Args) > 1 {
		backend = os.Args[1]
	}
	p := &proxy{conns: map[uint64]*conn{}}
	p.be.Family = unix.AF_INET
	p.be.Port = 8080>>8 | (8080&0xff)<<8
	var a [4]byte
	fmt.Sscanf(backend, "%d.%d.%d.%d", &a[0], &a[1], &a[2], &a[3])
	p.be.Addr = a
	ln, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		panic(err)
	}
	unix.SetsockoptInt(ln, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	unix.SetsockoptInt(ln, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
	if err := unix.Bind(ln, &unix.SockaddrInet4{Port: 18080}); err != nil {
		panic(err)
	}
	if err := unix.Listen(ln, 4096); err != nil {
		panic(err)
	}
	p.ln = ln
	if p.r, err = newRing(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	p.postAccept()
	r := p.r
	for {
		r.enter(1)
		head := atomic.LoadUint32(r.cqHead)
		tail := atomic.LoadUint32(r.cqTail)
		for ; head != tail; head++ {
			p.complete(r.cqes[head&r.cqMask])
		}
		atomic.StoreUint32(r.cqHead, head)
	}
}
