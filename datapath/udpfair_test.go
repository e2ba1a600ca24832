package datapath

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/uproxy/uproxy/internal/testwait"
)

// silentUDPBackend is a UDP endpoint on loopback that never answers: its
// socket is open, and nothing reads it.
func silentUDPBackend(t *testing.T) netip.AddrPort {
	t.Helper()
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	return netip.MustParseAddrPort(pc.LocalAddr().String())
}

// serveUDPPort serves the service port name of engine p from bs in
// mode, with metrics and connection slots of its own, as the proxier
// gives each service port.
func serveUDPPort(t *testing.T, p *Engine, name string, mode UDPMode, bs ...netip.AddrPort) (*Listener, *Snapshot) {
	t.Helper()
	l := serve(t, p, "udp4", name, bs...)
	snap := testSnapshot(name, bs...)
	snap.Metrics = testPortMetrics(snap.Backends...)
	snap.Slots = &ConnSlots{}
	snap.UDPMode = mode
	l.Snap.Store(snap)
	return l, snap
}

// loopOf returns the loop that reads UDP listener l, or nil.
func loopOf(l *Listener) *eventLoop {
	if l.raw == nil {
		return nil
	}
	l.raw.mu.Lock()
	defer l.raw.mu.Unlock()
	if len(l.raw.regs) != 1 {
		return nil
	}
	return l.raw.regs[0].loop
}

// TestUDPPoolFairShare runs two request-reply ports on an engine whose
// pooled sockets are bounded to 8: a tenant's, whose 16 endpoints never
// answer, flooded with queries, and a DNS port with an answering
// endpoint. The tenant's queries hold every socket for the query
// timeout, yet every query to DNS is answered: it takes the place of the
// tenant's oldest, whose query is counted as dropped, as are the
// tenant's queries past its share. With two loops the ports are read by
// different loops, and the socket that gives way is the other loop's.
// Before, the tenant held the engine's bound until its queries timed
// out, and every DNS query was dropped.
func TestUDPPoolFairShare(t *testing.T) {
	const poolMax, flood, rounds = 8, 40, 10
	for _, tt := range []struct {
		name  string
		loops int
		ring  bool
	}{
		{"one loop", 1, false},
		{"two loops", 2, false},
		{"two loops with io_uring", 2, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.ring {
				if err := IOURingSupported(); err != nil {
					t.Skipf("skipping: the event loops cannot use io_uring here: %v", err)
				}
			}
			p := startEngine(t, Config{EventLoops: tt.loops, IOURing: tt.ring, UDPPoolMax: poolMax, UDPQueryTimeout: time.Minute})
			var silent []netip.AddrPort
			for range 16 {
				silent = append(silent, silentUDPBackend(t))
			}
			tenant, tsnap := serveUDPPort(t, p, "tenant/flood:dns", UDPRequestReply, silent...)
			dns, dsnap := serveUDPPort(t, p, "kube-system/kube-dns:dns", UDPRequestReply, udpBackend(t, "dns", false))
			if tt.loops > 1 {
				testwait.Until(t, 5*time.Second, "the listeners are registered", func() bool { return loopOf(tenant) != nil && loopOf(dns) != nil })
				if loopOf(tenant) == loopOf(dns) {
					t.Fatal("both listeners are read by one loop")
				}
			}
			type counts struct{ Sent, Dropped, Out, Open int }
			read := func(s *Snapshot) counts {
				m := s.Metrics.M
				p.fair.mu.Lock()
				out := s.Slots.udp.queries.n
				p.fair.mu.Unlock()
				return counts{Sent: int(value(m.UDPPoolQueries[PoolSent])), Dropped: int(value(m.UDPPoolQueries[PoolDropped])), Out: out, Open: int(p.poolOpen.Load())}
			}
			senders := make([]*net.UDPConn, 8)
			for i := range senders {
				senders[i] = dialUDP(t, int(tenant.Port))
			}
			sent := 0
			send := func(n int) {
				for i := range n {
					if _, err := senders[i%len(senders)].Write([]byte("q")); err != nil {
						t.Fatal(err)
					}
				}
				sent += n
				// Each query is out, awaiting its reply, or was dropped: at
				// once, or when a DNS query took its socket.
				testwait.Until(t, 5*time.Second, "the tenant's queries are out or dropped", func() bool {
					c := read(tsnap)
					return c.Out+c.Dropped == sent
				})
			}

			send(flood)
			if diff := cmp.Diff(counts{Sent: poolMax, Dropped: flood - poolMax, Out: poolMax, Open: poolMax}, read(tsnap)); diff != "" {
				t.Fatalf("after the tenant's flood (-want +got):\n%s", diff)
			}
			answered := 0
			for range rounds {
				if got := query(t, dns.Port, 3*time.Second); got == "dns:1" {
					answered++
				}
				send(poolMax) // the tenant takes what it can again
			}
			if answered != rounds {
				t.Errorf("%d of %d queries to DNS answered while the tenant held the pool", answered, rounds)
			}
			if got := read(dsnap); got.Dropped != 0 {
				t.Errorf("%d queries to DNS dropped", got.Dropped)
			}
			if got := read(tsnap); got.Out > poolMax {
				t.Errorf("the tenant has %d queries out, past the bound of %d", got.Out, poolMax)
			}
			testwait.Until(t, 5*time.Second, "the pools are within their bound", func() bool { return p.poolOpen.Load() <= poolMax })
		})
	}
}

// TestUDPFlowTableFairShare runs two flow ports on an engine whose flow
// table is bounded to 16 flows: a DNS port with four clients, and a
// tenant's flooded with clients from new ports. The full table ends the
// tenant's own least recently used flows: the DNS port's flows stay,
// and the tenant keeps its most recent ones, on every data path.
// Before, the table ended its least recently used flows, whichever
// port's: the DNS port's first.
func TestUDPFlowTableFairShare(t *testing.T) {
	const maxFlows, dnsClients, flood = 16, 4, 64
	for _, tt := range []struct {
		name string
		cfg  Config
		ring bool
	}{
		{"loops", Config{EventLoops: 2}, false},
		{"loops with io_uring", Config{EventLoops: 2, IOURing: true}, true},
		// A dialer of the caller's: the listeners are read by goroutines.
		{"goroutines", Config{Dial: func(ctx context.Context, network, address string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, address)
		}}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.ring {
				if err := IOURingSupported(); err != nil {
					t.Skipf("skipping: the event loops cannot use io_uring here: %v", err)
				}
			}
			cfg := tt.cfg
			cfg.UDPMaxFlows = maxFlows
			p := startEngine(t, cfg)
			dns, _ := serveUDPPort(t, p, "kube-system/kube-dns:dns", UDPFlow, udpBackend(t, "dns", false))
			tenant, tsnap := serveUDPPort(t, p, "tenant/flood:dns", UDPFlow, udpBackend(t, "tenant", false))
			// flowsOf returns the client ports of svc's flows, sorted, and
			// the flows by port.
			flowsOf := func(svc *Listener) ([]uint16, map[uint16]*udpFlow) {
				var ports []uint16
				byPort := map[uint16]*udpFlow{}
				flows := p.flowTable()
				for _, k := range flows.Keys() {
					if f, ok := flows.Peek(k); ok && f.svc == svc {
						ports = append(ports, k.client.Port())
						byPort[k.client.Port()] = f
					}
				}
				slices.Sort(ports)
				return ports, byPort
			}
			clientPort := func(c *net.UDPConn) uint16 { return netip.MustParseAddrPort(c.LocalAddr().String()).Port() }

			var clients []*net.UDPConn
			for range dnsClients {
				c := dialUDP(t, int(dns.Port))
				exchange(t, c, []byte("q"))
				clients = append(clients, c)
			}
			before, dnsFlows := flowsOf(dns)
			var recent []uint16 // the tenant's most recent clients
			for i := range flood {
				c := dialUDP(t, int(tenant.Port))
				if _, err := c.Write([]byte("q")); err != nil {
					t.Fatal(err)
				}
				if i >= flood-(maxFlows-dnsClients) {
					recent = append(recent, clientPort(c))
				}
			}
			// The table fills, then each new flow of the tenant's ends one.
			testwait.Until(t, 5*time.Second, "the tenant's flood fills the table", func() bool {
				return int(value(tsnap.Metrics.M.UDPEvicted)) >= flood-(maxFlows-dnsClients)
			})
			after, stayed := flowsOf(dns)
			if diff := cmp.Diff(before, after); diff != "" {
				t.Errorf("the DNS port's flows after the tenant's flood (-before +after):\n%s", diff)
			}
			for port, f := range dnsFlows {
				if stayed[port] != f {
					t.Errorf("the DNS flow of client port %d was replaced", port)
				}
			}
			slices.Sort(recent)
			if got, _ := flowsOf(tenant); !cmp.Equal(recent, got) {
				t.Errorf("the tenant's flows are of client ports %v, want its most recent clients' %v", got, recent)
			}
			for _, c := range clients {
				if got := exchange(t, c, []byte("q")); got != "dns:1" {
					t.Errorf("a DNS client got %q", got)
				}
			}
			if n := p.UDPFlows(); n != maxFlows {
				t.Errorf("%d flows, want the bound, %d", n, maxFlows)
			}
		})
	}
}

// TestUDPFairAccountingDoesNotAllocate checks that what a query and a
// flow do to their port's share, without contention, allocates nothing:
// a checkout and its return, a flow's addition, refresh and removal.
func TestUDPFairAccountingDoesNotAllocate(t *testing.T) {
	var u udpFairness
	a, b := &ConnSlots{}, &ConnSlots{}
	q, f, other := &udpFlow{}, &udpFlow{}, &udpFlow{}
	u.flowAdded(other, b)
	allocs := testing.AllocsPerRun(100, func() {
		u.checkedOut(q, a)
		u.returned(q)
		u.flowAdded(f, b)
		u.flowUsed(other)
		u.flowRemoved(f)
	})
	if allocs != 0 {
		t.Errorf("%v allocations per query and flow", allocs)
	}
}

// TestUDPFairReclaim checks the pool's choice at its bound, by the
// queries each port has out: a port below its share takes the oldest
// socket of the port with the most, if that has two more than it; a port
// at its share, or with none to take from, gets none.
func TestUDPFairReclaim(t *testing.T) {
	const limit = 8
	for _, tt := range []struct {
		name string
		out  []int // queries out, by port; the query is port 0's
		want int   // the port whose socket is taken; -1: none
	}{
		{"a port without queries, from the only one", []int{0, 8}, 1},
		{"from the largest", []int{0, 3, 5}, 2},
		{"below its share, from one two ahead", []int{2, 4, 2}, 1},
		{"below its share, as even as can be", []int{2, 3, 3}, -1},
		{"at its share", []int{4, 4}, -1},
		{"above its share", []int{7, 1}, -1},
		{"the only port", []int{8}, -1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var u udpFairness
			ports := make([]*ConnSlots, len(tt.out))
			oldest := map[*udpFlow]int{}
			for i, n := range tt.out {
				ports[i] = &ConnSlots{}
				for j := range n {
					f := &udpFlow{}
					u.checkedOut(f, ports[i])
					if j == 0 {
						oldest[f] = i
					}
				}
			}
			got := -1
			if f := u.reclaim(ports[0], limit); f != nil {
				i, ok := oldest[f]
				if !ok {
					t.Fatal("the socket taken is not its port's oldest")
				}
				got = i
				if f.fair.on != nil || u.returned(f) {
					t.Error("the socket taken is still among its port's")
				}
			}
			if got != tt.want {
				t.Errorf("took a socket of port %d, want %d", got, tt.want)
			}
		})
	}
}
