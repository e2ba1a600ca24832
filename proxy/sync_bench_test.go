package proxy

import (
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// BenchmarkSyncEndpointChange times the sync that follows one endpoint
// change when the Proxier serves n services of 10 endpoints each, with
// metrics on, as uproxy runs: the work between an EndpointSlice update
// arriving and new connections using it. Shared listeners keep the
// benchmark to one socket; the per-service work is the same.
func BenchmarkSyncEndpointChange(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			p := NewProxier(Config{
				SharedListeners: []v1.Protocol{v1.ProtocolTCP},
				OriginalDst:     func(*net.TCPConn) (netip.AddrPort, error) { return netip.AddrPort{}, nil },
				Metrics:         NewMetrics(prometheus.NewRegistry()),
				LocalAddrs:      func() ([]netip.Addr, error) { return nil, nil },
				Rules:           &recordingRules{},
			})
			defer p.Shutdown(b.Context())
			svcs := make([]*v1.Service, n)
			sls := make([]*discovery.EndpointSlice, n)
			for i := range n {
				name := fmt.Sprintf("svc-%05d", i)
				svcs[i] = svc(name, fmt.Sprintf("10.96.%d.%d", i/250, i%250+1), "http:80")
				var eps []ep
				for j := range 10 {
					eps = append(eps, ep{ip: fmt.Sprintf("10.244.%d.%d", i/25, (i%25)*10+j+1)})
				}
				sls[i] = slice(name+"-1", name, "http", 8080, eps...)
			}
			p.Tracker().Replace(svcs, sls)
			if err := p.sync(b.Context(), true); err != nil {
				b.Fatal(err)
			}
			last := sls[n-1]
			alt := []*discovery.EndpointSlice{
				slice(last.Name, "svc-"+fmt.Sprintf("%05d", n-1), "http", 8080, ep{ip: "10.244.250.1"}),
				last,
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				p.Tracker().OnSliceUpsert(alt[i%2])
				if err := p.sync(b.Context(), false); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
