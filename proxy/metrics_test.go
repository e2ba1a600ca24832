package proxy

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/promtest"
	"github.com/uproxy/uproxy/internal/testwait"
)

// scrape gathers reg and returns the sum of the samples of metric name
// whose labels include want (for histograms: the sample count), and how
// many series matched.
func scrape(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) (sum float64, series int) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return promtest.Sum(mf, want)
		}
	}
	return sum, series
}

func TestMetricsCountConnectionsAndSyncs(t *testing.T) {
	reg := prometheus.NewRegistry()
	a, b := nameBackend(t, "a"), nameBackend(t, "b")
	refused := nameBackend(t, "refused")
	refused.ln.Close()
	p, rules := startProxier(t, Config{Config: datapath.Config{EjectBase: time.Minute}, Metrics: introspect.NewMetrics(reg)})
	web := svc("web", "10.96.0.10", "http:80")
	sl := slicesFor("web", "http", a, b, refused)
	// A change triggered now (after uproxy started; older ones are not
	// counted): its programming latency is observed.
	sl[0].Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: time.Now().Format(time.RFC3339Nano)}
	p.Tracker().Replace([]*v1.Service{web}, sl)
	port := rules.port(t, "default/web:http")
	const n = 20
	for i := range n {
		if _, err := get(t, port); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	svcLabels := map[string]string{"service": "default/web", "port": "http"}
	with := func(kv ...string) map[string]string {
		m := map[string]string{"service": "default/web", "port": "http"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"uproxy_connections_total", with("backend", a.addr.String(), "result", "ok"), n / 2},
		{"uproxy_connections_total", with("backend", b.addr.String(), "result", "ok"), n / 2},
		{"uproxy_connections_total", with("result", "ok"), n},
		{"uproxy_connections_total", with("result", "dial_error"), 0},
		// The refused backend was picked once, failed and was ejected.
		{"uproxy_balancer_picks_total", map[string]string{"service": "default/web"}, n + 1},
		{"uproxy_balancer_picks_total", map[string]string{"backend": refused.addr.String()}, 1},
		{"uproxy_dial_errors_total", map[string]string{"reason": "refused"}, 1},
		{"uproxy_dial_duration_seconds", nil, n + 1},
		{"uproxy_bytes_total", with("direction", "downstream"), n * 2}, // "a\n" or "b\n"
		{"uproxy_bytes_total", with("direction", "upstream"), 0},
		{"kubeproxy_network_programming_duration_seconds", nil, 1},
	} {
		// The byte counts and the active gauge settle when the proxy sees
		// each connection end, just after the client does.
		testwait.Until(t, 5*time.Second, fmt.Sprintf("%s%v = %v", c.name, c.labels, c.want), func() bool {
			got, _ := scrape(t, reg, c.name, c.labels)
			return got == c.want
		})
	}
	testwait.Until(t, 5*time.Second, "no active connections", func() bool {
		got, series := scrape(t, reg, "uproxy_active_connections", svcLabels)
		return got == 0 && series == 1
	})
	for _, name := range []string{"kubeproxy_sync_proxy_rules_duration_seconds", "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
		"kubeproxy_sync_proxy_rules_service_changes_total", "kubeproxy_sync_proxy_rules_endpoint_changes_total"} {
		if got, _ := scrape(t, reg, name, nil); got < 1 {
			t.Errorf("%s = %v, want > 0", name, got)
		}
	}

	// An active connection shows in the gauge.
	hold := make(chan struct{})
	held := startBackend(t, func(c net.Conn) { fmt.Fprintln(c, "held"); <-hold })
	defer close(hold)
	p.Tracker().Replace([]*v1.Service{web}, slicesFor("web", "http", held))
	testwait.Until(t, 5*time.Second, "the old backends' series to go", func() bool {
		_, sa := scrape(t, reg, "uproxy_connections_total", map[string]string{"backend": a.addr.String()})
		_, sp := scrape(t, reg, "uproxy_balancer_picks_total", map[string]string{"backend": refused.addr.String()})
		return sa == 0 && sp == 0
	})
	c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	if got, _ := scrape(t, reg, "uproxy_active_connections", svcLabels); got != 1 {
		t.Errorf("active connections = %v with one held open, want 1", got)
	}
	c.Close()

	// Deleting the service deletes its series.
	p.Tracker().Replace(nil, nil)
	testwait.Until(t, 5*time.Second, "the service's series to go", func() bool {
		for _, name := range []string{"uproxy_connections_total", "uproxy_active_connections", "uproxy_bytes_total", "uproxy_balancer_picks_total"} {
			if _, series := scrape(t, reg, name, map[string]string{"service": "default/web"}); series != 0 {
				return false
			}
		}
		return true
	})
}

func TestMetricsNoEndpointsAndRefusedDestination(t *testing.T) {
	reg := prometheus.NewRegistry()
	p, rules := startProxier(t, Config{
		Config: datapath.Config{
			// Every connection claims to be for another address.
			OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) {
				return netip.MustParseAddrPort("10.1.2.3:80"), nil
			},
		},
		Metrics: introspect.NewMetrics(reg),
	})
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", nameBackend(t, "a")))
	if _, err := get(t, rules.port(t, "default/web:http")); err == nil {
		t.Error("connection to another destination not refused")
	}
	testwait.Until(t, 5*time.Second, "refused_destination", func() bool {
		got, _ := scrape(t, reg, "uproxy_connections_total", map[string]string{"service": "default/web", "result": "refused_destination", "backend": ""})
		return got == 1
	})

	// Without a destination check, a service without endpoints.
	reg2 := prometheus.NewRegistry()
	p2, rules2 := startProxier(t, Config{Metrics: introspect.NewMetrics(reg2)})
	p2.Tracker().Replace([]*v1.Service{svc("empty", "10.96.0.11", "http:80")}, nil)
	if _, err := get(t, rules2.port(t, "default/empty:http")); err == nil {
		t.Error("connection to a service without endpoints not refused")
	}
	testwait.Until(t, 5*time.Second, "no_endpoints", func() bool {
		got, _ := scrape(t, reg2, "uproxy_connections_total", map[string]string{"service": "default/empty", "result": "no_endpoints"})
		return got == 1
	})
}
