package proxy

import (
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/service"
)

// poolBackend is a UDP backend on loopback that records the source
// address of every datagram it gets, and answers each with its name
// unless it is silent.
type poolBackend struct {
	addr netip.AddrPort
	mu   sync.Mutex
	from []netip.AddrPort
}

func newPoolBackend(t *testing.T, name string, silent bool) *poolBackend {
	t.Helper()
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	b := &poolBackend{addr: netip.MustParseAddrPort(pc.LocalAddr().String())}
	done := make(chan struct{})
	go func() { // ends when pc is closed
		defer close(done)
		buf := make([]byte, 65535)
		for {
			_, from, err := pc.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			b.mu.Lock()
			b.from = append(b.from, from)
			b.mu.Unlock()
			if !silent {
				pc.WriteToUDPAddrPort([]byte(name), from)
			}
		}
	}()
	t.Cleanup(func() { pc.Close(); <-done })
	return b
}

// sources returns how many datagrams b got, and from how many source
// ports.
func (b *poolBackend) sources() (datagrams, ports int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	seen := map[netip.AddrPort]bool{}
	for _, f := range b.from {
		seen[f] = true
	}
	return len(b.from), len(seen)
}

// query sends one datagram from a new client socket, as a stub resolver
// does, and returns the reply, or "" after wait.
func query(t *testing.T, port int, wait time.Duration) string {
	t.Helper()
	c := dialUDP(t, port)
	defer c.Close()
	if _, err := c.Write([]byte("q")); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(wait))
	buf := make([]byte, 100)
	n, err := c.Read(buf)
	if err != nil {
		return ""
	}
	return string(buf[:n])
}

// longFlowWindow is the data path's (datapath/udppool.go): how soon after
// its reply a client that sends again from its port is taken for a long
// flow.
const longFlowWindow = 50 * time.Millisecond

// poolCounts is what a test reads of the pools.
type poolCounts struct {
	Sent, Dropped, Timeout, LongFlow float64
	Flows                            int     // in the flow table
	Open                             float64 // uproxy_udp_pool_sockets
}

func readPoolCounts(t *testing.T, reg *prometheus.Registry, p *Proxier) poolCounts {
	t.Helper()
	get := func(r string) float64 {
		v, _ := scrape(t, reg, "uproxy_udp_pool_queries_total", map[string]string{"result": r})
		return v
	}
	c := poolCounts{Sent: get("sent"), Dropped: get("dropped"), Timeout: get("timeout"), LongFlow: get("long_flow"),
		Flows: p.UDPFlows()}
	c.Open, _ = scrape(t, reg, "uproxy_udp_pool_sockets", nil)
	return c
}

// poolSockets reads uproxy_udp_pool_sockets.
func poolSockets(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	v, _ := scrape(t, reg, "uproxy_udp_pool_sockets", nil)
	return v
}

// udpMode sets s's uproxy.io/udp-mode annotation.
func udpMode(s *v1.Service, mode string) *v1.Service {
	if s.Annotations == nil {
		s.Annotations = map[string]string{}
	}
	s.Annotations[service.AnnotationUDPMode] = mode
	return s
}

// TestUDPPool checks the socket pools of request–reply queries:
// one socket carries query after query (checkout and return); a query
// without a reply closes its socket after the query timeout; a pool at
// its bound drops and counts what it cannot carry; the pool of an
// endpoint removed from the service gets no queries and closes its
// sockets; in auto mode a client that sends again is a long flow, in the
// table; in flow mode every client is one.
func TestUDPPool(t *testing.T) {
	type env struct {
		p    *Proxier
		reg  *prometheus.Registry
		port int
		a, b *poolBackend
	}
	for _, dp := range []struct {
		name string
		ring bool
	}{{"loops", false}, {"ring", true}} {
		t.Run(dp.name, func(t *testing.T) {
			if dp.ring {
				if err := datapath.IOURingSupported(); err != nil {
					t.Skipf("skipping: the event loops cannot use io_uring here: %v", err)
				}
			}
			for _, tt := range []struct {
				name string
				mode string // the annotation; "": none, request-reply on port 53
				cfg  Config
				// silent backends never answer.
				silent bool
				// run drives the proxier, whose service forwards to backend a,
				// and returns what the backends saw.
				run  func(t *testing.T, e env) any
				want any
				// counts, after run once the pools have settled; nil: not
				// checked.
				counts *poolCounts
			}{{
				name: "one socket carries query after query",
				run: func(t *testing.T, e env) any {
					for i := range 20 {
						if got := query(t, e.port, 3*time.Second); got != "a" {
							t.Fatalf("query %d: reply %q", i, got)
						}
					}
					n, ports := e.a.sources()
					return [2]int{n, ports}
				},
				want:   [2]int{20, 1},
				counts: &poolCounts{Sent: 20, Open: 1},
			}, {
				name: "a client that keeps its port sends queries too",
				run: func(t *testing.T, e env) any {
					c := dialUDP(t, e.port)
					for range 5 {
						exchange(t, c, []byte("q"))
					}
					n, ports := e.a.sources()
					return [2]int{n, ports}
				},
				want:   [2]int{5, 1},
				counts: &poolCounts{Sent: 5, Open: 1},
			}, {
				name: "two queries at once from one port both get their replies",
				run: func(t *testing.T, e env) any {
					// As glibc and musl ask for A and AAAA.
					c := dialUDP(t, e.port)
					c.Write([]byte("A"))
					c.Write([]byte("AAAA"))
					var got []string
					buf := make([]byte, 10)
					for range 2 {
						c.SetReadDeadline(time.Now().Add(3 * time.Second))
						n, err := c.Read(buf)
						if err != nil {
							t.Fatalf("after %d replies: %v", len(got), err)
						}
						got = append(got, string(buf[:n]))
					}
					return got
				},
				want: []string{"a", "a"},
			}, {
				name:   "a query without a reply closes its socket",
				cfg:    Config{Config: datapath.Config{UDPQueryTimeout: 50 * time.Millisecond}},
				silent: true,
				run: func(t *testing.T, e env) any {
					for range 2 {
						query(t, e.port, 150*time.Millisecond)
					}
					// Each query got a socket of its own: the first one's was
					// closed when the query timed out.
					testwait.Until(t, 5*time.Second, "the backend gets both", func() bool { n, _ := e.a.sources(); return n == 2 })
					n, ports := e.a.sources()
					return [2]int{n, ports}
				},
				want:   [2]int{2, 2},
				counts: &poolCounts{Sent: 2, Timeout: 2},
			}, {
				name:   "a pool at its bound drops queries",
				cfg:    Config{Config: datapath.Config{UDPPoolSize: 2, UDPQueryTimeout: 300 * time.Millisecond}},
				silent: true,
				run: func(t *testing.T, e env) any {
					for range 3 {
						dialUDP(t, e.port).Write([]byte("q"))
					}
					testwait.Until(t, 5*time.Second, "a query is dropped", func() bool {
						v, _ := scrape(t, e.reg, "uproxy_udp_pool_queries_total", map[string]string{"result": "dropped"})
						return v == 1
					})
					if open := poolSockets(t, e.reg); open != 2 {
						t.Errorf("%v pooled sockets at the bound of 2", open)
					}
					testwait.Until(t, 5*time.Second, "the backend gets two", func() bool { n, _ := e.a.sources(); return n == 2 })
					n, _ := e.a.sources()
					return n
				},
				want:   2,
				counts: &poolCounts{Sent: 2, Dropped: 1, Timeout: 2},
			}, {
				name: "a removed endpoint's pool gets no queries and closes",
				cfg:  Config{Config: datapath.Config{UDPTimeout: 100 * time.Millisecond}},
				run: func(t *testing.T, e env) any {
					query(t, e.port, 3*time.Second)
					e.p.Tracker().Replace([]*v1.Service{svc("dns", "10.96.0.10", "dns:53/UDP")}, udpSlices("dns", e.b.addr))
					testwait.Until(t, 5*time.Second, "queries go to b", func() bool { return query(t, e.port, 3*time.Second) == "b" })
					before, _ := e.a.sources()
					for range 10 {
						if got := query(t, e.port, 3*time.Second); got != "b" {
							t.Errorf("a query to the service got %q, want b's reply", got)
						}
					}
					after, _ := e.a.sources()
					// The idle pools close: a's, and b's once the test stops
					// querying.
					testwait.Until(t, 5*time.Second, "the pools close", func() bool { return poolSockets(t, e.reg) == 0 })
					return after - before
				},
				want: 0,
			}, {
				name: "auto: one query per client is pooled",
				mode: "auto",
				run: func(t *testing.T, e env) any {
					for range 5 {
						query(t, e.port, 3*time.Second)
						time.Sleep(2 * longFlowWindow) // no port the kernel reuses is taken for a long flow
					}
					n, ports := e.a.sources()
					return [2]int{n, ports}
				},
				want:   [2]int{5, 1},
				counts: &poolCounts{Sent: 5, Open: 1},
			}, {
				name: "auto: a client that sends again is a long flow",
				mode: "auto",
				run: func(t *testing.T, e env) any {
					c := dialUDP(t, e.port)
					for range 5 {
						exchange(t, c, []byte("q"))
					}
					// The first datagram went out on a pooled socket, the
					// others on the flow's own.
					n, ports := e.a.sources()
					return [2]int{n, ports}
				},
				want:   [2]int{5, 2},
				counts: &poolCounts{Sent: 1, Flows: 1, Open: 1},
			}, {
				name:   "auto: a client that sends again before the reply keeps its socket",
				mode:   "auto",
				silent: true,
				run: func(t *testing.T, e env) any {
					c := dialUDP(t, e.port)
					for range 3 {
						c.Write([]byte("q"))
						time.Sleep(10 * time.Millisecond) // sends apart, each before the silent backend's reply
					}
					testwait.Until(t, 5*time.Second, "the backend gets all three", func() bool { n, _ := e.a.sources(); return n == 3 })
					n, ports := e.a.sources()
					return [2]int{n, ports}
				},
				want:   [2]int{3, 1},
				counts: &poolCounts{Sent: 1, LongFlow: 1, Flows: 1},
			}, {
				name: "flow: every client is a flow",
				mode: "flow",
				run: func(t *testing.T, e env) any {
					for range 3 {
						query(t, e.port, 3*time.Second)
					}
					n, ports := e.a.sources()
					return [2]int{n, ports}
				},
				want:   [2]int{3, 3},
				counts: &poolCounts{Flows: 3},
			}} {
				t.Run(tt.name, func(t *testing.T) {
					a, b := newPoolBackend(t, "a", tt.silent), newPoolBackend(t, "b", tt.silent)
					reg := prometheus.NewRegistry()
					cfg := tt.cfg
					cfg.EventLoops, cfg.IOURing, cfg.Metrics = 1, dp.ring, introspect.NewMetrics(reg)
					p, rules := startProxier(t, cfg)
					s := svc("dns", "10.96.0.10", "dns:53/UDP")
					if tt.mode != "" {
						udpMode(s, tt.mode)
					}
					p.Tracker().Replace([]*v1.Service{s}, udpSlices("dns", a.addr))
					got := tt.run(t, env{p: p, reg: reg, port: rules.port(t, "default/dns:dns"), a: a, b: b})
					if diff := cmp.Diff(tt.want, got); diff != "" {
						t.Errorf("what the backends saw (-want +got):\n%s", diff)
					}
					if tt.counts == nil {
						return
					}
					want := *tt.counts
					var counts poolCounts
					testwait.Until(t, 5*time.Second, "the pools settle", func() bool {
						counts = readPoolCounts(t, reg, p)
						return counts == want
					})
					if diff := cmp.Diff(want, counts); diff != "" {
						t.Errorf("pool counts (-want +got):\n%s", diff)
					}
				})
			}
		})
	}
}

// TestUDPModeAnnotation checks the default of uproxy.io/udp-mode, which
// pools DNS without any annotation, and its values.
func TestUDPModeAnnotation(t *testing.T) {
	for _, tt := range []struct {
		name, port, mode string
		want             service.UDPMode
		wantErr          bool
	}{
		{name: "DNS by default", port: "dns:53/UDP", want: service.UDPRequestReply},
		{name: "others by default", port: "wg:51820/UDP", want: service.UDPFlow},
		{name: "flow", port: "dns:53/UDP", mode: "flow", want: service.UDPFlow},
		{name: "auto", port: "quic:443/UDP", mode: "auto", want: service.UDPAuto},
		{name: "request-reply", port: "syslog:514/UDP", mode: " request-reply ", want: service.UDPRequestReply},
		{name: "bad", port: "dns:53/UDP", mode: "pooled", wantErr: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := svc("s", "10.96.0.10", tt.port)
			if tt.mode != "" {
				udpMode(s, tt.mode)
			}
			err := service.ValidateService(s)
			if (err != nil) != tt.wantErr {
				t.Fatalf("ValidateService: %v, want an error: %v", err, tt.wantErr)
			}
			if err != nil {
				return
			}
			sps := service.Ports(s, service.Defaults{})
			if diff := cmp.Diff(tt.want, sps[0].UDPMode); diff != "" {
				t.Errorf("UDPMode (-want +got):\n%s", diff)
			}
		})
	}
}

// BenchmarkUDPNewPortPerQuery measures DNS-like traffic on loopback:
// clients each send a query from a new socket as soon as the previous one
// was answered through an echo backend, so that every query is a new
// client to the proxy; ns/op is one query and its reply. It compares a
// flow per client with pooled sockets.
func BenchmarkUDPNewPortPerQuery(b *testing.B) {
	for _, mode := range []string{"flow", "request-reply"} {
		b.Run("mode="+mode, func(b *testing.B) {
			echo := udpBackend(b, "", true)
			p, rules := startProxier(b, Config{Config: datapath.Config{EventLoops: 1}})
			p.Tracker().Replace([]*v1.Service{udpMode(svc("dns", "10.96.0.10", "dns:53/UDP"), mode)}, udpSlices("dns", echo))
			port := rules.port(b, "default/dns:dns")
			to := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port}
			var left, lost atomic.Int64
			left.Store(int64(b.N))
			var wg sync.WaitGroup
			b.ReportAllocs()
			b.ResetTimer()
			for range 32 {
				wg.Add(1)
				go func() { // ends when the b.N queries are shared out
					defer wg.Done()
					msg, buf := make([]byte, 64), make([]byte, 256)
					for left.Add(-1) >= 0 {
						c, err := net.DialUDP("udp4", nil, to)
						if err != nil {
							b.Error(err)
							return
						}
						c.Write(msg)
						_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
						if _, err := c.Read(buf); err != nil {
							lost.Add(1)
						}
						c.Close()
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			if n := lost.Load(); n > int64(b.N)/100 {
				b.Errorf("%d of %d queries lost", n, b.N)
			}
		})
	}
}
