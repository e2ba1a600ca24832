package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/golang-lru/v2/expirable"
	"go.uber.org/zap"

	"github.com/uproxy/uproxy/balancer"
)

// maxDatagram is the largest UDP payload: 65,535 bytes less the 8-byte
// UDP header (IPv4 further subtracts its 20-byte header, to 65,507).
const maxDatagram = 65535 - 8

// flowKey identifies a UDP flow: one client of one listener, to one
// destination. The listener is the one whose socket received the
// datagrams (a shared listener in the shared layout). The destination is
// where they arrived: a service's own address in tproxy mode, so that
// one client socket talking to two services through a shared listener
// has two flows; the local address in redirect mode, where conntrack
// already keeps such flows apart by giving the second one another source
// port (nf_nat's unique-tuple search, since their reply tuples towards
// the one listener port would otherwise be the same).
type flowKey struct {
	l      *listener
	client netip.AddrPort
	dst    netip.AddrPort
}

// udpFlow is one client's association with one backend: a connected UDP
// socket towards the backend, and a goroutine that relays its replies.
type udpFlow struct {
	key flowKey
	// svc is the service port's listener: key.l itself, or the one a
	// shared listener routed the flow to.
	svc *listener
	// orig is the original destination the flow was routed by: dst in
	// tproxy mode, conntrack's answer for a shared listener in redirect
	// mode, unknown otherwise.
	orig    netip.AddrPort
	backend *balancer.Backend
	conn    *net.UDPConn // connected to backend
	// dst is where the client's datagrams arrived: in redirect mode the
	// local address the kernel redirected them to (replies sent from it are
	// mapped back to the service's address and port by conntrack); in
	// tproxy mode the service's address and port themselves. Either way a
	// client with a connected socket (a DNS resolver) accepts the replies.
	dst    netip.AddrPort
	sock   udpSocket
	closed atomic.Bool
	pm     *portMetrics // the metrics of the flow's service port; nil if none
	// refreshed is when the flow's timeout was last pushed back in the
	// table (monotonic nanoseconds from flowClock): see touch.
	refreshed atomic.Int64
}

// touchInterval bounds how often a flow's traffic pushes its timeout back
// in the table. The expirable LRU's Add takes the table's lock and moves
// the entry between expiry buckets: doing it for every datagram, from the
// listener's loop and every flow's reply goroutine, made the table a point
// of contention (BenchmarkUDPFlowLookup). A flow then lives between
// --udp-timeout and --udp-timeout plus this after its last datagram.
const touchInterval = 250 * time.Millisecond

// touch pushes the flow's timeout back, at most once per touchInterval,
// if the flow is still the table's entry for its key.
func (f *udpFlow) touch(p *Proxier) {
	now := flowClock()
	last := f.refreshed.Load()
	if now-last < int64(touchInterval) || !f.refreshed.CompareAndSwap(last, now) {
		return
	}
	flows := p.flowTable()
	if cur, ok := flows.Peek(f.key); ok && cur == f {
		flows.Add(f.key, f)
	}
}

// flowStart anchors flowClock.
var flowStart = time.Now()

// flowClock is a monotonic clock in nanoseconds, for touch.
func flowClock() int64 { return int64(time.Since(flowStart)) }

func (f *udpFlow) close() {
	if f.closed.CompareAndSwap(false, true) {
		f.conn.Close()
		f.pm.flowClosed()
	}
}

// flowTable holds every UDP flow of a Proxier, bounded in size, each
// expiring after the UDP timeout without traffic. It is an expirable LRU
// from hashicorp/golang-lru; that LRU runs one expiry goroutine that never
// exits, so the table is created once per Proxier, with its first UDP
// listener, and lives as long as the process.
type flowTable struct {
	once sync.Once
	lru  *expirable.LRU[flowKey, *udpFlow]
	// created publishes lru to readers that must not create it (UDPFlows,
	// from any goroutine).
	created atomic.Pointer[expirable.LRU[flowKey, *udpFlow]]
}

func (p *Proxier) flowTable() *expirable.LRU[flowKey, *udpFlow] {
	p.flows.once.Do(func() {
		size, ttl := p.cfg.UDPMaxFlows, p.cfg.UDPTimeout
		if size <= 0 {
			size = 65536
		}
		if ttl <= 0 {
			ttl = 30 * time.Second
		}
		// The callback runs with the LRU's lock held: it only closes the
		// flow's socket, which ends the flow's reply goroutine.
		p.flows.lru = expirable.NewLRU(size, func(_ flowKey, f *udpFlow) { f.close() }, ttl)
		p.flows.created.Store(p.flows.lru)
	})
	return p.flows.lru
}

// UDPFlows returns the number of live UDP flows. Safe for concurrent use.
func (p *Proxier) UDPFlows() int {
	if lru := p.flows.created.Load(); lru != nil {
		return lru.Len()
	}
	return 0
}

func (p *Proxier) listenUDP(ctx context.Context, network, addr string) (*net.UDPConn, error) {
	if p.cfg.ListenUDP != nil {
		return p.cfg.ListenUDP(ctx, network, addr)
	}
	lc := p.listenConfig()
	pc, err := lc.ListenPacket(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return pc.(*net.UDPConn), nil
}

func (p *Proxier) udpSocket(l *listener) (udpSocket, error) {
	if p.cfg.Transparent {
		ls, err := newListenSocket(l.pc, l.key.v6, false, p.cfg.udpReadBatch())
		if err != nil {
			return nil, err
		}
		return &tproxySocket{listenSocket: ls}, nil
	}
	return newListenSocket(l.pc, l.key.v6, true, p.cfg.udpReadBatch())
}

// udpLoop reads the listener's datagrams until it is closed, and forwards
// each to its client's flow, creating the flow on the first datagram. It
// is the only goroutine that creates flows for l.
func (p *Proxier) udpLoop(l *listener) {
	defer p.wg.Done()
	sock, err := p.udpSocket(l)
	if err != nil {
		if sock == nil {
			p.log.Error("UDP listener unusable", zap.Stringer("servicePort", l.key.name), zap.Error(err))
			return
		}
		p.log.Error("UDP listener cannot see destination addresses; replies may come from the wrong address",
			zap.Stringer("servicePort", l.key.name), zap.Error(err))
	}
	defer sock.close()
	p.flowTable() // created before the first flow
	batch := make([]datagram, p.cfg.udpReadBatch())
	var delay time.Duration
	for {
		n, err := sock.readBatch(batch)
		switch {
		case errors.Is(err, net.ErrClosed):
			p.removeFlows(l)
			return
		case errors.Is(err, errNoDestination):
			p.connLog.Warn("dropping datagrams without their destination address (not redirected)", zap.Stringer("servicePort", l.key.name))
			continue
		case err != nil:
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			p.connLog.Warn("UDP read failed; backing off", zap.Stringer("servicePort", l.key.name), zap.Error(err))
			time.Sleep(delay)
			continue
		}
		delay = 0
		for i := range batch[:n] {
			p.forwardDatagram(l, sock, &batch[i])
			listenBuffers.put(batch[i].buf)
			batch[i] = datagram{}
		}
	}
}

// forwardDatagram sends one client datagram to its flow's backend. A
// backend that answered with ICMP port unreachable makes the send fail:
// it is ejected and the next one tried, at most DialAttempts times.
func (p *Proxier) forwardDatagram(l *listener, sock udpSocket, d *datagram) {
	key := flowKey{l, d.client, d.dst}
	svc, orig := l, netip.AddrPort{}
	if p.cfg.Transparent {
		orig = d.dst
	}
	// One lookup per datagram: udpFlowFor checks and reuses what it finds.
	cur, _ := p.flowTable().Peek(key)
	if l.key.name.IsShared() {
		// The flow remembers its service; only its first datagram asks
		// which, and in redirect mode that means asking conntrack.
		if cur != nil {
			svc, orig = cur.svc, cur.orig
		} else {
			var err error
			if !p.cfg.Transparent {
				// IP_PKTINFO gives the local address without the port:
				// the listener's own.
				local := netip.AddrPortFrom(d.dst.Addr(), l.port)
				orig, err = p.cfg.UDPOriginalDst(d.client, local)
			}
			if svc = l.route(orig); svc == nil || err != nil {
				p.sharedRefused(l, orig, err)
				return
			}
		}
	}
	payload := (*d.buf)[:d.n]
	for range p.cfg.dialAttempts() {
		f, err := p.udpFlowFor(svc, key, sock, orig, cur)
		if err != nil {
			p.connLog.Warn("no backend for UDP flow", zap.Stringer("servicePort", svc.key.name), zap.Error(err))
			return
		}
		if _, err := f.conn.Write(payload); err != nil {
			p.udpFailed(f, err)
			cur = nil // removed from the table
			continue
		}
		f.pm.up(int64(d.n))
		f.touch(p)
		return
	}
}

// udpFlowFor returns cur, the table's flow of key (nil: none), if it is
// still usable for service port l, or creates one. orig is the datagram's original destination when known (tproxy
// mode, or a shared listener's conntrack lookup). A flow whose backend is
// no longer usable (removed, no longer ready, ejected) is replaced, so no
// client stays blackholed behind a dead endpoint.
func (p *Proxier) udpFlowFor(l *listener, key flowKey, sock udpSocket, orig netip.AddrPort, cur *udpFlow) (*udpFlow, error) {
	flows := p.flowTable()
	client := key.client
	snap := l.snap.Load()
	if snap == nil {
		return nil, fmt.Errorf("%s: not synced yet", l.key.name)
	}
	pm := snap.metrics
	// Without an original destination (a listener of its own in redirect
	// mode) a datagram counts as cluster-IP traffic.
	bal := snap.route(orig, orig.IsValid(), client.Addr(), p.internalClient)
	if bal == nil {
		pm.refusedDestination()
		return nil, fmt.Errorf("%s: datagram to %s, not one of the service's addresses", snap.sp.Name, orig)
	}
	set := snap.cluster
	if bal == snap.local {
		set = snap.local
	}
	if f := cur; f != nil {
		if !f.closed.Load() && !f.backend.Ejected() && snap.serves(set, f.backend) {
			return f, nil
		}
		flows.Remove(key)
	}
	b := bal.Pick(client.Addr())
	if b == nil {
		pm.noEndpoint()
		return nil, fmt.Errorf("%s: %w", snap.sp.Name, errNoEndpoints)
	}
	bm := pm.backend(b)
	bm.picked()
	var from netip.Addr
	if p.cfg.Transparent && snap.sp.PreserveSourceIP {
		from = client.Addr()
	}
	start := pm.dialStart()
	conn, err := p.dialUDP(b.Addr, from)
	pm.dialDone(start, err)
	if err != nil {
		p.health.failure(b)
		bm.failed()
		return nil, fmt.Errorf("dial %s: %w", b.Addr, err)
	}
	bm.connected()
	f := &udpFlow{key: key, svc: l, orig: orig, backend: b, conn: conn, dst: key.dst, sock: sock, pm: pm}
	f.refreshed.Store(flowClock())
	pm.flowOpened()
	b.Acquire()
	flows.Add(key, f)
	p.wg.Add(1)
	go p.udpReplies(f) // ends when the flow's socket is closed
	return f, nil
}

// udpFailed handles an error sending to or receiving from a flow's
// backend: ECONNREFUSED (an ICMP port unreachable) ejects the backend;
// the flow is dropped either way.
func (p *Proxier) udpFailed(f *udpFlow, err error) {
	if errors.Is(err, syscall.ECONNREFUSED) {
		p.health.failure(f.backend)
	}
	if flows := p.flowTable(); flows != nil {
		if cur, ok := flows.Peek(f.key); ok && cur == f {
			flows.Remove(f.key)
		}
	}
	f.close()
}

func (p *Proxier) dialUDP(addr netip.AddrPort, from netip.Addr) (*net.UDPConn, error) {
	return dialAs[*net.UDPConn](p.dial("udp", addr, from))
}

// replyBuffers recycles reply buffers: a flow holds one only while it
// relays a datagram, not while it waits, so idle flows cost no buffer.
var replyBuffers bufferPool

// udpReplies relays the backend's datagrams to the client until the
// flow's socket is closed (expiry, eviction, replacement, shutdown).
func (p *Proxier) udpReplies(f *udpFlow) {
	defer p.wg.Done()
	defer f.backend.Release()
	rc, err := f.conn.SyscallConn()
	if err != nil {
		f.close()
		return
	}
	for {
		bp, n, err := readDatagram(rc, &replyBuffers)
		if err != nil {
			p.udpFailed(f, err)
			return
		}
		err = f.sock.write((*bp)[:n], f.key.client, f.dst)
		replyBuffers.put(bp)
		if err != nil {
			p.connLog.Warn("UDP reply to client failed", zap.Stringer("client", f.key.client), zap.Error(err))
		} else {
			f.pm.down(int64(n))
		}
		f.touch(p)
	}
}

// removeFlows drops every flow of a closed listener: those its socket
// received, and those a shared listener routed to it.
func (p *Proxier) removeFlows(l *listener) {
	flows := p.flowTable()
	for _, k := range flows.Keys() {
		if f, ok := flows.Peek(k); k.l == l || ok && f.svc == l {
			flows.Remove(k)
		}
	}
}
