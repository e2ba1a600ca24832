package datapath

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"k8s.io/utils/clock"

	"github.com/uproxy/uproxy/balancer"
)

// Config configures an Engine: the data path's knobs and test seams. The
// zero value of each field is documented; the zero Config is a working
// redirect-mode data path with event loops on epoll.
type Config struct {
	// OriginalDst recovers the destination a client connected to before the
	// kernel redirected it (SO_ORIGINAL_DST in redirect mode), from the
	// accepted socket c, which it may only read through c.Control; v6 is
	// the family of the socket's listener. The connection is dropped
	// unless it equals the listener's service VIP and port, so the
	// listener cannot be used to reach a service it does not serve. Nil
	// means no check.
	OriginalDst func(c syscall.RawConn, v6 bool) (netip.AddrPort, error)
	// Transparent selects tproxy mode. The kernel's TPROXY rules hand
	// connections and datagrams to listeners bound to the loopback address
	// with IP_TRANSPARENT, destination unchanged: the original destination
	// is a connection's local address, or a datagram's IP_RECVORIGDSTADDR;
	// UDP replies leave from transparent sockets bound to it. Listeners
	// on loopback cannot be reached from outside the node. Either mode
	// dials backends from the client's own address where KeepClient says
	// so. False is
	// redirect mode: listeners on every address, destinations rewritten by
	// REDIRECT.
	Transparent bool
	// MasqueradeAll dials every backend from the node's address, as
	// kube-proxy's --masquerade-all masquerades everything; a service
	// port's SourceIP SourceClient still keeps the client's. False keeps
	// the client's own address wherever kube-proxy would (KeepClient).
	MasqueradeAll bool
	// BridgedReplies says that the kernel rules take a backend's replies
	// to a client's address off a Linux bridge whose frames pass
	// iptables (br_netfilter), up to the proxy's socket
	// (redirect.Replies, redirect.TProxy): a client and a backend on one
	// such bridge keep the client's address. False dials them from the
	// node's address (fallbackSameSegment).
	BridgedReplies bool
	// Listen opens a listener; nil means net.ListenConfig.Listen.
	Listen func(ctx context.Context, network, address string) (net.Listener, error)
	// ListenUDP opens a UDP listener; nil means net.ListenConfig.ListenPacket.
	ListenUDP func(ctx context.Context, network, address string) (*net.UDPConn, error)
	// OwnMark is the mark (SO_MARK) put on every socket the proxy dials a
	// backend from, by its own dialers (not Dial's): the kernel rules
	// let packets that carry it past every interception
	// (redirect.OwnMark), so the proxy's connections reach the backend
	// they were dialled to even when its address and port are a
	// Service's, instead of coming back to the proxy. Setting it
	// takes CAP_NET_ADMIN. Zero means the sockets are not marked.
	OwnMark uint32
	// Dial connects to a backend; nil means net.Dialer.DialContext.
	Dial func(ctx context.Context, network, address string) (net.Conn, error)
	// UDPTimeout is how long a UDP flow lives without traffic in either
	// direction (kube-proxy's --udp-timeout); zero means 30s, conntrack's
	// default for UDP streams.
	UDPTimeout time.Duration
	// UDPMaxFlows bounds the UDP flow table, across all services: past it
	// a new flow ends the least recently used flow of its own service
	// port, if the port holds its fair share of the table or more, else
	// of the port with the most flows (udpfair.go). Zero means 65536.
	UDPMaxFlows int
	// UDPPoolSize bounds, on each event loop, the sockets connected to one
	// endpoint that carry request–reply queries, one query at a time each
	// (udppool.go): a new client's first datagram goes out on one, and a
	// query that finds them all awaiting replies is dropped. Zero means
	// 256; negative means no pooling: every client is a flow of its own.
	UDPPoolSize int
	// UDPPoolMax bounds the pooled sockets across every endpoint and
	// loop. At the bound a service port's queries take no more than its
	// fair share of the sockets from the other ports' (udpfair.go). Zero
	// means 4096.
	UDPPoolMax int
	// UDPQueryTimeout is how long a pooled socket waits for the reply to
	// its query; past it the socket is closed. Zero means 5s, a stub
	// resolver's default timeout (resolv.conf(5)).
	UDPQueryTimeout time.Duration
	// UDPReadBatch is the most datagrams a UDP listener reads with one
	// recvmmsg(2) when datagrams queue up; zero means 8, one reads them
	// one at a time. BenchmarkUDPRequestResponse measures the difference.
	UDPReadBatch int
	// UDPOriginalDst returns where a datagram that the kernel redirected
	// from client to the local address local was originally sent (in
	// redirect mode, conntrack's entry for the flow). It is asked once per
	// new UDP flow in redirect mode: a shared listener routes the flow by
	// it, and a service port's own listener drops a flow whose original
	// destination is unknown or not the service's, which no rule of
	// uproxy's sent there. A listener of its own skips it while the kernel
	// guards its port (Listener.Guarded) and its addresses all route alike
	// (Snapshot.RoutesAlike). Nil means UDP is shared only in tproxy mode,
	// and a service port's own UDP listener forwards whatever reaches its
	// port (tests that send to listeners directly).
	UDPOriginalDst func(client, local netip.AddrPort) (netip.AddrPort, error)
	// DialTimeout bounds one connection attempt to a backend; zero means 1s.
	DialTimeout time.Duration
	// DialAttempts is how many backends a connection tries before it is
	// refused; zero means 3.
	DialAttempts int
	// EventLoops is the number of event loops that carry TCP connections
	// and relay UDP flows' replies (loop.go). Zero (or less, which the
	// command refuses) means one less than GOMAXPROCS, at least one.
	EventLoops int
	// IOURing makes each event loop wait in an io_uring, and carry its TCP
	// connections' small messages through it, receiving into buffers the
	// kernel picks only when data comes (loopring.go). False means epoll
	// only. Where the kernel lacks what the loops need (Linux 5.19), the
	// engine logs why and uses epoll.
	IOURing bool
	// IOURingBuffers is how many receive buffers each event loop's
	// io_uring provides the kernel, a power of two up to 32768; a loop
	// holds a buffer only while its bytes wait to be sent on. Zero means
	// 256. A count the ring refuses leaves the loops on epoll, as any ring
	// that cannot be set up does (logged).
	IOURingBuffers int
	// BackendKeepAliveEvery is how often an event loop turns TCP
	// keep-alive on for the backend sockets it connected without it
	// (eventLoop.armKeepAlive): a connection that lasts gets keep-alive
	// within that time. Zero means 15s.
	BackendKeepAliveEvery time.Duration
	// IdleTimeout closes a TCP connection after neither side has sent or
	// received anything for about that long (between one and two periods).
	// Zero means no idle timeout.
	IdleTimeout time.Duration
	// MaxConnections bounds the TCP connections in progress at once,
	// across every listener, from accept to close: past it, a connection
	// accepted is reset at once, before any backend is dialled, and
	// counted (ConnectionsOverMax). Each holds two descriptors (client
	// and backend); a bound below the open-files limit keeps the
	// descriptors that the rules writes (iptables-restore) and the
	// control plane need, which accept(2) would otherwise take until it
	// failed with EMFILE. Zero (or less) means no bound.
	MaxConnections int
	// EjectBase is how long a backend that refused or timed out a
	// connection is skipped by the balancers; it doubles with each
	// consecutive failure up to EjectMax. Zeros mean 1s and 30s.
	EjectBase, EjectMax time.Duration
	// Logger receives the data path's logs; nil means none.
	Logger *zap.Logger
	// Clock is the time source for ejection timing (and, in package
	// proxy, sync timing); nil means the real clock. Socket deadlines
	// always use the real clock.
	Clock clock.WithTickerAndDelayedExecution
	// Stats, if set, counts what the data path carried and how, for the
	// tests that must tell the data paths apart although traffic flows
	// the same on each. Nil means nothing is counted.
	Stats *Stats
	// StartLoop, if set, runs before each event loop starts, and an
	// error from it fails the start as the kernel's would (no descriptor
	// left for an epoll instance): for the tests of what the control
	// plane does then. Nil means nothing runs.
	StartLoop func() error
}

func (c *Config) ioURingBuffers() int {
	if c.IOURingBuffers == 0 {
		return defaultRingBufs
	}
	return c.IOURingBuffers
}

func (c *Config) backendKeepAliveEvery() time.Duration {
	if c.BackendKeepAliveEvery <= 0 {
		return defaultKeepAliveEvery
	}
	return c.BackendKeepAliveEvery
}

func (c *Config) dialTimeout() time.Duration {
	if c.DialTimeout <= 0 {
		return time.Second
	}
	return c.DialTimeout
}

func (c *Config) dialAttempts() int {
	if c.DialAttempts <= 0 {
		return 3
	}
	return c.DialAttempts
}

func (c *Config) clock() clock.WithTickerAndDelayedExecution {
	if c.Clock == nil {
		return clock.RealClock{}
	}
	return c.Clock
}

func (c *Config) udpReadBatch() int {
	if c.UDPReadBatch <= 0 {
		return 8
	}
	return min(c.UDPReadBatch, maxReadBatch)
}

func (c *Config) logger() *zap.Logger {
	if c.Logger == nil {
		return zap.NewNop()
	}
	return c.Logger
}

// Engine carries the connections and datagrams of the listeners it is
// given, each routed by the Snapshot its listener holds: it owns the
// event loops, the TCP sessions and the UDP flows.
//
// The event loops accept, read and carry the connections and flows. A
// listener they cannot take (a dialer of the caller's, a socket that
// cannot be duplicated) owns an accept or read goroutine that exits when
// the listener is closed, and each connection it accepts a goroutine
// that exits once the connection is handed to a loop. Drain ends them
// all.
type Engine struct {
	cfg     Config
	log     *zap.Logger
	connLog *zap.Logger // sampled: per-connection errors
	health  *balancer.Health
	// clients tells a pod, the node and an outside client apart
	// (NewEngine).
	clients Clients

	src sourceKeeper // where a client's address cannot be kept (srcfallback.go)

	loops   loopGroup      // the TCP data path's event loops, started on first use
	closing bool           // under sessMu
	wg      sync.WaitGroup // accept and read goroutines, and sessions

	tcpProxy
	udpRelay
}

// tcpProxy is the part of the Engine that carries TCP connections: it
// accepts them, picks and dials a backend, and hands both sockets to an
// event loop (tcp.go, dial.go). Its methods reach the rest of the Engine
// through e.
type tcpProxy struct {
	e        *Engine
	sessMu   sync.Mutex
	sessions map[*session]struct{}
	// overMax counts the connections refused at Config.MaxConnections.
	overMax atomic.Uint64
}

// udpRelay is the part of the Engine that relays UDP: it reads the
// listeners' datagrams, keeps a flow (or a pooled socket) per client and
// backend, and relays the replies (udp.go, udppool.go). Its methods reach
// the rest of the Engine through e.
type udpRelay struct {
	e     *Engine
	flows flowTable // UDP flows, created with the first UDP listener
	// poolOpen counts the pooled UDP sockets of every event loop, against
	// Config.UDPPoolMax.
	poolOpen atomic.Int64
	// fair shares poolOpen's bound and the flow table's among the
	// service ports (udpfair.go).
	fair udpFairness
}

// NewEngine returns an Engine configured by cfg. clients tells a pod, the
// node and an outside client apart, for externalTrafficPolicy Local
// (Snapshot.Route) and for the address backends see (KeepClient); nil
// counts every client as outside the cluster, and dials every backend
// from the node's address.
func NewEngine(cfg Config, clients Clients) *Engine {
	p := &Engine{
		cfg:     cfg,
		log:     cfg.logger(),
		clients: clients,
		loops: loopGroup{n: cfg.eventLoops(), opts: loopOptions{
			idle: cfg.IdleTimeout, dialTimeout: cfg.dialTimeout(),
			keepAliveEvery: cfg.backendKeepAliveEvery(), ringBufs: cfg.ioURingBuffers(),
			stats: cfg.Stats,
		}},
	}
	p.src.bridgedReplies = cfg.BridgedReplies
	p.tcpProxy = tcpProxy{e: p, sessions: map[*session]struct{}{}}
	p.udpRelay.e = p
	if cfg.StartLoop != nil {
		p.loops.newLoop = func(o loopOptions) (*eventLoop, error) {
			if err := cfg.StartLoop(); err != nil {
				return nil, err
			}
			return newEventLoop(o)
		}
	}
	if cfg.IOURing {
		if err := IOURingSupported(); err != nil {
			p.log.Warn("io_uring is not available for the event loops; they use epoll only", zap.Error(err))
		} else {
			p.loops.opts.ring = true
			p.loops.noRing = func(err error) {
				p.log.Warn("an event loop could not set up its io_uring; it uses epoll only", zap.Error(err))
			}
			p.loops.opts.ringFailed = func(err error) {
				p.log.Error("an event loop's io_uring failed: the connections it carried were reset, and the loop uses epoll only from now on", zap.Error(err))
			}
		}
	}
	// At most 5 identical per-connection messages per second, then 1 in 100.
	p.connLog = p.log.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(c, time.Second, 5, 100)
	}))
	clk := cfg.clock()
	p.health = balancer.NewHealth(cfg.EjectBase, cfg.EjectMax, func(d time.Duration, f func()) { clk.AfterFunc(d, f) })
	return p
}

// internalClient reports whether ip is a pod's or the node's.
func (p *Engine) internalClient(ip netip.Addr) bool { return internal(p.clients, ip) }

// keepClient reports whether a connection or flow of snap from client,
// sent to the cluster IP or not (toClusterIP), is to be dialled from the
// client's own address (KeepClient).
func (p *Engine) keepClient(snap *Snapshot, toClusterIP bool, client netip.Addr) bool {
	return KeepClient(snap.SourceIP, p.cfg.MasqueradeAll, snap.Policy, toClusterIP, client, p.clients)
}

// Forget stops tracking b's failures: b has left every service.
func (p *Engine) Forget(b *balancer.Backend) { p.health.Forget(b) }

// Failures returns how many connection attempts in a row b has failed
// (0 when it is healthy).
func (p *Engine) Failures(b *balancer.Backend) int { return p.health.Failures(b) }

// Refuse refuses, from now on, every connection accepted: the first step
// of a shutdown, before the listeners close.
func (p *Engine) Refuse() {
	p.sessMu.Lock()
	p.closing = true
	p.sessMu.Unlock()
}

// Drain waits, once the listeners are closed, for every loop and
// established connection to finish until ctx is done, then refuses
// connections still being accepted, closes the established ones and waits
// for them to end. It then stops the event loops.
func (p *Engine) Drain(ctx context.Context) error {
	done := make(chan struct{})
	go func() { p.wg.Wait(); close(done) }() // exits when every loop and session has ended (forced below)
	defer p.loops.stop()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
	}
	p.sessMu.Lock()
	p.closing = true // from here on a connection accepted is refused
	n := len(p.sessions)
	for s := range p.sessions {
		s.abort()
	}
	p.sessMu.Unlock()
	<-done
	return fmt.Errorf("drain timeout: closed %d connections", n)
}

// ActiveConnections returns the number of proxied connections in progress.
func (p *Engine) ActiveConnections() int {
	p.sessMu.Lock()
	defer p.sessMu.Unlock()
	return len(p.sessions)
}

// ConnectionsOverMax returns how many connections were refused because
// Config.MaxConnections were in progress. Safe for concurrent use.
func (p *Engine) ConnectionsOverMax() uint64 { return p.overMax.Load() }

// EventLoops returns how many event loops carry the connections and how
// they wait: "io_uring" or "epoll". A loop whose own ring could not be set
// up uses epoll, and the log says so. Fixed by NewEngine; safe for
// concurrent use.
func (p *Engine) EventLoops() (n int, io string) {
	if p.loops.opts.ring {
		return p.loops.n, "io_uring"
	}
	return p.loops.n, "epoll"
}

// Listen opens a TCP listener as Config.Listen says.
func (p *Engine) Listen(ctx context.Context, network, addr string) (net.Listener, error) {
	if p.cfg.Listen != nil {
		return p.cfg.Listen(ctx, network, addr)
	}
	lc := p.listenConfig()
	return lc.Listen(ctx, network, addr)
}

// Prepare readies l's bound socket, LN or PC, for accepting or reading:
// it sets what accepted sockets inherit, and hands the socket to the
// event loops where they serve it. It does not start accepting
// (StartAccepting, StartAfter). An error means nothing can read l: the
// caller closes it.
func (p *Engine) Prepare(l *Listener) error {
	if rc := ListenerRawConn(l.LN); rc != nil {
		// Once the socket is bound, whether bound here or inherited, and
		// not on the attempts whose bind failed. Setting them before bind
		// and again for the event loops cost 4 more system calls per listener:
		// 40,000 for the first sync of 10,000 services.
		if err := setAcceptOptions(rc); err != nil {
			p.log.Warn("cannot set the listener's socket options; accepted connections go without keep-alive",
				zap.Stringer("servicePort", l.Name), zap.Error(err))
		}
		if fd := p.rawListenerFD(rc); fd >= 0 {
			// The duplicate is the socket's only descriptor from now on.
			// Keeping both cost a second descriptor per listener (10,000
			// services then needed 20,000, a common hard limit) and a
			// registration in the runtime's poller, which woke for every
			// connection too. Closing the original leaves the socket
			// listening: it is closed with its last descriptor.
			l.LN.Close()
			l.LN, l.raw = nil, p.newLoopListener(l, fd)
		}
	}
	if l.PC != nil {
		if err := p.loopPacketListener(l); err != nil {
			return err
		}
	}
	return nil
}

// StartAccepting starts accepting on l, or reading from it: with the
// event loops, which serve it from then on, or on a goroutine of its
// own, which ends when l is closed.
//
// Only the loops can fail it: when none can be started (no descriptor
// left for an epoll instance) or they are stopping.
func (p *Engine) StartAccepting(l *Listener) error {
	if l.raw != nil {
		if err := p.loops.listen(l.raw); err != nil {
			return fmt.Errorf("no event loop to accept on it: %w", err)
		}
		return nil
	}
	p.wg.Add(1)
	if l.UDP {
		go p.udpLoop(l)
	} else {
		go p.acceptLoop(l)
	}
	return nil
}

// StartAfter starts accepting or reading on l (StartAccepting) once
// ready is closed, from a goroutine that waits for it, and that exits at
// once if stopped is closed first. For a listener the event loops serve,
// it fails when no loop can start (no descriptor left for an epoll
// instance), so that the caller can report it now rather than only log
// it later.
func (p *Engine) StartAfter(l *Listener, ready, stopped <-chan struct{}) error {
	if l.raw != nil {
		if _, err := p.loops.running(); err != nil {
			return fmt.Errorf("no event loop to accept on it: %w", err)
		}
	}
	p.wg.Add(1)
	go func() {
		select {
		case <-ready:
		case <-stopped:
			p.wg.Done()
			return
		}
		switch {
		case l.raw != nil:
			if err := p.StartAccepting(l); err != nil {
				// The loops were running when the listener was adopted;
				// only loops stopped since (Shutdown, Drain) and unable to
				// start again get here, on an Engine that is going away.
				p.log.Error("cannot accept on an adopted listener", zap.Stringer("servicePort", l.Name), zap.Error(err))
			}
			p.wg.Done()
		case l.UDP:
			p.udpLoop(l)
		default:
			p.acceptLoop(l)
		}
	}()
	return nil
}

// Closed ends what l still holds once it is closed: a hosted UDP service
// port's flows end now, as a closed socket's would.
func (p *Engine) Closed(l *Listener) {
	if l.UDP {
		p.removeFlows(l)
	}
}

// acceptLoop accepts until l is closed. On temporary errors (EMFILE,
// ENFILE, ENOBUFS) it backs off (nextAcceptDelay), as net/http's Server
// does, instead of spinning or exiting: the old userspace proxy died here.
func (tp *tcpProxy) acceptLoop(l *Listener) {
	p := tp.e
	defer p.wg.Done()
	var delay time.Duration
	for {
		c, err := l.LN.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			delay = tp.acceptBackoff(l, delay, err)
			continue
		}
		delay = 0
		tc, ok := c.(*net.TCPConn)
		if !ok {
			c.Close()
			continue
		}
		if s := tp.newSession(l, tc, -1); s != nil {
			go tp.serveTCP(l, tc, s)
		}
	}
}

// acceptBackoff logs a failed accept and sleeps before the next one, for
// nextAcceptDelay after the previous delay. It returns the delay slept.
func (tp *tcpProxy) acceptBackoff(l *Listener, delay time.Duration, err error) time.Duration {
	p := tp.e
	delay = nextAcceptDelay(delay)
	p.connLog.Warn("accept failed; backing off", zap.Stringer("servicePort", l.Name), zap.Duration("delay", delay), zap.Error(err))
	time.Sleep(delay)
	return delay
}

// ListenerRawConn returns the RawConn of ln, a TCP listener's socket; nil
// for no listener (a UDP listener has none) or one that is no socket (from
// Config.Listen).
func ListenerRawConn(ln net.Listener) syscall.RawConn {
	sc, ok := ln.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// rawListenerFD returns a duplicate of a listener's socket, rc, for
// the event loops to accept on or read; -1 with a dialer of the
// caller's (Config.Dial, which the loops do not call), or if it cannot
// be duplicated. The caller then closes the listener, leaving the
// duplicate as the socket's only descriptor.
func (p *Engine) rawListenerFD(rc syscall.RawConn) int {
	if p.cfg.Dial != nil {
		return -1
	}
	nfd, err := dupRaw(rc)
	if err != nil {
		return -1
	}
	return nfd
}

// newLoopListener returns the loopListener of l's socket fd: the event
// loops accept on it straight with accept4(2), and the accepted sockets
// inherit its options (keep-alive, TCP_NODELAY). An accepted socket never
// joins the runtime's poller, which would cost six system calls per
// connection for nothing: register it, read its local address, set
// TCP_NODELAY, then duplicate it, deregister it and close it when it moves
// to a loop.
func (tp *tcpProxy) newLoopListener(l *Listener, fd int) *loopListener {
	p := tp.e
	serve := func(el *eventLoop, fd int, client netip.AddrPort) {
		if s := tp.newSession(l, nil, fd); s != nil {
			tp.startTCP(el, l, accepted{rc: fdConn(fd), client: client}, s)
		}
	}
	failed := func(err error, delay time.Duration) {
		if delay == 0 {
			p.log.Error("cannot accept on the listener: registering it with an event loop failed", zap.Stringer("servicePort", l.Name), zap.Error(err))
			return
		}
		p.connLog.Warn("accept failed; backing off", zap.Stringer("servicePort", l.Name), zap.Duration("delay", delay),
			zap.Error(os.NewSyscallError("accept4", err)))
	}
	return newLoopListener(fd, serve, failed)
}
