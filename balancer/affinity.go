package balancer

import (
	"net/netip"
	"slices"
	"sync"
	"time"
)

// AffinityConfig configures an AffinityTable.
type AffinityConfig struct {
	// Timeout is how long a client keeps its backend after its last
	// connection. Zero (or negative) means 10800s, kube-proxy's default for
	// sessionAffinityConfig.clientIP.timeoutSeconds.
	Timeout time.Duration
	// MaxEntries bounds the number of clients remembered. Zero (or
	// negative) means 65536.
	MaxEntries int
	// Now returns the current time. Nil means time.Now; tests inject a
	// fake clock.
	Now func() time.Time
}

// AffinityTable remembers which backend each client IP was sent to, giving
// the ClientIP session affinity of a Kubernetes Service. It is safe for
// concurrent use and is meant to outlive balancer rebuilds: the proxy keeps
// one per service port and wraps each new Balancer with Wrap.
type AffinityTable struct {
	timeout int64 // nanoseconds
	max     int
	now     func() time.Time

	mu        sync.Mutex
	entries   map[netip.Addr]affinityEntry
	nextSweep int64 // unix nanoseconds
}

// affinityEntry is one client's backend and when it last picked it.
type affinityEntry struct {
	backend *Backend
	used    int64 // unix nanoseconds
}

// NewAffinityTable returns an empty table configured by cfg.
func NewAffinityTable(cfg AffinityConfig) *AffinityTable {
	t := &AffinityTable{
		timeout: int64(cfg.Timeout),
		max:     cfg.MaxEntries,
		now:     cfg.Now,
		entries: make(map[netip.Addr]affinityEntry),
	}
	if t.timeout <= 0 {
		t.timeout = int64(10800 * time.Second)
	}
	if t.max <= 0 {
		t.max = 65536
	}
	if t.now == nil {
		t.now = time.Now
	}
	return t
}

// Wrap returns a Balancer that sends each client to the backend it was last
// sent to, if that backend is still in backends, not ejected (unless all
// are), and was used less than Timeout ago; otherwise it asks inner and
// records the answer. backends must be the list inner was built from.
//
// Every Pick refreshes the client's last-used time, as kube-proxy's
// iptables rules do: the service chain's "-m recent --rcheck --seconds"
// match sends the client to its endpoint chain, whose "-m recent --set"
// stamps it again. An entry therefore expires Timeout after the client's
// last new connection, not its first.
func (t *AffinityTable) Wrap(inner Balancer, backends []*Backend) Balancer {
	members := make(map[*Backend]struct{}, len(backends))
	for _, b := range backends {
		members[b] = struct{}{}
	}
	return &affinity{table: t, inner: inner, backends: slices.Clone(backends), members: members}
}

// Len returns the number of clients in the table, including expired ones
// not yet swept.
func (t *AffinityTable) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.entries)
}

// Lookup returns the backend recorded for client and when the record
// expires, for status and explain output. It has no side effects: it
// neither refreshes nor removes the entry.
func (t *AffinityTable) Lookup(client netip.Addr) (addr netip.AddrPort, expires time.Time, ok bool) {
	now := t.now().UnixNano()
	t.mu.Lock()
	e, ok := t.entries[client.Unmap()]
	t.mu.Unlock()
	if !ok || now-e.used >= t.timeout {
		return netip.AddrPort{}, time.Time{}, false
	}
	return e.backend.Addr, time.Unix(0, e.used+t.timeout), true
}

// sweep deletes expired entries. It costs O(entries), so callers run it at
// most once per Timeout/4, which keeps Pick O(1) amortized while bounding
// how long an expired entry can occupy a slot.
func (t *AffinityTable) sweep(now int64) {
	for c, e := range t.entries {
		if now-e.used >= t.timeout {
			delete(t.entries, c)
		}
	}
	t.nextSweep = now + t.timeout/4
}

// affinity is a Balancer wrapped by an AffinityTable.
type affinity struct {
	table    *AffinityTable
	inner    Balancer
	backends []*Backend
	members  map[*Backend]struct{}
}

var _ Balancer = (*affinity)(nil)

// Pick returns the client's recorded backend if it is still usable, and
// otherwise inner's pick, which it records unless the table is full.
func (a *affinity) Pick(client netip.Addr) *Backend {
	if len(a.backends) == 0 {
		return nil
	}
	client = client.Unmap()
	t := a.table
	now := t.now().UnixNano()
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.entries[client]
	if ok && now-e.used < t.timeout && a.usable(e.backend) {
		t.entries[client] = affinityEntry{e.backend, now}
		return e.backend
	}
	// Asking inner under the lock keeps two simultaneous first connections
	// from one client on the same backend.
	b := a.inner.Pick(client)
	if b == nil {
		return nil
	}
	if now >= t.nextSweep {
		t.sweep(now)
	}
	if _, ok := t.entries[client]; ok || len(t.entries) < t.max {
		t.entries[client] = affinityEntry{b, now}
	}
	return b
}

// usable reports whether a recorded backend may be picked again: it is
// still a member and not ejected, unless every member is.
func (a *affinity) usable(b *Backend) bool {
	if _, ok := a.members[b]; !ok {
		return false
	}
	return !b.Ejected() || !anyHealthy(a.backends)
}

// Unwrap returns the balancer that b wraps for ClientIP affinity (see
// Wrap), or b itself: what explain output asks for a client's pick
// without recording it.
func Unwrap(b Balancer) Balancer {
	if a, ok := b.(*affinity); ok {
		return a.inner
	}
	return b
}
