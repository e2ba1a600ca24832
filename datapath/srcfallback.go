package datapath

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
	"github.com/vishvananda/netlink"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// A connection that keeps the client's address (KeepClient) dials its
// backend from that address. The backend's replies then go to the
// client's address, and reach the proxy's socket only if they pass
// through the node's IP layer, where the rules mark them for local
// delivery (redirect.Replies, and tproxy mode's own rules). Routed
// replies do: a backend on another node answers through the client's
// node, a pod on a link of its own through the node. A backend on the
// client's own Linux bridge (flannel, the bridge CNI, kubenet) answers
// the client directly: with br_netfilter, the rules take that reply off
// the bridge and up to the IP layer (Config.BridgedReplies); without
// it, the client drops the SYN-ACK of a connection it never opened, and
// the dial would time out. So uproxy keeps the client's address wherever
// the replies come back, and elsewhere dials from the node's address. A
// dial from the client's address that gets no reply is retried from the
// node's only for a client behind a gateway (fallBack): for a pod of
// this node the silence is the backend's policy, and the retry would
// get around it.

// Reasons of uproxy_source_ip_fallbacks_total.
const (
	// fallbackNone: the attempt dials from the client's address, or the
	// service port does not ask to keep it.
	fallbackNone = iota
	// fallbackSameSegment: the node's routes put the client and the
	// backend on the same link with no gateway, and the rules cannot
	// take the backend's replies off it (not a bridge whose frames
	// pass iptables, or Config.BridgedReplies not set).
	fallbackSameSegment
	// fallbackNoReply: a dial from the client's address got no SYN-ACK,
	// on this connection or recently for the same client and backend.
	fallbackNoReply
	// fallbackTransparentError: the socket could not be made to dial
	// from the client's address (IP_TRANSPARENT or bind refused: a
	// missing capability, or the address's ports exhausted).
	fallbackTransparentError
	numFallbackReasons
)

var fallbackReasonNames = [numFallbackReasons]string{"", "same_segment", "no_reply", "transparent_error"}

// FallbackReasons returns the reason label of each of
// PortCounters.SourceFallbacks; the first, for none, is empty.
func FallbackReasons() [numFallbackReasons]string { return fallbackReasonNames }

const (
	// segmentTTL bounds how long a route lookup is trusted: routes and
	// links change with pods, and a stale answer costs at worst one
	// connection's dial timeout (fallbackNoReply) or one client address.
	segmentTTL = 10 * time.Second
	// noReplyTTL is how long a client and backend whose transparent dial
	// got no reply are dialled from the node's address without trying
	// the client's again: long enough that the wait is rare, short enough
	// that a fixed network is noticed.
	noReplyTTL = 5 * time.Minute
	// maxSourceEntries bounds each cache: past it, the least recently
	// used entry makes room.
	maxSourceEntries = 16384
)

// segment is where the node's routes send an address.
type segment struct {
	// link is the output interface's index; zero when unknown.
	link int
	// direct: the route is a unicast route with no gateway, so the node
	// delivers to the address over link's L2 segment itself.
	direct bool
	// bridged: link is a Linux bridge whose frames br_netfilter hands to
	// iptables (bridge-nf-call-iptables, or -ip6tables, is 1).
	bridged bool
}

// local reports whether the node reaches the address directly over one
// of its links, with no gateway: a pod of this node, on its bridge or a
// veth of its own, whose replies come back through the node.
func (s segment) local() bool { return s.direct && s.link != 0 }

// sameSegment reports whether the node reaches a and b directly over the
// same link, so that b's replies to a never pass through the node.
func sameSegment(a, b segment) bool {
	return a.direct && b.direct && a.link != 0 && a.link == b.link
}

// routeSegment asks the kernel's routing tables where the node sends
// packets for addr (ip route get).
func routeSegment(addr netip.Addr) (segment, error) {
	routes, err := netlink.RouteGet(net.IP(addr.Unmap().AsSlice()))
	if err != nil {
		return segment{}, err
	}
	if len(routes) == 0 {
		return segment{}, nil
	}
	r := routes[0]
	seg := segment{
		link:   r.LinkIndex,
		direct: r.Type == unix.RTN_UNICAST && r.Gw == nil && r.Via == nil && len(r.MultiPath) == 0,
	}
	if seg.direct && seg.link != 0 {
		if l, err := netlink.LinkByIndex(seg.link); err == nil && l.Type() == "bridge" {
			seg.bridged = bridgeCallsIPTables(addr.Unmap().Is6())
		}
	}
	return seg, nil
}

// bridgeCallsIPTables reports whether br_netfilter hands bridged frames
// of the family to iptables (or ip6tables) in the proxy's network
// namespace.
func bridgeCallsIPTables(v6 bool) bool {
	name := "/proc/sys/net/bridge/bridge-nf-call-iptables"
	if v6 {
		name = "/proc/sys/net/bridge/bridge-nf-call-ip6tables"
	}
	b, err := os.ReadFile(name)
	return err == nil && len(b) > 0 && b[0] == '1'
}

// routePair is what a source decision needs to know: the routes to the
// client and to the backend.
type routePair struct{ client, backend segment }

// routeWaiter hears the routes that a decision on an event loop waited
// for (sourceKeeper.await). routed runs once, on the resolver's
// goroutine or await's caller, and must not block: an event loop's
// posts the rest of the decision back to the loop.
type routeWaiter interface{ routed(routePair) }

// routeCh is the routeWaiter of a goroutine that waits (sourceKeeper.wait).
type routeCh chan routePair

func (c routeCh) routed(r routePair) { c <- r }

// sourceKeeper decides which address each attempt that keeps the client's
// dials from, and remembers what it learnt: the route lookups per
// address, and the client and backend pairs whose transparent dial got no
// reply. Its zero value is ready to use; it is safe for concurrent use by
// every connection's dialler (goroutines and event loops).
//
// A route lookup is a netlink round trip, which an event loop must not
// wait for: the loop's other connections would wait with it. So lookups
// are made by the keeper's resolver goroutine only, once per address per
// segmentTTL, and their answers cached. A decision whose routes are
// cached is made at once (cached); an event loop's that misses asks the
// resolver (await) and finishes the decision when the answer is posted
// back to it; a goroutine waits for the answer (wait). The answer is the
// same as a lookup made on the spot, so the decision is too. The
// resolver goroutine is started by the first lookup asked for and exits
// once none is left to make: it runs only while a lookup is pending, and
// needs no stopping.
type sourceKeeper struct {
	// lookup, when set, replaces routeSegment (tests).
	lookup func(netip.Addr) (segment, error)
	// bridgedReplies: the rules take a backend's replies off a bridge
	// whose frames pass iptables (Config.BridgedReplies).
	bridgedReplies bool
	// size bounds each cache; zero means maxSourceEntries (tests set
	// less).
	size int

	mu       sync.Mutex
	segments *simplelru.LRU[netip.Addr, segmentEntry]
	noReply  *simplelru.LRU[[2]netip.Addr, int64] // (client, backend) → expiry, in Unix nanoseconds
	// pending holds the addresses being looked up, or queued for the
	// resolver (queue, in the order asked), with the decisions that wait
	// for them. resolving: the resolver goroutine runs.
	pending   map[netip.Addr]*pendingRoute
	queue     []netip.Addr
	resolving bool

	logged sync.Map // service ("namespace/name") → struct{}: services whose fallback was logged
}

type segmentEntry struct {
	seg     segment
	expires int64 // Unix nanoseconds: smaller and quicker to compare than a time.Time
}

// pendingRoute is an address queued for the resolver, or being looked up.
type pendingRoute struct {
	// asked is when it was first asked for: the answer is trusted for
	// segmentTTL from then.
	asked time.Time
	waits []*routeWait
}

// routeWait is a decision that waits for the routes to its client and
// backend: missing counts the addresses not answered yet.
type routeWait struct {
	client, backend netip.Addr
	r               routePair
	missing         int
	w               routeWaiter
}

// init creates the caches. Called with mu held.
func (k *sourceKeeper) init() {
	if k.segments != nil {
		return
	}
	size := k.size
	if size <= 0 {
		size = maxSourceEntries
	}
	// NewLRU fails only for a size below one.
	k.segments, _ = simplelru.NewLRU[netip.Addr, segmentEntry](size, nil)
	k.noReply, _ = simplelru.NewLRU[[2]netip.Addr, int64](size, nil)
	k.pending = map[netip.Addr]*pendingRoute{}
}

// fresh returns addr's cached route, if it is still fresh at now.
// Called with mu held.
func (k *sourceKeeper) fresh(now time.Time, addr netip.Addr) (segment, bool) {
	e, ok := k.segments.Get(addr)
	if !ok || now.UnixNano() >= e.expires {
		return segment{}, false
	}
	return e.seg, true
}

// cached returns the routes to client and backend from the cache, and
// the reason of an attempt from one to the other (reason), all under one
// lock, as every connection of a steady client takes it; false when
// either route has to be looked up first (await, wait).
func (k *sourceKeeper) cached(now time.Time, client, backend netip.Addr) (routePair, int, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.init()
	c, cok := k.fresh(now, client)
	b, bok := k.fresh(now, backend)
	if !cok || !bok {
		return routePair{}, fallbackNone, false
	}
	r := routePair{c, b}
	return r, k.reasonLocked(now, client, backend, r), true
}

// wait returns the routes to client and backend, waiting for the
// resolver to look up those that are not cached. For goroutines only:
// an event loop awaits.
func (k *sourceKeeper) wait(now time.Time, client, backend netip.Addr) routePair {
	if r, _, ok := k.cached(now, client, backend); ok {
		return r
	}
	ch := make(routeCh, 1)
	k.await(now, client, backend, ch)
	return <-ch
}

// await has the resolver look up the routes to client and backend that
// are not cached, and hands both to w once it has them; at once, on the
// caller's goroutine, if both are cached by now. A failed lookup is
// cached as an unknown segment: the transparent dial is tried, and a
// missing reply still falls back (fallbackNoReply).
func (k *sourceKeeper) await(now time.Time, client, backend netip.Addr, w routeWaiter) {
	k.mu.Lock()
	k.init()
	rw := &routeWait{client: client, backend: backend, w: w}
	var ok bool
	if rw.r.client, ok = k.fresh(now, client); !ok {
		k.ask(now, client, rw)
	}
	if rw.r.backend, ok = k.fresh(now, backend); !ok && backend != client {
		k.ask(now, backend, rw)
	}
	// Once unlocked, rw is the resolver's to hand over.
	known := rw.missing == 0
	if !known && !k.resolving {
		k.resolving = true
		go k.resolve() // exits once no lookup is pending
	}
	k.mu.Unlock()
	if known {
		w.routed(rw.r)
	}
}

// ask queues addr's lookup for rw, unless it is pending already. Called
// with mu held.
func (k *sourceKeeper) ask(now time.Time, addr netip.Addr, rw *routeWait) {
	rw.missing++
	pr := k.pending[addr]
	if pr == nil {
		pr = &pendingRoute{asked: now}
		k.pending[addr] = pr
		k.queue = append(k.queue, addr)
	}
	pr.waits = append(pr.waits, rw)
}

// resolve is the resolver goroutine: it looks up the queued addresses
// one at a time, caches each answer and hands the decisions that waited
// for it their routes, until the queue is empty.
func (k *sourceKeeper) resolve() {
	lookup := k.lookup
	if lookup == nil {
		lookup = routeSegment
	}
	for {
		k.mu.Lock()
		if len(k.queue) == 0 {
			k.resolving = false
			k.queue = nil
			k.mu.Unlock()
			return
		}
		addr := k.queue[0]
		k.queue = k.queue[1:]
		k.mu.Unlock()

		seg, _ := lookup(addr)

		k.mu.Lock()
		pr := k.pending[addr]
		delete(k.pending, addr)
		k.segments.Add(addr, segmentEntry{seg: seg, expires: pr.asked.Add(segmentTTL).UnixNano()})
		var ready []*routeWait
		for _, rw := range pr.waits {
			if rw.client == addr {
				rw.r.client = seg
			}
			if rw.backend == addr {
				rw.r.backend = seg
			}
			if rw.missing--; rw.missing == 0 {
				ready = append(ready, rw)
			}
		}
		k.mu.Unlock()
		for _, rw := range ready {
			rw.w.routed(rw.r)
		}
	}
}

// reason returns why an attempt from client to backend, whose routes are
// r, cannot keep the client's address, or fallbackNone when it can.
func (k *sourceKeeper) reason(now time.Time, client, backend netip.Addr, r routePair) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.init()
	return k.reasonLocked(now, client, backend, r)
}

// reasonLocked is reason, called with mu held.
func (k *sourceKeeper) reasonLocked(now time.Time, client, backend netip.Addr, r routePair) int {
	if until, known := k.noReply.Get([2]netip.Addr{client, backend}); known && now.UnixNano() < until {
		return fallbackNoReply
	}
	if sameSegment(r.client, r.backend) && !(k.bridgedReplies && r.client.bridged) {
		return fallbackSameSegment
	}
	return fallbackNone
}

// noReplyFrom remembers that client's transparent dials to backend get no
// reply, though the node's own do.
func (k *sourceKeeper) noReplyFrom(now time.Time, client, backend netip.Addr) {
	k.mu.Lock()
	k.init()
	k.noReply.Add([2]netip.Addr{client, backend}, now.Add(noReplyTTL).UnixNano())
	k.mu.Unlock()
}

// firstFallback reports whether svc has not fallen back before, and
// remembers that it has.
func (k *sourceKeeper) firstFallback(svc string) bool {
	_, seen := k.logged.LoadOrStore(svc, struct{}{})
	return !seen
}

// keepSource returns the address to dial backend from, for a flow of
// snap from client: the client's, unless its replies cannot come back
// through the node (reason, from the keeper), then the node's (the zero
// Addr). A fallback is counted and, the first time for the service,
// logged. Used where no dial can time out waiting for a reply (UDP); the
// caller has ruled out the backends always dialled from the node's
// address (nodeBackend).
func (p *Engine) keepSource(snap *Snapshot, client, backend netip.Addr, reason int) netip.Addr {
	if reason == fallbackNone {
		return client
	}
	p.sourceFellBack(snap, reason, client, backend)
	return netip.Addr{}
}

// sourceFellBack counts a connection or flow dialled from the node's
// address though its service port asks to keep the client's, and logs the
// first of each service.
func (p *Engine) sourceFellBack(snap *Snapshot, reason int, client, backend netip.Addr) {
	snap.Metrics.sourceFallback(reason)
	if p.src.firstFallback(snap.Service) {
		p.log.Info("the client's address cannot be kept for this backend, so uproxy dials it from the node's address (the PROXY protocol header, if the service asks for one, still carries the client's); logged once per service, counted in uproxy_source_ip_fallbacks_total",
			zap.Stringer("servicePort", snap.Name), zap.String("reason", fallbackReasonNames[reason]),
			zap.Stringer("client", client), zap.Stringer("backend", backend))
	}
}

// nodeBackend reports whether backend is dialled from the node's address
// though the connection or flow from client would keep the client's:
// when it is the client itself (a hairpin, which kube-proxy masquerades;
// a socket cannot connect to its own address and port, and the client
// would see its own address answer), or one of the node's own addresses
// (a host-network endpoint on this node), whose replies the node sends
// from its own sockets, through OUTPUT, where no rule of uproxy's can
// turn them back to the dialling socket. NetworkPolicy does not select
// host-network pods, so their seeing the node loses it nothing.
func (p *Engine) nodeBackend(client, backend netip.Addr) bool {
	backend = backend.Unmap()
	return backend == client || p.clients != nil && p.clients.Node(backend)
}

// srcAttempt is a TCP connection's state of keeping the client's address.
type srcAttempt struct {
	// keep is the client's address and port, to dial from when the
	// connection keeps the client's address (KeepClient); the zero
	// AddrPort otherwise.
	keep netip.AddrPort
	// local: the node reaches the client directly, over one of its own
	// links (a pod of this node, on its bridge or a veth of its own), so
	// the backend's replies to it come back through the node (fallBack).
	// Set from the routes of the attempt's source choice (sourceRouted).
	local bool
	// reason is why the current attempt dials from the node's address
	// though keep is set (fallbackNone: it does not).
	reason int
	// retry, when not fallbackNone, is why the current backend's
	// transparent attempt failed: the next attempt dials it again from
	// the node's address.
	retry int
	// timedOut: the current attempt is such a retry after a transparent
	// dial timed out, which the connection, if it works, teaches the
	// sourceKeeper (noReplyFrom).
	timedOut bool
	// anyPort: the client's port was taken for the backend (another
	// connection of the client's, or the last attempt's socket, holds
	// the same addresses and ports; the connect, synchronous or on the
	// ring, failed with EADDRNOTAVAIL): the next attempt dials the same
	// backend from the client's address and a port the kernel picks.
	anyPort bool
}

// chooseSource sets the address the attempt at d.b dials from (d.from):
// the client's when the connection keeps it and the backend's replies
// come back through the node, else the node's (nodeBackend for the
// backends that are always dialled from it). The choice needs the routes
// to the client and the backend: a goroutine's dial waits for those not
// cached; an event loop's (d.loop set) does not, and chooseSource
// returns false: the resolver posts the routes to the loop, which
// finishes the choice (sourceRouted) and dials (loopTCP.routed).
func (d *tcpDial) chooseSource() bool {
	d.from, d.src.reason, d.src.timedOut = d.src.keep, fallbackNone, false
	if !d.src.keep.IsValid() {
		return true
	}
	client, backend := d.src.keep.Addr(), d.b.Addr.Addr()
	if d.p.nodeBackend(client, backend) {
		d.from = netip.AddrPort{}
		return true
	}
	now := d.p.cfg.clock().Now()
	r, reason, ok := d.p.src.cached(now, client, backend)
	switch {
	case !ok && d.loop != nil:
		d.p.src.await(now, client, backend, d)
		return false
	case !ok:
		r = d.p.src.wait(now, client, backend)
		reason = d.p.src.reason(now, client, backend, r)
	}
	d.sourceChosen(r, reason)
	return true
}

// sourceRouted finishes chooseSource with r, the routes to the client
// and the backend, once the resolver has them.
func (d *tcpDial) sourceRouted(r routePair) {
	d.sourceChosen(r, d.p.src.reason(d.p.cfg.clock().Now(), d.src.keep.Addr(), d.b.Addr.Addr(), r))
}

// sourceChosen sets the attempt's source from r, the routes to the
// client and the backend, and reason, the keeper's decision with them.
func (d *tcpDial) sourceChosen(r routePair, reason int) {
	d.src.local = r.client.local()
	if reason != fallbackNone {
		d.from, d.src.reason = netip.AddrPort{}, reason
	}
}

// routed posts the routes chooseSource waited for to the event loop that
// dials, which goes on with the attempt (loopTCP.routed). If the loop is
// stopping, the session ends with it.
func (d *tcpDial) routed(r routePair) {
	l, ls := d.loop, d.ls
	l.post(func() { l.routed(ls, r) })
}

// retryFromNode returns the backend whose transparent attempt just
// failed (fallBack), to dial again from the node's address, or from the
// client's with another port when its own was taken; false when there
// is none. The retry is not an attempt of its own (dialAttempts):
// it is the same attempt, from another address.
func (d *tcpDial) retryFromNode() (netip.AddrPort, bool) {
	if d.src.anyPort {
		d.src.anyPort = false
		d.from = netip.AddrPortFrom(d.src.keep.Addr(), 0)
		return d.b.Addr, true
	}
	if d.src.retry == fallbackNone {
		return netip.AddrPort{}, false
	}
	d.from, d.src.reason, d.src.retry = netip.AddrPort{}, d.src.retry, fallbackNone
	d.src.timedOut = d.src.reason == fallbackNoReply
	return d.b.Addr, true
}

// fallBack reports whether the failed attempt at d.b is retried from the
// node's address before it counts as failed: a dial from the client's
// address that could not take that address, or that timed out
// (transparentFailure), unless the node reaches the client directly. The
// replies to such a client (a pod of this node) come back through the
// node, and a reply bridged to it is taken off the bridge
// (Config.BridgedReplies; where it cannot be, chooseSource dials from
// the node's address in the first place), so its dial that times out
// was dropped on its way: by the backend's NetworkPolicy, most often,
// which a retry from the node's address would get around. The client
// waits, as it would under kube-proxy. A client behind a gateway (a pod
// of another node reaching a node port, a host beyond a router) may
// have its replies routed past the node, and is retried. d.b stays
// acquired for the retry (retryFromNode). A backend that fails from the
// node's address too is a real failure.
func (d *tcpDial) fallBack(err error) bool {
	if !d.fromClient() {
		return false
	}
	if d.from.Port() != 0 && (errors.Is(err, unix.EADDRNOTAVAIL) || errors.Is(err, unix.EADDRINUSE)) {
		d.src.anyPort = true
		return true
	}
	d.src.retry = transparentFailure(err)
	if d.src.retry == fallbackNoReply && d.src.local {
		d.src.retry = fallbackNone
	}
	return d.src.retry != fallbackNone
}

// fromClient reports whether the current attempt dials from the
// client's address.
func (d *tcpDial) fromClient() bool {
	return d.from.IsValid() && d.src.keep.IsValid() && d.from.Addr() == d.src.keep.Addr()
}

// sourceConnected records, once the attempt at d.b connected, a fallback
// that made it: counted, logged once per service, and after a dial that
// timed out remembered, so that the client's next connections to the
// backend do not wait for a reply that will not come. Only a timeout
// teaches it, so the pair is tried again from the client's address once
// noReplyTTL has passed.
func (d *tcpDial) sourceConnected() {
	if d.src.reason == fallbackNone {
		return
	}
	if d.src.timedOut {
		d.p.src.noReplyFrom(d.p.cfg.clock().Now(), d.src.keep.Addr(), d.b.Addr.Addr())
	}
	d.p.sourceFellBack(d.snap, d.src.reason, d.src.keep.Addr(), d.b.Addr.Addr())
}

// transparentFailure returns why a dial from the client's address that
// failed with err may work from the node's: it timed out (the event
// loops' deadline, or the dialer's context), the sign of a SYN-ACK that
// went elsewhere; or the socket could not take the client's address. Any
// other error is the backend's, and fallbackNone.
func transparentFailure(err error) int {
	var se *os.SyscallError
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded) || isNetTimeout(err):
		return fallbackNoReply
	case errors.As(err, &se) && se.Syscall == "bind",
		errors.Is(err, unix.EPERM), errors.Is(err, unix.EACCES), errors.Is(err, unix.EADDRNOTAVAIL), errors.Is(err, unix.EADDRINUSE):
		return fallbackTransparentError
	}
	return fallbackNone
}
