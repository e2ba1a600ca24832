package proxy

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testbackend"
	"github.com/uproxy/uproxy/internal/testwait"
)

// udpBackend answers every datagram with "name:" and the datagram's
// length, or echoes it when echo is set.
func udpBackend(t testing.TB, name string, echo bool) netip.AddrPort {
	return testbackend.UDP(t, name, echo)
}

func udpSlice(name, svc string, backends ...netip.AddrPort) *discovery.EndpointSlice {
	s := slice(name, svc, "dns", int32(backends[0].Port()))
	s.Ports[0].Protocol = ptr.To(v1.ProtocolUDP)
	for _, b := range backends {
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{Addresses: []string{b.Addr().String()}, Conditions: discovery.EndpointConditions{Ready: ptr.To(true)}})
	}
	return s
}

// udpSlices gives each backend (with its own port) its own slice.
func udpSlices(svc string, backends ...netip.AddrPort) []*discovery.EndpointSlice {
	var out []*discovery.EndpointSlice
	for i, b := range backends {
		out = append(out, udpSlice(fmt.Sprintf("%s-%d", svc, i), svc, b))
	}
	return out
}

// exchange sends msg from a connected client socket and returns the reply:
// a connected socket accepts only replies from the address it sent to.
func exchange(t *testing.T, c *net.UDPConn, msg []byte) string {
	t.Helper()
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	buf := make([]byte, 65535)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatalf("no reply: %v", err)
	}
	return string(buf[:n])
}

func dialUDP(t testing.TB, port int) *net.UDPConn {
	t.Helper()
	c, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestUDPFlows(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		a, b := udpBackend(t, "a", false), udpBackend(t, "b", false)
		p, rules := startProxier(t, Config{Config: datapath.Config{IOURing: dp.ring, UDPTimeout: 300 * time.Millisecond}})
		dns := udpMode(svc("dns", "10.96.0.10", "dns:53/UDP"), "flow")
		p.Tracker().Replace([]*v1.Service{dns}, udpSlices("dns", a, b))
		port := rules.port(t, "default/dns:dns")

		// Each client sticks to one backend; two clients spread over both.
		c1, c2 := dialUDP(t, port), dialUDP(t, port)
		first := exchange(t, c1, []byte("hello"))
		for range 5 {
			if got := exchange(t, c1, []byte("hello")); got != first {
				t.Fatalf("flow moved from %q to %q", first, got)
			}
		}
		second := exchange(t, c2, []byte("hi"))
		if first[:1] == second[:1] {
			t.Errorf("two clients on the same backend %q under round-robin", first[:1])
		}
		if p.UDPFlows() != 2 {
			t.Errorf("%d flows, want 2", p.UDPFlows())
		}

		// Datagrams up to the maximum size are forwarded whole.
		if got := exchange(t, c1, bytes.Repeat([]byte{'x'}, 65507)); !strings.HasSuffix(got, ":65507") {
			t.Errorf("max-size datagram: backend saw %q", got)
		}

		// c1's backend is removed: its next datagram moves to the other one.
		var keep netip.AddrPort
		if first[:1] == "a" {
			keep = b
		} else {
			keep = a
		}
		p.Tracker().Replace([]*v1.Service{dns}, udpSlices("dns", keep))
		testwait.Until(t, 5*time.Second, "c1 moves to the live backend", func() bool {
			return exchange(t, c1, []byte("again"))[:1] != first[:1]
		})

		// Idle flows expire.
		testwait.Until(t, 5*time.Second, "flows expire", func() bool { return p.UDPFlows() == 0 })
	})
}

func TestUDPEjectsRefusingBackend(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		good := udpBackend(t, "good", false)
		// A port nobody listens on answers with ICMP port unreachable.
		dead, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		deadAddr := netip.MustParseAddrPort(dead.LocalAddr().String())
		dead.Close()
		p, rules := startProxier(t, Config{Config: datapath.Config{IOURing: dp.ring, EjectBase: time.Minute}})
		p.Tracker().Replace([]*v1.Service{svc("dns", "10.96.0.10", "dns:53/UDP")}, udpSlices("dns", deadAddr, good))
		port := rules.port(t, "default/dns:dns")
		// Whichever client lands on the dead backend first loses that datagram
		// (UDP has no retry), but the backend is ejected and no later datagram
		// is lost.
		for i := range 4 {
			c := dialUDP(t, port)
			c.Write([]byte("probe"))
			c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
			c.Read(make([]byte, 100))
			_ = i
		}
		for i := range 10 {
			c := dialUDP(t, port)
			if got := exchange(t, c, []byte("x")); !strings.HasPrefix(got, "good:") {
				t.Fatalf("client %d got %q", i, got)
			}
		}
	})
}

func TestUDPNoLeaks(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		echo := udpBackend(t, "", true)
		baseG, baseFD := runtime.NumGoroutine(), countFDs(t)
		func() {
			reg := prometheus.NewRegistry()
			// Without pooling, every one-query client is a flow
			// (TestUDPPoolNoLeaks checks the pools).
			p, rules := startProxier(t, Config{Config: datapath.Config{IOURing: dp.ring, UDPMaxFlows: 50, UDPPoolSize: -1}, Metrics: introspect.NewMetrics(reg)})
			p.Tracker().Replace([]*v1.Service{svc("dns", "10.96.0.10", "dns:53/UDP")}, udpSlices("dns", echo))
			port := rules.port(t, "default/dns:dns")
			for range 200 {
				c := dialUDP(t, port)
				exchange(t, c, []byte("x"))
				c.Close()
			}
			if n := p.UDPFlows(); n > 50 {
				t.Errorf("%d flows, above the bound of 50", n)
			}
			// Each flow past the 50th made the table end its oldest one.
			// (Not one per client: the kernel may give a closed client's
			// port to the next, which then finds its flow still there.)
			opened, _ := scrape(t, reg, "uproxy_connections_total", map[string]string{"result": "ok"})
			if got, _ := scrape(t, reg, "uproxy_udp_flows_evicted_total", nil); opened < 100 || got != opened-50 {
				t.Errorf("uproxy_udp_flows_evicted_total = %v after %v flows; want all but 50 of them", got, opened)
			}
			// Evicted flows close their sockets: at most the 50 flows',
			// the listener's and the event loop's remain.
			testwait.Until(t, 5*time.Second, "evicted flows' sockets close", func() bool { return countFDs(t) <= baseFD+50+4 })
			p.Shutdown(t.Context())
		}()
		// One goroutine stays: the flow table's expiry loop (see flowTable).
		testwait.Until(t, 5*time.Second, "goroutines and descriptors return to baseline", func() bool {
			return runtime.NumGoroutine() <= baseG+2 && countFDs(t) <= baseFD
		})
	})
}
