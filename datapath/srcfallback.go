package datapath

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// preserve-source-ip dials a backend from the client's own address (tproxy
// mode). The backend's replies then go to the client's address, and come
// back to uproxy only if they pass through the node. When the client and
// the backend share one of the node's L2 segments (two pods on one Linux
// bridge, as flannel and the bridge CNI attach them), the backend reaches
// the client directly, the client drops the SYN-ACK of a connection it
// never opened, and the dial times out. A bridge rule could send
// those replies up to the node's IP layer, but one on addresses and ports
// cannot tell them from the pods' own connections, and the bridge is the
// CNI's, not uproxy's. So uproxy keeps the client's address wherever the replies
// come back through the node, and elsewhere dials from the node's address:
// the annotation is a request, never a reason to fail a connection.

// Reasons of uproxy_source_ip_fallbacks_total.
const (
	// fallbackNone: the attempt dials from the client's address, or the
	// service port does not ask to keep it.
	fallbackNone = iota
	// fallbackSameSegment: the node's routes put the client and the
	// backend on the same link with no gateway.
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
	// maxSourceEntries bounds each cache; a full cache starts over.
	maxSourceEntries = 16384
)

// segment is where the node's routes send an address.
type segment struct {
	// link is the output interface's index; zero when unknown.
	link int
	// direct: the route is a unicast route with no gateway, so the node
	// delivers to the address over link's L2 segment itself.
	direct bool
}

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
	return segment{
		link:   r.LinkIndex,
		direct: r.Type == unix.RTN_UNICAST && r.Gw == nil && r.Via == nil && len(r.MultiPath) == 0,
	}, nil
}

// sourceKeeper decides which address each preserve-source-ip attempt
// dials from, and remembers what it learnt: the route lookups per
// address, and the client and backend pairs whose transparent dial got no
// reply. Its zero value is ready to use; it is safe for concurrent use by
// every connection's dialler (goroutines and event loops). A steady
// connection rate costs two map reads under a read lock; a route lookup
// (a netlink round trip) happens once per address per segmentTTL.
type sourceKeeper struct {
	// lookup, when set, replaces routeSegment (tests).
	lookup func(netip.Addr) (segment, error)

	mu       sync.RWMutex
	segments map[netip.Addr]segmentEntry
	noReply  map[[2]netip.Addr]time.Time // (client, backend) → expiry

	logged sync.Map // service ("namespace/name") → struct{}: services whose fallback was logged
}

type segmentEntry struct {
	seg     segment
	expires time.Time
}

// reason returns why an attempt from client to backend cannot keep the
// client's address, or fallbackNone when it can.
func (k *sourceKeeper) reason(now time.Time, client, backend netip.Addr) int {
	k.mu.RLock()
	until, known := k.noReply[[2]netip.Addr{client, backend}]
	c, cok := k.segments[client]
	b, bok := k.segments[backend]
	k.mu.RUnlock()
	if known && now.Before(until) {
		return fallbackNoReply
	}
	if !cok || !now.Before(c.expires) {
		c = k.learn(now, client)
	}
	if !bok || !now.Before(b.expires) {
		b = k.learn(now, backend)
	}
	if sameSegment(c.seg, b.seg) {
		return fallbackSameSegment
	}
	return fallbackNone
}

// learn looks up addr's route and caches it. A failed lookup is cached as
// an unknown segment: the transparent dial is tried, and a missing reply
// still falls back (fallbackNoReply).
func (k *sourceKeeper) learn(now time.Time, addr netip.Addr) segmentEntry {
	lookup := k.lookup
	if lookup == nil {
		lookup = routeSegment
	}
	seg, _ := lookup(addr)
	e := segmentEntry{seg: seg, expires: now.Add(segmentTTL)}
	k.mu.Lock()
	if k.segments == nil || len(k.segments) >= maxSourceEntries {
		k.segments = map[netip.Addr]segmentEntry{}
	}
	k.segments[addr] = e
	k.mu.Unlock()
	return e
}

// noReplyFrom remembers that client's transparent dials to backend get no
// reply, though the node's own do.
func (k *sourceKeeper) noReplyFrom(now time.Time, client, backend netip.Addr) {
	k.mu.Lock()
	if k.noReply == nil || len(k.noReply) >= maxSourceEntries {
		k.noReply = map[[2]netip.Addr]time.Time{}
	}
	k.noReply[[2]netip.Addr{client, backend}] = now.Add(noReplyTTL)
	k.mu.Unlock()
}

// firstFallback reports whether svc has not fallen back before, and
// remembers that it has.
func (k *sourceKeeper) firstFallback(svc string) bool {
	_, seen := k.logged.LoadOrStore(svc, struct{}{})
	return !seen
}

// keepSource returns the address to dial backend from, for a flow or
// connection of sp from client: the client's, unless its replies cannot
// come back through the node, then the node's (the zero Addr). A fallback
// is counted and, the first time for the service, logged. Used where no
// dial can time out waiting for a reply (UDP).
func (p *Engine) keepSource(snap *Snapshot, client, backend netip.Addr) netip.Addr {
	r := p.src.reason(p.cfg.clock().Now(), client, backend)
	if r == fallbackNone {
		return client
	}
	p.sourceFellBack(snap, r, client, backend)
	return netip.Addr{}
}

// sourceFellBack counts a connection or flow dialled from the node's
// address though its service port asks to keep the client's, and logs the
// first of each service.
func (p *Engine) sourceFellBack(snap *Snapshot, reason int, client, backend netip.Addr) {
	snap.Metrics.sourceFallback(reason)
	if p.src.firstFallback(snap.Service) {
		p.log.Info("preserve-source-ip: the client's address cannot be kept for this backend, so uproxy dials it from the node's address (the PROXY protocol header, if the service asks for one, still carries the client's); logged once per service, counted in uproxy_source_ip_fallbacks_total",
			zap.Stringer("servicePort", snap.Name), zap.String("reason", fallbackReasonNames[reason]),
			zap.Stringer("client", client), zap.Stringer("backend", backend))
	}
}

// srcAttempt is a TCP connection's state of preserve-source-ip.
type srcAttempt struct {
	// keep is the client's address, to dial from when the service port
	// asks to keep it (tproxy mode); the zero Addr otherwise.
	keep netip.Addr
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
}

// chooseSource sets the address the attempt at d.b dials from (d.from):
// the client's when the service port asks to keep it and the backend's
// replies come back through the node, else the node's.
func (d *tcpDial) chooseSource() {
	d.from, d.src.reason, d.src.timedOut = d.src.keep, fallbackNone, false
	if !d.src.keep.IsValid() {
		return
	}
	if r := d.p.src.reason(d.p.cfg.clock().Now(), d.src.keep, d.b.Addr.Addr()); r != fallbackNone {
		d.from, d.src.reason = netip.Addr{}, r
	}
}

// retryFromNode returns the backend whose transparent attempt just
// failed (fallBack), to dial again from the node's address; false when
// there is none. The retry is not an attempt of its own (dialAttempts):
// it is the same attempt, from another address.
func (d *tcpDial) retryFromNode() (netip.AddrPort, bool) {
	if d.src.retry == fallbackNone {
		return netip.AddrPort{}, false
	}
	d.from, d.src.reason, d.src.retry = netip.Addr{}, d.src.retry, fallbackNone
	d.src.timedOut = d.src.reason == fallbackNoReply
	return d.b.Addr, true
}

// fallBack reports whether the failed attempt at d.b is retried from the
// node's address before it counts as failed: a dial from the client's
// address that timed out or could not take that address
// (transparentFailure). d.b stays acquired for the retry (retryFromNode).
// A backend that fails from the node's address too is a real failure.
func (d *tcpDial) fallBack(err error) bool {
	if !d.from.IsValid() || d.from != d.src.keep {
		return false
	}
	d.src.retry = transparentFailure(err)
	return d.src.retry != fallbackNone
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
		d.p.src.noReplyFrom(d.p.cfg.clock().Now(), d.src.keep, d.b.Addr.Addr())
	}
	d.p.sourceFellBack(d.snap, d.src.reason, d.src.keep, d.b.Addr.Addr())
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
