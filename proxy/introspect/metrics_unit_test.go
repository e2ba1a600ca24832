package introspect

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/proxy/service"

	"github.com/uproxy/uproxy/datapath"
)

// TestMetricsRetainService checks that each service's counters outlive
// its snapshots while a port or backend stays, and go with the last round
// (beginService … retainService) that did not use them.
func TestMetricsRetainService(t *testing.T) {
	m := NewMetrics(prometheus.NewRegistry())
	be := func(s string) *balancer.Backend { return balancer.NewBackend(netip.MustParseAddrPort(s), 0) }
	a, b := be("10.244.0.1:8080"), be("10.244.0.2:8080")
	web := types.NamespacedName{Namespace: "default", Name: "web"}
	port := func(name string) *service.Port {
		return &service.Port{Name: service.PortName{NamespacedName: web, Port: name}, Port: 80}
	}
	state := func() map[string][]string {
		out := map[string][]string{}
		for _, st := range m.ports[web.String()] {
			var addrs []string
			for _, bm := range st.backends {
				addrs = append(addrs, bm.Addr.String())
			}
			slices.Sort(addrs)
			out[st.port] = addrs
		}
		return out
	}
	round := func(ports map[string][]*balancer.Backend) map[string]*datapath.PortMetrics {
		m.BeginService()
		pms := map[string]*datapath.PortMetrics{}
		for name, bs := range ports {
			pms[name] = m.ForPort(port(name), bs)
		}
		m.RetainService(web.String())
		return pms
	}

	first := round(map[string][]*balancer.Backend{"http": {a, b}, "admin": {a}})
	first["http"].Backend(b).Picks.Add(1)
	if diff := cmp.Diff(map[string][]string{"http": {"10.244.0.1:8080", "10.244.0.2:8080"}, "admin": {"10.244.0.1:8080"}}, state()); diff != "" {
		t.Errorf("after the first round (-want +got):\n%s", diff)
	}

	// The admin port and backend a of http go; b keeps its counters.
	second := round(map[string][]*balancer.Backend{"http": {b}})
	if diff := cmp.Diff(map[string][]string{"http": {"10.244.0.2:8080"}}, state()); diff != "" {
		t.Errorf("after the second round (-want +got):\n%s", diff)
	}
	if got := second["http"].Backend(b).Picks.Load(); got != 1 {
		t.Errorf("b's picks = %d after a round that kept it, want 1", got)
	}

	// A round without ports drops the service.
	round(nil)
	if _, ok := m.ports[web.String()]; ok {
		t.Errorf("the service's counters outlived a round without ports: %v", state())
	}
}

// TestMetricsManyBackends checks that a port's backend counters are found
// past smallBackends backends (by map) as below it (by scan), and carried over
// when the port shrinks back below it.
func TestMetricsManyBackends(t *testing.T) {
	m := NewMetrics(prometheus.NewRegistry())
	web := types.NamespacedName{Namespace: "default", Name: "web"}
	sp := &service.Port{Name: service.PortName{NamespacedName: web, Port: "http"}, Port: 80}
	var bs []*balancer.Backend
	for i := range 3 * smallBackends {
		bs = append(bs, balancer.NewBackend(netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, 0, byte(i + 1)}), 8080), 0))
	}
	round := func(bs []*balancer.Backend) *datapath.PortMetrics {
		m.BeginService()
		pm := m.ForPort(sp, bs)
		m.RetainService(web.String())
		return pm
	}
	many := round(bs)
	for i, b := range bs {
		bm := many.Backend(b)
		if bm == nil || bm.Addr != b.Addr {
			t.Fatalf("backend %d (%s): counters %+v", i, b.Addr, bm)
		}
		bm.OK.Add(uint64(i))
	}
	few := round(bs[:3])
	st := m.ports[web.String()][0]
	if len(st.backends) != 3 || st.byAddr != nil {
		t.Errorf("after shrinking to 3 backends the port holds %d, indexed %v", len(st.backends), st.byAddr != nil)
	}
	for i, b := range bs[:3] {
		if bm := few.Backend(b); bm == nil || bm.OK.Load() != uint64(i) {
			t.Errorf("backend %d (%s) lost its counters: %+v", i, b.Addr, bm)
		}
	}
	if bm := few.Backend(bs[5]); bm != nil {
		t.Errorf("a backend the port no longer has still has counters: %+v", bm)
	}
}
