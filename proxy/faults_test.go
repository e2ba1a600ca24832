package proxy

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
)

// killableBackend is an echo server that can be killed, as the kernel
// kills a process's sockets (its listener closed, its connections reset),
// and healed (listening again on the same address).
type killableBackend struct {
	t        *testing.T
	addr     string
	accepted atomic.Int64

	mu    sync.Mutex
	ln    net.Listener
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

func startKillable(t *testing.T) *killableBackend {
	t.Helper()
	b := &killableBackend{t: t, addr: "127.0.0.1:0", conns: map[net.Conn]struct{}{}}
	b.heal()
	t.Cleanup(func() { b.kill(); b.wg.Wait() })
	return b
}

// heal listens on the backend's address (a free port the first time) and
// serves until kill.
func (b *killableBackend) heal() {
	b.t.Helper()
	ln, err := net.Listen("tcp4", b.addr)
	if err != nil {
		b.t.Fatal(err)
	}
	b.mu.Lock()
	b.ln, b.addr = ln, ln.Addr().String()
	b.mu.Unlock()
	b.wg.Go(func() { // ends when kill closes ln
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			b.accepted.Add(1)
			b.mu.Lock()
			b.conns[c] = struct{}{}
			b.mu.Unlock()
			b.wg.Go(func() { // ends at EOF, or when kill resets c
				defer c.Close()
				io.Copy(c, c)
			})
		}
	})
}

func (b *killableBackend) kill() {
	b.mu.Lock()
	ln, conns := b.ln, b.conns
	b.ln, b.conns = nil, map[net.Conn]struct{}{}
	b.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
	for c := range conns {
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
	}
}

func (b *killableBackend) backend() *backend {
	b.mu.Lock()
	defer b.mu.Unlock()
	return &backend{addr: netip.MustParseAddrPort(b.addr)}
}

// transfer streams payload to c in 16 KiB pieces, pause apart, half-closes,
// and checks that the echo that comes back has the payload's SHA-256.
func transfer(c net.Conn, payload []byte, pause time.Duration) error {
	c.SetDeadline(time.Now().Add(20 * time.Second))
	done := make(chan error, 1)
	go func() { // ends when the payload is written or the connection fails
		for rest := payload; len(rest) > 0; {
			k := min(len(rest), 16<<10)
			if _, err := c.Write(rest[:k]); err != nil {
				done <- err
				return
			}
			rest = rest[k:]
			time.Sleep(pause) // a slow sender is the point: the transfer outlasts the kill
		}
		done <- c.(*net.TCPConn).CloseWrite()
	}()
	h := sha256.New()
	n, err := io.Copy(h, c)
	werr := <-done
	if err == nil {
		err = werr
	}
	if err != nil {
		return fmt.Errorf("after %d of %d bytes: %w", n, len(payload), err)
	}
	if want := sha256.Sum256(payload); !bytes.Equal(h.Sum(nil), want[:]) {
		return fmt.Errorf("checksum mismatch: %d bytes back of %d", n, len(payload))
	}
	return nil
}

// TestProxyBackendKilledMidTransfer kills one of two backends while
// transfers to both are going on: the transfers to it fail at once (the
// reset is passed on), the others complete, new connections all go to the
// survivor without an error, and the killed backend gets connections
// again once it is back.
func TestProxyBackendKilledMidTransfer(t *testing.T) {
	good := startKillable(t)
	victim := startKillable(t)
	p, rules := startProxier(t, Config{Config: datapath.Config{DialTimeout: 200 * time.Millisecond, EjectBase: 200 * time.Millisecond}})
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", good.backend(), victim.backend()))
	port := rules.port(t, "default/web:http")
	addr := fmt.Sprintf("127.0.0.1:%d", port)

	const transfers = 4 // round-robin: two on each backend
	type result struct {
		err error
		at  time.Time
	}
	results := make(chan result, transfers)
	start := make(chan struct{})
	for i := range transfers {
		c, err := net.Dial("tcp4", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		payload := make([]byte, 1<<20)
		rng := rand.New(rand.NewPCG(uint64(i), 2))
		for j := range payload {
			payload[j] = byte(rng.Uint32())
		}
		go func() { // ends with the transfer, within its deadline
			<-start
			err := transfer(c, payload, 10*time.Millisecond) // at least 0.64s
			results <- result{err, time.Now()}
		}()
	}
	testwait.Until(t, 5*time.Second, "the connections reach both backends", func() bool {
		return good.accepted.Load() == transfers/2 && victim.accepted.Load() == transfers/2
	})
	close(start)
	time.Sleep(100 * time.Millisecond) // the kill comes mid-transfer, by design
	killed := time.Now()
	victim.kill()
	failed := 0
	for range transfers {
		r := <-results
		if r.err == nil {
			continue
		}
		failed++
		if d := r.at.Sub(killed); d > 2*time.Second {
			t.Errorf("a transfer to the killed backend failed only %v after the kill: %v", d, r.err)
		}
	}
	if failed != transfers/2 {
		t.Errorf("%d transfers failed, want the %d to the killed backend", failed, transfers/2)
	}

	exchangeOK := func(what string) {
		t.Helper()
		c, err := net.DialTimeout("tcp4", addr, time.Second)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		defer c.Close()
		if err := transfer(c, []byte("ping"), 0); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	before := good.accepted.Load()
	for i := range 20 {
		exchangeOK(fmt.Sprintf("new connection %d after the kill", i))
	}
	if n := good.accepted.Load() - before; n != 20 {
		t.Errorf("the survivor accepted %d of the 20 new connections", n)
	}

	victim.heal()
	testwait.Until(t, 5*time.Second, "the healed backend gets connections again", func() bool {
		exchangeOK("while the killed backend heals")
		return victim.accepted.Load() > transfers/2
	})
}

// TestProxyBackendThatNeverReads checks that a backend which accepts and
// then neither reads nor closes does not hold uproxy's sessions, and so
// its descriptors, for ever: the idle timeout ends them, although the
// copy towards the backend is blocked on a full window, where a read
// deadline cannot interrupt it.
func TestProxyBackendThatNeverReads(t *testing.T) {
	var (
		mu    sync.Mutex
		stuck []net.Conn
	)
	release := make(chan struct{})
	never := startBackend(t, func(c net.Conn) {
		mu.Lock()
		stuck = append(stuck, c)
		mu.Unlock()
		<-release // never read, never close: the test looks at the end
	})
	t.Cleanup(func() { close(release) })
	const idle = 200 * time.Millisecond
	p, rules := startProxier(t, Config{Config: datapath.Config{IdleTimeout: idle}})
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", never))
	port := rules.port(t, "default/web:http")

	// Clients that push more than the socket buffers on the way hold: the
	// copy towards the backend blocks on its full window, and so does the
	// client. Once nothing has moved for an idle period, uproxy resets the
	// connection: the client learns it at once instead of at its own
	// timeout, and the session ends.
	const clients = 3
	var wg sync.WaitGroup
	for i := range clients {
		c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			defer c.Close()
			start := time.Now()
			c.SetWriteDeadline(start.Add(30 * time.Second))
			_, err := c.Write(make([]byte, 64<<20))
			if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.EPIPE) {
				t.Errorf("client %d writing to a backend that never reads: %v, want a reset from uproxy", i, err)
			}
			// The buffers fill at once, but the backend's kernel reopens
			// its window a little, a few times, as it compacts the receive
			// queue it holds (tcp_collapse), and each such move restarts
			// the idle period: seconds, but far from the client's deadline.
			if d := time.Since(start); d > 10*time.Second {
				t.Errorf("client %d was reset %v after it started, want within 10s", i, d)
			}
			t.Logf("client %d was reset %v after it started", i, time.Since(start).Round(time.Millisecond))
		})
	}
	wg.Wait()
	testwait.Until(t, 5*time.Second, "uproxy ends the stuck sessions", func() bool { return p.ActiveConnections() == 0 })
	// uproxy closed its side: the backend's sockets see the end.
	mu.Lock()
	defer mu.Unlock()
	for i, c := range stuck {
		c.SetReadDeadline(time.Now().Add(time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil && !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("backend connection %d: %v, want EOF or a reset from uproxy", i, err)
		}
	}
}
