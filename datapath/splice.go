package datapath

import (
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The TCP data path moves bulk bytes socket → pipe → socket with
// splice(2), and small messages through a pooled userspace buffer, in the
// proxy's own loop on the sockets' RawConns rather than
// net.TCPConn.ReadFrom. ReadFrom takes a pipe from the runtime's pool for
// the whole call, including the wait for the source to become readable
// (internal/poll.Splice: getPipe, then spliceDrain blocks in waitRead), so
// every idle direction of every connection pinned two pipe descriptors:
// six per proxied connection. Here a direction takes a pipe (or a buffer)
// only once its source has data, and gives it back as soon as it has been
// emptied into the destination, so an idle connection holds just its two
// sockets.

// spliceFlags: never block inside the kernel (the sockets' readiness comes
// from Go's netpoller through RawConn), and move pages instead of copying
// them where the kernel can.
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

// spliceOnce waits until src is readable (holding no pipe meanwhile), moves
// what it has (up to one pipe's worth) into a pipe, and pumps all of it to
// dst. It returns the bytes written to dst; eof when src has reached EOF
// (nothing moved). An error from src's wait (a deadline, a close) comes
// back as is, so the caller can tell a timeout; it happens only while no
// byte is in flight. An error while pumping loses at most the bytes in
// the pipe, and the pipe with them.
func (pp *pipePool) spliceOnce(dst, src syscall.RawConn) (written int, eof bool, err error) {
	var (
		p          *kernelPipe
		in         int
		serr, perr error
	)
	rerr := src.Read(func(fd uintptr) bool {
		if p == nil {
			if p, perr = pp.get(); perr != nil {
				return true
			}
		}
		in, serr = spliceRetry(int(fd), p.w, maxSplice)
		if serr == unix.EAGAIN {
			// The pipe is empty, so EAGAIN means the socket has nothing:
			// give the pipe back before the wait, however long it is.
			pp.put(p)
			p = nil
			return false
		}
		return true
	})
	switch {
	case perr != nil:
		return 0, false, perr
	case rerr != nil:
		if p != nil {
			pp.put(p)
		}
		return 0, false, rerr
	case serr != nil:
		if p != nil {
			pp.put(p)
		}
		return 0, false, fmt.Errorf("splice from socket: %w", serr)
	case in == 0:
		pp.put(p)
		return 0, true, nil
	}
	p.data = in
	werr := dst.Write(func(fd uintptr) bool {
		for p.data > 0 {
			n, err := spliceRetry(p.r, int(fd), p.data)
			if n > 0 {
				p.data -= n
				written += n
				continue
			}
			if err == unix.EAGAIN {
				return false // wait until dst has room
			}
			if err == nil {
				err = io.ErrUnexpectedEOF // the pipe is ours: it cannot be empty here
			}
			serr = err
			return true
		}
		return true
	})
	pp.put(p)
	if werr != nil {
		return written, false, werr
	}
	if serr != nil {
		return written, false, fmt.Errorf("splice to socket: %w", serr)
	}
	return written, false, nil
}

// maxSplice bounds one socket → pipe splice; the pipe's capacity bounds it
// further.
const maxSplice = 1 << 20

// copyBufSize is the buffer of the userspace path for small messages. A
// read that fills it means a bulk transfer, which goes back to splice.
const copyBufSize = 16 << 10

// copyBufs lends buffers to the userspace path. A buffer is held only
// between a read and the write of what it read, never across a wait, so an
// idle connection holds none.
var copyBufs = sync.Pool{New: func() any { return new([copyBufSize]byte) }}

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

// move waits until src has data and moves what it can to dst, by splice or
// by copyMessages as the traffic so far suggests. It returns the bytes
// written to dst, eof at src's EOF, and the error of the wait (a deadline,
// a close) or of the transfer. copied, if set, counts the bytes that go
// through the userspace buffer (Stats.Copied).
func (h *halfState) move(dst, src syscall.RawConn, copied *atomic.Int64) (n int, eof bool, err error) {
	if h.splicing {
		n, eof, err = tcpPipes.spliceOnce(dst, src)
		if n >= spliceAtLeast {
			h.small = 0
		} else {
			h.small++
		}
		h.splicing = err == nil && !eof && h.small < smallSplices
		if !errors.Is(err, errNoPipe) {
			return n, eof, err
		}
	}
	n, eof, h.splicing, err = h.copyMessages(dst, src)
	if copied != nil {
		copied.Add(int64(n))
	}
	return n, eof, err
}

// copyMessages moves src's bytes to dst through a pooled userspace buffer:
// per message a read, a write, and, until TCP_INQ is on, the read that
// finds the socket empty; splice always takes three (socket → pipe, pipe
// → socket, and the splice that finds the socket empty), plus a pipe from
// the pool. It keeps going, message after message, inside one RawRead, and
// returns:
//   - full, once a read fills the buffer (a bulk transfer: splice is
//     cheaper from there on), after writing what it read;
//   - eof at src's EOF;
//   - with the error of src's wait (a deadline, a close), or of a read or
//     write (the caller then aborts: bytes read but not written are lost
//     with the session).
//
// written counts the bytes written to dst in every case.
func (h *halfState) copyMessages(dst, src syscall.RawConn) (written int, eof, full bool, err error) {
	var (
		buf     *[copyBufSize]byte
		pending []byte
		serr    error
		moved   bool // since the last wait
	)
	rerr := src.Read(func(fd uintptr) bool {
		if buf == nil {
			buf = copyBufs.Get().(*[copyBufSize]byte)
		}
		for {
			var (
				n, inq int
				err    error
			)
			if h.inq {
				n, inq, err = recvInq(int(fd), buf[:])
			} else {
				n, err = readRetry(int(fd), buf[:])
				inq = 1 // unknown: read again
			}
			switch {
			case err == unix.EAGAIN:
				if moved {
					moved = false
					if h.boundaries++; h.boundaries == inqAfter {
						h.inq = unix.SetsockoptInt(int(fd), unix.SOL_TCP, unix.TCP_INQ, 1) == nil
					}
				}
				copyBufs.Put(buf)
				buf = nil
				return false
			case err != nil:
				serr = fmt.Errorf("read from socket: %w", err)
				return true
			case n == 0:
				eof = true
				return true
			}
			w, werr := writeNow(dst, buf[:n])
			written += w
			moved = true
			full = n == len(buf)
			switch {
			case werr != nil:
				serr = werr
				return true
			case w < n:
				pending = buf[w:n] // dst is full: wait for room outside this read
				return true
			case full:
				return true
			case inq == 0:
				// Nothing left to read, and no FIN (see recvInq): wait for
				// the next data without the read that would only say
				// EAGAIN. Safe within one RawRead: the poller's readiness
				// is reset only when a RawRead starts, so anything that
				// arrived after the read wakes the wait at once.
				copyBufs.Put(buf)
				buf = nil
				return false
			}
			// A short read may have taken the FIN along with the data,
			// which no later readiness event would announce: read again,
			// which finds EAGAIN (then wait), EOF, or new data.
		}
	})
	if rerr == nil && serr == nil && len(pending) > 0 {
		var w int
		w, serr = writeAll(dst, pending)
		written += w
	}
	if buf != nil {
		copyBufs.Put(buf)
	}
	if rerr != nil {
		return written, false, false, rerr
	}
	return written, eof, full, serr
}

// writeNow writes as much of b to dst as it takes without waiting. It
// uses Control, which holds a reference on the descriptor (so a
// concurrent Close cannot free the number for reuse) but not the write
// lock: this direction is dst's only writer.
func writeNow(dst syscall.RawConn, b []byte) (int, error) {
	var (
		w   int
		err error
	)
	if cerr := dst.Control(func(fd uintptr) {
		for w < len(b) {
			var n int
			n, err = writeRetry(int(fd), b[w:])
			if err != nil {
				if err == unix.EAGAIN {
					err = nil
				}
				return
			}
			w += n
		}
	}); cerr != nil {
		return w, cerr
	}
	if err != nil {
		return w, fmt.Errorf("write to socket: %w", err)
	}
	return w, nil
}

// writeAll writes b to dst, waiting for room as needed.
func writeAll(dst syscall.RawConn, b []byte) (int, error) {
	var (
		w    int
		werr error
	)
	if err := dst.Write(func(fd uintptr) bool {
		for w < len(b) {
			n, err := writeRetry(int(fd), b[w:])
			if err == unix.EAGAIN {
				return false
			}
			if err != nil {
				werr = fmt.Errorf("write to socket: %w", err)
				return true
			}
			w += n
		}
		return true
	}); err != nil {
		return w, err
	}
	return w, werr
}

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
