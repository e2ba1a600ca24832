package proxy

import (
	"sync/atomic"
	"time"

	"github.com/uproxy/uproxy/proxy/routing"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/proxy/listeners"
)

// listenerSet holds one service's listeners, one per port and family.
// A service has few, so they are scanned: a map per service held more
// memory than its listeners at scale.
type listenerSet []*listener

// get returns the listener of k, or nil.
func (ls listenerSet) get(k listeners.Key) *listener {
	for _, l := range ls {
		if l.Key == k {
			return l
		}
	}
	return nil
}

// listener is a service port's listener (listeners.Listener: its socket,
// or its host's) with the routing the sync built for it.
type listener struct {
	*listeners.Listener
	// snap is what the listener's Snap was built from; nil until the
	// first sync that applies it.
	snap atomic.Pointer[routing.Snapshot]

	// Owned by the sync goroutine.
	affinity        *balancer.AffinityTable
	affinityTimeout time.Duration
}
