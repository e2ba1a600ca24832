package proxy

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/introspect"
)

// TestUDPFairShare runs a tenant's Service on 53/UDP next to the
// cluster's DNS, on two event loops whose UDP bounds are small, and
// floods the tenant's: the DNS Service's queries are all answered though
// the tenant's 16 endpoints never answer and its queries would hold
// every pooled socket for the query timeout; its flows stay though the
// tenant's clients, each from a new port, would fill the flow table.
// The tenant's excess is counted: queries as dropped, flows as evicted.
// Before, one Service could take the engine's bounds whole.
func TestUDPFairShare(t *testing.T) {
	const poolMax, maxFlows = 8, 16
	for _, tt := range []struct {
		name string
		mode string // both Services' uproxy.io/udp-mode
		run  func(t *testing.T, reg *prometheus.Registry, tenant, dns int, dnsBackend *poolBackend)
	}{{
		name: "pooled sockets",
		mode: "request-reply",
		run: func(t *testing.T, reg *prometheus.Registry, tenant, dns int, _ *poolBackend) {
			const flood = 40
			for range flood {
				dialUDP(t, tenant).Write([]byte("q"))
			}
			testwait.Until(t, 5*time.Second, "the tenant holds the pool", func() bool {
				v, _ := scrape(t, reg, "uproxy_udp_pool_queries_total", map[string]string{"result": "dropped"})
				return v == flood-poolMax
			})
			answered := 0
			for range 10 {
				if query(t, dns, 3*time.Second) == "dns" {
					answered++
				}
				for range poolMax {
					dialUDP(t, tenant).Write([]byte("q"))
				}
			}
			if answered != 10 {
				t.Errorf("%d of 10 queries to DNS answered while the tenant flooded", answered)
			}
			testwait.Until(t, 5*time.Second, "the pools are within their bound", func() bool {
				return poolSockets(t, reg) <= poolMax
			})
		},
	}, {
		name: "flows",
		mode: "flow",
		run: func(t *testing.T, reg *prometheus.Registry, tenant, dns int, dnsBackend *poolBackend) {
			const dnsClients, flood = 4, 64
			var clients []*net.UDPConn
			for range dnsClients {
				c := dialUDP(t, dns)
				if got := exchange(t, c, []byte("q")); got != "dns" {
					t.Fatalf("a DNS client got %q", got)
				}
				clients = append(clients, c)
			}
			for range flood {
				dialUDP(t, tenant).Write([]byte("q"))
			}
			testwait.Until(t, 5*time.Second, "the tenant's flood fills the table", func() bool {
				v, _ := scrape(t, reg, "uproxy_udp_flows_evicted_total", nil)
				return v == flood-(maxFlows-dnsClients)
			})
			for _, c := range clients {
				if got := exchange(t, c, []byte("q")); got != "dns" {
					t.Errorf("a DNS client got %q", got)
				}
			}
			// The DNS clients' flows stayed: their second datagrams came
			// from the sockets of their first.
			n, ports := dnsBackend.sources()
			if diff := cmp.Diff([2]int{2 * dnsClients, dnsClients}, [2]int{n, ports}); diff != "" {
				t.Errorf("datagrams and source ports the DNS endpoint saw (-want +got):\n%s", diff)
			}
		},
	}} {
		t.Run(tt.name, func(t *testing.T) {
			eachDataPath(t, func(t *testing.T, dp dataPath) {
				var silent []netip.AddrPort
				for range 16 {
					silent = append(silent, newPoolBackend(t, "tenant", true).addr)
				}
				dnsBackend := newPoolBackend(t, "dns", false)
				reg := prometheus.NewRegistry()
				p, rules := startProxier(t, Config{
					Config: datapath.Config{
						EventLoops: 2, IOURing: dp.ring,
						UDPPoolMax: poolMax, UDPQueryTimeout: time.Minute, UDPMaxFlows: maxFlows,
					},
					Metrics: introspect.NewMetrics(reg),
				})
				p.Tracker().Replace(
					[]*v1.Service{
						udpMode(svc("flood", "10.96.0.20", "dns:53/UDP"), tt.mode),
						udpMode(svc("kube-dns", "10.96.0.10", "dns:53/UDP"), tt.mode),
					},
					append(udpSlices("flood", silent...), udpSlices("kube-dns", dnsBackend.addr)...))
				tt.run(t, reg, rules.port(t, "default/flood:dns"), rules.port(t, "default/kube-dns:dns"), dnsBackend)
			})
		})
	}
}
