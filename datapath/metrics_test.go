package datapath

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/uproxy/uproxy/balancer"
)

// testPortMetrics returns the counters of a service port with backends
// bs, as the control plane builds them (proxy's Metrics.forPort), with
// unregistered meters.
func testPortMetrics(bs ...*balancer.Backend) *PortMetrics {
	m := &Meters{
		DialDuration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "dial_duration_seconds"}),
		UDPFlows:     prometheus.NewGauge(prometheus.GaugeOpts{Name: "udp_flows"}),
		UDPEvicted:   prometheus.NewCounter(prometheus.CounterOpts{Name: "udp_evicted"}),
	}
	for i := range m.DialErrors {
		m.DialErrors[i] = prometheus.NewCounter(prometheus.CounterOpts{Name: "dial_errors"})
	}
	pm := &PortMetrics{Service: "default/web", Port: "http", C: &PortCounters{}, M: m, Backends: map[*balancer.Backend]*BackendMetrics{}}
	for _, b := range bs {
		pm.Backends[b] = &BackendMetrics{Addr: b.Addr.String()}
	}
	return pm
}

// TestMetricsDataPathDoesNotAllocate checks the hot path rule: everything
// a connection does to the metrics (with children resolved when the
// snapshot was built) allocates nothing, exactly as with metrics disabled.
func TestMetricsDataPathDoesNotAllocate(t *testing.T) {
	b := balancer.NewBackend(netip.MustParseAddrPort("10.0.0.1:8080"), 0)
	refusedErr := fmt.Errorf("dial: %w", syscall.ECONNREFUSED)
	connection := func(pm *PortMetrics) {
		bm := pm.backend(b)
		bm.picked()
		start := pm.dialStart()
		pm.dialDone(start, nil)
		pm.dialDone(start, refusedErr)
		bm.connected()
		bm.failed()
		pm.connStart()
		pm.up(1234)
		pm.down(5678)
		pm.connEnd()
		pm.flowOpened()
		pm.flowClosed()
		pm.noEndpoint()
		pm.refusedDestination()
	}
	enabled := testPortMetrics(b)
	for name, pm := range map[string]*PortMetrics{"disabled": nil, "enabled": enabled} {
		if allocs := testing.AllocsPerRun(1000, func() { connection(pm) }); allocs != 0 {
			t.Errorf("metrics %s: %v allocations per connection, want 0", name, allocs)
		}
	}
	if !errors.Is(refusedErr, syscall.ECONNREFUSED) || dialReason(refusedErr) != DialRefused {
		t.Error("a refused dial is not classified as refused")
	}
}

func TestDialReason(t *testing.T) {
	for _, c := range []struct {
		err  error
		want int
	}{
		{&net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}, DialRefused},
		{&net.OpError{Op: "dial", Err: syscall.EHOSTUNREACH}, DialUnreachable},
		{&net.OpError{Op: "dial", Err: syscall.ENETUNREACH}, DialUnreachable},
		{fmt.Errorf("dial: %w", errTimeout{}), DialTimeout},
		{errors.New("weird"), DialOther},
	} {
		if got := dialReason(c.err); got != c.want {
			t.Errorf("dialReason(%v) = %s, want %s", c.err, DialReasonNames[got], DialReasonNames[c.want])
		}
	}
}

type errTimeout struct{}

func (errTimeout) Error() string   { return "i/o timeout" }
func (errTimeout) Timeout() bool   { return true }
func (errTimeout) Temporary() bool { return true }

// BenchmarkConnectionMetrics measures the metric updates of one
// connection, with metrics enabled and disabled: both report 0 allocs/op.
func BenchmarkConnectionMetrics(b *testing.B) {
	for _, enabled := range []bool{false, true} {
		b.Run(fmt.Sprintf("metrics=%v", enabled), func(b *testing.B) {
			be := balancer.NewBackend(netip.MustParseAddrPort("10.0.0.1:8080"), 0)
			var pm *PortMetrics
			if enabled {
				pm = testPortMetrics(be)
			}
			b.ReportAllocs()
			for b.Loop() {
				bm := pm.backend(be)
				bm.picked()
				pm.dialDone(pm.dialStart(), nil)
				bm.connected()
				pm.connStart()
				pm.up(100)
				pm.down(100)
				pm.connEnd()
			}
		})
	}
}
