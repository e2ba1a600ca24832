package balancer

import (
	"sync"
	"sync/atomic"
	"time"
)

// Health ejects backends that fail to accept connections (passive health
// checking, like Envoy's outlier detection): the first failure ejects a
// backend (SetEjected) for Base, each consecutive one doubles that up to
// Max, and a success resets the count. Balancers then skip the backend
// while another is healthy. NewHealth makes one; it is safe for concurrent
// use.
type Health struct {
	afterFunc func(time.Duration, func())
	base, max time.Duration
	failing   atomic.Int32 // number of entries in fails; lets Success skip the lock
	mu        sync.Mutex
	fails     map[*Backend]int
}

// NewHealth returns a Health that ejects for base (zero means 1s), doubling
// up to maxEject (zero means 30s), and re-admits a backend by calling f
// after d through afterFunc (nil means time.AfterFunc; a test passes a fake
// clock's).
func NewHealth(base, maxEject time.Duration, afterFunc func(d time.Duration, f func())) *Health {
	if base <= 0 {
		base = time.Second
	}
	if maxEject <= 0 {
		maxEject = 30 * time.Second
	}
	if afterFunc == nil {
		afterFunc = func(d time.Duration, f func()) { time.AfterFunc(d, f) }
	}
	return &Health{afterFunc: afterFunc, base: base, max: max(base, maxEject), fails: map[*Backend]int{}}
}

// Failure records that b failed, and ejects it for its turn's time.
func (h *Health) Failure(b *Backend) {
	h.mu.Lock()
	n := h.fails[b] + 1
	if n == 1 {
		h.failing.Add(1)
	}
	h.fails[b] = n
	h.mu.Unlock()
	d := h.base << min(n-1, 20)
	if d > h.max || d <= 0 {
		d = h.max
	}
	b.SetEjected(true)
	// The timer fires once and exits; re-admission lets the next pick
	// probe the backend again.
	h.afterFunc(d, func() { b.SetEjected(false) })
}

// Success records that b accepted a connection: its failures are forgotten.
func (h *Health) Success(b *Backend) {
	if h.failing.Load() == 0 {
		return
	}
	h.Forget(b)
}

// Forget drops b's failures, as when b leaves the endpoints.
func (h *Health) Forget(b *Backend) {
	h.mu.Lock()
	if _, ok := h.fails[b]; ok {
		delete(h.fails, b)
		h.failing.Add(-1)
	}
	h.mu.Unlock()
}

// Failures returns b's consecutive failures.
func (h *Health) Failures(b *Backend) int {
	if h.failing.Load() == 0 {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.fails[b]
}
