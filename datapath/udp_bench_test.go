package datapath

import (
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/golang-lru/v2/expirable"
)

// BenchmarkUDPFlowLookup measures the flow table's work for one datagram
// of an established flow, in a table of 10,000 flows, from parallel
// goroutines (a listener's read loop and its flows' reply goroutines):
// a Peek to find the flow, and an Add that refreshes its timeout.
func BenchmarkUDPFlowLookup(b *testing.B) {
	const flows = 10000
	lru := expirable.NewLRU[flowKey, *udpFlow](65536, nil, 30*time.Second)
	l := &Listener{}
	keys := make([]flowKey, flows)
	for i := range keys {
		keys[i] = flowKey{l, netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)}), 40000), netip.MustParseAddrPort("10.244.0.1:40001")}
		lru.Add(keys[i], &udpFlow{key: keys[i]})
	}
	var next atomic.Uint32
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		i := int(next.Add(7919))
		for pb.Next() {
			k := keys[i%flows]
			i++
			f, ok := lru.Peek(k)
			if !ok {
				b.Error("flow missing")
				return
			}
			lru.Add(k, f)
		}
	})
}
