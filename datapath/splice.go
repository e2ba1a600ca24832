package datapath

import (
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The TCP data path moves bulk bytes socket → pipe → socket with
// splice(2), and small messages through a buffer, on the event loops
// (loopTCP.read and flush) rather than with net.TCPConn.ReadFrom, which
// takes a pipe from the runtime's pool for the whole call, including the
// wait for the source to become readable (internal/poll.Splice: getPipe,
// then spliceDrain blocks in waitRead), so every idle direction of every
// connection pinned two pipe descriptors: six per proxied connection.
// Here a direction takes a pipe (or a buffer) only once its source has
// data, and gives it back as soon as it has been emptied into the
// destination, so an idle connection holds just its two sockets.

// spliceFlags: never block inside the kernel (the loop learns the sockets'
// readiness from epoll), and move pages instead of copying them where the
// kernel can.
const spliceFlags = unix.SPLICE_F_NONBLOCK | unix.SPLICE_F_MOVE

// kernelPipe is one pipe(2) pair used as the splice buffer, and how many
// bytes sit in it. A pipe goes back to the pool only when empty.
type kernelPipe struct {
	r, w int
	data int
}

func (p *kernelPipe) close() {
	_ = unix.Close(p.r)
	_ = unix.Close(p.w)
}

// pipePool lends pipes to the directions that are moving data. It keeps at
// most max free pipes, and closes them all once no session has used it for
// trimAfter, so a quiet proxy holds no pipe at all. Safe for concurrent use.
type pipePool struct {
	// size is the pipe capacity asked with F_SETPIPE_SZ; zero keeps the
	// kernel's default (16 pages, 64 KiB).
	size int
	// max bounds the free list; a pipe returned to a full list is closed.
	max int
	// trimAfter: free pipes are closed once no session is open for this
	// long.
	trimAfter time.Duration

	mu    sync.Mutex
	free  []*kernelPipe
	users int         // open sessions (enter/leave)
	trim  *time.Timer // runs trimIdle trimAfter after users last dropped to 0
}

// tcpPipes is the process's pipe pool. Its free list is small: a pipe is
// held only between a source turning readable and the pipe being drained,
// so even thousands of connections need only as many pipes as there are
// transfers in flight at one instant. Its pipes hold 1 MiB (as the
// runtime's do): with the default 64 KiB a bulk transfer makes many more
// system calls per byte. Only splicing directions take them.
var tcpPipes = &pipePool{max: 64, size: maxSplice, trimAfter: time.Second}

// enter registers a session that may take pipes; leave undoes it.
func (pp *pipePool) enter() {
	pp.mu.Lock()
	pp.users++
	pp.mu.Unlock()
}

// leave: when the last session leaves, the free pipes are closed after
// trimAfter unless a session is open then. The timer is re-armed at every
// such moment, so it fires trimAfter after the last one; its function runs
// once per firing in a goroutine of its own and returns.
func (pp *pipePool) leave() {
	pp.mu.Lock()
	defer pp.mu.Unlock()
	pp.users--
	if pp.users > 0 || len(pp.free) == 0 {
		return
	}
	if pp.trim == nil {
		pp.trim = time.AfterFunc(pp.trimAfter, pp.trimIdle)
		return
	}
	pp.trim.Reset(pp.trimAfter)
}

// trimIdle closes every free pipe if no session is open.
func (pp *pipePool) trimIdle() {
	pp.mu.Lock()
	if pp.users > 0 {
		pp.mu.Unlock()
		return
	}
	free := pp.free
	pp.free = nil
	pp.mu.Unlock()
	for _, p := range free {
		p.close()
	}
}

// errNoPipe: no pipe could be made (EMFILE, ENFILE, …). Nothing has been
// read then, so the direction goes on through userspace buffers.
var errNoPipe = errors.New("no splice pipe")

// get returns an empty pipe, from the free list or new.
func (pp *pipePool) get() (*kernelPipe, error) {
	pp.mu.Lock()
	if n := len(pp.free); n > 0 {
		p := pp.free[n-1]
		pp.free[n-1] = nil
		pp.free = pp.free[:n-1]
		pp.mu.Unlock()
		return p, nil
	}
	pp.mu.Unlock()
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil, fmt.Errorf("%w: %w", errNoPipe, err)
	}
	if pp.size > 0 {
		// A smaller pipe still works (more splice calls), so a refusal
		// (pipe-max-size, or the user's pipe-user-pages-soft) is ignored.
		_, _ = unix.FcntlInt(uintptr(fds[0]), unix.F_SETPIPE_SZ, pp.size)
	}
	return &kernelPipe{r: fds[0], w: fds[1]}, nil
}

// put returns p. A pipe that still holds bytes (its transfer failed
// half-way) is closed, never reused: the next user would send them to the
// wrong connection.
func (pp *pipePool) put(p *kernelPipe) {
	if p.data != 0 {
		p.close()
		return
	}
	pp.mu.Lock()
	if len(pp.free) < pp.max {
		pp.free = append(pp.free, p)
		p = nil
	}
	pp.mu.Unlock()
	if p != nil {
		p.close()
	}
}

// idleFree returns the number of free pipes (for tests).
func (pp *pipePool) idleFree() int {
	pp.mu.Lock()
	defer pp.mu.Unlock()
	return len(pp.free)
}

// maxSplice bounds one socket → pipe splice; the pipe's capacity bounds it
// further.
const maxSplice = 1 << 20

// copyBufSize is the buffer of the userspace path for small messages. A
// read that fills it means a bulk transfer, which goes back to splice.
const copyBufSize = 16 << 10

// halfState is what one direction of a session carries from one wait for
// data to the next.
type halfState struct {
	// splicing: the direction moves bulk data with splice, else messages
	// through a userspace buffer. small counts the splices in a row that
	// found less than spliceAtLeast to move.
	splicing bool
	small    int
	// inq: TCP_INQ is on for the source (see recvInq). It is turned on at
	// the second wait between messages, so that a connection that carries
	// one request and one answer does not pay for it.
	inq        bool
	boundaries int
}

// inqAfter is the number of waits between messages after which a
// direction turns TCP_INQ on.
const inqAfter = 2

// recvInq reads into b with recvmsg(2), and returns the TCP_INQ hint: the
// bytes still queued after this read, or 1 when none are but a FIN has
// arrived (tcp_inq_hint: "After receiving a FIN, tell the user-space to
// continue reading"); 1 as well when the hint is missing.
func recvInq(fd int, b []byte) (n, inq int, err error) {
	var oob [32]byte // one cmsghdr and an int
	iov := unix.Iovec{Base: &b[0]}
	iov.SetLen(len(b))
	msg := unix.Msghdr{Iov: &iov, Iovlen: 1, Control: &oob[0]}
	msg.SetControllen(len(oob))
	r, err := rawCallP(unix.SYS_RECVMSG, uintptr(fd), unsafe.Pointer(&msg), 0, 0, 0, 0)
	if err != nil {
		return 0, 0, err
	}
	n = int(r)
	inq = 1
	if hdrLen := unix.CmsgLen(0); int(msg.Controllen) >= unix.CmsgLen(4) {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
		if h.Level == unix.SOL_TCP && h.Type == unix.TCP_CM_INQ {
			inq = int(*(*int32)(unsafe.Pointer(&oob[hdrLen])))
		}
	}
	return n, inq, nil
}

// A direction that splices goes back to the userspace path when
// smallSplices wake-ups in a row found less than spliceAtLeast to move: a
// bulk transfer has such wake-ups now and then, and each return costs a
// 16 KiB copy.
const (
	spliceAtLeast = 4 << 10
	smallSplices  = 4
)
