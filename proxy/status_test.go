package proxy

import (
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
)

func TestStatus(t *testing.T) {
	a, b := nameBackend(t, "a"), nameBackend(t, "b")
	refused := nameBackend(t, "refused")
	refused.ln.Close()
	p, rules := startProxier(t, Config{Config: datapath.Config{EjectBase: time.Minute}})
	if st := p.Status(); len(st.Ports) != 0 || st.Mode != "redirect" {
		t.Errorf("before the first sync: %+v", st)
	}
	web := svc("web", "10.96.0.10", "http:80")
	web.Spec.SessionAffinity = v1.ServiceAffinityClientIP
	p.Tracker().Replace([]*v1.Service{web}, slicesFor("web", "http", refused, a, b))
	port := rules.port(t, "default/web:http")

	// Status is read while syncs replace the view.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
				_ = p.Status()
			}
		}
	})
	for range 3 {
		if _, err := get(t, port); err != nil {
			t.Fatal(err)
		}
	}
	p.Tracker().Replace([]*v1.Service{web, svc("other", "10.96.0.11", "dns:53/UDP")}, slicesFor("web", "http", refused, a, b))
	testwait.Until(t, 5*time.Second, "two ports in the status", func() bool { return len(p.Status().Ports) == 2 })
	close(stop)
	wg.Wait()

	st := p.Status()
	other, w := st.Ports[0], st.Ports[1]
	if other.Service != "default/other" || other.Protocol != "UDP" || len(other.Endpoints) != 0 {
		t.Errorf("other: %+v", other)
	}
	if w.Service != "default/web" || w.Port != "http" || w.Family != "IPv4" || int(w.ListenPort) != port ||
		w.Balancer != "round-robin" || w.Affinity != "ClientIP" || w.AffinityTimeoutSeconds != 10800 ||
		len(w.Addresses) != 1 || w.Addresses[0] != "ClusterIP 10.96.0.10:80" || w.Mode != "redirect" {
		t.Errorf("web: %+v", w)
	}
	if len(w.Endpoints) != 3 {
		t.Fatalf("web endpoints: %+v", w.Endpoints)
	}
	for _, e := range w.Endpoints {
		if !e.Ready || !e.Cluster || e.Active != 0 {
			t.Errorf("endpoint %+v", e)
		}
		failed := e.Address == refused.addr.String()
		if e.Ejected != failed || (e.RecentDialErrors > 0) != failed {
			t.Errorf("endpoint %s: ejected %v, %d recent dial errors; want the refused one only", e.Address, e.Ejected, e.RecentDialErrors)
		}
	}
}

func TestServicePortInfoListenPorts(t *testing.T) {
	for _, tt := range []struct {
		port, end uint16
		want      string
	}{
		{40000, 0, "40000"},
		{40000, 40000, "40000"},
		{40000, 40015, "40000-40015"},
	} {
		if got := (introspect.ServicePortInfo{ListenPort: tt.port, ListenPortEnd: tt.end}).ListenPorts(); got != tt.want {
			t.Errorf("ports %d to %d: got %q, want %q", tt.port, tt.end, got, tt.want)
		}
	}
}

// TestStatusDataPath: the status says what carries the connections, as
// `uproxy status` and the startup log show it.
func TestStatusDataPath(t *testing.T) {
	ringErr := datapath.IOURingSupported()
	for _, tt := range []struct {
		name      string
		cfg       Config
		wantLoops int
		wantIO    string
		needRing  bool
	}{
		{"default", Config{}, max(1, runtime.GOMAXPROCS(0)-1), "epoll", false},
		{"epoll", Config{Config: datapath.Config{EventLoops: 2}}, 2, "epoll", false},
		{"io_uring", Config{Config: datapath.Config{EventLoops: 2, IOURing: true}}, 2, "io_uring", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.needRing && ringErr != nil {
				t.Skipf("skipping: io_uring is not available here: %v", ringErr)
			}
			st := NewProxier(tt.cfg).Status()
			if st.EventLoops != tt.wantLoops || st.IO != tt.wantIO {
				t.Errorf("Status() says %d loops on %q, want %d on %q", st.EventLoops, st.IO, tt.wantLoops, tt.wantIO)
			}
		})
	}
}
