package proxy

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"syscall"
	"testing"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/listeners"
	"github.com/uproxy/uproxy/proxy/service"
)

// hashService is a source-hash Service with ports http (80), https (443)
// and metrics (9090), whose EndpointSlices give http and https the same
// httpPods, and metrics the metricsPods.
func hashService(httpPods, metricsPods int) (*v1.Service, []*discovery.EndpointSlice) {
	s := svc("web", "10.96.0.10", "http:80", "https:443", "metrics:9090")
	s.Annotations = map[string]string{service.AnnotationBalancer: string(balancer.SourceHash)}
	web := slice("web-1", "web", "http", 8080)
	web.Ports = append(web.Ports, discovery.EndpointPort{Name: ptr.To("https"), Port: ptr.To[int32](8443), Protocol: ptr.To(v1.ProtocolTCP)})
	for i := range httpPods {
		web.Endpoints = append(web.Endpoints, discovery.Endpoint{Addresses: []string{fmt.Sprintf("10.244.0.%d", i+1)}})
	}
	metrics := slice("web-2", "web", "metrics", 9090)
	for i := range metricsPods {
		metrics.Endpoints = append(metrics.Endpoints, discovery.Endpoint{Addresses: []string{fmt.Sprintf("10.244.1.%d", i+1)}})
	}
	return s, []*discovery.EndpointSlice{web, metrics}
}

// hashProxier returns a Proxier, not running, whose source-hash tables
// are bounded by bound bytes, and what it logs at Info and above.
func hashProxier(t *testing.T, bound int64) (*Proxier, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.InfoLevel)
	p := NewProxier(Config{
		Config: datapath.Config{
			OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) { return netip.AddrPort{}, nil },
			Logger:      zap.New(core),
		},
		SharedListeners: []v1.Protocol{v1.ProtocolTCP},
		Rules:           &recordingRules{},
		SourceHashBytes: bound,
	})
	t.Cleanup(func() { p.Shutdown(context.Background()) })
	return p, logs
}

// hashing returns the hashing of each of service web's ports (Maglev and
// its table's size, or rendezvous), the number of tables the service
// holds, and the total the proxier counts.
func hashing(p *Proxier) (ports map[string]string, tables int, total int64) {
	name := types.NamespacedName{Namespace: "default", Name: "web"}
	ports = map[string]string{}
	for _, l := range p.services[name] {
		bal := l.snap.Load().Cluster
		desc := balancer.SourceHashMethod(bal)
		if t := p.hash.budget.Table(name, l.snap.Load().ClusterBackends); t != nil && desc == "Maglev" {
			desc = fmt.Sprintf("Maglev %d", t.Len())
		}
		ports[l.Key.Name.Port] = desc
	}
	return ports, p.hash.budget.Tables(name), p.hash.budget.Bytes()
}

// TestSourceHashTablesShared checks that a Maglev table is sized by its
// backends and shared by the ports whose endpoints have the same
// addresses, and that the proxier's count of their memory follows the
// service's changes.
func TestSourceHashTablesShared(t *testing.T) {
	p, _ := hashProxier(t, 0)
	sync := func(s *v1.Service, sls []*discovery.EndpointSlice) {
		t.Helper()
		var svcs []*v1.Service
		if s != nil {
			svcs = append(svcs, s)
		}
		p.Tracker().Replace(svcs, sls)
		if err := p.sync(t.Context(), false); err != nil {
			t.Fatal(err)
		}
	}
	type state struct {
		Ports  map[string]string
		Tables int
		Total  int64
	}
	get := func() state {
		ports, tables, total := hashing(p)
		return state{ports, tables, total}
	}

	sync(hashService(10, 3))
	want := state{map[string]string{"http": "Maglev 2053", "https": "Maglev 2053", "metrics": "Maglev 2053"}, 2, 2 * 2053 * 2}
	if diff := cmp.Diff(want, get()); diff != "" {
		t.Errorf("10 and 3 pods (-want +got):\n%s", diff)
	}
	// The table grows with the pods.
	sync(hashService(30, 3))
	want = state{map[string]string{"http": "Maglev 8209", "https": "Maglev 8209", "metrics": "Maglev 2053"}, 2, (8209 + 2053) * 2}
	if diff := cmp.Diff(want, get()); diff != "" {
		t.Errorf("30 and 3 pods (-want +got):\n%s", diff)
	}
	sync(nil, nil)
	if diff := cmp.Diff(state{map[string]string{}, 0, 0}, get()); diff != "" {
		t.Errorf("after the service is deleted (-want +got):\n%s", diff)
	}
}

// TestSourceHashTablesBound checks that the tables' total stays within
// SourceHashBytes: a balancer whose table would pass it uses rendezvous
// hashing, and the service is logged by name, once, and again when it
// fits once more.
func TestSourceHashTablesBound(t *testing.T) {
	p, logs := hashProxier(t, 2053*2) // room for one small table
	sync := func(s *v1.Service, sls []*discovery.EndpointSlice) {
		t.Helper()
		p.Tracker().Replace([]*v1.Service{s}, sls)
		if err := p.sync(t.Context(), false); err != nil {
			t.Fatal(err)
		}
	}
	sync(hashService(10, 3))
	ports, tables, total := hashing(p)
	if diff := cmp.Diff(map[string]string{"http": "Maglev 2053", "https": "Maglev 2053", "metrics": "rendezvous"}, ports); diff != "" {
		t.Errorf("over the bound (-want +got):\n%s", diff)
	}
	if tables != 1 || total != 2053*2 {
		t.Errorf("%d tables of %d bytes, want 1 of %d", tables, total, 2053*2)
	}
	// explain says which hashing picks, and picks as the balancer does.
	client := netip.MustParseAddr("192.0.2.7")
	for _, tt := range []struct{ port, key, hashing string }{{"80", "http", "(Maglev)"}, {"9090", "metrics", "(rendezvous)"}} {
		ex := p.Explain(netip.MustParseAddrPort("10.96.0.10:"+tt.port), v1.ProtocolTCP, client)
		l := p.services[types.NamespacedName{Namespace: "default", Name: "web"}].get(listeners.Key{Name: service.PortName{
			NamespacedName: types.NamespacedName{Namespace: "default", Name: "web"}, Port: tt.key, Protocol: v1.ProtocolTCP}})
		if want := l.snap.Load().Cluster.Pick(client).Addr.String(); ex.Backend != want || !strings.Contains(ex.Pick, tt.hashing) {
			t.Errorf("explain %s: backend %s by %q; want %s %s", tt.key, ex.Backend, ex.Pick, want, tt.hashing)
		}
	}
	// Another change while still over the bound logs nothing new.
	sync(hashService(11, 3))
	// All ports with the same pods: one table, which fits.
	s, sls := hashService(10, 0)
	sls[1] = slice("web-2", "web", "metrics", 9090, ep{IP: "10.244.0.1"}, ep{IP: "10.244.0.2"}, ep{IP: "10.244.0.3"}, ep{IP: "10.244.0.4"},
		ep{IP: "10.244.0.5"}, ep{IP: "10.244.0.6"}, ep{IP: "10.244.0.7"}, ep{IP: "10.244.0.8"}, ep{IP: "10.244.0.9"}, ep{IP: "10.244.0.10"})
	sync(s, sls)
	ports, tables, total = hashing(p)
	if diff := cmp.Diff(map[string]string{"http": "Maglev 2053", "https": "Maglev 2053", "metrics": "Maglev 2053"}, ports); diff != "" {
		t.Errorf("back under the bound (-want +got):\n%s", diff)
	}
	if tables != 1 || total != 2053*2 {
		t.Errorf("%d tables of %d bytes, want 1 of %d", tables, total, 2053*2)
	}
	var got []string
	for _, e := range logs.FilterMessageSnippet("lookup tables").All() {
		got = append(got, fmt.Sprintf("%s %s %v", e.Level, e.ContextMap()["service"], e.ContextMap()["balancers"]))
	}
	if diff := cmp.Diff([]string{"warn default/web 1", "info default/web <nil>"}, got); diff != "" {
		t.Errorf("log lines (-want +got):\n%s", diff)
	}
}
