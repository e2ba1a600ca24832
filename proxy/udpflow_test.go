package proxy

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
)

// TestUDPListenerForwardsOnlyRedirectedFlows runs a UDP service port on a
// listener of its own in redirect mode, with UDPOriginalDst standing for
// conntrack: a flow whose original destination is the service's address
// is forwarded; one that conntrack knows nothing of, or whose original
// destination is the listener's own port (sent there straight, not
// redirected), is dropped and counted, on every data path. Before, the
// listener forwarded any datagram, so a cluster DNS service answered
// anyone who found its listener's port, from outside the node too.
// The recording rules stand for a kernel without the listener guard, so
// UDPCheckEveryFlow keeps the check that a guarded listener skips.
func TestUDPListenerForwardsOnlyRedirectedFlows(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		a := udpBackend(t, "a", false)
		var mu sync.Mutex
		dsts := map[uint16]netip.AddrPort{} // conntrack's original destinations, by client port
		lookups := 0
		reg := prometheus.NewRegistry()
		p, rules := startProxier(t, Config{
			Config: datapath.Config{
				IOURing: dp.ring,
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
			},
			Metrics:           introspect.NewMetrics(reg),
			UDPCheckEveryFlow: true,
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
