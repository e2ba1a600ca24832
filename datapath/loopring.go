package datapath

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"time"
	"unsafe"

	"github.com/uproxy/uproxy/internal/uring"
	"golang.org/x/sys/unix"
)

// An event loop's io_uring (Config.IOURing): the ring carries the small
// messages of the loop's TCP sessions, so that one io_uring_enter submits
// a turn's operations and waits for the next; bulk transfers, listeners
// and UDP flows stay on epoll. See "The loops' io_uring" in docs/datapath.md.

// ringBufSize is the size of a loop's provided buffers, and
// defaultRingBufs their number unless Config.IOURingBuffers says
// otherwise. A buffer is held only while a receive's bytes wait to be
// sent on.
const (
	ringBufSize     = copyBufSize
	defaultRingBufs = 256
)

// Operation kinds, in the low bits of an operation's user data.
const (
	ringTagPoll    = 1 // the multishot poll of the loop's epoll descriptor
	ringTagConnect = 2 // a backend connection attempt
	ringTagRecv    = 3
	ringTagSend    = 4
	ringTagIgnore  = 5 // cancels and closes: their results change nothing
)

// ringData is the user data of session id's operation tag, in direction
// d, for connection attempt aux (its low four bits).
func ringData(id uint64, aux uint8, d, tag int) uint64 {
	return id<<8 | uint64(aux&15)<<4 | uint64(d)<<3 | uint64(tag)
}

// loopRing is an event loop's io_uring and what it carries: it is the
// loop's poller (it polls the loop's epoll set too) and the path of its
// sessions' small messages. Owned by the loop's goroutine, like the
// loop's other state; its methods work on that loop's sessions.
type loopRing struct {
	loop     *eventLoop
	r        *uring.Ring
	bufs     *uring.BufRing
	complete func(uring.CQE) // completed, bound once
	// sessions are the sessions on the ring, by ring id, and those that
	// left it (or ended) with operations still in flight.
	sessions map[uint64]*loopSession
	lastID   uint64
	ops      int // operations in flight, of every session
	// starved are the directions whose receive found no buffer
	// (ENOBUFS); they receive again once a buffer is free. starves
	// counts those receives.
	starved []ringStarved
	starves int
	// slowLeaves counts the sessions that left the ring because a
	// destination was full (sent).
	slowLeaves int
	// busy counts the turns in a row whose io_uring_enter found a
	// completion backlog (EBUSY) and nothing to reap.
	busy int
	// broken says why the loop can no longer account for the ring's
	// operations, once a completion of no session came (completed).
	broken error
}

// err says why the ring can no longer be used, or nil.
func (rs *loopRing) err() error {
	if rs.broken != nil {
		return rs.broken
	}
	return rs.r.Err()
}

// abandonRing carries on without l's ring once it has failed: an
// io_uring_enter error other than a completion backlog (EBADR: the kernel
// dropped completions; anything else: a ring the loop cannot trust), or
// a completion the loop cannot account for. Closing the ring
// cancels what is in flight, and what the sessions on it had moved is
// unknown, so they end with a reset; the closes the ring was asked for
// and never got are made here; the loop waits in epoll from then on, and
// so do the sessions it takes next. The buffers stay mapped: the kernel
// may write into them until it has torn the ring down.
func (l *eventLoop) abandonRing(err error) {
	rs := l.ring
	rs.r.Unsubmitted(func(e *uring.SQE) {
		if e.Opcode == uring.OpClose {
			_ = closeFD(int(e.Fd))
		}
	})
	rs.r.Close()
	l.ring, l.poll, l.ringErr, l.epollDue = nil, epollPoller{l.epfd}, err, false
	for _, ls := range rs.sessions {
		ls.onRing, ls.leaving, ls.connectArmed, ls.ringOps = false, false, false, 0
		if !ls.closed {
			l.end(ls, true)
		}
	}
	if l.ringFailed != nil {
		l.ringFailed(err)
	}
}

// ringBusyTurns is how many turns in a row a loop's ring may report a
// completion backlog with nothing to reap before the loop gives it up:
// reaping frees the room the backlog waits for, so one that stays has
// another cause.
const ringBusyTurns = 8

// ringStarved is a direction waiting for a buffer.
type ringStarved struct {
	ls *loopSession
	d  int
}

// IOURingSupported says why the event loops cannot use io_uring here
// (Config.IOURing), or nil: they need provided-buffer rings (Linux 5.19),
// and the kernel may refuse io_uring altogether
// (kernel.io_uring_disabled, a seccomp profile).
func IOURingSupported() error {
	// The ring is single-issuer: registering its buffers from another
	// thread than the one that set it up fails (EEXIST).
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r, err := uring.New(8)
	if err != nil {
		return err
	}
	defer r.Close()
	b, err := uring.NewBufRing(r, 1, 4096)
	if err != nil {
		return err
	}
	b.Close()
	return nil
}

// setupRing gives l its ring, or says why it cannot have one. Runs on the
// loop's goroutine, locked to its thread: the ring is single-issuer, and
// its issuer is the thread that sets it up.
func (l *eventLoop) setupRing(bufCount int) error {
	r, err := uring.New(4096)
	if err != nil {
		return err
	}
	bufs, err := uring.NewBufRing(r, bufCount, ringBufSize)
	if err != nil {
		r.Close()
		return err
	}
	rs := &loopRing{loop: l, r: r, bufs: bufs, sessions: map[uint64]*loopSession{}}
	rs.complete = rs.completed
	l.ring, l.poll = rs, rs
	rs.pollEpoll()
	return nil
}

// pollEpoll arms the multishot poll of the loop's epoll descriptor,
// which completes whenever the epoll set has events (ep_poll_callback
// wakes the set's pollers).
func (rs *loopRing) pollEpoll() {
	l := rs.loop
	e := rs.r.SQE()
	e.Opcode, e.Fd, e.Len, e.OpFlags = uring.OpPollAdd, int32(l.epfd), uring.PollAddMulti, unix.POLLIN
	e.UserData = ringTagPoll
}

// wait waits for the ring's completions, at most timeout milliseconds
// (negative: no bound), and handles them. While nothing is in flight on
// the ring it waits in epoll_wait instead, which returns the set's events
// itself: the loops of UDP flows and bulk transfers pay nothing for the
// ring. It returns the epoll events to handle, if any.
func (rs *loopRing) wait(events []unix.EpollEvent, timeout int) ([]unix.EpollEvent, error) {
	l := rs.loop
	if rs.ops == 0 && rs.r.Pending() == 0 && len(rs.starved) == 0 && !l.epollDue {
		n, err := unix.EpollWait(l.epfd, events, timeout)
		if err != nil {
			return nil, err
		}
		l.epollDue = n == len(events)
		return events[:n], nil
	}
	var err error
	switch {
	case l.epollDue:
		// Submit, and post what has completed (entering runs the
		// completion work pending on this thread), without waiting:
		// the epoll set has events to handle already.
		err = rs.r.EnterTimeout(1, 0)
	case timeout < 0:
		err = rs.r.Enter(1)
	default:
		err = rs.r.EnterTimeout(1, time.Duration(timeout)*time.Millisecond)
	}
	if err != nil {
		// A completion backlog (EBUSY) clears as the completions are
		// reaped; the next turn enters again. Any other error, or a
		// backlog that reaping does not clear, leaves a ring the loop
		// cannot trust.
		if !errors.Is(err, unix.EBUSY) {
			l.abandonRing(err)
			return nil, nil
		}
		if rs.r.Completions(rs.complete) > 0 {
			rs.busy = 0
		} else if rs.busy++; rs.busy > ringBusyTurns {
			l.abandonRing(err)
		}
		return nil, nil
	}
	rs.busy = 0
	rs.r.Completions(rs.complete)
	if !l.epollDue {
		return nil, nil
	}
	n, err := unix.EpollWait(l.epfd, events, 0)
	if err != nil {
		return nil, err
	}
	// A full batch may have left events behind, which raise no new
	// wake-up; so may a listener that reached acceptBatch (acceptQueued).
	l.epollDue = n == len(events)
	return events[:n], nil
}

// turnDone ends a turn of the loop: it publishes the buffers given
// back, and lets the starved directions receive again if one is free.
func (rs *loopRing) turnDone() {
	l := rs.loop
	if err := rs.err(); err != nil {
		l.abandonRing(err)
		return
	}
	rs.bufs.Flush()
	if len(rs.starved) == 0 || rs.bufs.Held() >= rs.bufs.Count() {
		return
	}
	starved := rs.starved
	rs.starved = nil
	for _, w := range starved {
		ls, dir := w.ls, &w.ls.dir[w.d]
		if !ls.closed && ls.onRing && !ls.leaving && !dir.eof && !dir.recving {
			rs.recv(ls, w.d)
		}
	}
}

// close waits (a little) for what is in flight to complete, and
// closes the ring. Runs on the loop, as it stops, after its sessions
// ended, which cancelled their operations and queued their sockets'
// closes.
func (rs *loopRing) close() {
	l := rs.loop
	if err := rs.err(); err != nil {
		l.abandonRing(err)
		return
	}
	if err := rs.r.Enter(0); err != nil { // the closes
		l.abandonRing(err)
		return
	}
	deadline := time.Now().Add(time.Second)
	for rs.ops > 0 && time.Now().Before(deadline) {
		if err := rs.r.EnterTimeout(1, 100*time.Millisecond); err != nil {
			break
		}
		rs.r.Completions(rs.complete)
	}
	rs.r.Close()
	if rs.ops == 0 {
		// With operations left (a bug), the kernel might still write
		// into the buffers as it tears the ring down: they stay mapped.
		rs.bufs.Close()
	}
	l.ring, l.poll = nil, epollPoller{l.epfd}
}

// add puts a new session on the ring: it starts the backend
// connection, or receives at once on both sockets of a connected one.
func (rs *loopRing) add(ls *loopSession) {
	l := rs.loop
	rs.lastID++
	ls.ringID = rs.lastID
	ls.onRing = true
	if l.stats != nil {
		l.stats.OnRing.Add(1)
	}
	rs.sessions[ls.ringID] = ls
	if ls.dial != nil {
		l.connect(ls)
		return
	}
	rs.start(ls)
}

// start starts both directions of a connected session.
func (rs *loopRing) start(ls *loopSession) {
	for d := range ls.dir {
		rs.recv(ls, d)
	}
}

// submit counts an operation of ls in flight.
func (rs *loopRing) submit(ls *loopSession) {
	ls.ringOps++
	rs.ops++
}

// connect connects the backend socket of ls to addr. The ring
// connects it as connect(2) would, and completes once the connection is
// made or has failed (io_uring/net.c: EINPROGRESS arms a poll), which
// saves the connect and the SO_ERROR getsockopt of the epoll path.
func (rs *loopRing) connect(ls *loopSession, addr netip.AddrPort) {
	ls.attempt++
	a := addr.Addr().Unmap()
	n := putSockaddr(&ls.connectAddr, netip.AddrPortFrom(a, addr.Port()), a.Is6())
	e := rs.r.SQE()
	e.Opcode, e.Fd = uring.OpConnect, int32(ls.side[1].fd)
	e.Addr, e.Off = uint64(uintptr(unsafe.Pointer(&ls.connectAddr))), uint64(n)
	e.UserData = ringData(ls.ringID, ls.attempt, 0, ringTagConnect)
	ls.connectArmed = true
	rs.submit(ls)
}

// recv receives on side d of ls into a provided buffer.
func (rs *loopRing) recv(ls *loopSession, d int) {
	e := rs.r.SQE()
	e.Opcode, e.Fd, e.Flags = uring.OpRecv, int32(ls.side[d].fd), uring.SQEBufSelect
	e.Len = uint32(rs.bufs.Size()) // BufIndex 0: any buffer of group 0
	e.UserData = ringData(ls.ringID, 0, d, ringTagRecv)
	ls.dir[d].recving = true
	rs.submit(ls)
}

// send sends what direction d's buffer holds, from off on, to the
// other side.
func (rs *loopRing) send(ls *loopSession, d int) {
	l := rs.loop
	rs, dir := l.ring, &ls.dir[d]
	b := rs.bufs.Buf(dir.rbid)[dir.roff:dir.rlen]
	e := rs.r.SQE()
	// MSG_DONTWAIT: a send that finds the socket full completes at once,
	// with what it could send (or EAGAIN), instead of waiting in the ring
	// with the buffer (io_uring/net.c: REQ_F_NOWAIT), so that the loop's
	// buffers wait for no slow reader (sent).
	e.Opcode, e.Fd, e.OpFlags = uring.OpSend, int32(ls.side[1-d].fd), unix.MSG_NOSIGNAL|unix.MSG_DONTWAIT
	e.Addr, e.Len = uint64(uintptr(unsafe.Pointer(&b[0]))), uint32(len(b))
	e.UserData = ringData(ls.ringID, 0, d, ringTagSend)
	dir.sending = true
	rs.submit(ls)
}

// cancel cancels the operation whose user data is ud. Its own
// completion is ignored; the cancelled operation's comes as usual.
func (rs *loopRing) cancel(ud uint64) {
	e := rs.r.SQE()
	e.Opcode, e.Addr, e.UserData = uring.OpAsyncCancel, ud, ringTagIgnore
}

// cancelAll cancels every operation of ls in flight. Runs as ls
// ends; its sockets are closed after, but stay open (and so do not yet
// send a reset) until the ring lets go of them.
func (rs *loopRing) cancelAll(ls *loopSession) {
	if ls.connectArmed {
		rs.cancel(ringData(ls.ringID, ls.attempt, 0, ringTagConnect))
	}
	for d := range ls.dir {
		if ls.dir[d].recving {
			rs.cancel(ringData(ls.ringID, 0, d, ringTagRecv))
		}
		if ls.dir[d].sending {
			rs.cancel(ringData(ls.ringID, 0, d, ringTagSend))
		}
	}
}

// closeFD closes fd on the ring, with the loop's next submission. Its
// number stays taken until then, so no socket opened meanwhile gets it. A
// socket's close completes as it is submitted (io_close goes to a worker
// only for files with a flush method), so the number is looked up while
// it is still the session's.
func (rs *loopRing) closeFD(fd int) {
	e := rs.r.SQE()
	e.Opcode, e.Fd, e.UserData = uring.OpClose, int32(fd), ringTagIgnore
}

// forget forgets ls's ring id once nothing of it is in flight.
func (rs *loopRing) forget(ls *loopSession) {
	if ls.ringOps == 0 {
		delete(rs.sessions, ls.ringID)
	}
}

// completed handles one completion.
func (rs *loopRing) completed(c uring.CQE) {
	l := rs.loop
	tag := int(c.UserData & 7)
	switch tag {
	case ringTagPoll:
		if c.Flags&uring.CQEFMore == 0 {
			rs.pollEpoll() // the kernel ended it (an overflow, or an error)
		}
		l.epollDue = true
		return
	case ringTagIgnore:
		return
	}
	bid := -1
	if c.Flags&uring.CQEFBuffer != 0 {
		bid = int(c.Flags >> uring.CQEBufferShift)
		rs.bufs.Took()
	}
	ls := rs.sessions[c.UserData>>8]
	if ls == nil {
		// Every operation is counted against its session, which stays
		// known until they have all completed: the loop has lost track
		// of the ring, and gives it up at the end of the turn.
		if rs.broken == nil {
			rs.broken = fmt.Errorf("io_uring completion %#x of no session", c.UserData)
		}
		if bid >= 0 {
			rs.bufs.Put(uint16(bid))
		}
		return
	}
	rs.ops--
	ls.ringOps--
	d := int(c.UserData >> 3 & 1)
	dir := &ls.dir[d]
	current := uint8(c.UserData>>4&15) == ls.attempt&15
	switch tag {
	case ringTagConnect:
		if current {
			// A timed-out attempt's completion may come after the next
			// attempt started, which is still in flight.
			ls.connectArmed = false
		}
	case ringTagRecv:
		dir.recving = false
	case ringTagSend:
		dir.sending = false
	}
	if ls.closed {
		if bid >= 0 {
			rs.bufs.Put(uint16(bid))
		}
		if tag == ringTagSend {
			rs.bufs.Put(dir.rbid)
		}
		rs.forget(ls)
		return
	}
	switch tag {
	case ringTagConnect:
		if !ls.connecting || !current {
			return // an attempt that timed out: connectDone moved on
		}
		var err error
		if c.Res < 0 {
			err = os.NewSyscallError("connect", unix.Errno(-c.Res))
		}
		if l.connectDone(ls, err) {
			rs.start(ls)
		}
	case ringTagRecv:
		rs.received(ls, d, c.Res, bid)
	case ringTagSend:
		rs.sent(ls, d, c.Res)
	}
}

// received handles direction d's receive, of res bytes into buffer
// bid (or an error).
func (rs *loopRing) received(ls *loopSession, d int, res int32, bid int) {
	l := rs.loop
	rs, dir := l.ring, &ls.dir[d]
	if res <= 0 && bid >= 0 {
		// A completion that says its receive took a buffer (CQEFBuffer)
		// owns it whatever its result; one without bytes has nothing to
		// send on, so the buffer goes back at once, or the ring would
		// lose it for good.
		rs.bufs.Put(uint16(bid))
	}
	switch {
	case res > 0:
		if !ls.ringServed {
			ls.ringServed = true
			if l.stats != nil {
				l.stats.RingServed.Add(1)
			}
		}
		ls.moved = true
		if l.stats != nil {
			l.stats.Copied.Add(int64(res))
		}
		if ls.leaving || int(res) == rs.bufs.Size() {
			// A bulk transfer, or the session is leaving the ring: the
			// bytes go out on the epoll path.
			dir.pending = append(dir.pending, rs.bufs.Buf(uint16(bid))[:res]...)
			rs.bufs.Put(uint16(bid))
			if int(res) == rs.bufs.Size() {
				dir.h.splicing = true
			}
			rs.leave(ls)
			return
		}
		dir.rbid, dir.roff, dir.rlen = uint16(bid), 0, int(res)
		rs.send(ls, d)
	case res == 0:
		dir.eof = true
		if ls.leaving {
			rs.leave(ls)
			return
		}
		dir.done = true
		if ls.dir[1-d].done {
			// Both EOFs passed: closing both sends the last FIN.
			l.end(ls, false)
			return
		}
		// Not a ring shutdown: io_uring runs those on a worker thread
		// (io_shutdown never completes non-blocking), which can look the
		// descriptor up after the session has closed it and its number
		// went to a new socket.
		if err := shutdownWrite(ls.side[1-d].fd); err != nil && err != unix.ENOTCONN {
			l.end(ls, true)
		}
	case res == -int32(unix.ENOBUFS) && !ls.leaving:
		rs.starved = append(rs.starved, ringStarved{ls, d})
		rs.starves++
	case ls.leaving && res == -int32(unix.ECANCELED), ls.leaving && res == -int32(unix.ENOBUFS):
		rs.leave(ls)
	default:
		l.end(ls, true)
	}
}

// sent handles direction d's send of res bytes (or an error).
func (rs *loopRing) sent(ls *loopSession, d int, res int32) {
	l := rs.loop
	rs, dir := l.ring, &ls.dir[d]
	if res == -int32(unix.EAGAIN) {
		res = 0
	} else if res < 0 {
		rs.bufs.Put(dir.rbid)
		l.end(ls, true)
		return
	}
	dir.total += int64(res)
	dir.roff += int(res)
	if dir.roff < dir.rlen {
		// The destination is full: its peer reads slower than the
		// source sends. The rest waits on the epoll path, in memory of
		// the session's own, rather than in a buffer of the loop's.
		dir.pending = append(dir.pending, rs.bufs.Buf(dir.rbid)[dir.roff:dir.rlen]...)
		rs.bufs.Put(dir.rbid)
		if !ls.leaving {
			rs.slowLeaves++
		}
		rs.leave(ls)
		return
	}
	rs.bufs.Put(dir.rbid)
	if ls.leaving {
		rs.leave(ls)
		return
	}
	rs.recv(ls, d)
}

// leave takes ls off the ring: it cancels the receives in flight and,
// once nothing of ls is in flight, registers its sockets with the epoll
// set and moves on what the ring left (pending bytes, an EOF).
func (rs *loopRing) leave(ls *loopSession) {
	l := rs.loop
	if !ls.leaving {
		ls.leaving = true
		for d := range ls.dir {
			if ls.dir[d].recving {
				rs.cancel(ringData(ls.ringID, 0, d, ringTagRecv))
			}
		}
	}
	if ls.ringOps > 0 {
		return
	}
	rs.forget(ls)
	ls.onRing, ls.leaving = false, false
	for i := range ls.side {
		if err := l.register(ls, i); err != nil {
			l.end(ls, true)
			return
		}
	}
	l.pumpBoth(ls)
}
