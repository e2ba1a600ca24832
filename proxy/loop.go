package proxy

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// The data path's event loops carry sessions on a thread each, with no
// goroutine per connection or direction: see "Event loops" in the package
// documentation.

// loopGroup starts event loops on first use and stops them on request.
// Safe for concurrent use.
type loopGroup struct {
	// n is the number of loops; opts configure each of them.
	n    int
	opts loopOptions
	// newLoop starts a loop (nil: newEventLoop); tests replace it, under mu.
	newLoop func(loopOptions) (*eventLoop, error)
	// noRing, if set, hears why a loop asked for a ring has none, and
	// carries everything on epoll.
	noRing func(error)

	mu    sync.Mutex
	loops []*eventLoop
	next  int
}

// loopFor returns the loop that takes the next session, starting the
// loops if they are not running.
func (g *loopGroup) loopFor() (*eventLoop, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.start(); err != nil {
		return nil, err
	}
	l := g.loops[g.next%len(g.loops)]
	g.next++
	return l, nil
}

// running returns every loop, starting them if they are not running.
func (g *loopGroup) running() ([]*eventLoop, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.start(); err != nil {
		return nil, err
	}
	return g.loops, nil
}

// start starts the loops if they are not running. Called with mu held.
func (g *loopGroup) start() error {
	if g.n <= 0 {
		return errors.New("no event loops configured")
	}
	if g.loops == nil {
		loops := make([]*eventLoop, 0, g.n)
		for range g.n {
			newLoop := g.newLoop
			if newLoop == nil {
				newLoop = newEventLoop
			}
			l, err := newLoop(g.opts)
			if err != nil {
				for _, l := range loops {
					l.stop()
				}
				return err
			}
			if l.ringErr != nil && g.noRing != nil {
				g.noRing(l.ringErr)
			}
			if l.ringErr != nil && g.opts.stats != nil {
				g.opts.stats.noRing.Add(1)
			}
			loops = append(loops, l)
		}
		g.loops = loops
	}
	return nil
}

// stop ends the loops, once no session is left on them; the next session
// starts new ones.
func (g *loopGroup) stop() {
	g.mu.Lock()
	loops := g.loops
	g.loops = nil
	g.mu.Unlock()
	for _, l := range loops {
		l.stop()
	}
}

// loopOptions configure an event loop: idle is the idle timeout (zero:
// none), dialTimeout bounds one connection attempt to a backend, and ring
// asks for an io_uring (loopring.go), without which (or where the kernel
// has none) the loop carries everything on epoll.
type loopOptions struct {
	idle, dialTimeout time.Duration
	// keepAliveEvery is how often the loop turns keep-alive on for the
	// backend sockets that lack it (Config.BackendKeepAliveEvery).
	keepAliveEvery time.Duration
	ring           bool
	// ringBufs is the number of the ring's provided buffers
	// (Config.IOURingBuffers).
	ringBufs int
	// ringFailed, if set, hears why a loop gave up its ring while running
	// (abandonRing); it runs on the loop's goroutine.
	ringFailed func(error)
	// stats, if set, counts what the loops carried and how.
	stats *loopStats
}

// loopStats counts, across a proxier's data path, the sessions the ring
// could have carried and those it did, so that a test of the ring data
// path can tell it from epoll (a ring that failed to set up leaves the
// sessions on epoll, and the traffic flows all the same), and the bytes
// that went through userspace buffers rather than splice, so that a test
// can tell that bulk transfers splice (with TCP_INQ the reads are
// recvmsg(2), which the kernel's per-process read counters do not see).
// Only tests keep one (Config.stats). Safe for concurrent use.
type loopStats struct {
	// eligible: sessions a ring would take (no PROXY protocol header);
	// onRing: those put on a ring; ringServed: those whose bytes a ring
	// received; carried: sessions that moved bytes, by any path. noRing:
	// loops that could not set up their ring. copied: bytes moved through
	// userspace buffers, on any path.
	eligible, onRing, ringServed, carried, noRing, copied atomic.Int64
}

// eventLoop carries sessions on one epoll instance. Its goroutine (run)
// owns the sessions, their descriptors and every field below mu's; other
// goroutines reach it only through post. The goroutine exits after stop.
type eventLoop struct {
	epfd, wakefd int
	idle         time.Duration
	dialTimeout  time.Duration
	done         chan struct{} // closed when run returns

	mu       sync.Mutex
	tasks    []func()
	stopping bool

	// Owned by run's goroutine.
	sides     []*loopSide // by descriptor number
	sessions  map[*loopSession]struct{}
	flows     map[*udpFlow]struct{}
	gen       int32
	nextSweep time.Time
	// keepAliveEvery is how often armKeepAlive runs; nextKeepAlive is
	// when it runs next.
	keepAliveEvery time.Duration
	nextKeepAlive  time.Time
	// connecting: the sessions whose backend connection is in progress;
	// nextDeadline is the earliest of their deadlines, or zero.
	connecting   map[*loopSession]struct{}
	nextDeadline time.Time
	buf          [copyBufSize]byte
	// recv and replies relay UDP replies: allocated with the first flow.
	recv    *flowReceiver
	replies *replyQueue
	// pools: the UDP socket pools of request–reply queries (udppool.go),
	// allocated with the first query.
	pools *loopPools
	// accepting: the listeners registered with the loop, by slot
	// (accept.go); freeSlots: its unused slots. paused: the slots whose
	// listener is out of the epoll set after a failed accept, the earliest
	// due again at nextResume. acceptAddr receives accepted peers' addresses.
	accepting  []acceptSlot
	freeSlots  []int32
	paused     []int32
	nextResume time.Time
	acceptAddr unix.RawSockaddrInet6
	// ring is the loop's io_uring, if it has one (loopring.go); ringErr
	// says why a loop asked for one has none. epollDue: the epoll set may
	// hold events that raise no new wake-up of the ring's poll of it.
	ring       *loopRing
	ringErr    error
	epollDue   bool
	ringFailed func(error) // loopOptions.ringFailed
	stats      *loopStats  // loopOptions.stats; nil: none kept
}

// newEventLoop creates the loop's epoll instance and starts its
// goroutine.
func newEventLoop(o loopOptions) (*eventLoop, error) {
	idle, dialTimeout := o.idle, o.dialTimeout
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	wakefd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(epfd)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	// The wake-up descriptor is level-triggered and marked by generation
	// 0, which no session side has.
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wakefd)}
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, wakefd, &ev); err != nil {
		unix.Close(epfd)
		unix.Close(wakefd)
		return nil, fmt.Errorf("epoll_ctl add eventfd: %w", err)
	}
	l := &eventLoop{
		epfd: epfd, wakefd: wakefd, idle: idle, dialTimeout: dialTimeout,
		done:       make(chan struct{}),
		sessions:   map[*loopSession]struct{}{},
		flows:      map[*udpFlow]struct{}{},
		connecting: map[*loopSession]struct{}{},
		ringFailed: o.ringFailed,
		stats:      o.stats,
	}
	now := time.Now()
	if idle > 0 {
		l.nextSweep = now.Add(idle)
	}
	// Loops built without a Config (tests) get the Config's defaults.
	l.keepAliveEvery = cmp.Or(o.keepAliveEvery, defaultKeepAliveEvery)
	ringBufs := cmp.Or(o.ringBufs, defaultRingBufs)
	l.nextKeepAlive = now.Add(l.keepAliveEvery)
	started := make(chan struct{})
	go l.run(o.ring, ringBufs, started) // exits after stop
	<-started
	return l, nil
}

// post runs f on the loop's goroutine; false if the loop is stopping.
func (l *eventLoop) post(f func()) bool {
	l.mu.Lock()
	if l.stopping {
		l.mu.Unlock()
		return false
	}
	l.tasks = append(l.tasks, f)
	wake := len(l.tasks) == 1
	l.mu.Unlock()
	if wake {
		l.wake()
	}
	return true
}

func (l *eventLoop) wake() {
	one := [8]byte{1}
	_, _ = unix.Write(l.wakefd, one[:])
}

// stop makes run abort whatever sessions are left, close the loop's
// descriptors and return, and waits for it.
func (l *eventLoop) stop() {
	l.mu.Lock()
	l.stopping = true
	l.mu.Unlock()
	l.wake()
	<-l.done
}

// run is the loop's goroutine.
//
// It keeps one thread: the runtime otherwise hands the goroutine from one
// thread to another, and every hand-over waits for a thread to be woken
// while the sessions of the whole loop wait with it (see
// docs/performance.md).
//
// With ring, it sets up its io_uring first, and waits in it; it closes
// started once the ring is set up, or has failed to.
func (l *eventLoop) run(ring bool, ringBufs int, started chan<- struct{}) {
	defer close(l.done)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if ring {
		if err := l.setupRing(ringBufs); err != nil {
			l.ringErr = err
		}
	}
	close(started)
	events := make([]unix.EpollEvent, 256)
	for {
		var (
			ready []unix.EpollEvent
			err   error
		)
		if l.ring != nil {
			ready, err = l.ringWait(events, l.timeout())
		} else {
			var n int
			n, err = unix.EpollWait(l.epfd, events, l.timeout())
			ready = events[:max(n, 0)]
		}
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			// Only a bad epoll descriptor or buffer fails epoll_wait: a
			// bug, not a condition to carry on from. (ringWait handles
			// the ring's own errors: see abandonRing.)
			panic(fmt.Sprintf("uproxy: waiting on an event loop: %v", err))
		}
		woken := false
		for _, ev := range ready {
			switch {
			case ev.Pad == 0:
				woken = true
			case ev.Pad < 0:
				l.listenerReady(ev.Fd)
			default:
				l.ready(ev)
			}
		}
		if woken {
			var b [8]byte
			_, _ = unix.Read(l.wakefd, b[:])
			if l.runTasks() {
				return
			}
		}
		if l.ring != nil {
			l.ringTurnDone()
		}
		// The UDP replies of everything handled above (runTasks included:
		// a flow that had more than its budget) go out together.
		if l.replies != nil {
			l.replies.flush()
		}
		l.tickPools()
		if l.idle <= 0 && l.nextDeadline.IsZero() && l.nextResume.IsZero() && len(l.sessions) == 0 {
			continue
		}
		now := time.Now()
		if !l.nextResume.IsZero() && !now.Before(l.nextResume) {
			l.resumeAccept(now)
		}
		if !l.nextDeadline.IsZero() && !now.Before(l.nextDeadline) {
			l.expire(now)
		}
		if l.idle > 0 && !now.Before(l.nextSweep) {
			l.sweep()
			l.nextSweep = now.Add(l.idle)
		}
		if !now.Before(l.nextKeepAlive) {
			l.armKeepAlive()
			l.nextKeepAlive = now.Add(l.keepAliveEvery)
		}
	}
}

// timeout is epoll_wait's: until the next idle sweep, connection deadline,
// paused listener's turn (resumeAccept) or, while the loop carries
// sessions, keep-alive round, in milliseconds
// rounded up; -1 (none) without any.
func (l *eventLoop) timeout() int {
	var next time.Time
	if l.idle > 0 {
		next = l.nextSweep
	}
	if len(l.sessions) > 0 && (next.IsZero() || l.nextKeepAlive.Before(next)) {
		next = l.nextKeepAlive
	}
	for _, d := range [...]time.Time{l.nextDeadline, l.nextResume} {
		if !d.IsZero() && (next.IsZero() || d.Before(next)) {
			next = d
		}
	}
	next = l.poolDeadline(next)
	if next.IsZero() {
		return -1
	}
	return max(0, int((time.Until(next)+time.Millisecond-1)/time.Millisecond))
}

// runTasks runs what post queued; true once the loop is stopping, after
// it has aborted its sessions and closed its descriptors.
func (l *eventLoop) runTasks() bool {
	l.mu.Lock()
	tasks, stopping := l.tasks, l.stopping
	l.tasks = nil
	l.mu.Unlock()
	for _, f := range tasks {
		f()
	}
	if !stopping {
		return false
	}
	for ls := range l.sessions {
		l.end(ls, true)
	}
	// Only this loop sends on its flows' sockets.
	for f := range l.flows {
		f.close()
		l.dropFlow(f)
	}
	if l.ring != nil {
		l.closeRing()
	}
	unix.Close(l.epfd)
	unix.Close(l.wakefd)
	return true
}

// loopSession is a session carried by an event loop: side 0 is the
// client, side 1 the backend; direction d copies side d to side 1-d.
type loopSession struct {
	side   [2]loopSide
	dir    [2]loopDir
	closed bool
	// dial, when set, is how the loop connects the backend (connect);
	// connecting while an attempt is in progress, until deadline.
	dial       *tcpDial
	connecting bool
	deadline   time.Time
	// moved: bytes moved since the last idle sweep. progress: the TCP_INFO
	// counters of the two sockets at that sweep (see session.stillActive).
	moved    bool
	progress [2]uint64
	// keepAlive: the backend's socket has TCP keep-alive on (armKeepAlive).
	keepAlive bool
	// finish runs once, on the loop, after both sockets are closed, with
	// the bytes each direction wrote.
	finish func(up, down int64)
	// onRing: the session's directions run on the loop's ring
	// (loopring.go), under ringID, with ringOps operations in flight;
	// leaving: it goes over to epoll once they have completed.
	// connectArmed: the ring's connect of backend connection attempt
	// number attempt is in flight. ringServed: a ring receive has carried
	// bytes of the session (loopStats.ringServed).
	onRing, leaving, connectArmed, ringServed bool
	ringID                                    uint64
	ringOps                                   int
	attempt                                   uint8
	connectAddr                               unix.RawSockaddrInet6 // the ring's connect reads it
}

// loopSide is one of a session's sockets, or a UDP flow's (flow), and
// what epoll last said of it (edge-triggered: a flag stays set until a
// call finds EAGAIN).
type loopSide struct {
	ls                 *loopSession
	flow               *udpFlow
	fd                 int
	gen                int32
	readable, writable bool
}

// loopDir is one direction's state between events.
type loopDir struct {
	h       halfState
	pipe    *kernelPipe // spliced bytes not yet written, if any
	pending []byte      // copied bytes not yet written, if any
	eof     bool        // the source has reached EOF
	done    bool        // and the EOF has been passed on
	total   int64       // bytes written to the destination
	moved   bool        // since the source last had nothing to read
	// On the ring: a receive, or a send, is in flight; rbid is the
	// provided buffer whose bytes rbid[roff:rlen] are being sent.
	recving, sending bool
	rbid             uint16
	roff, rlen       int
}

// add registers a session's sockets, or its client's and starts dialling
// the backend; on failure it ends the session. Runs on the loop.
func (l *eventLoop) add(ls *loopSession) {
	l.sessions[ls] = struct{}{}
	// A backend connected before the hand-over was dialled by
	// net.Dialer, with Go's keep-alive, or by Config.Dial, which chooses.
	ls.keepAlive = ls.dial == nil
	eligible := ls.dial == nil || ls.dial.snap.sp.ProxyProtocol == 0
	if eligible && l.stats != nil {
		l.stats.eligible.Add(1)
	}
	if l.ring != nil && eligible {
		l.ringAdd(ls)
		return
	}
	if err := l.register(ls, 0); err != nil {
		l.end(ls, true)
		return
	}
	if ls.dial != nil {
		l.connect(ls)
		return
	}
	if err := l.register(ls, 1); err != nil {
		l.end(ls, true)
	}
}

// register adds side i of ls to the epoll set, for reading and writing,
// edge-triggered. Registering reports the socket's current readiness at
// once (ep_insert queues a file that is ready already), so bytes that came
// before the session got here are not missed.
func (l *eventLoop) register(ls *loopSession, i int) error {
	sd := &ls.side[i]
	sd.ls, sd.readable, sd.writable = ls, false, !ls.connecting
	return l.watch(sd, unix.EPOLLIN|unix.EPOLLOUT|unix.EPOLLRDHUP|unix.EPOLLET)
}

// watch adds sd's socket to the epoll set for events, under a new
// generation.
func (l *eventLoop) watch(sd *loopSide, events uint32) error {
	l.gen++
	if l.gen <= 0 {
		l.gen = 1
	}
	sd.gen = l.gen
	if sd.fd >= len(l.sides) {
		grown := make([]*loopSide, max(sd.fd+1, 2*len(l.sides), 64))
		copy(grown, l.sides)
		l.sides = grown
	}
	l.sides[sd.fd] = sd
	ev := unix.EpollEvent{Events: events, Fd: int32(sd.fd), Pad: sd.gen}
	if err := epollAdd(l.epfd, sd.fd, &ev); err != nil {
		return os.NewSyscallError("epoll_ctl add", err)
	}
	return nil
}

// connect starts the next attempt at a backend for ls (tcpDial.next),
// moving on at once past attempts that fail to start; when none is left
// the session ends. The attempt completes in ready (connected), or fails
// there or at its deadline (expire).
func (l *eventLoop) connect(ls *loopSession) {
	d := ls.dial
	for {
		addr, err := d.next()
		if err != nil {
			d.refused(err)
			l.end(ls, true)
			return
		}
		var fd int
		if ls.onRing {
			fd, err = rawSocket(unix.SOCK_STREAM, addr, d.from, d.p.cfg.OwnMark)
		} else {
			fd, err = rawDial(unix.SOCK_STREAM, addr, d.from, d.p.cfg.OwnMark)
		}
		if err != nil {
			d.failed(err)
			continue
		}
		ls.side[1].fd = fd
		ls.connecting = true
		if ls.onRing {
			l.ringConnect(ls, addr)
		} else if err := l.register(ls, 1); err != nil {
			l.closeSide(&ls.side[1], false)
			ls.connecting = false
			d.failed(err)
			continue
		}
		ls.deadline = time.Now().Add(l.dialTimeout)
		l.connecting[ls] = struct{}{}
		if l.nextDeadline.IsZero() || ls.deadline.Before(l.nextDeadline) {
			l.nextDeadline = ls.deadline
		}
		return
	}
}

// connectDone ends ls's connection attempt: with err nil the backend is
// connected, and its PROXY header, if any, is the first thing to send it;
// otherwise the next attempt starts. False if the session is over.
func (l *eventLoop) connectDone(ls *loopSession, err error) bool {
	ls.connecting = false
	delete(l.connecting, ls)
	d := ls.dial
	if err != nil {
		if ls.connectArmed {
			l.ringCancel(ringData(ls.ringID, ls.attempt, 0, ringTagConnect))
		}
		l.closeSide(&ls.side[1], false)
		d.failed(err)
		l.connect(ls)
		return false
	}
	d.connected()
	hdr, err := d.header()
	if err != nil {
		d.p.connLog.Warn("sending the PROXY protocol header failed", zap.Stringer("servicePort", d.name), zap.Error(err))
		l.end(ls, true)
		return false
	}
	if len(hdr) > 0 {
		ls.dir[0].pending = hdr
	}
	ls.side[1].writable = true
	return true
}

// expire fails the connection attempts past their deadline, and works
// out the next deadline.
func (l *eventLoop) expire(now time.Time) {
	l.nextDeadline = time.Time{}
	for ls := range l.connecting {
		if !now.Before(ls.deadline) {
			l.connectDone(ls, errConnectTimeout)
		}
	}
	for ls := range l.connecting { // connectDone may have added some
		if l.nextDeadline.IsZero() || ls.deadline.Before(l.nextDeadline) {
			l.nextDeadline = ls.deadline
		}
	}
}

// ready handles one epoll event.
func (l *eventLoop) ready(ev unix.EpollEvent) {
	fd := int(ev.Fd)
	if fd < 0 || fd >= len(l.sides) {
		return
	}
	sd := l.sides[fd]
	if sd == nil || sd.gen != ev.Pad {
		return // the side was closed earlier in this batch
	}
	if sd.flow != nil {
		l.flowReady(sd.flow)
		return
	}
	if ev.Events&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		sd.readable = true
	}
	if ev.Events&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		sd.writable = true
	}
	ls := sd.ls
	if ls.connecting {
		if sd != &ls.side[1] {
			return // the client's bytes wait until the backend is connected
		}
		if ev.Events&(unix.EPOLLOUT|unix.EPOLLERR|unix.EPOLLHUP) == 0 {
			return
		}
		soerr, err := unix.GetsockoptInt(sd.fd, unix.SOL_SOCKET, unix.SO_ERROR)
		if err == nil && soerr != 0 {
			err = os.NewSyscallError("connect", unix.Errno(soerr))
		}
		if !l.connectDone(ls, err) {
			return
		}
		// The client may have sent its first bytes already.
	}
	l.pumpBoth(ls)
}

// pumpBoth pumps both directions of ls in turn, and aborts it on an
// error.
func (l *eventLoop) pumpBoth(ls *loopSession) {
	for d := range ls.dir {
		if ls.closed {
			return
		}
		if err := l.pump(ls, d); err != nil {
			l.end(ls, true)
			return
		}
	}
}

// pump moves direction d's bytes until its source has nothing more, its
// destination is full, or its EOF has been passed on. An error means the
// session must be aborted.
//
// Like session.copyHalf, a direction moves small messages through a
// userspace buffer (the loop's own: it is emptied into the destination
// before the next read) and bulk transfers with splice(2) through a pooled
// pipe, held only while it has bytes in it.
func (l *eventLoop) pump(ls *loopSession, d int) error {
	dir, src, dst := &ls.dir[d], &ls.side[d], &ls.side[1-d]
	for !dir.done {
		if dir.pipe != nil || len(dir.pending) > 0 {
			if !dst.writable {
				return nil
			}
			if err := l.flush(dir, dst); err != nil {
				return err
			}
			if dir.pipe != nil || len(dir.pending) > 0 {
				dst.writable = false
				return nil
			}
			continue
		}
		if dir.eof {
			dir.done = true
			if ls.dir[1-d].done {
				// Both EOFs passed: close both at once, which sends the
				// last FIN without a shutdown call of its own.
				l.end(ls, false)
				return nil
			}
			if err := shutdownWrite(dst.fd); err != nil && err != unix.ENOTCONN {
				return fmt.Errorf("shutdown: %w", err)
			}
			return nil
		}
		if !src.readable || !dst.writable {
			return nil
		}
		if err := l.read(ls, dir, src, dst); err != nil {
			return err
		}
	}
	return nil
}

// read takes what src has, into a pipe or the loop's buffer, and writes
// as much of it as dst takes at once; the rest waits in dir.
func (l *eventLoop) read(ls *loopSession, dir *loopDir, src, dst *loopSide) error {
	h := &dir.h
	if h.splicing {
		p, err := tcpPipes.get()
		if err == nil {
			n, err := spliceRetry(src.fd, p.w, maxSplice)
			switch {
			case err == unix.EAGAIN:
				tcpPipes.put(p)
				l.drained(dir, src)
				return nil
			case err != nil:
				tcpPipes.put(p)
				return fmt.Errorf("splice from socket: %w", err)
			case n == 0:
				tcpPipes.put(p)
				dir.eof = true
				return nil
			}
			p.data = n
			dir.pipe = p
			dir.moved, ls.moved = true, true
			if n >= spliceAtLeast {
				h.small = 0
			} else if h.small++; h.small >= smallSplices {
				h.splicing = false
			}
			return nil
		}
		if !errors.Is(err, errNoPipe) {
			return err
		}
		// No pipe to be had: this read goes through the buffer.
	}
	var (
		n, inq int
		err    error
	)
	if h.inq {
		n, inq, err = recvInq(src.fd, l.buf[:])
	} else {
		n, err = readRetry(src.fd, l.buf[:])
		inq = 1 // unknown: read again
	}
	switch {
	case err == unix.EAGAIN:
		l.drained(dir, src)
		return nil
	case err != nil:
		return fmt.Errorf("read from socket: %w", err)
	case n == 0:
		dir.eof = true
		return nil
	}
	dir.moved, ls.moved = true, true
	// Read on until the socket is empty or the buffer full, and only then
	// write: the read that finds the socket empty comes anyway, and when
	// it finds the FIN instead, the bytes go out with MSG_MORE and the
	// shutdown that passes the FIN on joins them in one segment
	// (tcp_send_fin appends the FIN to the last unsent skb), as HAProxy's
	// do: the peer is woken once, not twice.
	empty, eof := inq == 0, false
	for !empty && !eof && n < len(l.buf) {
		var m int
		if h.inq {
			m, inq, err = recvInq(src.fd, l.buf[n:])
		} else {
			m, err = readRetry(src.fd, l.buf[n:])
			inq = 1
		}
		switch {
		case err == unix.EAGAIN:
			empty = true
		case err != nil:
			return fmt.Errorf("read from socket: %w", err)
		case m == 0:
			eof = true
		default:
			n += m
			empty = inq == 0
		}
	}
	if l.stats != nil {
		l.stats.copied.Add(int64(n))
	}
	full := n == len(l.buf)
	flags := 0
	if eof {
		flags = unix.MSG_MORE
	}
	w, err := sendRetry(dst.fd, l.buf[:n], flags)
	if w > 0 {
		dir.total += int64(w)
	}
	switch {
	case err == unix.EAGAIN:
		w = 0
		dst.writable = false
	case err != nil:
		return fmt.Errorf("write to socket: %w", err)
	}
	if w < n {
		dir.pending = append([]byte(nil), l.buf[w:n]...)
	}
	if full {
		h.splicing = true // a bulk transfer: splice from here on
	}
	if eof {
		dir.eof = true
	} else if empty {
		// Nothing left (EAGAIN, or no FIN and no bytes by TCP_INQ's
		// hint): edge-triggered epoll reports the next bytes that arrive,
		// even ones that came while this ran.
		l.drained(dir, src)
	}
	return nil
}

// drained notes that src has nothing to read. The second time that
// happens between messages, TCP_INQ is turned on for src, as in
// copyMessages.
func (l *eventLoop) drained(dir *loopDir, src *loopSide) {
	src.readable = false
	if !dir.moved {
		return
	}
	dir.moved = false
	h := &dir.h
	if !h.inq {
		if h.boundaries++; h.boundaries == inqAfter {
			h.inq = unix.SetsockoptInt(src.fd, unix.SOL_TCP, unix.TCP_INQ, 1) == nil
		}
	}
}

// flush writes dir's waiting bytes to dst until they are gone or dst is
// full.
func (l *eventLoop) flush(dir *loopDir, dst *loopSide) error {
	for len(dir.pending) > 0 {
		w, err := writeRetry(dst.fd, dir.pending)
		if w > 0 {
			dir.total += int64(w)
			dir.pending = dir.pending[w:]
		}
		if err == unix.EAGAIN {
			return nil
		}
		if err != nil {
			return fmt.Errorf("write to socket: %w", err)
		}
	}
	dir.pending = nil
	if p := dir.pipe; p != nil {
		for p.data > 0 {
			n, err := spliceRetry(p.r, dst.fd, p.data)
			if n > 0 {
				p.data -= n
				dir.total += int64(n)
				continue
			}
			if err == unix.EAGAIN {
				return nil
			}
			if err == nil {
				err = io.ErrUnexpectedEOF // the pipe is ours: it cannot be empty here
			}
			return fmt.Errorf("splice to socket: %w", err)
		}
		tcpPipes.put(p)
		dir.pipe = nil
	}
	return nil
}

// end closes the session's sockets (abort: with a reset, as
// session.abort does) and runs its finish. Runs on the loop; once only.
func (l *eventLoop) end(ls *loopSession, abort bool) {
	if ls.closed {
		return
	}
	ls.closed = true
	delete(l.sessions, ls)
	delete(l.connecting, ls)
	if ls.onRing {
		l.ringCancelAll(ls)
		l.ringForget(ls)
	}
	for i := range ls.side {
		l.closeSide(&ls.side[i], abort)
	}
	for i := range ls.dir {
		if p := ls.dir[i].pipe; p != nil {
			tcpPipes.put(p) // closes it: it still holds bytes
			ls.dir[i].pipe = nil
		}
	}
	tcpPipes.leave()
	if l.stats != nil && ls.dir[0].total+ls.dir[1].total > 0 {
		l.stats.carried.Add(1)
	}
	ls.finish(ls.dir[0].total, ls.dir[1].total)
}

// closeSide closes sd's socket, if it has one (abort: with a reset). Its
// descriptor leaves the epoll set as it closes.
func (l *eventLoop) closeSide(sd *loopSide, abort bool) {
	if sd.fd < 0 {
		return
	}
	if sd.fd < len(l.sides) && l.sides[sd.fd] == sd {
		l.sides[sd.fd] = nil
	}
	if abort {
		_ = unix.SetsockoptLinger(sd.fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1})
	}
	if l.ring != nil {
		l.ringCloseFD(sd.fd)
	} else {
		_ = closeFD(sd.fd)
	}
	sd.fd = -1
}

// abort ends ls with a reset, if it has not ended. Runs on the loop.
func (l *eventLoop) abort(ls *loopSession) {
	l.end(ls, true)
}

// sweep aborts the sessions that moved nothing, and whose sockets made no
// progress either, since the previous sweep: idle for between one and two
// periods.
func (l *eventLoop) sweep() {
	for ls := range l.sessions {
		if ls.connecting {
			continue // the dial timeout bounds it
		}
		now := [2]uint64{fdProgress(ls.side[0].fd), fdProgress(ls.side[1].fd)}
		active := ls.moved || now != ls.progress
		ls.moved, ls.progress = false, now
		if !active {
			l.end(ls, true)
		}
	}
}

// defaultKeepAliveEvery is how often a loop arms keep-alive unless
// Config.BackendKeepAliveEvery says otherwise.
const defaultKeepAliveEvery = 15 * time.Second

// armKeepAlive turns TCP keep-alive on, with Go's default timing, for the
// backend sockets that do not have it yet. The loop connects backends
// without it, and comes here every Config.BackendKeepAliveEvery.
//
// A connection that ends sooner, as most short ones do, never pays the
// four setsockopt calls, a visible part of a short connection's cost. It
// loses nothing, since with 15 s of idle before the first probe none
// would have gone out.
// HAProxy, nginx and Envoy set no keep-alive on backend sockets at all.
//
// A connection that lasts gets keep-alive within that period.
// Setting TCP_KEEPIDLE counts the idle time already passed
// (tcp_sock_set_keepidle), so a dead backend is found at most that much
// later than if the socket had had keep-alive from the start.
func (l *eventLoop) armKeepAlive() {
	for ls := range l.sessions {
		if ls.keepAlive || ls.connecting || ls.closed || ls.side[1].fd < 0 {
			continue
		}
		// It fails only on a socket that is no longer one; whatever
		// happened to the connection shows on its next read or write.
		_ = setKeepAliveFD(ls.side[1].fd)
		ls.keepAlive = true
	}
}

// fdProgress returns bytes received plus bytes acknowledged by the peer
// (see tcpProgress).
func fdProgress(fd int) uint64 {
	info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil {
		return 0
	}
	return info.Bytes_received + info.Bytes_acked
}

// errLoopStopped: the loop stopped before it could take the session.
var errLoopStopped = errors.New("event loop stopped")

// dupFD returns a duplicate of c's descriptor, close-on-exec.
func dupFD(c syscall.Conn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	return dupRaw(rc)
}

// dupRaw returns a duplicate of rc's descriptor, close-on-exec.
func dupRaw(rc syscall.RawConn) (int, error) {
	nfd := -1
	var err error
	if cerr := rc.Control(func(fd uintptr) { nfd, err = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0) }); cerr != nil {
		return -1, cerr
	}
	if err != nil {
		return -1, os.NewSyscallError("fcntl F_DUPFD_CLOEXEC", err)
	}
	return nfd, nil
}

// eventLoops is the number of loops cfg asks for: zero means one less
// than GOMAXPROCS (at least one), negative none.
//
// A loop blocks in epoll_wait, a system call, and keeps its P meanwhile
// (the runtime retakes it only through sysmon, a tick or more later), so
// the default leaves one P to the rest of the process: a loop on every
// CPU gains short connections but costs UDP requests, latency and CPU
// per request (see docs/performance.md).
func (c *Config) eventLoops() int {
	switch {
	case c.EventLoops < 0:
		return 0
	case c.EventLoops == 0:
		return max(1, runtime.GOMAXPROCS(0)-1)
	}
	return c.EventLoops
}

// addFlow watches a UDP flow's socket for the backend's replies. Runs on
// the loop, before any dropFlow of the flow (connectFlow).
func (l *eventLoop) addFlow(f *udpFlow) {
	if l.recv == nil {
		l.recv = newFlowReceiver()
		l.replies = newReplyQueue(func(f *udpFlow, n int, err error) { f.p.replied(f, n, err) })
	}
	l.flows[f] = struct{}{}
	f.side = loopSide{flow: f, fd: f.fd}
	if err := l.watch(&f.side, unix.EPOLLIN|unix.EPOLLET); err != nil {
		f.p.udpFailed(f, err)
	}
}

// flowBudget bounds the replies one wake-up relays for one flow, so that
// a backend that floods its client cannot hold the loop.
const flowBudget = 64

// flowReady relays the replies queued on f's socket to its client. A
// receive error (ECONNREFUSED after an ICMP port unreachable: udp(7))
// ends the flow. Runs on the loop.
func (l *eventLoop) flowReady(f *udpFlow) {
	if f.slot != nil {
		l.slotReady(f)
		return
	}
	r := l.recv
	for relayed := 0; relayed < flowBudget; {
		if f.closed.Load() {
			return
		}
		n, err := r.receive(f.fd)
		switch {
		case err == unix.EAGAIN:
			return
		case err != nil:
			f.p.udpFailed(f, os.NewSyscallError("recvmmsg", err))
			return
		}
		for i := range n {
			f.p.queueReply(f, l.replies, r.datagram(i))
		}
		if n < len(r.hdrs) {
			// The socket had no more: the next datagram will raise a new
			// edge (epoll(7)), so no read is needed to find EAGAIN.
			return
		}
		relayed += n
	}
	// Edge-triggered: no new event comes for what is left. Relay it after
	// the other ready sockets had their turn.
	l.post(func() { l.flowReady(f) })
}

// dropFlow closes a closed flow's socket, which takes it out of the
// epoll set, and lets go of its backend. Runs on the loop, after the flow
// was closed; at most once per flow.
func (l *eventLoop) dropFlow(f *udpFlow) {
	if _, ok := l.flows[f]; !ok {
		return
	}
	delete(l.flows, f)
	if f.fd < len(l.sides) && l.sides[f.fd] == &f.side {
		l.sides[f.fd] = nil
	}
	_ = closeFD(f.fd)
	f.release()
}

// flowReceiver reads a flow's replies for a loop, two at a time with
// recvmmsg(2): when the call returns one, the socket's queue was empty
// after it, and no further read that would find EAGAIN is needed (a UDP
// socket has no TCP_INQ hint).
type flowReceiver struct {
	hdrs [2]unix.Mmsghdr
	iovs [2]unix.Iovec
	bufs [2][]byte
}

func newFlowReceiver() *flowReceiver {
	r := &flowReceiver{}
	for i := range r.hdrs {
		r.bufs[i] = make([]byte, maxDatagram)
		r.iovs[i].Base = &r.bufs[i][0]
		r.iovs[i].SetLen(maxDatagram)
		r.hdrs[i].Hdr.Iov = &r.iovs[i]
		r.hdrs[i].Hdr.SetIovlen(1)
	}
	return r
}

// receive reads up to two datagrams from fd, without waiting.
func (r *flowReceiver) receive(fd int) (int, error) {
	n, err := rawCallP(unix.SYS_RECVMMSG, uintptr(fd), unsafe.Pointer(&r.hdrs[0]), uintptr(len(r.hdrs)), unix.MSG_DONTWAIT, 0, 0)
	return int(n), err
}

// datagram returns the i-th datagram the last receive read.
func (r *flowReceiver) datagram(i int) []byte { return r.bufs[i][:r.hdrs[i].Len] }
