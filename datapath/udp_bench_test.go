package datapath

import (
	"net"
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

// BenchmarkUDPFairAccounting measures what a pooled query does to its
// service port's share of the engine's bound, without contention: its
// checkout and its return, with other ports' queries out.
func BenchmarkUDPFairAccounting(b *testing.B) {
	var u udpFairness
	for range 16 {
		u.checkedOut(&udpFlow{}, &ConnSlots{})
	}
	s, f := &ConnSlots{}, &udpFlow{}
	b.ReportAllocs()
	for b.Loop() {
		u.checkedOut(f, s)
		u.returned(f)
	}
}

// BenchmarkUDPFlowTableFull measures a new flow in a full flow table
// whose service port holds more than its share, as under a flood of new
// source ports: the port's least recently used flow ends to make room.
func BenchmarkUDPFlowTableFull(b *testing.B) {
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	const size = 4096
	p := &Engine{cfg: Config{UDPMaxFlows: size}}
	p.udpRelay.e = p
	dns, flood := &ConnSlots{}, &ConnSlots{}
	dst := netip.MustParseAddrPort("10.96.0.10:53")
	flow := func(i int) *udpFlow {
		// Ending a flow closes conn, which each shares: a second close
		// changes nothing.
		client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(i >> 16), byte(i >> 8)}), uint16(i))
		return &udpFlow{p: p, key: flowKey{client: client, dst: dst}, conn: conn, fd: -1}
	}
	for i := range size {
		s := flood
		if i%64 == 0 {
			s = dns
		}
		p.addFlow(flow(i), s)
	}
	flows := make([]*udpFlow, b.N)
	for i := range flows {
		flows[i] = flow(size + i)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		p.addFlow(flows[i], flood)
	}
}
