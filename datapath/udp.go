package datapath

import (
	"bytes"
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

	"github.com/hashicorp/golang-lru/v2/expirable"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

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
	l      *Listener
	client netip.AddrPort
	dst    netip.AddrPort
}

// udpFlow is one client's association with one backend: a connected UDP
// socket towards the backend, whose replies an event loop relays (or,
// for a listener the loops do not read, a goroutine of the flow's own).
type udpFlow struct {
	p   *Engine
	key flowKey
	// svc is the service port's listener: key.l itself, or the one a
	// shared listener routed the flow to.
	svc *Listener
	// orig is the original destination the flow was routed by: dst in
	// tproxy mode, conntrack's answer for a shared listener in redirect
	// mode, unknown otherwise.
	orig    netip.AddrPort
	backend *balancer.Backend
	// The socket connected to the backend: conn when a goroutine reads the
	// listener (read by the flow's goroutine, udpReplies), or else fd,
	// owned by loop, which reads the listener, writes the flow's requests
	// (send), relays its replies (flowReady) and closes it (dropFlow).
	conn *net.UDPConn
	fd   int
	loop *eventLoop
	side loopSide // fd's entry in loop's epoll set; owned by loop
	// dst is where the client's datagrams arrived: in redirect mode the
	// local address the kernel redirected them to (replies sent from it are
	// mapped back to the service's address and port by conntrack); in
	// tproxy mode the service's address and port themselves. Either way a
	// client with a connected socket (a DNS resolver) accepts the replies.
	dst    netip.AddrPort
	sock   udpSocket
	closed atomic.Bool
	pm     *PortMetrics // the metrics of the flow's service port; nil if none
	// refreshed is when the flow's timeout was last pushed back in the
	// table (monotonic nanoseconds from flowClock): see touch.
	refreshed atomic.Int64
	// slot, when set, makes the socket a pooled one, not in the flow
	// table, that carries one request–reply query at a time (udppool.go).
	// Owned by loop.
	slot *poolSlot
	// share is the service port whose query the socket carries, or whose
	// flow it is, and fair its place among the port's (udpfair.go).
	// Guarded by udpFairness.mu.
	share *ConnSlots
	fair  fairLink
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
func (f *udpFlow) touch(p *Engine) {
	if f.slot != nil {
		return // not in the table
	}
	now := flowClock()
	last := f.refreshed.Load()
	if now-last < int64(touchInterval) || !f.refreshed.CompareAndSwap(last, now) {
		return
	}
	p.flowTable()
	p.flows.mu.Lock()
	defer p.flows.mu.Unlock()
	// Peek and Add as one step: the LRU's Add of a key it holds replaces
	// the value without evicting it, so a flow that was replaced between
	// the two would come back over its replacement, whose socket and
	// goroutine nothing would then end.
	if cur, ok := p.flows.lru.Peek(f.key); ok && cur == f {
		p.flows.lru.Add(f.key, f)
		p.fair.flowUsed(f)
	}
}

// removeFlow removes f from the flow table, which ends it, if it is
// still its key's flow: a flow that has been replaced leaves its
// replacement alone.
func (ur *udpRelay) removeFlow(f *udpFlow) {
	flows := ur.flowTable()
	ur.flows.mu.Lock()
	defer ur.flows.mu.Unlock()
	if cur, ok := flows.Peek(f.key); ok && cur == f {
		flows.Remove(f.key)
	}
}

// addFlow makes f its key's flow, a flow of the service port whose
// snapshot has slots s. If the table is full, a flow ends to make room
// (udpfair.go): the least recently used of s, if s holds its share of
// the table or more, else of the port with the most flows; ended tells
// whether one did, and of tells which port's it was, when known. Only
// the goroutine or loop that reads f's listener adds flows of its keys.
func (ur *udpRelay) addFlow(f *udpFlow, s *ConnSlots) (ended bool, of fmt.Stringer) {
	flows := ur.flowTable()
	share := ur.fair.of(s)
	ur.flows.mu.Lock()
	defer ur.flows.mu.Unlock()
	if flows.Contains(f.key) {
		// A flow past its timeout that the LRU's expiry has not removed
		// yet: Add would replace it without its eviction callback, which
		// ends it and forgets its share.
		flows.Remove(f.key)
	}
	if flows.Len() >= ur.flows.max {
		if v := ur.fair.flowVictim(share, ur.flows.max); v != nil {
			ended = true
			if v.svc != nil {
				of = v.svc.Name
			}
			if !flows.Remove(v.key) {
				ur.fair.flowRemoved(v)
			}
		}
	}
	ur.fair.flowAdded(f, share)
	if flows.Add(f.key, f) && !ended {
		ended = true
	}
	return ended, of
}

// flowStart anchors flowClock.
var flowStart = time.Now()

// flowClock is a monotonic clock in nanoseconds, for touch.
func flowClock() int64 { return int64(time.Since(flowStart)) }

// close ends the flow; safe to call from any goroutine, any number of
// times. On an event loop, the loop closes the socket (drop): only the
// loop uses it, so no send can meet a closed descriptor whose number
// another socket has taken.
func (f *udpFlow) close() {
	if !f.closed.CompareAndSwap(false, true) {
		return
	}
	if f.slot == nil {
		f.pm.flowClosed()
	}
	if f.conn != nil {
		f.conn.Close()
	} else {
		f.drop()
	}
}

// send writes one client datagram to the backend, without waiting: a full
// send buffer drops it (errDatagramDropped). On an event loop it runs on
// f.loop, whose dropFlow alone closes f.fd.
func (f *udpFlow) send(b []byte) error {
	if f.conn != nil {
		_, err := f.conn.Write(b)
		return err
	}
	if f.closed.Load() {
		return net.ErrClosed
	}
	_, err := writeRetry(f.fd, b)
	switch err {
	case nil:
		return nil
	case unix.EAGAIN:
		return errDatagramDropped
	}
	return os.NewSyscallError("write", err)
}

// errDatagramDropped: a datagram found its flow's send buffer full.
var errDatagramDropped = errors.New("datagram dropped: the backend socket's send buffer is full")

// drop has the flow's loop close its socket, once the flow is closed. If
// the loop has stopped, it closed the socket as it stopped (runTasks).
func (f *udpFlow) drop() {
	l := f.loop
	l.post(func() { l.dropFlow(f) })
}

// flowTable holds every UDP flow of an Engine, bounded in size, each
// expiring after the UDP timeout without traffic. It is an expirable LRU
// from hashicorp/golang-lru; that LRU runs one expiry goroutine that never
// exits, so the table is created once per Engine, with its first UDP
// listener, and lives as long as the process.
type flowTable struct {
	once sync.Once
	lru  *expirable.LRU[flowKey, *udpFlow]
	// mu makes a check of a key's flow and the change that depends on it
	// one step (touch, removeFlow, addFlow). The LRU's own lock covers
	// each call alone.
	mu sync.Mutex
	// created publishes lru to readers that must not create it (UDPFlows,
	// from any goroutine).
	created atomic.Pointer[expirable.LRU[flowKey, *udpFlow]]
	// max is the table's bound (Config.UDPMaxFlows), set with lru.
	max int
}

func (ur *udpRelay) flowTable() *expirable.LRU[flowKey, *udpFlow] {
	p := ur.e
	ur.flows.once.Do(func() {
		size, ttl := p.cfg.UDPMaxFlows, p.cfg.UDPTimeout
		if size <= 0 {
			size = 65536
		}
		if ttl <= 0 {
			ttl = 30 * time.Second
		}
		// The callback runs with the LRU's lock held: it only forgets the
		// flow's share and closes its socket, which ends the flow's reply
		// goroutine.
		ur.flows.max = size
		ur.flows.lru = expirable.NewLRU(size, func(_ flowKey, f *udpFlow) {
			ur.fair.flowRemoved(f)
			f.close()
		}, ttl)
		ur.flows.created.Store(ur.flows.lru)
	})
	return ur.flows.lru
}

// UDPFlows returns the number of live UDP flows. Safe for concurrent use.
func (p *Engine) UDPFlows() int {
	if lru := p.flows.created.Load(); lru != nil {
		return lru.Len()
	}
	return 0
}

// ListenUDP opens a UDP listener as Config.ListenUDP says.
func (p *Engine) ListenUDP(ctx context.Context, network, addr string) (*net.UDPConn, error) {
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

// udpSocket returns the udpSocket of l's socket, rc, and the
// listenSocket that reads it. With a nil udpSocket the socket is
// unusable; with an error besides, it cannot tell datagrams' destinations.
func (ur *udpRelay) udpSocket(l *Listener, rc syscall.RawConn) (udpSocket, *listenSocket, error) {
	p := ur.e
	if p.cfg.Transparent {
		ls, err := newListenSocket(rc, l.V6, false, p.cfg.udpReadBatch())
		if err != nil {
			return nil, nil, err
		}
		return &tproxySocket{listenSocket: ls}, ls, nil
	}
	ls, err := newListenSocket(rc, l.V6, true, p.cfg.udpReadBatch())
	return ls, ls, err
}

// udpSocketErr logs why the udpSocket of l, sock, is unusable (nil) or
// cannot tell datagrams' destinations; false if it is unusable.
func (ur *udpRelay) udpSocketErr(l *Listener, sock udpSocket, err error) bool {
	p := ur.e
	switch {
	case err == nil:
	case sock == nil:
		p.log.Error("UDP listener unusable", zap.Stringer("servicePort", l.Name), zap.Error(err))
		return false
	default:
		p.log.Error("UDP listener cannot see destination addresses; replies may come from the wrong address",
			zap.Stringer("servicePort", l.Name), zap.Error(err))
	}
	return true
}

// udpLoop reads the listener's datagrams until it is closed, and forwards
// each to its client's flow, creating the flow on the first datagram. It
// is the only goroutine that creates flows for l.
func (ur *udpRelay) udpLoop(l *Listener) {
	p := ur.e
	defer p.wg.Done()
	rc, err := l.PC.SyscallConn()
	if err != nil {
		p.log.Error("UDP listener unusable", zap.Stringer("servicePort", l.Name), zap.Error(err))
		return
	}
	sock, _, err := ur.udpSocket(l, rc)
	if !ur.udpSocketErr(l, sock, err) {
		return
	}
	defer sock.close()
	ur.flowTable() // created before the first flow
	batch := make([]datagram, p.cfg.udpReadBatch())
	var delay time.Duration
	for {
		n, err := sock.readBatch(batch)
		switch {
		case errors.Is(err, net.ErrClosed):
			ur.removeFlows(l)
			return
		case errors.Is(err, errNoDestination):
			p.connLog.Warn("dropping datagrams without their destination address (not redirected)", zap.Stringer("servicePort", l.Name))
			continue
		case err != nil:
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			p.connLog.Warn("UDP read failed; backing off", zap.Stringer("servicePort", l.Name), zap.Error(err))
			time.Sleep(delay)
			continue
		}
		delay = 0
		for i := range batch[:n] {
			ur.forwardDatagram(nil, l, sock, &batch[i])
			listenBuffers.put(batch[i].buf)
			batch[i] = datagram{}
		}
	}
}

// forwardDatagram sends one client datagram to its flow's backend. A
// backend that answered with ICMP port unreachable makes the send fail:
// it is ejected and the next one tried, at most DialAttempts times. el
// is the event loop that read the datagram, which then carries the new
// flows; nil on the listener's goroutine.
func (ur *udpRelay) forwardDatagram(el *eventLoop, l *Listener, sock udpSocket, d *datagram) {
	p := ur.e
	key := flowKey{l, d.client, d.dst}
	svc, orig := l, netip.AddrPort{}
	if p.cfg.Transparent {
		orig = d.dst
	}
	// One lookup per datagram: udpFlowFor checks and reuses what it finds.
	cur, _ := ur.flowTable().Peek(key)
	var rq *recentQuery
	if cur == nil {
		cur, rq = ur.pooledFlow(el, key)
	}
	switch {
	case cur != nil && !l.Shared:
		orig = cur.orig
	case rq != nil && !l.Shared:
		orig = rq.orig
	case !l.Shared && !p.cfg.Transparent && p.cfg.UDPOriginalDst != nil && !ur.guardedRoute(l):
		// A listener of its own binds every address, and receives what
		// anyone sends to its port unless the listener guard drops it
		// (Listener.Guarded): the guard holds the port only from the next
		// rules write, and not at all after someone flushed its set. Until
		// then a new flow is forwarded only if uproxy's rules redirected
		// it here: conntrack's entry names the original destination,
		// which must be the service's (udpFlowFor). A datagram sent
		// straight to the port has its own entry, whose destination is
		// the listener's. The lookup is also needed, guard or not,
		// when the traffic policies route by the original destination.
		local := netip.AddrPortFrom(d.dst.Addr(), l.Port)
		var err error
		if orig, err = p.cfg.UDPOriginalDst(d.client, local); err != nil {
			ur.notRedirected(l, err)
			return
		}
	}
	if (cur != nil || rq != nil) && !orig.IsValid() && !l.Shared && ur.routesByDst(l) {
		// A flow admitted on the guard alone, whose service has come to
		// route by the original destination since (a Local policy): ask
		// now, rather than take it for cluster-IP traffic. It was
		// redirected, so a failed lookup (an expired entry) drops nothing.
		local := netip.AddrPortFrom(d.dst.Addr(), l.Port)
		if o, err := p.cfg.UDPOriginalDst(d.client, local); err == nil {
			orig = o
		}
	}
	if l.Shared {
		// The flow remembers its service; only its first datagram asks
		// which, and in redirect mode that means asking conntrack.
		if cur != nil {
			svc, orig = cur.svc, cur.orig
		} else if rq != nil && l.Route(rq.orig) == rq.svc {
			// A pooled client's service, unless it has left the
			// listener since.
			svc, orig = rq.svc, rq.orig
		} else {
			var err error
			if !p.cfg.Transparent {
				// IP_PKTINFO gives the local address without the port:
				// the listener's own.
				local := netip.AddrPortFrom(d.dst.Addr(), l.Port)
				orig, err = p.cfg.UDPOriginalDst(d.client, local)
			}
			if svc = l.Route(orig); svc == nil || err != nil {
				p.sharedRefused(l, orig, err)
				return
			}
		}
	}
	t := udpTarget{el: el, svc: svc, key: key, sock: sock, orig: orig}
	ur.deliver(t, cur, rq, (*d.buf)[:d.n], p.cfg.dialAttempts(), nil)
}

// udpTarget is where forwardDatagram sends a datagram: to the flow of
// key, a client of service port svc whose datagrams come through sock,
// sent to orig (when known), on event loop el (nil: the listener's
// goroutine).
type udpTarget struct {
	el   *eventLoop
	svc  *Listener
	key  flowKey
	sock udpSocket
	orig netip.AddrPort
}

// deliver sends payload to t's flow: cur, the one it has, if still
// usable, else a new one (udpFlowFor), trying at most tries backends.
// pick, when set, is the backend picked for the datagram before it
// waited for the routes that choose its new flow's source address, with
// those routes (resume).
func (ur *udpRelay) deliver(t udpTarget, cur *udpFlow, rq *recentQuery, payload []byte, tries int, pick *udpPick) {
	p := ur.e
	for ; tries > 0; tries-- {
		f, waits, err := ur.udpFlowFor(t, cur, rq, pick)
		pick = nil
		if waits != nil {
			ur.hold(t, *waits, payload, tries)
			return
		}
		if err != nil {
			p.connLog.Warn("no backend for UDP flow", zap.Stringer("servicePort", t.svc.Name), zap.Error(err))
			return
		}
		if err := f.send(payload); err != nil {
			if errors.Is(err, errDatagramDropped) {
				p.connLog.Warn("UDP datagram dropped", zap.Stringer("servicePort", t.svc.Name), zap.Error(err))
				return
			}
			ur.udpFailed(f, err)
			cur = nil // removed from the table
			continue
		}
		f.pm.up(int64(len(payload)))
		f.touch(p)
		return
	}
}

// udpPick is the backend picked, on an event loop, for a datagram's new
// flow whose source address waits for the routes to the client and the
// backend, and those routes once the resolver has them.
type udpPick struct {
	b      *balancer.Backend
	routes routePair
	// long: the client had become a long flow (recentQuery.long), which
	// the lookup of its last query consumed before the datagram waited.
	long bool
}

// heldDatagram is a datagram whose new flow waits for the routes that
// choose its source address, which the event loop must not wait for (a
// netlink round trip): a copy of the datagram, off the listener's
// buffers, that the loop forwards once the resolver has posted the
// routes to it (routed, resume). Owned by the loop; tries is what is
// left of its DialAttempts.
type heldDatagram struct {
	ur      *udpRelay
	t       udpTarget
	pick    udpPick
	payload []byte
	tries   int
}

const (
	// maxHeldBytes bounds what an event loop holds of the datagrams that
	// wait for route lookups: about a socket's default receive buffer
	// (net.core.rmem_default), which would have held them had the loop
	// waited for the lookups itself.
	maxHeldBytes = 256 << 10
	// heldOverhead is what holding a datagram costs besides its payload,
	// so that empty datagrams count against maxHeldBytes too.
	heldOverhead = 256
)

// hold keeps payload, a datagram to t whose new flow to backend b waits
// for routes, until the resolver has them; its loop forwards it then
// (resume). Past maxHeldBytes the datagram is dropped, as a full
// socket buffer would drop it. On the loop.
func (ur *udpRelay) hold(t udpTarget, pick udpPick, payload []byte, tries int) {
	p := ur.e
	el := t.el
	if el.held+len(payload)+heldOverhead > maxHeldBytes {
		p.connLog.Warn("UDP datagram dropped: its event loop holds too many datagrams of new clients whose routes are being looked up",
			zap.Stringer("servicePort", t.svc.Name), zap.Stringer("client", t.key.client))
		return
	}
	el.held += len(payload) + heldOverhead
	h := &heldDatagram{ur: ur, t: t, pick: pick, payload: bytes.Clone(payload), tries: tries}
	p.src.await(p.cfg.clock().Now(), t.key.client.Addr(), pick.b.Addr.Addr(), h)
}

// routed posts h back to its loop with its routes. If the loop is
// stopping, h is dropped with it.
func (h *heldDatagram) routed(r routePair) {
	h.pick.routes = r
	el := h.t.el
	el.post(func() { h.ur.resume(h) })
}

// resume forwards h, on its loop, once its routes are known: to the flow
// its client has by now, if an earlier datagram made one, else to a new
// one, to the backend picked before if it is still usable. A datagram
// whose listener closed while it waited is dropped, as the listener's
// flows were.
func (ur *udpRelay) resume(h *heldDatagram) {
	el, key := h.t.el, h.t.key
	el.held -= len(h.payload) + heldOverhead
	if !key.l.raw.open() {
		return
	}
	cur, _ := ur.flowTable().Peek(key)
	var rq *recentQuery
	if cur == nil {
		cur, rq = ur.pooledFlow(el, key)
	}
	ur.deliver(h.t, cur, rq, h.payload, h.tries, &h.pick)
}

// guardedRoute reports whether a new flow of service port l's own
// listener needs no conntrack lookup (Config.UDPOriginalDst): the kernel
// drops what was not redirected to the port (Listener.Guarded), and
// every address of the service routes alike (Snapshot.RoutesAlike), so
// the original destination would change nothing. It keeps a lookup,
// a netlink round trip, off every new client of a port like DNS's.
func (ur *udpRelay) guardedRoute(l *Listener) bool {
	if !l.Guarded.Load() {
		return false
	}
	snap := l.Snap.Load()
	return snap != nil && snap.RoutesAlike()
}

// routesByDst reports whether service port l's own listener, in redirect
// mode with conntrack lookups, routes by a flow's original destination
// (see guardedRoute).
func (ur *udpRelay) routesByDst(l *Listener) bool {
	p := ur.e
	if p.cfg.Transparent || p.cfg.UDPOriginalDst == nil {
		return false
	}
	snap := l.Snap.Load()
	return snap != nil && !snap.RoutesAlike()
}

// notRedirected counts and logs a datagram that service port l's own
// listener received with no original destination: not redirected.
func (ur *udpRelay) notRedirected(l *Listener, err error) {
	p := ur.e
	if snap := l.Snap.Load(); snap != nil {
		snap.Metrics.refusedDestination()
	}
	p.connLog.Warn("dropping a UDP datagram that was not redirected to the service", zap.Stringer("servicePort", l.Name), zap.Error(err))
}

// udpFlowFor returns cur, the table's flow of t.key (nil: none), if it
// is still usable for service port t.svc, or creates one, on event loop
// t.el when it is set (see connectFlow). t.orig is the datagram's
// original destination when known (tproxy mode, or a shared listener's
// conntrack lookup). A flow whose backend is no longer usable (removed,
// no longer ready, ejected) is replaced, so no client stays blackholed
// behind a dead endpoint. rq, when set, is the client's last pooled
// query (udppool.go): if rq.long, the client has become a long flow,
// which goes to the same backend if it can. Otherwise, on an event loop,
// a new client's datagram on a port of request-reply or auto mode is a
// query sent through a pooled socket: one of the pool that dials the
// backend from the client's address when the client keeps it
// (keepSource), else from the node's.
//
// Where the client keeps its address, the new flow's source address
// needs the routes to the client and the backend. On an event loop,
// when the resolver has yet to look them up, udpFlowFor returns the
// backend it picked as waits, and no flow: the caller holds the datagram
// (hold), and calls again with pick, the backend and its routes, once
// they are known.
func (ur *udpRelay) udpFlowFor(t udpTarget, cur *udpFlow, rq *recentQuery, pick *udpPick) (f *udpFlow, waits *udpPick, err error) {
	p := ur.e
	el, l, key, sock, orig := t.el, t.svc, t.key, t.sock, t.orig
	client := key.client
	snap := l.Snap.Load()
	if snap == nil {
		return nil, nil, fmt.Errorf("%s: not synced yet", l.Name)
	}
	pm := snap.Metrics
	// Without an original destination (a listener of its own in redirect
	// mode, without Config.UDPOriginalDst or guarded with every address
	// routing alike) a datagram counts as cluster-IP traffic.
	var bal balancer.Balancer
	if !(p.cfg.Transparent && forgedLoopback(client.Addr(), orig)) {
		bal = snap.Route(orig, orig.IsValid(), client.Addr(), p.internalClient)
	}
	if bal == nil {
		pm.refusedDestination()
		return nil, nil, fmt.Errorf("%s: datagram to %s, not one of the service's addresses", snap.Name, orig)
	}
	set := snap.Cluster
	if bal == snap.Local {
		set = snap.Local
	}
	if f := cur; f != nil {
		if !f.closed.Load() && !f.backend.Ejected() && snap.serves(set, f.backend) {
			return f, nil, nil
		}
		ur.removeFlow(f)
	}
	b, long := rq.recentBackend(snap, set)
	if pick != nil {
		long = long || pick.long
	}
	if b == nil && pick != nil && !pick.b.Ejected() && snap.serves(set, pick.b) {
		b = pick.b
	}
	if b == nil {
		b = bal.Pick(client.Addr())
	}
	if b == nil {
		pm.noEndpoint()
		return nil, nil, fmt.Errorf("%s: %w", snap.Name, errNoEndpoints)
	}
	bm := pm.backend(b)
	if pick == nil || b != pick.b {
		bm.picked() // a pick that waited for its routes counted then
	}
	var from netip.Addr
	keep := p.keepClient(snap, snap.ToClusterIP(orig, orig.IsValid()), client.Addr())
	if keep && !p.nodeBackend(client.Addr(), b.Addr.Addr()) {
		now := p.cfg.clock().Now()
		var (
			reason int
			ok     bool
		)
		if pick != nil && b == pick.b {
			reason = p.src.reason(now, client.Addr(), b.Addr.Addr(), pick.routes)
		} else if _, reason, ok = p.src.cached(now, client.Addr(), b.Addr.Addr()); !ok {
			if el != nil {
				return nil, &udpPick{b: b, long: long}, nil
			}
			reason = p.src.reason(now, client.Addr(), b.Addr.Addr(), p.src.wait(now, client.Addr(), b.Addr.Addr()))
		}
		from = p.keepSource(snap, client.Addr(), b.Addr.Addr(), reason)
	}
	if !long {
		if f, ok, err := ur.checkout(el, l, snap, key, sock, orig, b, from); ok {
			return f, nil, err
		}
	}
	f = &udpFlow{p: p, key: key, svc: l, orig: orig, backend: b, fd: -1, dst: key.dst, sock: sock, pm: pm}
	start := pm.dialStart()
	err = ur.connectFlow(el, f, from)
	pm.dialDone(start, err)
	if err != nil {
		if !localDialFailure(err) {
			p.health.Failure(b)
		}
		bm.failed()
		return nil, nil, fmt.Errorf("dial %s: %w", b.Addr, err)
	}
	bm.connected()
	f.refreshed.Store(flowClock())
	pm.flowOpened()
	if ended, of := ur.addFlow(f, snap.Slots); ended {
		ur.flowEnded(pm, snap.Name, of)
	}
	if f.conn != nil {
		p.wg.Add(1)
		go ur.udpReplies(f) // ends when the flow's socket is closed
	}
	return f, nil, nil
}

// flowEnded counts and logs a flow that the full table ended to make
// room for a new flow of service port name (with metrics pm): one of
// port of's, when known.
func (ur *udpRelay) flowEnded(pm *PortMetrics, name, of fmt.Stringer) {
	pm.flowEvicted()
	fields := []zap.Field{zap.Stringer("servicePort", name)}
	if of != nil {
		fields = append(fields, zap.Stringer("endedFlowOf", of))
	}
	ur.e.connLog.Warn("UDP flow table full; the least recently used flow of a service port holding its share of the table or more ended to make room (raise --udp-max-flows, or the open-files limit)",
		fields...)
}

// connectFlow connects f's socket to its backend, from the address from
// when it is valid, and holds the backend (Acquire) until the flow ends.
// el, when set, is the event loop this runs on, which read the flow's
// first datagram: the socket joins it at once, before anyone else knows
// the flow, and the loop carries both directions, so that a request and
// its reply are handled by the same thread. Without one (the listener's
// goroutine reads it: a dialer of the caller's, or a socket the loops
// could not take) the flow gets a goroutine of its own.
func (ur *udpRelay) connectFlow(el *eventLoop, f *udpFlow, from netip.Addr) error {
	p := ur.e
	if el == nil {
		conn, err := ur.dialUDP(f.backend.Addr, from)
		if err != nil {
			return err
		}
		f.conn = conn
		f.backend.Acquire()
		return nil
	}
	fd, err := rawDial(unix.SOCK_DGRAM, f.backend.Addr, netip.AddrPortFrom(from, 0), p.cfg.OwnMark)
	if err != nil {
		return err
	}
	f.fd, f.loop = fd, el
	f.backend.Acquire()
	el.addFlow(f)
	return nil
}

// udpFailed handles an error sending to or receiving from a flow's
// backend: ECONNREFUSED (an ICMP port unreachable) ejects the backend;
// the flow is dropped either way.
func (ur *udpRelay) udpFailed(f *udpFlow, err error) {
	p := ur.e
	if errors.Is(err, syscall.ECONNREFUSED) {
		p.health.Failure(f.backend)
	}
	ur.removeFlow(f)
	f.close()
}

func (ur *udpRelay) dialUDP(addr netip.AddrPort, from netip.Addr) (*net.UDPConn, error) {
	p := ur.e
	return dialAs[*net.UDPConn](p.dial("udp", addr, from))
}

// replyBuffers recycles reply buffers: a flow holds one only while it
// relays a datagram, not while it waits, so idle flows cost no buffer.
var replyBuffers bufferPool

// udpReplies relays the backend's datagrams to the client until the
// flow's socket is closed (expiry, eviction, replacement, shutdown). It
// is the flow's goroutine, for a listener the loops do not read.
func (ur *udpRelay) udpReplies(f *udpFlow) {
	p := ur.e
	defer p.wg.Done()
	defer f.backend.Release()
	rc, err := f.conn.SyscallConn()
	if err != nil {
		f.close()
		return
	}
	rs := newReplySender()
	for {
		bp, n, err := readDatagram(rc, &replyBuffers)
		if err != nil {
			ur.udpFailed(f, err)
			return
		}
		ur.relayReply(f, rs, (*bp)[:n])
		replyBuffers.put(bp)
	}
}

// relayReply sends one of the backend's datagrams to the flow's client.
func (ur *udpRelay) relayReply(f *udpFlow, rs *replySender, b []byte) {
	path, err := f.sock.replyPath(f.dst)
	if err == nil {
		err = rs.send(path, b, f.key.client)
	}
	ur.replied(f, len(b), err)
}

// queueReply is relayReply on an event loop: the reply goes out when the
// loop flushes q.
func (ur *udpRelay) queueReply(f *udpFlow, q *replyQueue, b []byte) {
	path, err := f.sock.replyPath(f.dst)
	if err != nil {
		ur.replied(f, 0, err)
		return
	}
	q.add(path, b, f)
}

// replied counts a reply of n bytes sent to f's client, or logs why it
// was not, and pushes the flow's timeout back either way.
func (ur *udpRelay) replied(f *udpFlow, n int, err error) {
	p := ur.e
	if err != nil {
		p.connLog.Warn("UDP reply to client failed", zap.Stringer("client", f.key.client), zap.Error(err))
	} else {
		f.pm.down(int64(n))
	}
	f.touch(p)
}

// removeFlows drops every flow of a closed listener: those its socket
// received, and those a shared listener routed to it.
func (ur *udpRelay) removeFlows(l *Listener) {
	flows := ur.flowTable()
	for _, k := range flows.Keys() {
		if f, ok := flows.Peek(k); k.l == l || ok && f.svc == l {
			flows.Remove(k)
		}
	}
}

// udpListenBudget bounds the datagrams that one readiness of a UDP
// listener's socket reads on its event loop, so that a flooded service
// cannot hold the loop's other sockets up.
const udpListenBudget = 64

// loopPacketListener moves l's UDP socket, l.PC, to an event loop, which
// reads it from then on in place of the listener's goroutine (udpLoop):
// with a dialer of the caller's, or a socket it cannot duplicate, it
// leaves l alone. The loop that reads a datagram also writes it to its flow's
// backend socket, relays the backend's reply from that socket, and sends
// it with the other replies of its turn: a request crosses no goroutine
// and no thread.
//
// As for a TCP listener (listeners.Manager.Start), a duplicate of the descriptor
// becomes the socket's only one, out of the runtime's poller, which would
// otherwise wake a thread for every datagram that arrives, and for every
// reply sent through the socket: the runtime registers a socket for
// writability too, edge-triggered, and a UDP socket signals it each time
// the kernel frees a sent datagram (sock_wfree).
func (ur *udpRelay) loopPacketListener(l *Listener) error {
	p := ur.e
	rc, err := l.PC.SyscallConn()
	if err != nil {
		return err
	}
	fd := p.rawListenerFD(rc)
	if fd < 0 {
		return nil
	}
	ll := &loopListener{rawSock: rawSock{fd: fd}, oneLoop: true}
	sock, ls, err := ur.udpSocket(l, ll)
	if !ur.udpSocketErr(l, sock, err) {
		ll.close()
		return err
	}
	ls.seesEmpty()
	l.PC.Close()
	l.PC, l.raw = nil, ll
	batch := make([]datagram, p.cfg.udpReadBatch())
	ll.readable = func(el *eventLoop) (bool, error) {
		for read := 0; read < udpListenBudget; read += ls.asked {
			n, err := sock.readBatch(batch)
			switch {
			case err == unix.EAGAIN || errors.Is(err, net.ErrClosed):
				return false, nil
			case errors.Is(err, errNoDestination):
				p.connLog.Warn("dropping datagrams without their destination address (not redirected)", zap.Stringer("servicePort", l.Name))
			case err != nil:
				return false, err
			}
			for i := range batch[:n] {
				ur.forwardDatagram(el, l, sock, &batch[i])
				listenBuffers.put(batch[i].buf)
				batch[i] = datagram{}
			}
			if ls.drained() {
				return false, nil
			}
		}
		return true, nil
	}
	ll.failed = func(err error, delay time.Duration) {
		if delay == 0 {
			p.log.Error("cannot read the UDP listener: registering it with an event loop failed", zap.Stringer("servicePort", l.Name), zap.Error(err))
			return
		}
		p.connLog.Warn("UDP read failed; backing off", zap.Stringer("servicePort", l.Name), zap.Duration("delay", delay),
			zap.Error(os.NewSyscallError("recvmmsg", err)))
	}
	ll.closed = func() {
		ur.removeFlows(l)
		sock.close()
	}
	return nil
}
