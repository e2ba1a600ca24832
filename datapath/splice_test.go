package datapath

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testwait"
)

// readSyscalls returns this process's count of read-family syscalls
// (syscr in /proc/self/io). splice(2) and sendfile(2) do not count; every
// read(2) of a userspace copy does.
func readSyscalls(t *testing.T) int64 {
	t.Helper()
	f, err := os.Open("/proc/self/io")
	if err != nil {
		t.Skipf("no /proc/self/io: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "syscr: "); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	t.Skip("no syscr in /proc/self/io")
	return 0
}

// TestTCPPathSplices proves the proxy copies with splice(2): 64 MiB go
// client ← proxy ← backend, where the backend sends with sendfile and the
// client drains into /dev/null with splice, so the only read(2) calls left
// in the process would be the proxy's own if it copied through userspace.
// A control transfer through a userspace copy shows the measure works.
func TestTCPPathSplices(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		const size = 64 << 20
		payload := filepath.Join(t.TempDir(), "payload")
		if err := os.WriteFile(payload, make([]byte, size), 0o600); err != nil {
			t.Fatal(err)
		}
		be := startBackend(t, func(c net.Conn) {
			f, err := os.Open(payload)
			if err != nil {
				return
			}
			defer f.Close()
			c.(*net.TCPConn).ReadFrom(f) // sendfile
		})
		devnull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer devnull.Close()
		receive := func(port int) int64 {
			c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			n, err := devnull.ReadFrom(c) // splice
			if err != nil || n != size {
				t.Fatalf("received %d bytes, %v; want %d", n, err, size)
			}
			return n
		}

		p, port := proxyWeb(t, Config{IOURing: dp.ring, IdleTimeout: time.Hour}, be) // deadlines must not disable splice
		receive(port)                                                                // warm up: pipes, goroutines
		before, copiedBefore := readSyscalls(t), p.cfg.Stats.Copied.Load()
		receive(port)
		proxied, copied := readSyscalls(t)-before, p.cfg.Stats.Copied.Load()-copiedBefore
		// Messages go through a userspace buffer, with recvmsg once TCP_INQ is
		// on, which syscr does not count: the data path counts those bytes.
		if copied == 0 {
			t.Fatal("no byte went through userspace buffers, although a direction starts with them: the count is broken")
		}
		if copied > size/16 {
			t.Fatalf("the proxy copied %d of %d bytes through userspace buffers: it is not splicing", copied, size)
		}

		// Control: the same transfer through a copy that hides ReadFrom/WriteTo,
		// as any wrapper around the conns would.
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go func() {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			bc, err := net.Dial("tcp4", be.addr.String())
			if err != nil {
				return
			}
			defer bc.Close()
			io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{bc})
		}()
		before = readSyscalls(t)
		receive(ln.Addr().(*net.TCPAddr).Port)
		control := readSyscalls(t) - before

		t.Logf("for 64 MiB: spliced proxy %d read syscalls and %d bytes through userspace buffers; userspace copy %d read syscalls", proxied, copied, control)
		if control < 1000 {
			t.Fatalf("the control copy made only %d reads; the measure is broken", control)
		}
		if proxied > control/20 {
			t.Fatalf("the proxy made %d read syscalls for 64 MiB (a userspace copy made %d): it is not splicing", proxied, control)
		}
	})
}

// echoOnce opens a connection to port, which must echo, and exchanges
// one message, numbered i, over it. The caller closes it.
func echoOnce(t *testing.T, port, i int) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	msg := fmt.Sprintf("%05d", i)
	if _, err := c.Write([]byte(msg)); err != nil {
		c.Close()
		t.Fatal(err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
		c.Close()
		t.Fatalf("echo %d: %q, %v", i, buf, err)
	}
	return c
}

// proxyFDs counts this process's descriptors, less the free pipes of the
// pool (two each): those belong to no connection, and the pool may trim
// them at any moment when no session is open. It reads the pool on both
// sides of the count and retries until they agree.
func proxyFDs(t *testing.T) int {
	t.Helper()
	for {
		free := tcpPipes.idleFree()
		n := countFDs(t)
		if tcpPipes.idleFree() == free {
			return n - 2*free
		}
	}
}

// TestIdleConnectionHoldsTwoFDs checks that a proxied connection that has
// carried data both ways and is now idle holds exactly its two sockets in
// the proxy: no pipe. (net.TCPConn.ReadFrom held a pipe pair per direction
// for as long as it waited: six descriptors per connection.)
func TestIdleConnectionHoldsTwoFDs(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		// An echo through a userspace buffer: io.Copy on the bare conn would
		// splice, and hold a pipe in the backend while it waits.
		be := startBackend(t, func(c net.Conn) { io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{c}) })
		p, port := proxyWeb(t, Config{IOURing: dp.ring, IdleTimeout: time.Hour}, be)

		const n = 100
		// The event loops' own descriptors (an epoll and an eventfd each)
		// belong to no connection: start them before the count.
		if _, err := p.loops.loopFor(); err != nil {
			t.Fatal(err)
		}
		base := proxyFDs(t)
		conns := make([]net.Conn, 0, n)
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for i := range n {
			conns = append(conns, echoOnce(t, port, i))
		}
		testwait.Until(t, 5*time.Second, "every session is registered", func() bool { return p.ActiveConnections() == n })
		// In this process each connection also has the client's socket and the
		// backend's: two more descriptors that are not the proxy's.
		testwait.UntilOK(t, 5*time.Second, "2 descriptors per idle connection (client and backend sockets, no pipe)", func() (bool, string) {
			perConn := float64(proxyFDs(t)-base-2*n) / n
			return perConn == 2, fmt.Sprintf("%.2f", perConn)
		})
	})
}

// TestSplicePathKeepsEveryByte sends random payloads of random sizes, in
// random writes with pauses, through many concurrent connections to an
// echo backend, and checks that each comes back whole (SHA-256), that
// half-close ends each one cleanly, and that the byte counters, which come
// from the splice loop's counts, match what was sent.
func TestSplicePathKeepsEveryByte(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		be := echoBackend(t)
		// A short idle timeout, so that deadlines fire in the middle of
		// transfers and the copy has to resume without losing a byte.
		p := startEngine(t, Config{IOURing: dp.ring, IdleTimeout: time.Second})
		l := serve(t, p, "tcp4", "default/web:http", be.addr)
		snap := *l.Snap.Load()
		snap.Metrics = testPortMetrics(snap.Backends...)
		l.Snap.Store(&snap)
		port := int(l.Port)

		const conns = 40
		var (
			wg    sync.WaitGroup
			total atomic.Int64
			errs  = make(chan error, conns)
		)
		for i := range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(i), 1))
				size := rng.IntN(3 << 20)
				if i%8 == 0 {
					size = rng.IntN(200) // small messages too
				}
				payload := make([]byte, size)
				for j := range payload {
					payload[j] = byte(rng.Uint32())
				}
				total.Add(int64(size))
				c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
				if err != nil {
					errs <- err
					return
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(60 * time.Second))
				sent := make(chan error, 1)
				go func() { // exits when the payload is written or the conn fails
					rest := payload
					for len(rest) > 0 {
						k := min(len(rest), 1+rng.IntN(256<<10))
						if _, err := c.Write(rest[:k]); err != nil {
							sent <- err
							return
						}
						rest = rest[k:]
						if rng.IntN(16) == 0 {
							time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond) // a sender that stalls at random
						}
					}
					sent <- c.(*net.TCPConn).CloseWrite()
				}()
				h := sha256.New()
				n, err := io.Copy(h, c)
				if werr := <-sent; werr != nil {
					errs <- fmt.Errorf("connection %d: write: %w", i, werr)
					return
				}
				if err != nil || n != int64(size) || !bytes.Equal(h.Sum(nil), sha256Sum(payload)) {
					errs <- fmt.Errorf("connection %d: got %d bytes (%v), want %d, checksum match %v", i, n, err, size, bytes.Equal(h.Sum(nil), sha256Sum(payload)))
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		want := uint64(total.Load())
		for _, dir := range []*atomic.Uint64{&snap.Metrics.C.Upstream, &snap.Metrics.C.Downstream} {
			testwait.Until(t, 5*time.Second, "the byte counters settle", func() bool { return dir.Load() == want })
		}
	})
}

func sha256Sum(b []byte) []byte {
	s := sha256.Sum256(b)
	return s[:]
}

// TestPipePoolBoundsAndTrims checks the pool's descriptor accounting: a
// pipe returned with bytes in it is closed, the free list keeps at most
// max pipes, and once no session is open the free pipes are closed.
func TestPipePoolBoundsAndTrims(t *testing.T) {
	pp := &pipePool{max: 2, trimAfter: 20 * time.Millisecond}
	base := countFDs(t)
	pp.enter()
	var ps []*kernelPipe
	for range 4 {
		p, err := pp.get()
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	if got := countFDs(t) - base; got != 8 {
		t.Fatalf("4 pipes hold %d descriptors, want 8", got)
	}
	ps[0].data = 1 // a transfer failed half-way
	for _, p := range ps {
		pp.put(p)
	}
	if got, free := countFDs(t)-base, pp.idleFree(); got != 4 || free != 2 {
		t.Fatalf("after returning 4 pipes (one dirty) to a pool of 2: %d descriptors, %d free; want 4 and 2", got, free)
	}
	pp.enter()
	pp.leave() // a session is still open: nothing is trimmed
	testwait.Never(t, 50*time.Millisecond, "the pool trimmed its free pipes while a session was open", func() bool { return pp.idleFree() != 2 })
	// Other tests' sockets may still be closing: count only the drop.
	held := countFDs(t)
	pp.leave()
	testwait.Until(t, 5*time.Second, "the idle pool closes its pipes", func() bool { return pp.idleFree() == 0 && countFDs(t) <= held-4 })
}

// TestMessagesThenHalfClose exchanges small messages until the proxy reads
// them with TCP_INQ hints, then sends a last message together with the
// FIN: the FIN, which no later readiness event announces, must still be
// passed on, in both directions.
func TestMessagesThenHalfClose(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		// The backend echoes each message, and after the client's EOF sends
		// "bye" and its own FIN.
		be := startBackend(t, func(c net.Conn) {
			io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{c})
			c.Write([]byte("bye"))
		})
		_, port := proxyWeb(t, Config{IOURing: dp.ring, IdleTimeout: time.Hour}, be)
		c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 8)
		for i := range 2 * inqAfter {
			msg := fmt.Sprintf("msg%05d", i)
			if _, err := c.Write([]byte(msg)); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
				t.Fatalf("echo %d: %q, %v", i, buf, err)
			}
		}
		if _, err := c.Write([]byte("last")); err != nil {
			t.Fatal(err)
		}
		if err := c.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(c)
		if err != nil || string(got) != "lastbye" {
			t.Fatalf("after the half-close: %q, %v; want \"lastbye\" and EOF", got, err)
		}
	})
}

// TestSplicedSessionsLeakNothing runs bulk transfers, which splice through
// pooled pipes, and ends them every way (clean half-close, a reset from
// the client in the middle, a backend that stops reading and is cut off by
// the idle timeout), then checks that once the sessions are over and the
// pool has trimmed itself, the process holds no more descriptors or
// goroutines than before. The backend copies through userspace: the
// runtime's own splice pipes are closed only by the garbage collector.
func TestSplicedSessionsLeakNothing(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		stall := make(chan struct{})
		be := startBackend(t, func(c net.Conn) {
			var first [1]byte
			if _, err := io.ReadFull(c, first[:]); err != nil {
				return
			}
			if first[0] == 's' { // read some, then stop reading until the test ends
				io.CopyN(io.Discard, c, 256<<10)
				select {
				case <-stall:
				case <-time.After(10 * time.Second):
				}
				return
			}
			c.Write(first[:])
			io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{c})
		})
		var once sync.Once
		release := func() { once.Do(func() { close(stall) }) }
		defer release()
		baseG, baseFD := runtime.NumGoroutine(), proxyFDs(t)
		func() {
			p := startEngine(t, Config{IOURing: dp.ring, IdleTimeout: 300 * time.Millisecond})
			l := serve(t, p, "tcp4", "default/web:http", be.addr)
			port := int(l.Port)
			payload := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
			// More than the kernel's socket buffers on both sides can hold.
			flood := make([]byte, 32<<20)
			var wg sync.WaitGroup
			for i := range 30 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
					if err != nil {
						t.Error(err)
						return
					}
					defer c.Close()
					c.SetDeadline(time.Now().Add(10 * time.Second))
					switch i % 3 {
					case 0: // clean: send, half-close, read the echo to EOF
						go func() { c.Write(payload); c.(*net.TCPConn).CloseWrite() }()
						if n, err := io.Copy(io.Discard, c); n != int64(len(payload)) {
							t.Errorf("connection %d: echoed %d bytes, %v", i, n, err)
						}
					case 1: // reset in the middle, with bytes in the proxy's pipe
						// A small receive buffer stalls the proxy's pump
						// into this socket, so the reset finds bytes in the
						// pipe: that pipe must be closed, not reused.
						c.(*net.TCPConn).SetReadBuffer(4 << 10)
						go c.Write(payload) // fails at the reset, at the latest
						io.CopyN(io.Discard, c, 64<<10)
						c.(*net.TCPConn).SetLinger(0)
					default: // the backend stops reading, with bytes in the proxy's
						// pipe (the transfer splices by then): the idle timeout
						// cuts it off, and that pipe must be closed
						c.Write([]byte("s"))
						c.Write(flood) // fills the buffers, then fails when cut off
						io.Copy(io.Discard, c)
					}
				}()
			}
			wg.Wait()
			testwait.Until(t, 5*time.Second, "sessions end", func() bool { return p.ActiveConnections() == 0 })
			// As the proxier's Shutdown does.
			p.Refuse()
			l.Close()
			p.Drain(context.Background())
		}()
		release() // the stalled backends may go now
		// The pool closes its free pipes a second after the last session.
		testwait.UntilOK(t, 5*time.Second, "the goroutines and descriptors of the sessions to go", func() (bool, string) {
			g, fds := runtime.NumGoroutine(), countFDs(t)
			return g <= baseG+2 && fds <= baseFD+2, fmt.Sprintf("%d goroutines (before: %d), %d descriptors (before: %d; free pipes in the pool now: %d)",
				g, baseG, fds, baseFD, tcpPipes.idleFree())
		})
	})
}
