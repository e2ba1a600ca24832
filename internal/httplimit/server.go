package httplimit

import (
	"container/list"
	"log"
	"net"
	"net/http"
	"sync"
	"time"
)

// Defaults of ServerConfig's zero fields.
const (
	DefaultReadHeaderTimeout = 10 * time.Second
	DefaultReadTimeout       = 10 * time.Second
	DefaultWriteTimeout      = 30 * time.Second
	DefaultIdleTimeout       = 30 * time.Second
	DefaultMaxConnections    = 64
)

// ServerConfig bounds what clients may hold of one of uproxy's HTTP
// servers, or of a group of servers that share one ConnLimiter (the
// health-check node ports): how long each phase of a connection may
// last, and how many connections are open at once. Without them an idle
// connection was held for ever, each with a descriptor taken from the
// reserve that iptables-restore needs. The zero value of each field (or
// a negative one) means its default; the zero ServerConfig is the
// defaults.
type ServerConfig struct {
	// ReadHeaderTimeout bounds how long a client may take to send a
	// request's headers, from the connection's accept or from the first
	// bytes after a wait between requests: a client that connects and
	// sends nothing is closed after it. Zero means
	// DefaultReadHeaderTimeout.
	ReadHeaderTimeout time.Duration
	// ReadTimeout bounds reading a whole request, body included: a client
	// that trickles a body in is closed after it, and while it trickles
	// its connection is in a request, which ConnLimiter does not close.
	// No server of uproxy's takes a body, hence a default no longer than
	// the headers'. It does not bound the handler (net/http lifts the
	// read deadline once the request is read). Zero means
	// DefaultReadTimeout.
	ReadTimeout time.Duration
	// WriteTimeout bounds the time from the end of a request's headers to
	// the end of its answer: a client that stops reading is closed after
	// it. net/http/pprof's sampling handlers (?seconds=) extend their own
	// deadline by the time they sample. Zero means DefaultWriteTimeout.
	WriteTimeout time.Duration
	// IdleTimeout is how long a kept-alive connection may wait for its
	// next request before the server closes it. Zero means
	// DefaultIdleTimeout.
	IdleTimeout time.Duration
	// MaxConnections bounds the connections open at once, past which the
	// one idle the longest is closed to make room (ConnLimiter). Zero
	// means DefaultMaxConnections.
	MaxConnections int
}

func orDefault(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

func (c ServerConfig) readHeaderTimeout() time.Duration {
	return orDefault(c.ReadHeaderTimeout, DefaultReadHeaderTimeout)
}
func (c ServerConfig) readTimeout() time.Duration {
	return orDefault(c.ReadTimeout, DefaultReadTimeout)
}
func (c ServerConfig) writeTimeout() time.Duration {
	return orDefault(c.WriteTimeout, DefaultWriteTimeout)
}
func (c ServerConfig) idleTimeout() time.Duration {
	return orDefault(c.IdleTimeout, DefaultIdleTimeout)
}

func (c ServerConfig) maxConnections() int {
	if c.MaxConnections <= 0 {
		return DefaultMaxConnections
	}
	return c.MaxConnections
}

// Limiter returns a ConnLimiter of c's MaxConnections, for the servers
// that are to share it.
func (c ServerConfig) Limiter() *ConnLimiter { return NewConnLimiter(c.maxConnections()) }

// Server returns an http.Server for h with c's time-outs, whose
// connections lim counts (nil: none): serve it on lim.Listener(ln).
// errLog receives the server's errors (nil: the log package's standard
// logger, as http.Server's ErrorLog).
func (c ServerConfig) Server(h http.Handler, lim *ConnLimiter, errLog *log.Logger) *http.Server {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: c.readHeaderTimeout(),
		ReadTimeout:       c.readTimeout(),
		WriteTimeout:      c.writeTimeout(),
		IdleTimeout:       c.idleTimeout(),
		ErrorLog:          errLog,
	}
	if lim != nil {
		srv.ConnState = lim.connState
	}
	return srv
}

// ConnLimiter bounds the connections open at once on the listeners it
// wraps (Listener), which one or several http.Servers serve with its
// ConnState hook (ServerConfig.Server). When a new connection would go
// past the bound, the connection idle the longest is closed to make room:
// one waiting between two requests, or one that has not sent its first
// request's headers yet. Accept waits only while every connection is in
// the middle of a request, until one goes idle or closes (each within the
// server's ReadTimeout and WriteTimeout).
//
// Blocking accept at the bound instead, as netutil.LimitListener does,
// would leave a health probe in the kernel's accept queue behind idle
// connections until their time-outs closed them, long after a load
// balancer's probe has given up.
//
// Safe for concurrent use. It owns no goroutine: Accept waits on its
// caller's goroutine (the server's accept loop) and returns when the
// listener is closed.
type ConnLimiter struct {
	max int

	mu   sync.Mutex
	cond sync.Cond // on mu: a connection went idle or closed, or a listener closed
	// conns are the connections open, accepted by a wrapped listener
	// and not yet closed; idle holds those of them that are idle, the
	// longest idle first.
	conns map[net.Conn]*limitedConn
	idle  list.List // of *limitedConn
	// waiting counts the Accepts waiting for a connection to go idle or
	// close, for the tests.
	waiting int
}

// limitedConn is a connection a ConnLimiter counts.
type limitedConn struct {
	c    net.Conn
	idle *list.Element // its place in ConnLimiter.idle; nil in a request
}

// NewConnLimiter returns a ConnLimiter of n connections (at least one).
func NewConnLimiter(n int) *ConnLimiter {
	l := &ConnLimiter{max: max(n, 1), conns: map[net.Conn]*limitedConn{}}
	l.cond.L = &l.mu
	return l
}

// Listener returns ln, counting what it accepts against l. Closing it
// closes ln and ends an Accept waiting for room.
func (l *ConnLimiter) Listener(ln net.Listener) net.Listener {
	return &limitListener{Listener: ln, lim: l}
}

// Open returns how many connections l counts.
func (l *ConnLimiter) Open() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.conns)
}

// admit waits for room for c, accepted by ll, closing the longest idle
// connection if that makes it, and counts c, idle until its server reads
// a request. It reports false, without counting c, once ll is closed.
func (l *ConnLimiter) admit(ll *limitListener, c net.Conn) bool {
	l.mu.Lock()
	for len(l.conns) >= l.max {
		if e := l.idle.Front(); e != nil {
			victim := e.Value.(*limitedConn).c
			l.forget(victim)
			l.mu.Unlock()
			// Its server's goroutine sees the read fail and ends; the
			// StateClosed that follows finds it forgotten already.
			_ = victim.Close()
			l.mu.Lock()
			continue
		}
		if ll.closed {
			l.mu.Unlock()
			return false
		}
		l.waiting++
		l.cond.Wait()
		l.waiting--
	}
	lc := &limitedConn{c: c}
	lc.idle = l.idle.PushBack(lc)
	l.conns[c] = lc
	l.mu.Unlock()
	return true
}

// forget stops counting c. Called with mu held.
func (l *ConnLimiter) forget(c net.Conn) {
	lc := l.conns[c]
	if lc == nil {
		return
	}
	if lc.idle != nil {
		l.idle.Remove(lc.idle)
	}
	delete(l.conns, c)
	l.cond.Broadcast()
}

// connState is the servers' http.Server.ConnState: it follows each
// connection from idle to a request and back, and forgets it once closed
// or hijacked. Connections it does not count (closed to make room, or
// from another listener) are ignored.
func (l *ConnLimiter) connState(c net.Conn, s http.ConnState) {
	l.mu.Lock()
	defer l.mu.Unlock()
	lc := l.conns[c]
	if lc == nil {
		return
	}
	switch s {
	case http.StateActive:
		if lc.idle != nil {
			l.idle.Remove(lc.idle)
			lc.idle = nil
		}
	case http.StateIdle:
		if lc.idle == nil {
			lc.idle = l.idle.PushBack(lc)
			l.cond.Broadcast()
		}
	case http.StateClosed, http.StateHijacked:
		l.forget(c)
	}
}

// limitListener is a listener whose connections a ConnLimiter counts.
type limitListener struct {
	net.Listener
	lim    *ConnLimiter
	closed bool // under lim.mu
}

// Accept accepts a connection and waits for room for it (ConnLimiter).
func (ll *limitListener) Accept() (net.Conn, error) {
	c, err := ll.Listener.Accept()
	if err != nil {
		return nil, err
	}
	if !ll.lim.admit(ll, c) {
		_ = c.Close()
		return nil, &net.OpError{Op: "accept", Net: ll.Addr().Network(), Addr: ll.Addr(), Err: net.ErrClosed}
	}
	return c, nil
}

// Close closes the listener, and ends an Accept waiting for room.
func (ll *limitListener) Close() error {
	ll.lim.mu.Lock()
	ll.closed = true
	ll.lim.cond.Broadcast()
	ll.lim.mu.Unlock()
	return ll.Listener.Close()
}
