package proxy

import (
	"net/netip"

	"github.com/uproxy/uproxy/proxy/introspect"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// updateStatus replaces the introspection entries of service name with
// its listeners' current snapshots, or removes them when it has none. The
// sync goroutine calls it for each service it applies, so that a sync's
// cost follows the services that changed: rebuilding every entry took
// most of an endpoint change's sync (BenchmarkSyncEndpointChange). An
// entry holds only the snapshot and the listener's ports; the Inspector
// builds the rest when asked.
func updateStatus(t *introspect.Table, name types.NamespacedName, ls listenerSet) {
	entries := make([]introspect.Entry, 0, len(ls))
	for _, l := range ls {
		entries = append(entries, introspect.Entry{Snap: l.snap.Load(), Port: l.Port, PortEnd: l.PortEnd, V6: l.Key.V6})
	}
	t.Store(name, entries)
}

// Status returns the proxier's state as of its last sync, with live
// connection counts and ejections. Safe for concurrent use.
func (p *Proxier) Status() introspect.Status { return p.inspect.Status() }

// Explain explains traffic to dst over proto from client (invalid: not
// given) with the state of the last sync. It has no side effects: it
// picks nothing and refreshes no affinity. Safe for concurrent use.
func (p *Proxier) Explain(dst netip.AddrPort, proto v1.Protocol, client netip.Addr) introspect.Explanation {
	return p.inspect.Explain(dst, proto, client)
}

// UDPFlows returns the number of live UDP flows. Safe for concurrent use.
func (p *Proxier) UDPFlows() int { return p.dp.UDPFlows() }
