// Package uring is a minimal io_uring for one loop: the ring, its
// submission and completion queues, and a provided-buffer ring. It has
// what uproxy's event loops and the benchmarks' io_uring yardstick use,
// and no more; golang.org/x/sys/unix has only the system call numbers.
//
// A Ring and a BufRing are not safe for concurrent use: the goroutine
// that drives the ring owns both, and must be locked to its thread from
// New on. The ring is set up single-issuer where the kernel allows, and
// the kernel then refuses (EEXIST) to enter it, or register with it, from
// any other thread than the one that set it up.
package uring

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// io_uring's ABI (include/uapi/linux/io_uring.h).
const (
	OpPollAdd     = 6
	OpAccept      = 13
	OpAsyncCancel = 14
	OpConnect     = 16
	OpClose       = 19
	OpRead        = 22
	OpSend        = 26
	OpRecv        = 27
	OpShutdown    = 34

	setupCoopTaskrun  = 1 << 8
	setupSingleIssuer = 1 << 12

	offSQRing = 0
	offSQEs   = 0x10000000

	featSingleMmap = 1 << 0
	featExtArg     = 1 << 8

	enterGetEvents = 1 << 0
	enterExtArg    = 1 << 3

	// AcceptMulti, in an accept's Ioprio, makes it multishot.
	AcceptMulti = 1 << 0
	// PollAddMulti, in a poll's Len, makes it multishot.
	PollAddMulti = 1 << 0
	// CQEFBuffer: the completion's receive took a provided buffer, whose
	// id is Flags >> CQEBufferShift. CQEFMore: a multishot operation
	// stays armed after this completion.
	CQEFBuffer     = 1 << 0
	CQEFMore       = 1 << 1
	CQEBufferShift = 16
	// SQEBufSelect: the receive takes a buffer from the group in BufIndex.
	SQEBufSelect = 1 << 5

	registerPbufRing = 22
)

type sqOffsets struct {
	Head, Tail, RingMask, RingEntries, Flags, Dropped, Array, Resv1 uint32
	UserAddr                                                        uint64
}

type cqOffsets struct {
	Head, Tail, RingMask, RingEntries, Overflow, CQEs, Flags, Resv1 uint32
	UserAddr                                                        uint64
}

// params is struct io_uring_params.
type params struct {
	SQEntries, CQEntries, Flags, SQThreadCPU, SQThreadIdle, Features, WQFd uint32
	Resv                                                                   [3]uint32
	SQOff                                                                  sqOffsets
	CQOff                                                                  cqOffsets
}

// SQE is struct io_uring_sqe, 64 bytes.
type SQE struct {
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

// CQE is struct io_uring_cqe, 16 bytes.
type CQE struct {
	UserData uint64
	Res      int32
	Flags    uint32
}

// getEventsArg is struct io_uring_getevents_arg.
type getEventsArg struct {
	Sigmask   uint64
	SigmaskSz uint32
	Pad       uint32
	TS        uint64
}

// Ring is one io_uring with its rings mapped.
type Ring struct {
	fd             int
	sqRing, sqeMem []byte
	sqHead, sqTail *uint32
	sqMask         uint32
	sqArray        []uint32
	sqes           []SQE
	cqHead, cqTail *uint32
	cqMask         uint32
	cqes           []CQE
	tail, unsubmit uint32 // the local SQ tail; SQEs not yet submitted
	extArg         bool   // the kernel takes a timeout in io_uring_enter
	ts             unix.Timespec
	arg            getEventsArg
	// err is what broke the ring: SQE could not make room (Err). The
	// SQEs asked for since then are in spill, never submitted.
	err   error
	spill []*SQE
	// failEnter and failTimes: the next failTimes calls of
	// io_uring_enter fail with failEnter instead (FailEnter).
	failEnter unix.Errno
	failTimes int
}

// New sets up a ring of entries SQEs for one issuing thread
// (SINGLE_ISSUER), whose completion work runs on that thread at its next
// entry into the kernel, not in an interrupt of it (COOP_TASKRUN).
// Completions are not deferred until the thread enters the ring for them
// (DEFER_TASKRUN): a loop that waited for a CPU would then find its whole
// batch of receives unposted, and on busy CPUs the keep-alive tail grew.
// Kernels before 6.0 lack those flags (EINVAL), and get a plain
// ring.
func New(entries uint32) (*Ring, error) {
	var p params
	p.Flags = setupSingleIssuer | setupCoopTaskrun
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno == unix.EINVAL {
		p = params{}
		fd, _, errno = unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	}
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", errno)
	}
	r := &Ring{fd: int(fd), extArg: p.Features&featExtArg != 0}
	if p.Features&featSingleMmap == 0 {
		r.Close()
		return nil, errors.New("io_uring_setup: the kernel maps the rings apart (no IORING_FEAT_SINGLE_MMAP)")
	}
	size := max(int(p.SQOff.Array)+int(p.SQEntries)*4, int(p.CQOff.CQEs)+int(p.CQEntries)*int(unsafe.Sizeof(CQE{})))
	var err error
	if r.sqRing, err = unix.Mmap(r.fd, offSQRing, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		r.Close()
		return nil, fmt.Errorf("mmap io_uring rings: %w", err)
	}
	if r.sqeMem, err = unix.Mmap(r.fd, offSQEs, int(p.SQEntries)*int(unsafe.Sizeof(SQE{})), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		r.Close()
		return nil, fmt.Errorf("mmap io_uring SQEs: %w", err)
	}
	ring := r.sqRing // one mapping holds both rings
	u32 := func(off uint32) *uint32 { return (*uint32)(unsafe.Pointer(&ring[off])) }
	r.sqHead, r.sqTail, r.sqMask = u32(p.SQOff.Head), u32(p.SQOff.Tail), *u32(p.SQOff.RingMask)
	r.sqArray = unsafe.Slice(u32(p.SQOff.Array), p.SQEntries)
	r.sqes = unsafe.Slice((*SQE)(unsafe.Pointer(&r.sqeMem[0])), p.SQEntries)
	r.cqHead, r.cqTail, r.cqMask = u32(p.CQOff.Head), u32(p.CQOff.Tail), *u32(p.CQOff.RingMask)
	r.cqes = unsafe.Slice((*CQE)(unsafe.Pointer(&ring[p.CQOff.CQEs])), p.CQEntries)
	r.tail = atomic.LoadUint32(r.sqTail)
	return r, nil
}

// Available says why io_uring cannot be used here, or nil.
func Available() error {
	r, err := New(8)
	if err != nil {
		return err
	}
	r.Close()
	return nil
}

// Fd is the ring's descriptor.
func (r *Ring) Fd() int { return r.fd }

// Close unmaps the rings and closes the ring, which cancels what is still
// in flight.
func (r *Ring) Close() {
	for _, m := range [][]byte{r.sqeMem, r.sqRing} {
		if m != nil {
			_ = unix.Munmap(m)
		}
	}
	unix.Close(r.fd)
}

// SQE returns a zeroed SQE to fill in, submitting what is queued first if
// the ring is full. If that submission fails, the ring is broken (Err)
// and the SQE, and every one after it, goes nowhere: the caller finds
// them with Unsubmitted.
func (r *Ring) SQE() *SQE {
	if r.err == nil && r.tail-atomic.LoadUint32(r.sqHead) >= uint32(len(r.sqes)) {
		if err := r.Enter(0); err != nil {
			r.err = fmt.Errorf("submitting to make room for an SQE: %w", err)
		}
	}
	if r.err != nil {
		e := &SQE{}
		r.spill = append(r.spill, e)
		return e
	}
	i := r.tail & r.sqMask
	r.sqArray[i] = i
	r.tail++
	r.unsubmit++
	e := &r.sqes[i]
	*e = SQE{}
	return e
}

// Pending is the number of SQEs not yet submitted.
func (r *Ring) Pending() int { return int(r.unsubmit) }

// Err returns what broke the ring, or nil: an io_uring_enter that failed
// as SQE made room. The ring's owner then closes it and carries on
// without it.
func (r *Ring) Err() error { return r.err }

// Unsubmitted calls f for each SQE filled in and never submitted: those
// still queued in the ring, and those SQE returned after the ring broke.
// The owner of a failed ring uses it to do what they asked for (a
// close) by other means.
func (r *Ring) Unsubmitted(f func(*SQE)) {
	for i := r.tail - r.unsubmit; i != r.tail; i++ {
		f(&r.sqes[i&r.sqMask])
	}
	for _, e := range r.spill {
		f(e)
	}
}

// FailEnter makes the next times calls of io_uring_enter fail with errno,
// without entering the kernel: tests use it to check how the ring's
// owner survives errors it cannot otherwise provoke.
func (r *Ring) FailEnter(errno unix.Errno, times int) {
	r.failEnter, r.failTimes = errno, times
}

// Failing reports whether io_uring_enter calls are still to fail
// (FailEnter).
func (r *Ring) Failing() bool { return r.failTimes > 0 }

// Enter submits the queued SQEs and, with wait above zero, waits for that
// many completions.
func (r *Ring) Enter(wait uint32) error {
	return r.EnterTimeout(wait, -1)
}

// EnterTimeout is Enter that waits at most timeout (negative: no bound).
// A wait that times out is not an error. Kernels without
// IORING_FEAT_EXT_ARG (before 5.11) take no timeout: there a bounded
// wait only submits, and returns at once.
//
// With IORING_FEAT_NODROP, EBUSY means completions wait in the kernel's
// backlog for room in the completion ring: reap them (Completions) and
// enter again. EBADR means the kernel dropped completions: what was in
// flight can no longer be accounted for.
func (r *Ring) EnterTimeout(wait uint32, timeout time.Duration) error {
	atomic.StoreUint32(r.sqTail, r.tail) // publishes the SQEs written before
	var flags, arg, argsz uintptr
	if wait > 0 {
		flags = enterGetEvents
		if timeout >= 0 {
			if !r.extArg {
				wait, flags = 0, 0
			} else {
				r.ts = unix.NsecToTimespec(int64(timeout))
				r.arg = getEventsArg{TS: uint64(uintptr(unsafe.Pointer(&r.ts)))}
				flags |= enterExtArg
				arg, argsz = uintptr(unsafe.Pointer(&r.arg)), unsafe.Sizeof(r.arg)
			}
		}
	}
	for {
		if r.failTimes > 0 {
			r.failTimes--
			return fmt.Errorf("io_uring_enter: %w", r.failEnter)
		}
		n, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.unsubmit), uintptr(wait), flags, arg, argsz)
		switch errno {
		case 0:
			r.unsubmit -= uint32(n)
			return nil
		case unix.ETIME:
			// The wait timed out, and nothing was submitted: a call that
			// submits returns the count, whatever the wait did
			// (io_uring_enter: "submitted ? submitted : ret").
			return nil
		case unix.EINTR:
			continue
		}
		return fmt.Errorf("io_uring_enter: %w", errno)
	}
}

// Completions calls f for each completion the ring holds, then frees
// their slots; it returns how many there were.
func (r *Ring) Completions(f func(CQE)) int {
	head, tail := atomic.LoadUint32(r.cqHead), atomic.LoadUint32(r.cqTail)
	n := int(tail - head)
	for ; head != tail; head++ {
		f(r.cqes[head&r.cqMask])
	}
	atomic.StoreUint32(r.cqHead, head)
	return n
}

// bufReg is struct io_uring_buf_reg.
type bufReg struct {
	RingAddr    uint64
	RingEntries uint32
	Bgid        uint16
	Flags       uint16
	Resv        [3]uint64
}

// buf is struct io_uring_buf, an entry of a provided-buffer ring. The
// ring's tail is entry 0's Resv.
type buf struct {
	Addr uint64
	Len  uint32
	Bid  uint16
	Resv uint16
}

// BufRing is a provided-buffer ring (IORING_REGISTER_PBUF_RING, Linux
// 5.19) of group 0: the kernel takes a buffer from it when a receive has
// data, so a connection that waits for data holds no buffer. Its owner
// returns a buffer (Put) once done with its bytes, and publishes the
// returned ones (Flush) at the end of its turn.
type BufRing struct {
	count   int // a power of two
	size    int
	entries []buf
	mem     []byte // the ring's mapping
	bufs    []byte // count buffers of size bytes
	tail    uint16 // the local tail; publish is what the kernel sees
	publish uint16
	held    int // buffers taken by receives and not put back
}

// NewBufRing maps and registers r's buffer ring, as group 0, of count
// buffers (a power of two) of size bytes, full.
func NewBufRing(r *Ring, count, size int) (*BufRing, error) {
	if count <= 0 || count&(count-1) != 0 || count > 1<<15 {
		return nil, fmt.Errorf("buffer ring of %d buffers: not a power of two up to 32768", count)
	}
	b := &BufRing{count: count, size: size, held: count} // none in the ring yet
	var err error
	if b.mem, err = unix.Mmap(-1, 0, count*int(unsafe.Sizeof(buf{})), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANONYMOUS|unix.MAP_PRIVATE); err != nil {
		return nil, fmt.Errorf("mmap buffer ring: %w", err)
	}
	if b.bufs, err = unix.Mmap(-1, 0, count*size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANONYMOUS|unix.MAP_PRIVATE); err != nil {
		b.Close()
		return nil, fmt.Errorf("mmap buffers: %w", err)
	}
	b.entries = unsafe.Slice((*buf)(unsafe.Pointer(&b.mem[0])), count)
	reg := bufReg{RingAddr: uint64(uintptr(unsafe.Pointer(&b.mem[0]))), RingEntries: uint32(count)}
	if _, _, errno := unix.Syscall6(unix.SYS_IO_URING_REGISTER, uintptr(r.fd), registerPbufRing, uintptr(unsafe.Pointer(&reg)), 1, 0, 0); errno != 0 {
		b.Close()
		return nil, fmt.Errorf("io_uring_register IORING_REGISTER_PBUF_RING: %w", errno)
	}
	for bid := range count {
		b.Put(uint16(bid))
	}
	b.Flush()
	return b, nil
}

// Size is the size of each buffer.
func (b *BufRing) Size() int { return b.size }

// Count is the number of buffers.
func (b *BufRing) Count() int { return b.count }

// Held is the number of buffers taken by receives and not put back.
func (b *BufRing) Held() int { return b.held }

// Buf returns buffer bid.
func (b *BufRing) Buf(bid uint16) []byte {
	return b.bufs[int(bid)*b.size : (int(bid)+1)*b.size]
}

// Took counts a buffer that a completion says its receive took
// (CQEFBuffer).
func (b *BufRing) Took() { b.held++ }

// Put gives buffer bid back, to be published by Flush.
func (b *BufRing) Put(bid uint16) {
	e := &b.entries[int(b.tail)&(b.count-1)]
	e.Addr, e.Len, e.Bid = uint64(uintptr(unsafe.Pointer(&b.Buf(bid)[0]))), uint32(b.size), bid
	b.tail++
	b.held--
}

// Flush publishes the buffers put since the last Flush. The tail shares a
// 32-bit word with entry 0's Bid, which is stored with it unchanged: Go
// has no 16-bit atomic store, and the kernel reads the tail with acquire
// semantics (io_uring/kbuf.c), so the entries must be written before it.
func (b *BufRing) Flush() {
	if b.tail == b.publish {
		return
	}
	word := (*uint32)(unsafe.Pointer(&b.entries[0].Bid))
	atomic.StoreUint32(word, uint32(b.entries[0].Bid)|uint32(b.tail)<<16)
	b.publish = b.tail
}

// Close unmaps the buffers and their ring. The ring they were registered
// with must be closed, or have no receive in flight, first.
func (b *BufRing) Close() {
	for _, m := range [][]byte{b.mem, b.bufs} {
		if m != nil {
			_ = unix.Munmap(m)
		}
	}
}
