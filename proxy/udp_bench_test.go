package proxy

import (
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
)

// BenchmarkUDPRequestResponse measures the UDP data path end to end on
// loopback: clients each send a 64-byte datagram to a listener as soon as
// the previous one came back through an echo backend; ns/op is one
// request and its reply. It compares reading the listener one datagram
// per recvmmsg (batch=1) with batches of up to 8 (the default): batches
// form only when several clients' datagrams queue up.
func BenchmarkUDPRequestResponse(b *testing.B) {
	for _, clients := range []int{1, 32} {
		for _, batch := range []int{1, 8} {
			b.Run(fmt.Sprintf("clients=%d/batch=%d", clients, batch), func(b *testing.B) {
				benchUDPRequestResponse(b, Config{Config: datapath.Config{UDPReadBatch: batch}}, clients)
			})
		}
	}
}

func benchUDPRequestResponse(b *testing.B, cfg Config, clients int) {
	echo := udpBackend(b, "", true)
	p, rules := startProxier(b, cfg)
	p.Tracker().Replace([]*v1.Service{svc("dns", "10.96.0.10", "dns:53/UDP")}, udpSlices("dns", echo))
	port := rules.port(b, "default/dns:dns")
	conns := make([]*net.UDPConn, clients)
	for i := range conns {
		conns[i] = dialUDP(b, port)
	}
	msg := make([]byte, 64)
	var left atomic.Int64
	left.Store(int64(b.N))
	var wg sync.WaitGroup
	var lost atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	for _, c := range conns {
		wg.Add(1)
		go func() { // ends when the b.N requests are shared out
			defer wg.Done()
			buf := make([]byte, 256)
			for left.Add(-1) >= 0 {
				if _, err := c.Write(msg); err != nil {
					b.Error(err)
					return
				}
				_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
				if _, err := c.Read(buf); err != nil {
					lost.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	if n := lost.Load(); n > int64(b.N)/100 {
		b.Errorf("%d of %d requests lost", n, b.N)
	}
}
