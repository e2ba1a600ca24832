// Package balancer owns the choice of a backend for each new connection: the
// balancing algorithms, session affinity and passive-health ejection.
//
// It is a leaf package: it imports only the standard library. The proxy
// builds one Balancer per service port from the port's ready endpoints and
// swaps it atomically when they change; a Balancer is therefore immutable
// over its backend list, and all mutable per-backend state (active
// connection counts, passive-health ejection) lives in *Backend values that
// the proxy keeps across rebuilds.
package balancer

import (
	"fmt"
	"net/netip"
	"slices"
	"sync/atomic"
)

// Balancer picks a backend for a new connection.
//
// Implementations are safe for concurrent use by any number of goroutines,
// never modify the backend slice they were built from, and Pick does not
// allocate.
type Balancer interface {
	// Pick returns the backend for a new connection from client, or nil
	// when the balancer has no backends. It prefers backends that are not
	// ejected; when every backend is ejected it picks among all of them
	// (a proxy that refuses everything helps nobody).
	Pick(client netip.Addr) *Backend
}

// Backend is one endpoint that balancers choose from.
//
// The proxy creates a Backend per endpoint address and keeps it for as long
// as the endpoint exists, so that counters survive balancer rebuilds.
// Addr and Weight are set at creation and never change; the counters are
// atomic and safe for concurrent use.
type Backend struct {
	// Addr is the endpoint's address and port.
	Addr netip.AddrPort
	// Weight is the relative share of new connections for the weighted
	// balancers. Zero or negative means 1.
	Weight int

	active  atomic.Int64
	ejected atomic.Bool
}

// NewBackend returns a backend for addr with the given weight.
func NewBackend(addr netip.AddrPort, weight int) *Backend {
	return &Backend{Addr: addr, Weight: weight}
}

// weight returns the effective weight, at least 1.
func (b *Backend) weight() int64 {
	if b.Weight <= 0 {
		return 1
	}
	return int64(b.Weight)
}

// Acquire records that a connection to b has started. The caller must call
// Release exactly once when it ends.
func (b *Backend) Acquire() { b.active.Add(1) }

// TryAcquire records that a connection to b has started, as Acquire does,
// if fewer than limit connections to b are in progress, and reports
// whether it did. A limit of zero or less means no limit. The check and
// the increment are one atomic step, so callers racing for b's last slot
// never take it past limit. The caller must Release exactly once when a
// connection it acquired ends.
func (b *Backend) TryAcquire(limit int64) bool {
	if limit <= 0 {
		b.active.Add(1)
		return true
	}
	for {
		n := b.active.Load()
		if n >= limit {
			return false
		}
		if b.active.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// Release records that a connection to b has ended.
func (b *Backend) Release() { b.active.Add(-1) }

// Active returns the number of connections in progress.
func (b *Backend) Active() int64 { return b.active.Load() }

// SetEjected marks b as failing (true) or healthy again (false). Balancers
// skip ejected backends while any other backend is not ejected. The proxy's
// passive health checks own this flag.
func (b *Backend) SetEjected(v bool) { b.ejected.Store(v) }

// Ejected reports whether b is currently ejected.
func (b *Backend) Ejected() bool { return b.ejected.Load() }

// String returns the backend's address.
func (b *Backend) String() string { return b.Addr.String() }

// Kind names a balancing algorithm, as written in the uproxy.io/balancer
// annotation and the --balancer flag.
type Kind string

// The balancing algorithms.
const (
	// RoundRobin hands out backends in turn, ignoring weights.
	RoundRobin Kind = "round-robin"
	// WeightedRoundRobin hands out backends in turn in proportion to
	// their weights, interleaved as by nginx's smooth weighted round-robin.
	WeightedRoundRobin Kind = "weighted-round-robin"
	// LeastConn picks the backend with the fewest active connections;
	// past MaxLeastConnScan backends, the one with fewer of two drawn at
	// random.
	LeastConn Kind = "least-conn"
	// WeightedLeastConn picks the backend with the fewest active
	// connections per unit of weight; past MaxLeastConnScan backends, the
	// one with fewer of two drawn in proportion to their weights.
	WeightedLeastConn Kind = "weighted-least-conn"
	// SourceHash maps each client address to a backend with Maglev
	// consistent hashing, identically on every node, so that a backend
	// change moves few clients. It ignores weights.
	SourceHash Kind = "source-hash"
)

// Kinds lists every algorithm, in documentation order.
var Kinds = []Kind{RoundRobin, WeightedRoundRobin, LeastConn, WeightedLeastConn, SourceHash}

// ParseKind returns the Kind named s, or an error naming the valid choices.
func ParseKind(s string) (Kind, error) {
	for _, k := range Kinds {
		if string(k) == s {
			return k, nil
		}
	}
	return "", fmt.Errorf("unknown balancer %q (want one of %v)", s, Kinds)
}

// New returns a Balancer of the given kind over a private copy of backends,
// which must not contain nil. With no backends it returns a Balancer whose
// Pick always returns nil. An unknown kind yields round-robin rather than a
// panic: callers validate user input with ParseKind first, and a proxy that
// keeps forwarding is better than one that crashes on a typo that slipped
// through.
func New(kind Kind, backends []*Backend) Balancer {
	if len(backends) == 0 {
		return none{}
	}
	bs := slices.Clone(backends)
	switch kind {
	case WeightedRoundRobin:
		return newWeightedRoundRobin(bs)
	case LeastConn:
		return newLeastConn(bs, false)
	case WeightedLeastConn:
		return newLeastConn(bs, true)
	case SourceHash:
		return newMaglev(bs)
	default:
		return &roundRobin{backends: bs}
	}
}

// none is the Balancer for an empty backend list.
type none struct{}

var _ Balancer = none{}

// Pick returns nil.
func (none) Pick(netip.Addr) *Backend { return nil }

// anyHealthy reports whether some backend is not ejected.
func anyHealthy(backends []*Backend) bool {
	for _, b := range backends {
		if !b.Ejected() {
			return true
		}
	}
	return false
}

// spill returns a replacement for pick, an ejected backend, rotating through
// the non-ejected backends with ctr so that the ejected backend's share is
// spread over all of them in proportion to weights (nil means equal
// weights) instead of landing on its neighbour. It returns pick when every
// backend is ejected.
func spill(backends []*Backend, weights []uint64, ctr *atomic.Uint64, pick *Backend) *Backend {
	weight := func(i int) uint64 {
		if weights == nil {
			return 1
		}
		return weights[i]
	}
	var total uint64
	for i, b := range backends {
		if !b.Ejected() {
			total += weight(i)
		}
	}
	if total == 0 {
		return pick
	}
	r := (ctr.Add(1) - 1) % total
	for i, b := range backends {
		if b.Ejected() {
			continue
		}
		if w := weight(i); r >= w {
			r -= w
			continue
		}
		return b
	}
	return pick // ejections changed during the scan
}
