package datapath

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/uproxy/uproxy/internal/testwait"
	"golang.org/x/sys/unix"
)

// rawListening returns a duplicate of a listening socket on 127.0.0.1, as
// rawListenerFD makes one, and its address. The test's cleanup closes
// the original; the duplicate is the caller's.
func rawListening(t *testing.T) (int, string) {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	rc, err := ln.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	fd, derr := -1, error(nil)
	rc.Control(func(s uintptr) { fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) })
	if derr != nil {
		t.Fatal(derr)
	}
	return fd, ln.Addr().String()
}

// acceptRecorder records what the loops hand a loopListener: the
// connections it serves (closed at once) and the failures it reports.
type acceptRecorder struct {
	mu      sync.Mutex
	loops   map[*eventLoop]int // connections served, by loop
	served  int
	delays  []time.Duration
	failure []error
}

func (r *acceptRecorder) serve(el *eventLoop, fd int, client netip.AddrPort) {
	unix.Close(fd)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.loops == nil {
		r.loops = map[*eventLoop]int{}
	}
	r.loops[el]++
	r.served++
}

func (r *acceptRecorder) failed(err error, delay time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.delays = append(r.delays, delay)
	r.failure = append(r.failure, err)
}

func (r *acceptRecorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.served
}

// listenAndServe registers ll with g's loops, connects to addr, and waits
// until rec has served want connections in all.
func listenAndServe(t *testing.T, g *loopGroup, ll *loopListener, addr string, rec *acceptRecorder, want int) {
	t.Helper()
	if err := g.listen(ll); err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	testwait.Until(t, 5*time.Second, fmt.Sprintf("%d connections are served", want), func() bool { return rec.count() == want })
}

// registrations returns the lines of /proc/self/fdinfo for epoll instance
// epfd that are listener registrations (their data's upper half is
// watchListener's -1).
func registrations(t *testing.T, epfd int) []string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", epfd))
	if err != nil {
		t.Skipf("no epoll fdinfo: %v", err)
	}
	var regs []string
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "tfd:") && strings.Contains(line, "data: ffffffff") {
			regs = append(regs, line)
		}
	}
	return regs
}

// TestLoopAcceptBacksOff checks that a loop that cannot accept for want of
// descriptors stops accepting on the socket for a while, 5 ms then twice
// as long after each failure in a row, instead of spinning on a socket
// that stays readable, and serves the connection once accept works again.
func TestLoopAcceptBacksOff(t *testing.T) {
	g := &loopGroup{n: 1, opts: loopOptions{dialTimeout: time.Second}}
	defer g.stop()
	fd, addr := rawListening(t)
	var rec acceptRecorder
	ll := newLoopListener(fd, rec.serve, rec.failed)
	defer ll.close()
	var mu sync.Mutex
	var calls []time.Time
	const failures = 4
	ll.accept = func(fd int, sa *unix.RawSockaddrInet6) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, time.Now())
		if len(calls) <= failures {
			return -1, unix.EMFILE
		}
		return accept4(fd, sa)
	}
	listenAndServe(t, g, ll, addr, &rec, 1)

	mu.Lock()
	defer mu.Unlock()
	// Each failure, the success, then the accept that finds the queue
	// empty.
	checkBackoff(t, &rec, unix.EMFILE, "accept", calls, failures+2)
}

// checkBackoff checks what a loop did with a socket whose first four
// calls failed with errno: rec heard of each failure, with delays of 5 ms
// doubling; the calls, at the times in calls, numbered want in all, and
// each came after the delay that its failure asked for.
func checkBackoff(t *testing.T, rec *acceptRecorder, errno unix.Errno, what string, calls []time.Time, want int) {
	t.Helper()
	rec.mu.Lock()
	defer rec.mu.Unlock()
	delays := []time.Duration{5 * time.Millisecond, 10 * time.Millisecond, 20 * time.Millisecond, 40 * time.Millisecond}
	if diff := cmp.Diff(delays, rec.delays); diff != "" {
		t.Errorf("backoff delays (-want +got):\n%s", diff)
	}
	for _, err := range rec.failure {
		if err != errno {
			t.Errorf("reported failure %v, want %v", err, errno)
		}
	}
	if len(calls) != want {
		t.Errorf("%s was called %d times; want %d", what, len(calls), want)
	}
	for i := 1; i < min(len(calls), len(delays)+1); i++ {
		if gap := calls[i].Sub(calls[i-1]); gap < delays[i-1] {
			t.Errorf("%s %d came %v after the failure before it; want at least %v", what, i+1, gap, delays[i-1])
		}
	}
}

// TestLoopListenerClose checks that closing a loopListener takes the socket
// out of the loops' epoll sets before closing it: a duplicate of the
// descriptor, as handed to the next process, keeps the socket listening,
// and its queued connections are then the duplicate's to accept, not the
// loop's, which would otherwise be woken for them for ever.
func TestLoopListenerClose(t *testing.T) {
	g := &loopGroup{n: 2, opts: loopOptions{dialTimeout: time.Second}}
	defer g.stop()
	fd, addr := rawListening(t)
	var rec acceptRecorder
	ll := newLoopListener(fd, rec.serve, rec.failed)
	if err := g.listen(ll); err != nil {
		t.Fatal(err)
	}
	loops, err := g.running()
	if err != nil {
		t.Fatal(err)
	}
	for i, l := range loops {
		testwait.Until(t, 5*time.Second, fmt.Sprintf("loop %d registers the listener", i), func() bool { return len(registrations(t, l.epfd)) == 1 })
		// EPOLLEXCLUSIVE: a connection wakes one loop.
		var ev uint32
		reg := registrations(t, l.epfd)[0]
		if _, err := fmt.Sscanf(reg[strings.Index(reg, "events:"):], "events: %x", &ev); err != nil {
			t.Fatalf("loop %d's registration %q: %v", i, reg, err)
		}
		if want := uint32(unix.EPOLLIN | unix.EPOLLEXCLUSIVE); ev&want != want || ev&unix.EPOLLET != 0 {
			t.Errorf("loop %d's registration %q; want EPOLLIN|EPOLLEXCLUSIVE, level-triggered", i, reg)
		}
	}
	for i := range 20 {
		c, err := net.Dial("tcp4", addr)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		c.Close()
	}
	testwait.Until(t, 5*time.Second, "both loops' connections are served", func() bool { return rec.count() == 20 })

	dup, err := ll.dup()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(dup)
	ll.close()
	for i, l := range loops {
		testwait.Until(t, 5*time.Second, fmt.Sprintf("loop %d drops the listener", i), func() bool { return len(registrations(t, l.epfd)) == 0 })
	}
	c, err := net.Dial("tcp4", addr)
	if err != nil {
		t.Fatalf("the duplicate does not listen: %v", err)
	}
	defer c.Close()
	testwait.Never(t, 50*time.Millisecond, "a closed listener served a connection after close", func() bool { return rec.count() != 20 })
	nfd, _, err := unix.Accept4(dup, unix.SOCK_CLOEXEC)
	if err != nil {
		t.Fatalf("the connection is not in the duplicate's queue: %v", err)
	}
	unix.Close(nfd)
	// The slots are freed and reused.
	fd2, addr2 := rawListening(t)
	ll2 := newLoopListener(fd2, rec.serve, rec.failed)
	defer ll2.close()
	listenAndServe(t, g, ll2, addr2, &rec, 21)
	for i, l := range loops {
		slots := make(chan int)
		l.post(func() { slots <- len(l.accepting) })
		if got := <-slots; got != 1 {
			t.Errorf("loop %d has %d listener slots after one listener replaced another; want 1", i, got)
		}
	}
}

// TestListenersHoldNoGoroutine checks that, with event loops, a listener
// holds no goroutine, TCP or UDP: the loops accept on it, or read it. An
// accept goroutine per TCP listener kept 10,000 of them, with their
// stacks, at 10,000 services, and so did a reading goroutine per UDP
// listener.
func TestListenersHoldNoGoroutine(t *testing.T) {
	for _, network := range []string{"tcp4", "udp4"} {
		t.Run(network, func(t *testing.T) {
			const n = 50
			p := startEngine(t, Config{})
			// A first listener starts the loops, and the test's goroutines
			// settle.
			serve(t, p, network, "default/svc0:port")
			time.Sleep(50 * time.Millisecond) // nothing signals that the goroutines started have parked
			base := runtime.NumGoroutine()
			for i := range n - 1 {
				serve(t, p, network, fmt.Sprintf("default/svc%d:port", i+1))
			}
			if got := runtime.NumGoroutine() - base; got >= n/2 {
				t.Errorf("%d more listeners hold %d more goroutines; want none", n-1, got)
			}
		})
	}
}

// TestLoopUDPReadBacksOff checks that a loop whose reads of a UDP
// listener fail stops reading the socket for a while, 5 ms then twice as
// long after each failure in a row, instead of spinning on a socket that
// stays readable, and reads it again once the reads work.
func TestLoopUDPReadBacksOff(t *testing.T) {
	g := &loopGroup{n: 1, opts: loopOptions{dialTimeout: time.Second}}
	defer g.stop()
	pc, rc := loopbackUDP(t)
	fd := dupForTest(t, rc)
	var rec acceptRecorder
	ll := &loopListener{rawSock: rawSock{fd: fd}, failed: rec.failed, oneLoop: true}
	defer ll.close()
	const failures = 4
	var mu sync.Mutex
	var calls []time.Time
	var read atomic.Int32
	ll.readable = func(el *eventLoop) (bool, error) {
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, time.Now())
		if len(calls) <= failures {
			return false, unix.ENOBUFS
		}
		var b [64]byte
		for {
			_, err := unix.Read(fd, b[:])
			if err == unix.EAGAIN {
				return false, nil
			}
			if err != nil {
				return false, err
			}
			read.Add(1)
		}
	}
	if err := g.listen(ll); err != nil {
		t.Fatal(err)
	}
	c, err := net.DialUDP("udp4", nil, pc.LocalAddr().(*net.UDPAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 5*time.Second, "the datagram is read", func() bool { return read.Load() == 1 })

	mu.Lock()
	defer mu.Unlock()
	// Each failure, then the read.
	checkBackoff(t, &rec, unix.ENOBUFS, "read", calls, failures+1)
}
