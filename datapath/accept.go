package datapath

import (
	"net/netip"
	"time"

	"golang.org/x/sys/unix"
)

// Accepting on the event loops: the loop that finds a listener readable
// accepts, dials and carries the connection on its own thread, so no
// connection waits for a hand-over between threads. See "Accepting on the
// loops" in docs/datapath.md.

// acceptBackoffMin and acceptBackoffMax bound how long a loop stops
// accepting on a listener after accept failed for want of resources
// (EMFILE, ENFILE, ENOBUFS, ENOMEM), doubling on each failure in a row, as
// acceptBackoff does and net/http's Server does. The socket stays readable
// while its queue holds connections, so a level-triggered loop that kept
// it registered would spin.
const (
	acceptBackoffMin = 5 * time.Millisecond
	acceptBackoffMax = time.Second
)

// nextAcceptDelay returns the delay after a failed accept that follows
// one of delay (zero: the first failure in a row).
func nextAcceptDelay(delay time.Duration) time.Duration {
	return min(max(2*delay, acceptBackoffMin), acceptBackoffMax)
}

// acceptBatch is the most connections a loop accepts on one listener per
// readiness.
const acceptBatch = 16

// loopListener is a listening TCP socket that event loops accept on
// (loopGroup.listen), or a UDP listener's socket that one loop reads.
// Its methods are safe for concurrent use; serve, failed and readable run
// on the loops.
type loopListener struct {
	// serve takes over a connection that loop el accepted: fd is its
	// socket, which serve owns from then on. Runs on el.
	serve func(el *eventLoop, fd int, client netip.AddrPort)
	// failed reports an accept that failed with err, after which el stops
	// accepting on the socket for delay; or, with delay zero, that el
	// could not add the socket to its epoll set, and does not accept on
	// it. Runs on el.
	failed func(err error, delay time.Duration)
	// accept is accept4(2), rawsys's; tests replace it.
	accept func(fd int, sa *unix.RawSockaddrInet6) (int, error)
	// readable serves the socket when loop el finds it readable:
	// acceptQueued for a TCP listener; for a UDP socket, registered with
	// one loop only, a read and forward of what is queued
	// (loopPacketListener). Each works within a budget; more says it ran
	// out with more queued. An error pauses the socket (pauseAccept).
	readable func(el *eventLoop) (more bool, err error)
	// oneLoop registers the socket with one loop only (a UDP socket: the
	// loop that reads it carries its flows); a TCP listener is registered
	// with every loop.
	oneLoop bool
	// closed, if set, runs once the socket is closed: on the loop that
	// read it, after any readable call, or on close's goroutine if no loop
	// took the socket.
	closed func()

	// rawSock's mu guards its fd, so that no loop calls accept on a
	// descriptor that close has closed, and whose number may belong to
	// another socket by then. Its methods make the listener the
	// syscall.RawConn of a UDP socket's reads and replies.
	rawSock
	regs []listenSlot // the loops the socket is registered with, under mu
}

// listenSlot is where a loop keeps a listener: its slot in the loop's
// accepting table, which is the epoll event's data.
type listenSlot struct {
	loop *eventLoop
	slot int32
}

// newLoopListener returns a loopListener for fd, a listening TCP socket,
// which it owns from then on.
func newLoopListener(fd int, serve func(el *eventLoop, fd int, client netip.AddrPort), failed func(error, time.Duration)) *loopListener {
	ll := &loopListener{rawSock: rawSock{fd: fd}, serve: serve, failed: failed, accept: accept4}
	ll.readable = ll.acceptQueued
	return ll
}

// dup returns a duplicate of the socket's descriptor, close-on-exec.
func (ll *loopListener) dup() (int, error) {
	ll.mu.Lock()
	defer ll.mu.Unlock()
	if ll.fd < 0 {
		return -1, unix.EBADF
	}
	return unix.FcntlInt(uintptr(ll.fd), unix.F_DUPFD_CLOEXEC, 0)
}

// open reports whether the socket is not closed yet.
func (ll *loopListener) open() bool {
	ll.mu.Lock()
	defer ll.mu.Unlock()
	return ll.fd >= 0
}

// close takes the socket out of every loop's epoll set, then closes it.
// Taking it out first matters: a duplicate of the descriptor (one handed
// to the next process, ExportListeners) keeps the socket open after close,
// and epoll would go on reporting it (epoll(7): a registration lasts as
// long as the open file). Connections still queued are then the
// duplicate's, or are reset with the close.
func (ll *loopListener) close() {
	ll.mu.Lock()
	fd, regs := ll.fd, ll.regs
	ll.fd, ll.regs = -1, nil
	for _, r := range regs {
		r.loop.dropListener(fd, r.slot)
	}
	ll.mu.Unlock()
	if fd < 0 {
		return
	}
	_ = closeFD(fd)
	if done := ll.closed; done != nil && (len(regs) == 0 || !regs[0].loop.post(done)) {
		done()
	}
}

// acceptSlot is a loop's entry for one listener.
type acceptSlot struct {
	ll *loopListener
	// delay is the current backoff after failed accepts (zero: none);
	// resumeAt, while set, is when the loop registers the socket again.
	delay    time.Duration
	resumeAt time.Time
}

// listen registers ll with every loop of g, starting the loops if they
// are not running; with one of them only if ll.oneLoop. The registrations happen
// on the loops, shortly after: connections and datagrams arriving
// meanwhile wait in the socket's queue.
func (g *loopGroup) listen(ll *loopListener) error {
	loops, err := g.running()
	if err != nil {
		return err
	}
	if ll.oneLoop {
		l, err := g.loopFor()
		if err != nil {
			return err
		}
		loops = []*eventLoop{l}
	}
	for _, l := range loops {
		if !l.post(func() { l.addListener(ll) }) {
			return errLoopStopped
		}
	}
	return nil
}

// addListener registers ll's socket, unless it was closed meanwhile.
// Runs on the loop.
func (la *loopAccept) addListener(ll *loopListener) {
	l := la.loop
	var slot int32
	if n := len(la.freeSlots); n > 0 {
		slot, la.freeSlots = la.freeSlots[n-1], la.freeSlots[:n-1]
	} else {
		slot = int32(len(la.accepting))
		la.accepting = append(la.accepting, acceptSlot{})
	}
	ll.mu.Lock()
	defer ll.mu.Unlock()
	if ll.fd < 0 {
		la.freeSlots = append(la.freeSlots, slot)
		return
	}
	if err := la.watchListener(ll.fd, slot); err != nil {
		la.freeSlots = append(la.freeSlots, slot)
		ll.failed(err, 0)
		return
	}
	la.accepting[slot] = acceptSlot{ll: ll}
	ll.regs = append(ll.regs, listenSlot{loop: l, slot: slot})
}

// watchListener adds a listening socket to the epoll set. The event's data
// is the slot, marked by -1 in place of a generation, which no session
// side and not the wake-up descriptor (0) has.
func (la *loopAccept) watchListener(fd int, slot int32) error {
	l := la.loop
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLEXCLUSIVE, Fd: slot, Pad: -1}
	return epollAdd(l.epfd, fd, &ev)
}

// dropListener takes fd out of the loop's epoll set and frees its slot.
// Called by loopListener.close, under ll.mu, on any goroutine. A loop
// that is stopping closes its epoll instance, registrations and all.
func (la *loopAccept) dropListener(fd int, slot int32) {
	l := la.loop
	l.mu.Lock()
	if l.stopping {
		l.mu.Unlock()
		return
	}
	// Under mu, while stopping is false, the loop has not closed epfd
	// (runTasks closes it only once stopping is set).
	_ = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, fd, nil)
	l.mu.Unlock()
	// Events that an epoll_wait returned before the removal find ll.fd
	// at -1; the slot is freed only after them (runTasks runs after the
	// batch's events).
	l.post(func() {
		la.accepting[slot] = acceptSlot{}
		la.freeSlots = append(la.freeSlots, slot)
	})
}

// listenerReady serves the listener in slot, which epoll found readable
// (ll.readable), and pauses it if that failed. Runs on the loop.
func (la *loopAccept) listenerReady(slot int32) {
	l := la.loop
	if slot < 0 || int(slot) >= len(la.accepting) {
		return
	}
	as := &la.accepting[slot]
	ll := as.ll
	if ll == nil || !as.resumeAt.IsZero() {
		return
	}
	more, err := ll.readable(l)
	if err != nil {
		la.pauseAccept(slot, err)
		return
	}
	as.delay = 0
	// Level-triggered, a socket that holds more is reported again by the
	// next epoll_wait, but raises no new wake-up of a ring's poll of the
	// epoll set (loopring.go).
	l.epollDue = l.epollDue || more
}

// acceptQueued is a TCP listener's readable: it accepts the connections
// queued on the socket, up to acceptBatch, and serves them. more: some may
// be left; err: accept failed for want of resources.
func (ll *loopListener) acceptQueued(el *eventLoop) (more bool, err error) {
	for range acceptBatch {
		ll.mu.Lock()
		if ll.fd < 0 {
			ll.mu.Unlock()
			return false, nil
		}
		fd, err := ll.accept(ll.fd, &el.acceptAddr)
		ll.mu.Unlock()
		switch err {
		case nil:
			ll.serve(el, fd, sockaddrAddrPort(&el.acceptAddr))
		case unix.EAGAIN:
			return false, nil // none is left, or another loop took it
		case unix.ECONNABORTED, unix.EINTR:
			// Reset while queued, or interrupted: the socket is reported
			// again while more are queued.
			return true, nil
		default:
			return false, err
		}
	}
	return true, nil
}

// pauseAccept stops accepting on the listener in slot after err, for
// twice the previous delay (see acceptBackoffMin). Runs on the loop.
func (la *loopAccept) pauseAccept(slot int32, err error) {
	l := la.loop
	as := &la.accepting[slot]
	as.delay = nextAcceptDelay(as.delay)
	as.resumeAt = time.Now().Add(as.delay)
	ll := as.ll
	ll.mu.Lock()
	if ll.fd >= 0 {
		_ = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, ll.fd, nil)
	}
	ll.mu.Unlock()
	la.paused = append(la.paused, slot)
	if la.nextResume.IsZero() || as.resumeAt.Before(la.nextResume) {
		la.nextResume = as.resumeAt
	}
	ll.failed(err, as.delay)
}

// resumeAccept registers again the paused listeners whose delay is over,
// and works out when the next one is due. Runs on the loop.
func (la *loopAccept) resumeAccept(now time.Time) {
	la.nextResume = time.Time{}
	kept := la.paused[:0]
	for _, slot := range la.paused {
		as := &la.accepting[slot]
		switch {
		case as.ll == nil || as.resumeAt.IsZero():
			// Freed, perhaps reused, since it was paused.
		case now.Before(as.resumeAt):
			kept = append(kept, slot)
			if la.nextResume.IsZero() || as.resumeAt.Before(la.nextResume) {
				la.nextResume = as.resumeAt
			}
		default:
			as.resumeAt = time.Time{}
			ll := as.ll
			ll.mu.Lock()
			if ll.fd >= 0 {
				if err := la.watchListener(ll.fd, slot); err != nil {
					ll.failed(err, 0)
				}
			}
			ll.mu.Unlock()
		}
	}
	la.paused = kept
}
