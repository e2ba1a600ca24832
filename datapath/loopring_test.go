package datapath

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/internal/uring"
)

// onLoops runs f on each of p's event loops, in turn, and waits for it.
func onLoops(t *testing.T, p *Engine, f func(l *eventLoop)) {
	t.Helper()
	loops, err := p.loops.running()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range loops {
		done := make(chan struct{})
		if !l.post(func() { f(l); close(done) }) {
			t.Fatal("an event loop is stopping")
		}
		<-done
	}
}

// ringState is what a loop's ring carries, as ringSessions reports it.
type ringState struct {
	Ring          bool
	OnRing, Total int // sessions on the ring; sessions of the loop
}

func ringSessions(t *testing.T, p *Engine) ringState {
	t.Helper()
	var s ringState
	onLoops(t, p, func(l *eventLoop) {
		s.Ring = l.ring != nil
		s.Total += len(l.sessions)
		for ls := range l.sessions {
			if ls.onRing {
				s.OnRing++
			}
		}
	})
	return s
}

func skipWithoutRing(t *testing.T) {
	t.Helper()
	if err := IOURingSupported(); err != nil {
		t.Skipf("skipping: the event loops cannot use io_uring here: %v", err)
	}
}

// TestRingCarriesMessagesThenHandsBulkToEpoll checks that with
// Config.IOURing a session's small messages stay on the loop's ring, and
// that a message that fills a whole buffer takes the session off it, to
// the epoll path, without losing or reordering a byte either way.
func TestRingCarriesMessagesThenHandsBulkToEpoll(t *testing.T) {
	skipWithoutRing(t)
	be := startBackend(t, func(c net.Conn) { io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{c}) })
	p, port := proxyWeb(t, Config{EventLoops: 1, IOURing: true, IdleTimeout: time.Hour}, be)
	c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	exchange := func(msg []byte) {
		t.Helper()
		errc := make(chan error, 1)
		go func() { _, err := c.Write(msg); errc <- err }() // ends when the write does
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(c, got); err != nil {
			t.Fatal(err)
		}
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, msg) {
			t.Fatalf("echo of %d bytes differs", len(msg))
		}
	}
	for i := range 20 {
		exchange([]byte(fmt.Sprintf("message %d", i)))
	}
	if diff := cmp.Diff(ringState{Ring: true, OnRing: 1, Total: 1}, ringSessions(t, p)); diff != "" {
		t.Fatalf("after small messages (-want +got):\n%s", diff)
	}
	big := make([]byte, 4<<20)
	for i := range big {
		big[i] = byte(i * 7)
	}
	exchange(big)
	if diff := cmp.Diff(ringState{Ring: true, OnRing: 0, Total: 1}, ringSessions(t, p)); diff != "" {
		t.Fatalf("after a bulk message (-want +got):\n%s", diff)
	}
	for i := range 5 {
		exchange([]byte(fmt.Sprintf("after %d", i)))
	}
}

// TestRingStarvedReceivesResume runs a ring with a single buffer under
// many clients at once: receives that find no buffer wait for one, and
// every exchange completes, byte for byte.
func TestRingStarvedReceivesResume(t *testing.T) {
	skipWithoutRing(t)
	be := startBackend(t, func(c net.Conn) { io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{c}) })
	p, port := proxyWeb(t, Config{EventLoops: 1, IOURing: true, IOURingBuffers: 1, IdleTimeout: time.Hour}, be)
	const clients, rounds = 8, 200
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := range clients {
		wg.Go(func() {
			c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(20 * time.Second))
			got := make([]byte, 64)
			for r := range rounds {
				msg := fmt.Appendf(nil, "client %d round %d %s", i, r, bytes.Repeat([]byte{'.'}, 64))[:64]
				if _, err := c.Write(msg); err != nil {
					errs <- err
					return
				}
				if _, err := io.ReadFull(c, got); err != nil {
					errs <- fmt.Errorf("client %d round %d: %w", i, r, err)
					return
				}
				if !bytes.Equal(got, msg) {
					errs <- fmt.Errorf("client %d round %d: got %q, want %q", i, r, got, msg)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	var starves int
	onLoops(t, p, func(l *eventLoop) { starves += l.ring.starves })
	if starves == 0 {
		t.Errorf("no receive found the single buffer taken in %d exchanges of %d clients: the test did not starve the ring", clients*rounds, clients)
	}
	t.Logf("%d receives waited for a buffer", starves)
}

// TestRingSlowReaderHoldsNoBuffer has a backend send many small messages
// to a client that reads nothing for a while: the proxy's sends find the
// client's socket full, and the session leaves the ring rather than wait
// in it with one of the loop's buffers. Then the client reads it all,
// byte for byte. The backend sends until the session has left: the
// proxy's send buffer grows with TCP's autotuning (tcp_wmem), so no fixed
// amount is sure to fill it.
func TestRingSlowReaderHoldsNoBuffer(t *testing.T) {
	skipWithoutRing(t)
	const chunk = 1000
	pattern := func(off int) byte { return byte(off % 251) }
	stop := make(chan struct{})
	sent := make(chan int, 1)
	be := startBackend(t, func(c net.Conn) {
		buf := make([]byte, chunk)
		off := 0
		defer func() { sent <- off }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			for i := range buf {
				buf[i] = pattern(off + i)
			}
			if _, err := c.Write(buf); err != nil {
				return
			}
			off += chunk
			time.Sleep(100 * time.Microsecond) // small receives, not a bulk transfer
		}
	})
	p, port := proxyWeb(t, Config{EventLoops: 1, IOURing: true, IdleTimeout: time.Hour}, be)
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}}
	c, err := d.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The session leaves the ring when a send finds the client full (a
	// slow leave), or earlier, when a receive fills a whole buffer: on a
	// loaded machine the backend's small writes can arrive together, and
	// the loop then takes the transfer for bulk. Either way, once off the
	// ring it must hold none of the ring's buffers.
	var slow, held, ringSessions, sessions int
	var served int64
	left := false
	defer func() {
		if !left {
			close(stop)
		}
	}()
	testwait.UntilOK(t, time.Minute, "the session to leave the ring", func() (bool, string) {
		onLoops(t, p, func(l *eventLoop) {
			slow, held = l.ring.slowLeaves, l.ring.bufs.Held()
			ringSessions, sessions = len(l.ring.sessions), len(l.sessions)
			served = l.stats.RingServed.Load()
		})
		return slow > 0 || (served > 0 && sessions == 1 && ringSessions == 0),
			fmt.Sprintf("%d buffers held, %d of the loop's %d sessions on the ring, %d served by it", held, ringSessions, sessions, served)
	})
	left = true
	if slow == 0 {
		t.Logf("the session left the ring as a bulk transfer, before a send found the client full")
	}
	close(stop)
	if held != 0 {
		t.Errorf("the loop holds %d buffers while the client reads nothing; want none", held)
	}
	c.SetDeadline(time.Now().Add(time.Minute))
	var total int
	select {
	case total = <-sent:
	case <-time.After(time.Minute):
		t.Fatal("the backend did not stop sending")
	}
	got, err := io.ReadAll(io.LimitReader(c, int64(total)))
	if err != nil || len(got) != total {
		t.Fatalf("read %d of the %d bytes the backend sent: %v", len(got), total, err)
	}
	for i, b := range got {
		if b != pattern(i) {
			t.Fatalf("byte %d is %d, want %d", i, b, pattern(i))
		}
	}
}

// TestRingEmptyReceiveGivesItsBufferBack hands a loop's ring a receive
// completion that took a buffer and carries no bytes: the buffer must go
// back, so that the loop's count of buffers held returns to zero. Such a
// completion was counted as taking its buffer, which was never returned.
// The receive is real, on a socket pair with a byte to read, so
// the kernel really takes the buffer; only its result is changed to 0
// before the loop sees it.
func TestRingEmptyReceiveGivesItsBufferBack(t *testing.T) {
	skipWithoutRing(t)
	runtime.LockOSThread() // the ring's single issuer is this thread
	defer runtime.UnlockOSThread()
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(epfd)
	l := &eventLoop{epfd: epfd}
	l.loopTCP = loopTCP{loop: l, sessions: map[*loopSession]struct{}{}, connecting: map[*loopSession]struct{}{}}
	if err := l.setupRing(defaultRingBufs); err != nil {
		t.Fatal(err)
	}
	defer l.ring.close()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	if _, err := unix.Write(fds[1], []byte("x")); err != nil {
		t.Fatal(err)
	}
	rs := l.ring
	ls := &loopSession{onRing: true}
	ls.side[0].fd, ls.side[1].fd = fds[0], fds[1]
	rs.lastID++
	ls.ringID = rs.lastID
	rs.sessions[ls.ringID] = ls
	l.ring.recv(ls, 0)
	carried := false
	deadline := time.Now().Add(5 * time.Second)
	for ls.dir[0].recving && time.Now().Before(deadline) {
		if err := rs.r.EnterTimeout(1, 100*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		rs.r.Completions(func(c uring.CQE) {
			if c.UserData&7 == ringTagRecv {
				carried = c.Flags&uring.CQEFBuffer != 0
				c.Res = 0
			}
			l.ring.completed(c)
		})
	}
	if ls.dir[0].recving || !carried {
		t.Fatalf("the receive did not complete with a buffer (completed: %v)", !ls.dir[0].recving)
	}
	rs.bufs.Flush()
	if held := rs.bufs.Held(); held != 0 {
		t.Errorf("the loop holds %d buffers after a receive that carried no bytes; want none", held)
	}
}

// TestRingErrorsNeverPanic makes an event loop's io_uring_enter fail and
// checks that the process survives: a completion backlog (EBUSY) that
// clears leaves the ring and its sessions alone; dropped completions
// (EBADR), any other error, and a backlog that never clears make the loop
// give the ring up: its sessions end, and it carries new ones on epoll.
// Each of them panicked the process before.
func TestRingErrorsNeverPanic(t *testing.T) {
	skipWithoutRing(t)
	for _, tc := range []struct {
		name     string
		errno    syscall.Errno
		times    int
		keepRing bool
	}{
		{"completion backlog that clears", syscall.EBUSY, 3, true},
		{"completion backlog that stays", syscall.EBUSY, 1000, false},
		{"dropped completions", syscall.EBADR, 1, false},
		{"any other error", syscall.EINVAL, 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			be := startBackend(t, func(c net.Conn) { io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{c}) })
			p, port := proxyWeb(t, Config{EventLoops: 1, IOURing: true, IdleTimeout: time.Hour}, be)
			first := echoOnce(t, port, 0)
			defer first.Close()
			if s := ringSessions(t, p); s.OnRing != 1 {
				t.Fatalf("before the error: %+v; want the session on the ring", s)
			}
			onLoops(t, p, func(l *eventLoop) { l.ring.r.FailEnter(tc.errno, tc.times) })
			// The loop enters its ring again once it has run the task;
			// a new connection wakes it, and shows it still serves.
			testwait.Until(t, 5*time.Second, "the loop to use up the injected errors", func() bool {
				echoOnce(t, port, 1).Close()
				used := false
				onLoops(t, p, func(l *eventLoop) { used = l.ring == nil || l.ring.busy == 0 && !l.ring.r.Failing() })
				return used
			})
			s := ringSessions(t, p)
			if s.Ring != tc.keepRing {
				t.Fatalf("after %v: ring kept %v, want %v", tc.errno, s.Ring, tc.keepRing)
			}
			first.SetDeadline(time.Now().Add(5 * time.Second))
			msg := []byte("after the error")
			_, werr := first.Write(msg)
			got := make([]byte, len(msg))
			_, rerr := io.ReadFull(first, got)
			if tc.keepRing {
				if werr != nil || rerr != nil || !bytes.Equal(got, msg) {
					t.Errorf("the session on the ring broke: read %q (%v, %v)", got, werr, rerr)
				}
			} else if rerr == nil || errors.Is(rerr, os.ErrDeadlineExceeded) {
				t.Errorf("the session on the abandoned ring did not end: read %q, %v", got, rerr)
			}
			for i := range 3 {
				echoOnce(t, port, 10+i).Close()
			}
		})
	}
}

// TestIOURingBuffersReachTheRing checks that Config.IOURingBuffers sizes
// the loops' provided buffers: a count that is not a power of two cannot
// be registered, and the loop goes on with epoll only.
func TestIOURingBuffersReachTheRing(t *testing.T) {
	skipWithoutRing(t)
	for _, tt := range []struct {
		name    string
		buffers int
		noRing  int64
	}{
		{"default", 0, 0},
		{"a power of two", 4, 0},
		{"not a power of two", 3, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := startEngine(t, Config{EventLoops: 1, IOURing: true, IOURingBuffers: tt.buffers})
			l, err := p.loops.loopFor()
			if err != nil {
				t.Fatal(err)
			}
			if got := p.cfg.Stats.NoRing.Load(); got != tt.noRing {
				t.Errorf("%d loops without a ring (%v), want %d", got, l.ringErr, tt.noRing)
			}
		})
	}
}
