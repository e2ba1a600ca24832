package datapath

// Request–reply UDP through pooled backend sockets.
//
// A DNS stub resolver sends each query from a new socket, so to the proxy
// every query is a new flow: a socket of its own connected to a backend,
// a flow table entry, epoll registration, and a close once the flow
// expires. A service port in request-reply mode (Snapshot.UDPMode: the
// uproxy.io/udp-mode annotation, whose default for port 53 is
// request-reply, so that kube-dns needs none) carries each datagram as a
// query instead: it goes out on a socket checked out of a
// pool of connected sockets that the event loop keeps per endpoint, and
// the socket returns to the pool with the backend's first reply. This is
// IPVS's one-packet scheduling (--ops), or Envoy's per-host pool of
// upstream UDP sockets, without parsing the payload: uproxy does not know
// the protocol, so it cannot match replies to queries by a DNS ID. A
// pooled socket therefore carries one query at a time, and the reply that
// arrives on it belongs to the client that checked it out. A resolver
// that sends two queries at once from one port (glibc and musl ask for A
// and AAAA together) has two sockets checked out, one per query.
//
// A query that gets no reply within Config.UDPQueryTimeout closes its
// socket instead of returning it: a late reply could otherwise reach the
// next client to check that socket out. Replies that reach an idle pooled
// socket (a second reply to one query) are dropped. Sockets leave the
// pool oldest first, which gives such stray datagrams the longest time to
// land on an idle socket.
//
// Protocols whose clients keep their port and whose servers answer more
// than once, or first (QUIC, WireGuard), need a socket per client, for
// the server sees one source address per client: flow mode, the default
// of every port but 53. Auto mode tells the two apart by watching: a
// client starts as a query, and becomes a flow, to the backend that
// answered it, if it sends a second datagram while its query is still out
// (its socket then becomes the flow's, so the backend sees one source
// address throughout) or within longFlowWindow after the reply. A new
// query that the kernel happens to give a port another query used a
// moment before is taken for a long flow too: it works as before pooling,
// just without its saving.
//
// A client whose address its backend sees (KeepClient) has pools of its
// own, whose sockets are transparent and bound to its address: a pool
// is an endpoint's and a source address's (poolKey), so that a pod's
// resolver, which sends each query from a new port, reuses the sockets
// of its address as the node's queries reuse the node's. Nothing is
// pooled for the datagrams of listeners read by goroutines rather than
// event loops.
// Session affinity holds: the balancer picks each query's backend
// from the client's address, as it picks a flow's. The redirect mode
// check of new flows (Config.UDPOriginalDst) runs for a client's first
// query; the loop remembers its answer for the client's later ones for
// the UDP timeout at most, as the flow table does for a flow.
//
// The pools are bounded, per endpoint on each loop (Config.UDPPoolSize)
// and across the engine (Config.UDPPoolMax), so that no query rate can
// run the process out of descriptors: a query that finds its endpoint's
// pool busy to its bound is dropped and counted
// (uproxy_udp_pool_queries_total{result="dropped"}), as the kernel drops
// a datagram that finds a full socket buffer. The engine's bound is
// shared fairly among the service ports (udpfair.go): at it, a port's
// query is dropped only if the port holds its share of the sockets, and
// otherwise takes the socket of the oldest query of the port with the
// most, which is counted as dropped instead. A pool whose endpoint got
// no query for the UDP timeout (removed from the Service, or idle) closes
// its idle sockets; an endpoint removed from the Service gets no queries,
// as only the current endpoints are picked.

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/balancer"
)

// longFlowWindow is how soon after its reply a client must send again,
// from the same port, for the proxy to take it for a long flow rather
// than a request–reply query. Protocols that keep their port (QUIC,
// WireGuard) answer a reply at once; a new query from a port the kernel
// reused after another query is rare within it.
const longFlowWindow = 50 * time.Millisecond

// maxRecent bounds the clients a loop remembers in each of its two
// generations (loopPools.recent).
const maxRecent = 1 << 15

// errPoolFull: every socket of an endpoint's pool, or of the engine's,
// carries a query in flight.
var errPoolFull = errors.New("UDP query dropped: the endpoint's socket pool is at its bound, every socket awaiting a reply")

// udpPoolSize is Config.UDPPoolSize with its default; zero: no pooling.
func (c *Config) udpPoolSize() int {
	switch {
	case c.UDPPoolSize < 0:
		return 0
	case c.UDPPoolSize == 0:
		return 256
	}
	return c.UDPPoolSize
}

func (c *Config) udpPoolMax() int64 {
	if c.UDPPoolMax <= 0 {
		return 4096
	}
	return int64(c.UDPPoolMax)
}

func (c *Config) udpQueryTimeout() time.Duration {
	if c.UDPQueryTimeout <= 0 {
		return 5 * time.Second
	}
	return c.UDPQueryTimeout
}

func (c *Config) udpTimeout() time.Duration {
	if c.UDPTimeout <= 0 {
		return 30 * time.Second
	}
	return c.UDPTimeout
}

// poolSlot makes a flow's socket a pooled one. Owned by the flow's loop.
type poolSlot struct {
	pool *udpPool
	// busy: checked out by the client of the flow's key, until deadline.
	busy     bool
	deadline time.Time
}

// poolKey names a pool: the endpoint its sockets are connected to, and
// the address they dial it from, a client's (a transparent socket, for a
// client whose address its backend sees) or, when not valid, the node's.
type poolKey struct {
	backend netip.AddrPort
	from    netip.Addr
}

// udpPool is a loop's sockets connected to one endpoint from one
// address. Owned by the loop.
type udpPool struct {
	key  poolKey
	idle []*udpFlow // oldest first
	open int        // sockets, idle or busy
	used time.Time  // the last checkout
}

// recentQuery is a client's last query: where it went, and when.
type recentQuery struct {
	at      time.Time
	backend *balancer.Backend
	svc     *Listener
	orig    netip.AddrPort
	// answered: an auto port's query, remembered at its reply (at). long:
	// the client sent again within longFlowWindow of it.
	answered, long bool
}

// loopPools is an event loop's UDP socket pools and the queries they
// carry. Owned by the loop.
type loopPools struct {
	p      *Engine
	byAddr map[poolKey]*udpPool
	busy   map[*udpFlow]struct{} // the checked-out sockets
	// pending: the checked-out sockets of UDPAuto ports, by client.
	pending map[flowKey]*udpFlow
	// recent and older remember clients' last queries, for the UDP
	// timeout at most: a client goes into recent, which becomes older, and
	// older is emptied, when recent is full. A client's next datagram
	// needs no new look at conntrack (Config.UDPOriginalDst), as a flow's
	// does not; an auto port's client that sends again within
	// longFlowWindow of its reply is a long flow.
	recent, older map[flowKey]recentQuery
	nextTick      time.Time
}

// udpPools returns the loop's pools, creating them on first use. On the
// loop.
func (lf *loopFlows) udpPools(p *Engine) *loopPools {
	if lf.pools == nil {
		lf.pools = &loopPools{
			p:       p,
			byAddr:  map[poolKey]*udpPool{},
			busy:    map[*udpFlow]struct{}{},
			pending: map[flowKey]*udpFlow{},
			recent:  map[flowKey]recentQuery{},
			older:   map[flowKey]recentQuery{},
		}
	}
	return lf.pools
}

// pooledFlow looks at a datagram of key that has no flow in the table,
// read on event loop el (nil: none): if key's query is still out on an
// auto port, the client is a long flow, and its query's socket becomes
// the flow's, which is returned. Otherwise rq is key's last query, if it
// is remembered: its destination holds for this datagram, and if rq.long
// the datagram starts a flow to the same backend. On the loop.
func (ur *udpRelay) pooledFlow(el *eventLoop, key flowKey) (f *udpFlow, rq *recentQuery) {
	if el == nil || el.pools == nil {
		return nil, nil
	}
	lp := el.pools
	if len(lp.pending) > 0 {
		if f := lp.pending[key]; f != nil && ur.keepAsFlow(f) {
			return f, nil
		}
	}
	if len(lp.recent) == 0 && len(lp.older) == 0 {
		return nil, nil
	}
	return nil, lp.lookup(key, time.Now())
}

// keepAsFlow takes a checked-out socket out of its pool and makes it the
// flow of its query's client, in the flow table. It keeps the backend it
// holds (Acquire) until the flow ends. False if the socket is closing,
// its place taken by another port's query (reclaim): the client's
// datagram is then a new query. On the loop.
func (ur *udpRelay) keepAsFlow(f *udpFlow) bool {
	if !ur.fair.returned(f) {
		return false
	}
	lp := f.loop.pools
	delete(lp.pending, f.key)
	delete(lp.busy, f)
	f.slot.pool.open--
	ur.poolOpen.Add(-1)
	f.pm.poolSockets(-1)
	f.slot = nil
	f.pm.pooled(PoolLongFlow)
	f.refreshed.Store(flowClock())
	f.pm.flowOpened()
	if ended, of := ur.addFlow(f, f.share); ended {
		ur.flowEnded(f.pm, f.svc.Name, of)
	}
	return true
}

// lookup returns key's last query, if it is younger than the UDP
// timeout; it forgets a query that makes the client a long flow.
func (lp *loopPools) lookup(key flowKey, now time.Time) *recentQuery {
	for _, m := range [2]map[flowKey]recentQuery{lp.recent, lp.older} {
		rq, ok := m[key]
		if !ok {
			continue
		}
		age := now.Sub(rq.at)
		switch {
		case age >= lp.p.cfg.udpTimeout():
			delete(m, key)
			return nil
		case rq.answered && age < longFlowWindow:
			delete(m, key)
			rq.long = true
		}
		return &rq
	}
	return nil
}

// remember records key's query.
func (lp *loopPools) remember(key flowKey, rq recentQuery) {
	if len(lp.recent) >= maxRecent {
		lp.older, lp.recent = lp.recent, lp.older
		clear(lp.recent)
	}
	lp.recent[key] = rq
}

// recentBackend returns the backend of rq, a client's answered query,
// if it still serves set; long says whether there was such a query: the
// client's datagram is then a long flow's.
func (rq *recentQuery) recentBackend(snap *Snapshot, set balancer.Balancer) (b *balancer.Backend, long bool) {
	if rq == nil || !rq.long {
		return nil, false
	}
	if rq.backend.Ejected() || !snap.serves(set, rq.backend) {
		return nil, true
	}
	return rq.backend, true
}

// checkout sends key's query, to the service port of snapshot snap,
// through a socket of b's pool on event loop el, which it returns; ok is
// false if the query cannot be pooled (no event loop, pooling off, a
// port of UDPFlow mode). On the loop.
func (ur *udpRelay) checkout(el *eventLoop, l *Listener, snap *Snapshot, key flowKey, sock udpSocket, orig netip.AddrPort, b *balancer.Backend, from netip.Addr) (f *udpFlow, ok bool, err error) {
	p := ur.e
	mode, pm, share := snap.UDPMode, snap.Metrics, ur.fair.of(snap.Slots)
	size := p.cfg.udpPoolSize()
	if el == nil || size == 0 || mode == UDPFlow {
		return nil, false, nil
	}
	lp := el.udpPools(p)
	pk := poolKey{backend: b.Addr, from: from}
	pool := lp.byAddr[pk]
	if pool == nil {
		pool = &udpPool{key: pk}
		lp.byAddr[pk] = pool
	}
	now := time.Now()
	pool.used = now
	for f == nil && len(pool.idle) > 0 {
		f = pool.idle[0]
		pool.idle[0] = nil
		pool.idle = pool.idle[1:]
		if f.closed.Load() {
			f = nil // failed while idle (slotReady): the loop closed it
		}
	}
	if f == nil {
		if f, err = ur.openSlot(el, pool, b, pm, share); err != nil {
			return nil, true, err
		}
	}
	f.key, f.svc, f.orig, f.backend, f.dst, f.sock, f.pm = key, l, orig, b, key.dst, sock, pm
	f.slot.busy, f.slot.deadline = true, now.Add(p.cfg.udpQueryTimeout())
	b.Acquire()
	lp.busy[f] = struct{}{}
	ur.fair.checkedOut(f, share)
	if mode == UDPAuto {
		lp.pending[key] = f
	} else {
		lp.remember(key, recentQuery{at: now, backend: b, svc: l, orig: orig})
	}
	if lp.nextTick.IsZero() {
		lp.nextTick = now.Add(ur.poolTick())
	}
	pm.pooled(PoolSent)
	pm.backend(b).connected()
	return f, true, nil
}

// openSlot opens a socket for pool, for a query of the service port
// share, within the pool's bound and the port's share of the engine's,
// and puts it on loop el.
func (ur *udpRelay) openSlot(el *eventLoop, pool *udpPool, b *balancer.Backend, pm *PortMetrics, share *ConnSlots) (*udpFlow, error) {
	p := ur.e
	if pool.open >= p.cfg.udpPoolSize() || !ur.takePlace(el, pool, share) {
		pm.pooled(PoolDropped)
		return nil, errPoolFull
	}
	start := pm.dialStart()
	fd, err := rawDial(unix.SOCK_DGRAM, b.Addr, netip.AddrPortFrom(pool.key.from, 0), p.cfg.OwnMark)
	pm.dialDone(start, err)
	if err != nil {
		ur.poolOpen.Add(-1)
		if !localDialFailure(err) {
			p.health.Failure(b)
		}
		pm.backend(b).failed()
		return nil, fmt.Errorf("dial %s: %w", b.Addr, err)
	}
	pool.open++
	f := &udpFlow{p: p, fd: fd, loop: el, backend: b, slot: &poolSlot{pool: pool}}
	el.addFlow(f)
	if f.closed.Load() { // the loop could not watch it (udpFailed)
		return nil, fmt.Errorf("watching a pooled socket to %s: %w", b.Addr, net.ErrClosed)
	}
	f.pm = pm
	pm.poolSockets(1)
	return f, nil
}

// takePlace counts a new pooled socket on loop el, for pool and a query
// of the service port share, against the engine's bound; false if the
// query is to be dropped. At the bound an idle socket of another pool on
// the loop gives way, or else, if share holds less than its share of
// the bound, the oldest checked-out socket of the port with the most
// (udpfair.go).
func (ur *udpRelay) takePlace(el *eventLoop, pool *udpPool, share *ConnSlots) bool {
	limit := ur.e.cfg.udpPoolMax()
	if ur.poolOpen.Add(1) <= limit {
		return true
	}
	ur.poolOpen.Add(-1)
	// Pools of many source addresses could hold the engine's bound in
	// idle sockets: one gives way, on this loop, to a query that needs a
	// socket now.
	if el.closeIdleSlot(pool) {
		if ur.poolOpen.Add(1) <= limit {
			return true
		}
		ur.poolOpen.Add(-1) // another loop took it
	}
	f := ur.fair.reclaim(share, limit)
	if f == nil {
		return false
	}
	f.pm.pooled(PoolDropped)
	if f.loop == el {
		f.closed.Store(true)
		el.dropFlow(f)
	} else if f.closed.CompareAndSwap(false, true) {
		// Only its loop closes its descriptor; the engine holds one
		// socket past its bound until it does.
		f.drop()
	}
	ur.poolOpen.Add(1)
	return true
}

// poolTick is how often a loop looks for queries past their timeout and
// pools to close.
func (ur *udpRelay) poolTick() time.Duration {
	p := ur.e
	return min(max(p.cfg.udpQueryTimeout()/8, 10*time.Millisecond), time.Second)
}

// slotReady relays the reply on a pooled socket to the client of its
// query, and returns the socket to its pool; it drops what arrives on an
// idle one. On the loop.
func (lf *loopFlows) slotReady(f *udpFlow) {
	l := lf.loop
	r := lf.recv
	for read := 0; read < flowBudget; read += len(r.hdrs) {
		if f.closed.Load() {
			return
		}
		n, err := r.receive(f.fd)
		switch {
		case err == unix.EAGAIN:
			return
		case err != nil:
			// ECONNREFUSED after an ICMP port unreachable (udp(7)).
			f.p.udpFailed(f, os.NewSyscallError("recvmmsg", err))
			return
		}
		if f.slot.busy {
			for i := range n {
				f.p.queueReply(f, lf.replies, r.datagram(i))
			}
			lf.checkin(f)
		}
		if n < len(r.hdrs) {
			return
		}
	}
	// Edge-triggered: what is left raises no new event (flowReady).
	l.post(func() { lf.flowReady(f) })
}

// checkin returns f, whose query got its reply, to its pool, unless
// another port's query took its place (reclaim): the drop that query's
// loop posted closes it. On the loop.
func (lf *loopFlows) checkin(f *udpFlow) {
	lp := lf.pools
	f.slot.busy = false
	delete(lp.busy, f)
	if lp.pending[f.key] == f {
		delete(lp.pending, f.key)
		lp.remember(f.key, recentQuery{at: time.Now(), backend: f.backend, svc: f.svc, orig: f.orig, answered: true})
	}
	f.backend.Release()
	if f.p.fair.returned(f) {
		f.slot.pool.idle = append(f.slot.pool.idle, f)
	}
}

// release lets go of what f's socket held, as the loop closes it
// (dropFlow): the backend a flow or a checked-out socket holds, and a
// pooled socket's place in its pool. An idle pooled socket is out of the
// pool's idle list already (reap), or the loop is stopping. On the loop.
func (f *udpFlow) release() {
	s := f.slot
	if s == nil {
		f.backend.Release()
		return
	}
	lp := f.loop.pools
	delete(lp.busy, f)
	if lp.pending[f.key] == f {
		delete(lp.pending, f.key)
	}
	s.pool.open--
	f.p.poolOpen.Add(-1)
	f.pm.poolSockets(-1)
	if s.busy {
		s.busy = false
		f.p.fair.returned(f)
		f.backend.Release()
	}
}

// closeIdleSlot closes the oldest idle socket of the loop's pool, other
// than except, that was used least recently, and reports whether there
// was one. On the loop.
func (lf *loopFlows) closeIdleSlot(except *udpPool) bool {
	lp := lf.pools
	if lp == nil {
		return false
	}
	var victim *udpPool
	for _, pool := range lp.byAddr {
		if pool != except && len(pool.idle) > 0 && (victim == nil || pool.used.Before(victim.used)) {
			victim = pool
		}
	}
	if victim == nil {
		return false
	}
	f := victim.idle[0]
	victim.idle[0] = nil
	victim.idle = victim.idle[1:]
	f.closed.Store(true)
	lf.dropFlow(f)
	return true
}

// tickPools ends the queries past their timeout, closing their sockets
// (a late reply must not reach the socket's next client), and closes the
// idle sockets of pools that had no query for the UDP timeout. On the
// loop, once per turn.
func (lf *loopFlows) tickPools() {
	lp := lf.pools
	if lp == nil || lp.nextTick.IsZero() {
		return
	}
	now := time.Now()
	if now.Before(lp.nextTick) {
		return
	}
	p := lp.p
	for f := range lp.busy {
		if now.Before(f.slot.deadline) {
			continue
		}
		if f.closed.CompareAndSwap(false, true) { // else closed by a failure, or for another port's query (reclaim)
			f.pm.pooled(PoolTimedOut)
		}
		lf.dropFlow(f)
	}
	for addr, pool := range lp.byAddr {
		if now.Sub(pool.used) < p.cfg.udpTimeout() {
			continue
		}
		idle := pool.idle
		pool.idle = nil
		for _, f := range idle {
			f.closed.Store(true)
			lf.dropFlow(f)
		}
		if pool.open == 0 {
			delete(lp.byAddr, addr)
		}
	}
	lp.nextTick = time.Time{}
	if len(lp.busy) > 0 || len(lp.byAddr) > 0 {
		lp.nextTick = now.Add(p.poolTick())
	}
}

// poolDeadline returns the earlier of next and the loop's next pool
// tick; zero times mean none.
func (lf *loopFlows) poolDeadline(next time.Time) time.Time {
	if lf.pools == nil {
		return next
	}
	if d := lf.pools.nextTick; !d.IsZero() && (next.IsZero() || d.Before(next)) {
		return d
	}
	return next
}
