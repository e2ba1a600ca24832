// Package testbackend owns the in-process backends that the proxy's and
// the data path's tests send traffic to, on 127.0.0.1, until the test ends.
package testbackend

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
)

// TCP is a TCP server on 127.0.0.1 that runs a handler for each
// connection. The test's cleanup closes it and waits for its goroutines.
type TCP struct {
	// LN is the listening socket; closing it makes the backend refuse.
	LN   net.Listener
	Addr netip.AddrPort
	wg   sync.WaitGroup
}

// StartTCP starts a TCP backend that runs handle for each connection and
// closes the connection after it.
func StartTCP(t testing.TB, handle func(net.Conn)) *TCP {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ServeTCP(t, ln, handle)
}

// ServeTCP is StartTCP on a listener of the caller's, which it owns from
// then on.
func ServeTCP(t testing.TB, ln net.Listener, handle func(net.Conn)) *TCP {
	b := &TCP{LN: ln, Addr: netip.MustParseAddrPort(ln.Addr().String())}
	b.wg.Add(1)
	go func() { // ends when the cleanup closes ln
		defer b.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			b.wg.Add(1)
			go func() { defer b.wg.Done(); defer c.Close(); handle(c) }()
		}
	}()
	t.Cleanup(func() { ln.Close(); b.wg.Wait() })
	return b
}

// Name answers every connection with name and a newline, and closes.
func Name(t testing.TB, name string) *TCP {
	return StartTCP(t, func(c net.Conn) { fmt.Fprintln(c, name) })
}

// Echo echoes until EOF, through a userspace buffer: io.Copy on the bare
// conn would splice with pipes from the runtime's pool, which are closed
// only by the garbage collector, and the tests that count descriptors
// would count them.
func Echo(t testing.TB) *TCP {
	return StartTCP(t, func(c net.Conn) { io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{c}) })
}

// UDP starts a UDP backend on 127.0.0.1 that answers every datagram with
// "name:" and the datagram's length, or echoes it when echo is set.
func UDP(t testing.TB, name string, echo bool) netip.AddrPort {
	t.Helper()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { // ends when the cleanup closes pc
		defer close(done)
		buf := make([]byte, 65535)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			if echo {
				pc.WriteTo(buf[:n], from)
			} else {
				pc.WriteTo(fmt.Appendf(nil, "%s:%d", name, n), from)
			}
		}
	}()
	t.Cleanup(func() { pc.Close(); <-done })
	return netip.MustParseAddrPort(pc.LocalAddr().String())
}

// Registry records what each test started (engines, proxiers), so that a
// helper that runs a test over every data path can check, after it, how
// they carried its traffic. Safe for concurrent use; an entry goes with
// its test's cleanup.
type Registry[T any] struct {
	mu sync.Mutex
	m  map[testing.TB][]T
}

// Add records v for t.
func (r *Registry[T]) Add(t testing.TB, v T) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m == nil {
		r.m = map[testing.TB][]T{}
	}
	r.m[t] = append(r.m[t], v)
	t.Cleanup(func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		delete(r.m, t)
	})
}

// Of returns what t started.
func (r *Registry[T]) Of(t testing.TB) []T {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.m[t]
}
