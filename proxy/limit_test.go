package proxy

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testbackend"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/service"
)

// TestDefaultConnectionLimit checks that Defaults.MaxConnections bounds
// the service ports of a Service without the annotation, and that the
// annotation overrides it, up or down.
func TestDefaultConnectionLimit(t *testing.T) {
	for _, tt := range []struct {
		name string
		ann  map[string]string
		def  int
		want int
	}{
		{"no default, no annotation", nil, 0, 0},
		{"the default", nil, 384, 384},
		{"the annotation, below", map[string]string{service.AnnotationMaxConnections: "10"}, 384, 10},
		{"the annotation, above", map[string]string{service.AnnotationMaxConnections: "1000"}, 384, 1000},
		{"an invalid annotation: the default", map[string]string{service.AnnotationMaxConnections: "x"}, 384, 384},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := svc("web", "10.96.0.10", "http:80")
			s.Annotations = tt.ann
			if got := service.Ports(s, service.Defaults{MaxConnections: tt.def})[0].MaxConnections; got != tt.want {
				t.Errorf("MaxConnections = %d, want %d", got, tt.want)
			}
		})
	}
}

func TestConnectionLimitAnnotations(t *testing.T) {
	type limits struct{ Total, PerEndpoint int }
	tests := []struct {
		name     string
		ann      map[string]string
		want     limits
		warnings []string // substrings, one per expected warning
	}{
		{"none", nil, limits{}, nil},
		{"both", map[string]string{service.AnnotationMaxConnections: "100", service.AnnotationMaxConnectionsPerEndpoint: "10"}, limits{100, 10}, nil},
		{"spaces", map[string]string{service.AnnotationMaxConnections: " 7 "}, limits{Total: 7}, nil},
		{"one", map[string]string{service.AnnotationMaxConnectionsPerEndpoint: "1"}, limits{PerEndpoint: 1}, nil},
		{"largest", map[string]string{service.AnnotationMaxConnections: "2147483647"}, limits{Total: 2147483647}, nil},
		{"zero", map[string]string{service.AnnotationMaxConnections: "0"},
			limits{}, []string{`annotation uproxy.io/max-connections: "0" is not an integer in 1-2147483647`}},
		{"negative", map[string]string{service.AnnotationMaxConnectionsPerEndpoint: "-5"},
			limits{}, []string{`annotation uproxy.io/max-connections-per-endpoint: "-5" is not an integer`}},
		{"too big", map[string]string{service.AnnotationMaxConnections: "2147483648"},
			limits{}, []string{`"2147483648" is not an integer in 1-2147483647`}},
		{"not a number", map[string]string{service.AnnotationMaxConnections: "lots", service.AnnotationMaxConnectionsPerEndpoint: "4"},
			limits{PerEndpoint: 4}, []string{`uproxy.io/max-connections: "lots"`}},
		{"fraction", map[string]string{service.AnnotationMaxConnections: "1.5"}, limits{}, []string{`"1.5"`}},
		{"empty", map[string]string{service.AnnotationMaxConnections: ""}, limits{}, []string{`uproxy.io/max-connections: ""`}},
		{"both invalid", map[string]string{service.AnnotationMaxConnections: "x", service.AnnotationMaxConnectionsPerEndpoint: "y"},
			limits{}, []string{`uproxy.io/max-connections: "x"`, `uproxy.io/max-connections-per-endpoint: "y"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := svc("web", "10.96.0.10", "http:80", "dns:53/UDP")
			s.Annotations = tt.ann
			// An invalid limit never rejects the Service.
			if err := service.ValidateService(s); err != nil {
				t.Fatalf("ValidateService() = %v, want nil", err)
			}
			ports := service.Ports(s, service.Defaults{})
			if len(ports) != 2 {
				t.Fatalf("service.Ports() returned %d ports, want 2", len(ports))
			}
			for _, sp := range ports {
				if diff := cmp.Diff(tt.want, limits{sp.MaxConnections, sp.MaxConnectionsPerEndpoint}); diff != "" {
					t.Errorf("%s limits (-want +got):\n%s", sp.Name, diff)
				}
			}
			warnings := service.Warnings(s)
			if len(warnings) != len(tt.warnings) {
				t.Fatalf("service.Warnings() = %v, want %d warnings", warnings, len(tt.warnings))
			}
			for i, w := range tt.warnings {
				if !strings.Contains(warnings[i].Error(), w) || !strings.Contains(warnings[i].Error(), "ignored") {
					t.Errorf("warning %d = %q, want it to contain %q and say the limit is ignored", i, warnings[i], w)
				}
			}
		})
	}
	skipped := svc("web", "None")
	skipped.Annotations = map[string]string{service.AnnotationMaxConnections: "x"}
	if w := service.Warnings(skipped); w != nil {
		t.Errorf("service.Warnings(headless) = %v, want nil: uproxy does not proxy it", w)
	}
}

// holdingBackend echoes until EOF and counts the connections it accepted.
func holdingBackend(t *testing.T) (*backend, *atomic.Int64) {
	var accepted atomic.Int64
	b := startBackend(t, func(c net.Conn) {
		accepted.Add(1)
		io.Copy(c, c)
	})
	return b, &accepted
}

// open connects to the listener on port of the given family ("tcp4" or
// "tcp6") and checks that the proxy carries a byte both ways. It returns
// the connection, or the error of the exchange.
func open(t *testing.T, network string, port int) (net.Conn, error) {
	t.Helper()
	host := "127.0.0.1"
	if network == "tcp6" {
		host = "::1"
	}
	// The kernel completes the handshake before uproxy accepts, so even a
	// refused connection connects; but a reset that arrives before the
	// dialler checks the socket's error fails the dial itself.
	c, err := net.DialTimeout(network, net.JoinHostPort(host, fmt.Sprint(port)), 2*time.Second)
	if err != nil {
		return nil, err
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	buf := []byte{0}
	_, err = c.Write([]byte{'x'})
	if err == nil {
		_, err = io.ReadFull(c, buf)
	}
	if err == nil && buf[0] != 'x' {
		err = fmt.Errorf("echoed %q, want %q", buf, "x")
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	c.SetDeadline(time.Time{})
	t.Cleanup(func() { c.Close() })
	return c, nil
}

// refused checks that a new connection to port is reset by the proxy.
func refused(t *testing.T, network string, port int, why string) {
	t.Helper()
	c, err := open(t, network, port)
	if err == nil {
		c.Close()
		t.Fatalf("%s: a connection was proxied", why)
	}
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("%s: the refused connection ended with %v, want a reset (ECONNRESET)", why, err)
	}
}

func TestProxyConnectionLimit(t *testing.T) {
	const limit = 3
	be, accepted := holdingBackend(t)
	reg := prometheus.NewRegistry()
	p, rules := startProxier(t, Config{Metrics: introspect.NewMetrics(reg)})
	s := svc("web", "10.96.0.10", "http:80")
	s.Annotations = map[string]string{service.AnnotationMaxConnections: fmt.Sprint(limit)}
	p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", be))
	port := rules.port(t, "default/web:http")

	var held []net.Conn
	for i := range limit {
		c, err := open(t, "tcp4", port)
		if err != nil {
			t.Fatalf("connection %d of %d: %v", i+1, limit, err)
		}
		held = append(held, c)
	}
	refused(t, "tcp4", port, fmt.Sprintf("connection %d with a limit of %d", limit+1, limit))
	if n := accepted.Load(); n != limit {
		t.Errorf("the backend accepted %d connections, want %d: the refused one must not be dialled", n, limit)
	}
	if n, _ := scrape(t, reg, "uproxy_connections_total", map[string]string{"service": "default/web", "result": "limit", "backend": ""}); n != 1 {
		t.Errorf("uproxy_connections_total{result=limit} = %v, want 1", n)
	}

	// An endpoint change keeps the count: the held connections still count.
	be2, _ := holdingBackend(t)
	p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", be, be2))
	testwait.Until(t, 5*time.Second, "the second endpoint is in the snapshot", func() bool {
		st := p.Status()
		return p.ActiveConnections() == limit && len(st.Ports) == 1 && len(st.Ports[0].Endpoints) == 2
	})
	refused(t, "tcp4", port, "over the limit after an endpoint change")

	// A closed connection frees its slot.
	held[0].Close()
	testwait.Until(t, 5*time.Second, "the slot is freed", func() bool { return p.ActiveConnections() == limit-1 })
	if _, err := open(t, "tcp4", port); err != nil {
		t.Fatalf("a new connection after one closed: %v", err)
	}
	refused(t, "tcp4", port, "full again")

	// Raising the limit admits more at once; removing it admits any number.
	s = s.DeepCopy()
	s.Annotations[service.AnnotationMaxConnections] = fmt.Sprint(limit + 1)
	p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", be, be2))
	testwait.Until(t, 5*time.Second, "the raised limit admits one more", func() bool {
		c, err := open(t, "tcp4", port)
		if err == nil {
			held = append(held, c)
		}
		return err == nil
	})
	refused(t, "tcp4", port, "at the raised limit")
	s = s.DeepCopy()
	delete(s.Annotations, service.AnnotationMaxConnections)
	p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", be, be2))
	testwait.Until(t, 5*time.Second, "no limit", func() bool {
		c, err := open(t, "tcp4", port)
		if err == nil {
			held = append(held, c)
		}
		return err == nil
	})
	for range 4 {
		if _, err := open(t, "tcp4", port); err != nil {
			t.Fatalf("without a limit: %v", err)
		}
	}
}

// TestProxyMaxConnections checks the bound of connections across every
// service port (datapath.Config.MaxConnections): past it a connection to
// any service is reset and counted in uproxy_connections_over_max_total,
// whatever each service's own limit.
func TestProxyMaxConnections(t *testing.T) {
	const limit = 2
	be, accepted := holdingBackend(t)
	reg := prometheus.NewRegistry()
	p, rules := startProxier(t, Config{Config: datapath.Config{MaxConnections: limit}, Metrics: introspect.NewMetrics(reg)})
	web, db := svc("web", "10.96.0.10", "http:80"), svc("db", "10.96.0.11", "http:80")
	p.Tracker().Replace([]*v1.Service{web, db}, append(slicesFor("web", "http", be), slicesFor("db", "http", be)...))
	webPort, dbPort := rules.port(t, "default/web:http"), rules.port(t, "default/db:http")
	for _, port := range []int{webPort, dbPort} {
		if _, err := open(t, "tcp4", port); err != nil {
			t.Fatal(err)
		}
	}
	refused(t, "tcp4", webPort, fmt.Sprintf("a third connection with a bound of %d", limit))
	refused(t, "tcp4", dbPort, "another service's, at the bound")
	if n := accepted.Load(); n != limit {
		t.Errorf("the backend accepted %d connections, want %d: the refused ones must not be dialled", n, limit)
	}
	if n, _ := scrape(t, reg, "uproxy_connections_over_max_total", nil); n != 2 {
		t.Errorf("uproxy_connections_over_max_total = %v, want 2", n)
	}
}

// TestProxyConnectionLimitSpansFamilies checks that a dual-stack service
// port's limit counts its IPv4 and IPv6 listeners together.
func TestProxyConnectionLimitSpansFamilies(t *testing.T) {
	if ln, err := net.Listen("tcp6", "[::1]:0"); err != nil {
		t.Skipf("no IPv6 loopback: %v", err)
	} else {
		ln.Close()
	}
	be4, _ := holdingBackend(t)
	ln6, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Fatal(err)
	}
	be6 := startBackendOn(t, ln6, func(c net.Conn) { io.Copy(c, c) })
	p, rules := startProxier(t, Config{})
	s := svc("web", "10.96.0.10", "http:80")
	s.Spec.ClusterIPs = []string{"10.96.0.10", "2001:db8::10"}
	s.Annotations = map[string]string{service.AnnotationMaxConnections: "2"}
	sl := slicesFor("web", "http", be4)
	sl = append(sl, slice("web-v6", "web", "http", int32(be6.addr.Port()), ep{IP: "::1"}))
	p.Tracker().Replace([]*v1.Service{s}, sl)
	rules.port(t, "default/web:http")
	var port4, port6 int
	testwait.Until(t, 5*time.Second, "both listeners", func() bool {
		rules.mu.Lock()
		defer rules.mu.Unlock()
		for _, i := range rules.last {
			if i.VIP.Is4() {
				port4 = int(i.ListenPort)
			} else {
				port6 = int(i.ListenPort)
			}
		}
		return port4 != 0 && port6 != 0
	})
	if _, err := open(t, "tcp4", port4); err != nil {
		t.Fatal(err)
	}
	if _, err := open(t, "tcp6", port6); err != nil {
		t.Fatal(err)
	}
	refused(t, "tcp4", port4, "IPv4 with one IPv4 and one IPv6 connection held")
	refused(t, "tcp6", port6, "IPv6 with one IPv4 and one IPv6 connection held")
}

// startBackendOn is startBackend on a given listener.
func startBackendOn(t *testing.T, ln net.Listener, handle func(net.Conn)) *backend {
	return wrapBackend(testbackend.ServeTCP(t, ln, handle))
}

func TestProxyPerEndpointLimit(t *testing.T) {
	for _, kind := range []balancer.Kind{balancer.RoundRobin, balancer.LeastConn, balancer.SourceHash} {
		t.Run(string(kind), func(t *testing.T) {
			const perEndpoint = 2
			a, acceptedA := holdingBackend(t)
			b, acceptedB := holdingBackend(t)
			reg := prometheus.NewRegistry()
			p, rules := startProxier(t, Config{Metrics: introspect.NewMetrics(reg)})
			s := svc("web", "10.96.0.10", "http:80")
			s.Annotations = map[string]string{
				service.AnnotationBalancer:                  string(kind),
				service.AnnotationMaxConnectionsPerEndpoint: fmt.Sprint(perEndpoint),
			}
			p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", a, b))
			port := rules.port(t, "default/web:http")

			// Source-hash sends every connection from 127.0.0.1 to the same
			// endpoint: the full one must be skipped for the other.
			var held []net.Conn
			for i := range 2 * perEndpoint {
				c, err := open(t, "tcp4", port)
				if err != nil {
					t.Fatalf("connection %d: %v", i+1, err)
				}
				held = append(held, c)
			}
			if na, nb := acceptedA.Load(), acceptedB.Load(); na != perEndpoint || nb != perEndpoint {
				t.Fatalf("endpoints accepted %d and %d connections, want %d each", na, nb, perEndpoint)
			}
			refused(t, "tcp4", port, "every endpoint full")
			if na, nb := acceptedA.Load(), acceptedB.Load(); na+nb != 2*perEndpoint {
				t.Errorf("a full endpoint was dialled: %d and %d accepted", na, nb)
			}
			if n, _ := scrape(t, reg, "uproxy_connections_total", map[string]string{"result": "endpoint_limit", "backend": ""}); n != 1 {
				t.Errorf("uproxy_connections_total{result=endpoint_limit} = %v, want 1", n)
			}
			if n, _ := scrape(t, reg, "uproxy_connections_total", map[string]string{"result": "limit"}); n != 0 {
				t.Errorf("uproxy_connections_total{result=limit} = %v, want 0 (no service-port limit)", n)
			}

			// Free one slot on each side in turn: the next connection goes
			// to the endpoint with room, whatever the balancer picks.
			for i, c := range held[:2] {
				beforeA, beforeB := acceptedA.Load(), acceptedB.Load()
				c.Close()
				testwait.Until(t, 5*time.Second, "a slot is freed", func() bool { return p.ActiveConnections() == 2*perEndpoint-1 })
				if _, err := open(t, "tcp4", port); err != nil {
					t.Fatalf("after freeing slot %d: %v", i, err)
				}
				if acceptedA.Load()+acceptedB.Load() != beforeA+beforeB+1 {
					t.Fatalf("after freeing slot %d: %d+%d accepted, want one more than %d+%d", i, acceptedA.Load(), acceptedB.Load(), beforeA, beforeB)
				}
				refused(t, "tcp4", port, "full again")
			}
		})
	}
}

// TestInvalidLimitIsLoggedOnce checks that a Service with an invalid limit
// is proxied without it, and that the warning names the object and is not
// repeated by the periodic full resyncs.
func TestInvalidLimitIsLoggedOnce(t *testing.T) {
	be, _ := holdingBackend(t)
	core, logs := observer.New(zap.InfoLevel) // the syncs too, to count them
	p, rules := startProxier(t, Config{Config: datapath.Config{Logger: zap.New(core)}, Sync: changes.RunnerConfig{MaxInterval: 20 * time.Millisecond}})
	s := svc("web", "10.96.0.10", "http:80")
	s.Annotations = map[string]string{service.AnnotationMaxConnections: "unlimited"}
	p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", be))
	port := rules.port(t, "default/web:http")
	for range 5 {
		if _, err := open(t, "tcp4", port); err != nil {
			t.Fatalf("the service with an invalid limit does not work: %v", err)
		}
	}
	// Ten periodic full resyncs re-apply the service.
	syncs := logs.FilterMessage("synced").Len()
	testwait.Until(t, 5*time.Second, "ten more syncs", func() bool { return logs.FilterMessage("synced").Len() >= syncs+10 })
	warnings := logs.FilterMessageSnippet("ignoring part of a service").All()
	if len(warnings) != 1 {
		t.Fatalf("%d warnings, want exactly 1: %v", len(warnings), warnings)
	}
	fields := warnings[0].ContextMap()
	if fields["object"] != "default/web" || !strings.Contains(fmt.Sprint(fields["error"]), `uproxy.io/max-connections: "unlimited"`) {
		t.Errorf("warning fields %v: want the object default/web and the annotation's value", fields)
	}

	// A new version with the same mistake is reported again; a fixed one
	// is not.
	s = s.DeepCopy()
	s.Annotations[service.AnnotationMaxConnectionsPerEndpoint] = "0"
	p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", be))
	testwait.Until(t, 5*time.Second, "the new version is reported", func() bool {
		return logs.FilterMessageSnippet("ignoring part of a service").Len() == 3
	})
	s = s.DeepCopy()
	s.Annotations = map[string]string{service.AnnotationMaxConnections: "1"}
	p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", be))
	syncs = logs.FilterMessage("synced").Len()
	testwait.Until(t, 5*time.Second, "five more syncs", func() bool { return logs.FilterMessage("synced").Len() >= syncs+5 })
	if n := logs.FilterMessageSnippet("ignoring part of a service").Len(); n != 3 {
		t.Errorf("%d warnings after the fix, want still 3", n)
	}
}
