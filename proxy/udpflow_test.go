package proxy

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
)

// TestFlowTouchNeverRevivesAReplacedFlow races a flow's touch, as its reply
// goroutine makes it, against the flow's replacement, as the listener's
// goroutine makes it when the flow's backend is ejected (udpFlowFor). A
// touch that found the flow current and then added it back after its
// replacement overwrote the replacement without ending it: its socket and
// goroutine stayed, out of the table, until the process exited (#30).
func TestFlowTouchNeverRevivesAReplacedFlow(t *testing.T) {
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	p := &Proxier{}
	key := flowKey{client: netip.MustParseAddrPort("10.244.0.5:40000"), dst: netip.MustParseAddrPort("10.96.0.10:53")}
	// Closing a flow closes conn, which each flow shares: a second close
	// of it changes nothing.
	newFlow := func() *udpFlow { return &udpFlow{p: p, key: key, conn: conn, fd: -1} }
	first := newFlow()
	p.addFlow(first)
	var current atomic.Pointer[udpFlow]
	current.Store(first)
	all := []*udpFlow{first}

	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			f := current.Load()
			f.refreshed.Store(math.MinInt64 / 2) // due for a refresh
			f.touch(p)
		}
	}()
	for range 100000 {
		old, f := current.Load(), newFlow()
		p.removeFlow(old)
		p.addFlow(f)
		current.Store(f)
		all = append(all, f)
	}
	close(stop)
	<-done

	in, ok := p.flowTable().Peek(key)
	if !ok {
		t.Fatal("the table lost the key's flow")
	}
	if in.closed.Load() {
		t.Error("the table holds a flow that was replaced and ended")
	}
	leaked := 0
	for _, f := range all {
		if f != in && !f.closed.Load() {
			leaked++
		}
	}
	if leaked > 0 {
		t.Errorf("%d of %d replaced flows were never ended: a touch put their predecessor back over them", leaked, len(all)-1)
	}
}

// TestUDPListenerForwardsOnlyRedirectedFlows runs a UDP service port on a
// listener of its own in redirect mode, with UDPOriginalDst standing for
// conntrack: a flow whose original destination is the service's address
// is forwarded; one that conntrack knows nothing of, or whose original
// destination is the listener's own port (sent there straight, not
// redirected), is dropped and counted, on every data path. Before, the
// listener forwarded any datagram, so a cluster DNS service answered
// anyone who found its listener's port, from outside the node too (#30).
func TestUDPListenerForwardsOnlyRedirectedFlows(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		a := udpBackend(t, "a", false)
		var mu sync.Mutex
		dsts := map[uint16]netip.AddrPort{} // conntrack's original destinations, by client port
		lookups := 0
		reg := prometheus.NewRegistry()
		p, rules := startProxier(t, Config{
			EventLoops: dp.loops, IOURing: dp.ring, Metrics: NewMetrics(reg),
			UDPOriginalDst: func(client, local netip.AddrPort) (netip.AddrPort, error) {
				mu.Lock()
				defer mu.Unlock()
				lookups++
				d, ok := dsts[client.Port()]
				if !ok {
					return d, errors.New("no conntrack entry")
				}
				return d, nil
			},
		})
		p.Tracker().Replace([]*v1.Service{udpMode(svc("dns", "10.96.0.53", "dns:53/UDP"), "flow")}, udpSlices("dns", a))
		port := rules.port(t, "default/dns:dns")
		client := func(dst string) *net.UDPConn {
			c := dialUDP(t, port)
			if dst != "" {
				mu.Lock()
				dsts[netip.MustParseAddrPort(c.LocalAddr().String()).Port()] = netip.MustParseAddrPort(dst)
				mu.Unlock()
			}
			return c
		}
		redirected := client("10.96.0.53:53")
		for range 3 {
			if got := exchange(t, redirected, []byte("q")); got != "a:1" {
				t.Errorf("a redirected flow got %q", got)
			}
		}
		for name, c := range map[string]*net.UDPConn{
			"no conntrack entry":        client(""),
			"sent straight to the port": client(fmt.Sprintf("192.0.2.1:%d", port)),
		} {
			c.Write([]byte("lost"))
			c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			if n, err := c.Read(make([]byte, 100)); err == nil {
				t.Errorf("%s: a datagram that was not redirected got a %d-byte reply", name, n)
			}
		}
		mu.Lock()
		if lookups != 3 {
			t.Errorf("%d original destination lookups, want one per flow: 3", lookups)
		}
		mu.Unlock()
		if n := p.UDPFlows(); n != 1 {
			t.Errorf("%d flows, want 1", n)
		}
		if got, _ := scrape(t, reg, "uproxy_connections_total", map[string]string{"result": "refused_destination"}); got != 2 {
			t.Errorf("uproxy_connections_total{result=refused_destination} = %v, want 2", got)
		}
	})
}
