package proxy

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"syscall"
	"testing"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/healthcheck"
	"github.com/uproxy/uproxy/proxy/service"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/ptr"
)

// BenchmarkSyncEndpointChange times the sync that follows one endpoint
// change when the Proxier serves n services of 10 endpoints each, with
// metrics on, as uproxy runs: the work between an EndpointSlice update
// arriving and new connections using it. Shared listeners keep the
// benchmark to one socket; the per-service work is the same.
func BenchmarkSyncEndpointChange(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			p, sls := syncedProxier(b, n)
			last := sls[n-1]
			alt := []*discovery.EndpointSlice{
				slice(last.Name, "svc-"+fmt.Sprintf("%05d", n-1), "http", 8080, ep{IP: "10.244.250.1"}),
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

// BenchmarkSyncPeriodic times the periodic full sync (every
// --iptables-sync-period) of n services of 10 endpoints each when nothing
// changed, without the kernel's part (recordingRules stands in for it):
// what the sync goroutine is busy with, every period, before it can
// apply the next endpoint change.
func BenchmarkSyncPeriodic(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			p, _ := syncedProxier(b, n)
			b.ReportAllocs()
			for b.Loop() {
				if err := p.sync(b.Context(), true); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkSyncAll times the first sync of n services of 10 endpoints
// each, with metrics on: what a starting uproxy does once the informers
// have listed everything, before the rules are written (recordingRules
// stands in for the kernel).
func BenchmarkSyncAll(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				b.StopTimer()
				p, svcs, sls := benchProxier(b, n)
				p.Tracker().Replace(svcs, sls)
				b.StartTimer()
				if err := p.sync(b.Context(), true); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				p.Shutdown(b.Context())
				b.StartTimer()
			}
		})
	}
}

// syncedProxier returns benchProxier's Proxier after its first sync of
// the n services, and their EndpointSlices.
func syncedProxier(b *testing.B, n int) (*Proxier, []*discovery.EndpointSlice) {
	p, svcs, sls := benchProxier(b, n)
	p.Tracker().Replace(svcs, sls)
	if err := p.sync(b.Context(), true); err != nil {
		b.Fatal(err)
	}
	return p, sls
}

// benchProxier returns a Proxier with shared TCP listeners and metrics,
// and n services of 10 endpoints each for its tracker.
func benchProxier(b *testing.B, n int) (*Proxier, []*v1.Service, []*discovery.EndpointSlice) {
	p := NewProxier(Config{
		Config: datapath.Config{
			OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) { return netip.AddrPort{}, nil },
		},
		SharedListeners: []v1.Protocol{v1.ProtocolTCP},
		Metrics:         introspect.NewMetrics(prometheus.NewRegistry()),
		Rules:           &recordingRules{},
		// As uproxy wires it: the node's addresses are listed on every
		// sync (LocalAddrs nil), and the health-check server is told.
		ServiceHealth: healthcheck.NewServiceHealth(healthcheck.ServiceHealthConfig{}),
	})
	b.Cleanup(func() { p.Shutdown(context.Background()) })
	svcs := make([]*v1.Service, n)
	sls := make([]*discovery.EndpointSlice, n)
	for i := range n {
		name := fmt.Sprintf("svc-%05d", i)
		svcs[i] = svc(name, fmt.Sprintf("10.96.%d.%d", i/250, i%250+1), "http:80")
		var eps []ep
		for j := range 10 {
			// 10.244.0.0/16 holds 6,400 services' endpoints; later
			// services reuse addresses, as valid as distinct ones here.
			eps = append(eps, ep{IP: fmt.Sprintf("10.244.%d.%d", (i/25)%256, (i%25)*10+j+1)})
		}
		sls[i] = slice(name+"-1", name, "http", 8080, eps...)
	}
	return p, svcs, sls
}

// BenchmarkSyncSourceHash compares source-hash with round-robin on every
// service: the first sync of n services of 10 endpoints each, and the
// heap the Proxier then holds (heap-bytes, after a garbage collection:
// the balancers, and source-hash's Maglev tables). The "ports" case is
// one service of 2,000 ports over the same 10 endpoints.
func BenchmarkSyncSourceHash(b *testing.B) {
	cases := []struct {
		name     string
		services func(b *testing.B) (*Proxier, []*v1.Service, []*discovery.EndpointSlice)
	}{
		{"services=10000", func(b *testing.B) (*Proxier, []*v1.Service, []*discovery.EndpointSlice) {
			return benchProxier(b, 10000)
		}},
		{"ports=2000", manyPortsProxier},
	}
	for _, c := range cases {
		for _, kind := range []balancer.Kind{balancer.RoundRobin, balancer.SourceHash} {
			b.Run(c.name+"/"+string(kind), func(b *testing.B) {
				var heap uint64
				for b.Loop() {
					b.StopTimer()
					p, svcs, sls := c.services(b)
					for _, s := range svcs {
						s.Annotations = map[string]string{service.AnnotationBalancer: string(kind)}
					}
					p.Tracker().Replace(svcs, sls)
					before := heapInUse()
					b.StartTimer()
					if err := p.sync(b.Context(), true); err != nil {
						b.Fatal(err)
					}
					b.StopTimer()
					heap += heapInUse() - min(before, heapInUse())
					p.Shutdown(b.Context())
					b.StartTimer()
				}
				b.ReportMetric(float64(heap)/float64(b.N), "heap-bytes/op")
			})
		}
	}
}

// heapInUse returns the bytes of live heap objects after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// manyPortsProxier returns benchProxier's Proxier and one service of
// 2,000 ports, all over the same 10 endpoints.
func manyPortsProxier(b *testing.B) (*Proxier, []*v1.Service, []*discovery.EndpointSlice) {
	p, _, _ := benchProxier(b, 0)
	var ports []string
	for i := range 2000 {
		ports = append(ports, fmt.Sprintf("p%d:%d", i, 10000+i))
	}
	s := svc("many", "10.96.0.10", ports...)
	var eps []ep
	for j := range 10 {
		eps = append(eps, ep{IP: fmt.Sprintf("10.244.0.%d", j+1)})
	}
	sl := slice("many-1", "many", "p0", 10000, eps...)
	for i := 1; i < 2000; i++ {
		sl.Ports = append(sl.Ports, discovery.EndpointPort{Name: ptr.To(fmt.Sprintf("p%d", i)), Port: ptr.To(int32(10000 + i)), Protocol: ptr.To(v1.ProtocolTCP)})
	}
	return p, []*v1.Service{s}, []*discovery.EndpointSlice{sl}
}
