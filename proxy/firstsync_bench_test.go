package proxy

import (
	"fmt"
	"net/netip"
	"syscall"
	"testing"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/healthcheck"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// BenchmarkFirstSyncPerService times the first sync of n services of 10
// endpoints each with a listener per service port (--listener=per-service,
// uproxy's default), in redirect and in tproxy mode: every listener is
// bound, made transparent and started before the rules are written
// (recordingRules stands in for the kernel). Tproxy mode's listeners need
// CAP_NET_ADMIN or CAP_NET_RAW (IP_TRANSPARENT); without it that case is
// skipped.
func BenchmarkFirstSyncPerService(b *testing.B) {
	for _, mode := range []string{"redirect", "tproxy"} {
		for _, n := range []int{1000, 10000} {
			b.Run(fmt.Sprintf("%s/%d", mode, n), func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					b.StopTimer()
					p, svcs, sls := benchPerServiceProxier(b, n, mode == "tproxy")
					p.Tracker().Replace(svcs, sls)
					b.StartTimer()
					if err := p.sync(b.Context(), true); err != nil {
						b.Fatal(err)
					}
					b.StopTimer()
					if mode == "tproxy" && len(p.services) == 0 && n > 0 {
						b.Skip("no listener opened (IP_TRANSPARENT needs CAP_NET_ADMIN)")
					}
					if got := len(p.services); got != n {
						b.Fatalf("%d services have listeners, want %d", got, n)
					}
					p.Shutdown(b.Context())
					b.StartTimer()
				}
			})
		}
	}
}

// benchPerServiceProxier is benchProxier with a listener per service
// port, transparent ones (tproxy mode) if transparent is set.
func benchPerServiceProxier(b *testing.B, n int, transparent bool) (*Proxier, []*v1.Service, []*discovery.EndpointSlice) {
	_, svcs, sls := benchProxier(b, n)
	p := NewProxier(Config{
		Config: datapath.Config{
			Transparent: transparent,
			OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) { return netip.AddrPort{}, nil },
		},
		Metrics:       introspect.NewMetrics(prometheus.NewRegistry()),
		Rules:         &recordingRules{},
		ServiceHealth: healthcheck.NewServiceHealth(healthcheck.ServiceHealthConfig{}),
	})
	b.Cleanup(func() { p.Shutdown(b.Context()) })
	return p, svcs, sls
}
