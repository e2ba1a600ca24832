package datapath

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The data path's event loops carry sessions on a thread each, with no
// goroutine per connection or direction: see "Event loops" in docs/datapath.md.

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
				g.opts.stats.NoRing.Add(1)
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
	stats *Stats
}

// Stats counts, across an Engine, the sessions the ring
// could have carried and those it did, so that a test of the ring data
// path can tell it from epoll (a ring that failed to set up leaves the
// sessions on epoll, and the traffic flows all the same), and the bytes
// that went through userspace buffers rather than splice, so that a test
// can tell that bulk transfers splice (with TCP_INQ the reads are
// recvmsg(2), which the kernel's per-process read counters do not see).
// Only tests keep one (Config.Stats). Safe for concurrent use.
type Stats struct {
	// Eligible: sessions a ring would take (no PROXY protocol header);
	// OnRing: those put on a ring; RingServed: those whose bytes a ring
	// received; Carried: sessions that moved bytes, by any path. NoRing:
	// loops that could not set up their ring. Copied: bytes moved through
	// userspace buffers, on any path.
	Eligible, OnRing, RingServed, Carried, NoRing, Copied atomic.Int64
}

// loopTCP is the part of an event loop that carries TCP sessions.
type loopTCP struct {
	loop        *eventLoop
	dialTimeout time.Duration
	sessions    map[*loopSession]struct{}
	// keepAliveEvery is how often armKeepAlive runs; nextKeepAlive is
	// when it runs next.
	keepAliveEvery time.Duration
	nextKeepAlive  time.Time
	// connecting: the sessions whose backend connection is in progress;
	// nextDeadline is the earliest of their deadlines, or zero.
	connecting   map[*loopSession]struct{}
	nextDeadline time.Time
	buf          [copyBufSize]byte
}

// loopFlows is the part of an event loop that carries UDP flows.
type loopFlows struct {
	loop  *eventLoop
	flows map[*udpFlow]struct{}
	// recv and replies relay UDP replies: allocated with the first flow.
	recv    *flowReceiver
	replies *replyQueue
	// pools: the UDP socket pools of request–reply queries (udppool.go),
	// allocated with the first query.
	pools *loopPools
	// held counts the datagrams the loop holds while their routes are
	// looked up, against maxHeldBytes (heldDatagram).
	held int
}

// loopAccept is the part of an event loop that accepts on listeners.
type loopAccept struct {
	loop *eventLoop
	// accepting: the listeners registered with the loop, by slot
	// (accept.go); freeSlots: its unused slots. paused: the slots whose
	// listener is out of the epoll set after a failed accept, the earliest
	// due again at nextResume. acceptAddr receives accepted peers' addresses.
	accepting  []acceptSlot
	freeSlots  []int32
	paused     []int32
	nextResume time.Time
	acceptAddr unix.RawSockaddrInet6
}

// poller is how an event loop waits for its descriptors: in epoll_wait
// (epollPoller), or in its io_uring (loopRing), which polls the epoll set
// as one of its operations and completes the ring's own between turns.
type poller interface {
	// wait returns the epoll events of the loop's next turn, waiting at
	// most timeout milliseconds (negative: no bound); a ring handles its
	// completions in it.
	wait(events []unix.EpollEvent, timeout int) ([]unix.EpollEvent, error)
	// turnDone ends a turn, after its events and tasks were handled.
	turnDone()
}

// epollPoller waits in epoll_wait on the loop's epoll instance.
type epollPoller struct{ epfd int }

func (p epollPoller) wait(events []unix.EpollEvent, timeout int) ([]unix.EpollEvent, error) {
	n, err := unix.EpollWait(p.epfd, events, timeout)
	return events[:max(n, 0)], err
}

func (epollPoller) turnDone() {}

// eventLoop carries sessions on one epoll instance. Its goroutine (run)
// owns the sessions, their descriptors and every field below mu's; other
// goroutines reach it only through post. The goroutine exits after stop.
//
// Its parts have a type each, whose methods run on the loop's goroutine
// and reach the rest of the loop through their loop field: loopTCP
// (loopsession.go) carries the TCP sessions, loopFlows (loopflow.go,
// udppool.go) the UDP flows, loopAccept (accept.go) the listeners, and
// the poller (epoll, or the loop's io_uring in loopring.go) waits.
type eventLoop struct {
	epfd, wakefd int
	idle         time.Duration
	done         chan struct{} // closed when run returns

	mu       sync.Mutex
	tasks    []func()
	stopping bool

	// Owned by run's goroutine.
	sides     []*loopSide // by descriptor number: sessions' and flows'
	gen       int32
	nextSweep time.Time
	loopTCP
	loopFlows
	loopAccept
	// poll is how the loop waits: its ring, if it has one, else epoll.
	poll poller
	// ring is the loop's io_uring, if it has one (loopring.go); ringErr
	// says why a loop asked for one has none. epollDue: the epoll set may
	// hold events that raise no new wake-up of the ring's poll of it.
	ring       *loopRing
	ringErr    error
	epollDue   bool
	ringFailed func(error) // loopOptions.ringFailed
	stats      *Stats      // loopOptions.stats; nil: none kept
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
		epfd: epfd, wakefd: wakefd, idle: idle, poll: epollPoller{epfd},
		done:       make(chan struct{}),
		ringFailed: o.ringFailed,
		stats:      o.stats,
	}
	l.loopTCP = loopTCP{loop: l, dialTimeout: dialTimeout, sessions: map[*loopSession]struct{}{}, connecting: map[*loopSession]struct{}{}}
	l.loopFlows = loopFlows{loop: l, flows: map[*udpFlow]struct{}{}}
	l.loopAccept.loop = l
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
		ready, err := l.poll.wait(events, l.timeout())
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			// Only a bad epoll descriptor or buffer fails epoll_wait: a
			// bug, not a condition to carry on from. (The ring's wait
			// handles the ring's own errors: see abandonRing.)
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
		l.poll.turnDone()
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
// paused listener's turn (resumeAccept), UDP pool tick (udppool.go) or,
// while the loop carries sessions, keep-alive round, in milliseconds
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
		l.ring.close()
	}
	unix.Close(l.epfd)
	unix.Close(l.wakefd)
	return true
}

// sweep aborts the sessions that moved nothing, and whose sockets made no
// progress either, since the previous sweep: idle for between one and two
// periods.
func (lt *loopTCP) sweep() {
	for ls := range lt.sessions {
		if ls.connecting {
			continue // the dial timeout bounds it
		}
		now := [2]uint64{fdProgress(ls.side[0].fd), fdProgress(ls.side[1].fd)}
		active := ls.moved || now != ls.progress
		ls.moved, ls.progress = false, now
		if !active {
			lt.end(ls, true)
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
func (lt *loopTCP) armKeepAlive() {
	for ls := range lt.sessions {
		if ls.keepAlive || ls.connecting || ls.closed || ls.side[1].fd < 0 {
			continue
		}
		// It fails only on a socket that is no longer one; whatever
		// happened to the connection shows on its next read or write.
		_ = setKeepAliveFD(ls.side[1].fd)
		ls.keepAlive = true
	}
}

// fdProgress returns bytes received plus bytes acknowledged by the peer:
// how the idle sweep tells a quiet direction of a busy connection, whose
// splices it cannot see, from a dead one.
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

// eventLoops is the number of loops cfg asks for: zero (or less) means
// one less than GOMAXPROCS, at least one.
//
// A loop blocks in epoll_wait, a system call, and keeps its P meanwhile
// (the runtime retakes it only through sysmon, a tick or more later), so
// the default leaves one P to the rest of the process: a loop on every
// CPU gains short connections but costs UDP requests, latency and CPU
// per request (see docs/performance.md).
func (c *Config) eventLoops() int {
	if c.EventLoops <= 0 {
		return max(1, runtime.GOMAXPROCS(0)-1)
	}
	return c.EventLoops
}
