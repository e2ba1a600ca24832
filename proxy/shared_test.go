package proxy

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/listeners"
	"github.com/uproxy/uproxy/proxy/service"
)

// TestSharedListenerRoutesByOriginalDestination runs three services on
// one shared TCP listener: each connection goes to the service its
// original destination names (cluster IP, external IP or node port), a
// destination no service has is refused, and services come and go
// without the listener moving.
func TestSharedListenerRoutesByOriginalDestination(t *testing.T) {
	a, b, c := nameBackend(t, "a"), nameBackend(t, "b"), nameBackend(t, "c")
	var mu sync.Mutex
	var dst netip.AddrPort
	setDst := func(s string) {
		mu.Lock()
		defer mu.Unlock()
		dst = netip.MustParseAddrPort(s)
	}
	p, rules := startProxier(t, Config{
		Config: datapath.Config{
			OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) {
				mu.Lock()
				defer mu.Unlock()
				return dst, nil
			},
		},
		PortRange:       quietPorts(t),
		SharedListeners: []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP},
	})
	web := svc("web", "10.96.0.10", "http:80")
	web.Spec.ExternalIPs = []string{"192.0.2.10"}
	api := svc("api", "10.96.0.11", "http:80")
	np := svc("np", "10.96.0.12", "http:8080")
	np.Spec.Type = v1.ServiceTypeNodePort
	np.Spec.Ports[0].NodePort = 30080
	dns := svc("dns", "10.96.0.53", "dns:53/UDP")
	slices := append(append(slicesFor("web", "http", a), slicesFor("api", "http", b)...), slicesFor("np", "http", c)...)
	p.Tracker().Replace([]*v1.Service{web, api, np, dns}, slices)

	port := rules.port(t, "default/web:http")
	testwait.Until(t, 5*time.Second, "every intercept", func() bool { return rules.has("default/np:http") && rules.has("default/api:http") })
	rules.mu.Lock()
	ports := map[string]uint16{}
	for _, i := range rules.last {
		ports[i.Service.String()+" "+i.Kind.String()] = i.ListenPort
	}
	rules.mu.Unlock()
	udp := ports["default/dns:dns ClusterIP"]
	if udp == 0 || udp == uint16(port) {
		t.Errorf("the UDP service's listener port is %d (the TCP one is %d): in redirect mode UDP keeps listeners of its own", udp, port)
	}
	want := map[string]uint16{
		"default/web:http ClusterIP":  uint16(port),
		"default/web:http ExternalIP": uint16(port),
		"default/api:http ClusterIP":  uint16(port),
		"default/np:http ClusterIP":   uint16(port),
		"default/np:http NodePort":    uint16(port),
		"default/dns:dns ClusterIP":   udp,
	}
	if diff := cmp.Diff(want, ports); diff != "" {
		t.Errorf("listener ports of the intercepts (-want +got):\n%s", diff)
	}

	for _, tc := range []struct{ dst, want string }{
		{"10.96.0.10:80", "a"},
		{"192.0.2.10:80", "a"},
		{"10.96.0.11:80", "b"},
		{"10.96.0.12:8080", "c"},
		{"10.244.0.1:30080", "c"}, // a node port, on any local address
		{"10.96.0.99:80", ""},     // no service's
		{"10.96.0.10:81", ""},     // a service's address, another port
	} {
		setDst(tc.dst)
		got, err := get(t, port)
		if tc.want == "" {
			if err == nil {
				t.Errorf("original destination %s: proxied to %q, want refused", tc.dst, got)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("original destination %s: got %q, %v; want %q", tc.dst, got, err, tc.want)
		}
	}

	// The shared TCP listener listens on a range of ports (see
	// listeners.SharedRedirectPorts), every one of them routed alike.
	if end := rules.intercept(t, "default/web:http").ListenPortEnd; end != uint16(port)+listeners.SharedRedirectPorts-1 {
		t.Errorf("the shared TCP listener's ports are %d-%d, want %d of them", port, end, listeners.SharedRedirectPorts)
	}
	setDst("10.96.0.11:80")
	if got, err := get(t, port+listeners.SharedRedirectPorts-1); err != nil || got != "b" {
		t.Errorf("through the shared listener's last port: got %q, %v; want %q", got, err, "b")
	}

	// api goes away: its address is refused, the others still served on
	// the same port.
	p.Tracker().Replace([]*v1.Service{web, np, dns}, append(slicesFor("web", "http", a), slicesFor("np", "http", c)...))
	testwait.Until(t, 5*time.Second, "api gone", func() bool { return !rules.has("default/api:http") })
	setDst("10.96.0.11:80")
	if got, err := get(t, port); err == nil {
		t.Errorf("a deleted service's address was proxied to %q", got)
	}
	setDst("10.96.0.10:80")
	if got, err := get(t, port); err != nil || got != "a" {
		t.Errorf("after another service left: got %q, %v", got, err)
	}
	if got := rules.port(t, "default/web:http"); got != port {
		t.Errorf("the shared listener moved from %d to %d", port, got)
	}
}

// TestSharedListenerHandsOverOneSocketPerProtocol checks that the shared
// layout exports the shared listeners, not the service ports they host,
// and that a successor adopts them: the port stays.
func TestSharedListenerHandsOverOneSocketPerProtocol(t *testing.T) {
	be := nameBackend(t, "a")
	cfg := Config{
		Config: datapath.Config{
			OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) {
				return netip.MustParseAddrPort("10.96.0.10:80"), nil
			},
		},
		PortRange:         quietPorts(t),
		LoopbackEndpoints: true,
		SharedListeners:   []v1.Protocol{v1.ProtocolTCP},
	}
	svcs := []*v1.Service{svc("web", "10.96.0.10", "http:80"), svc("api", "10.96.0.11", "http:80")}
	sl := slicesFor("web", "http", be)

	// ExportListeners wants the sync goroutine stopped: this Proxier is
	// synced by hand instead of running.
	q := NewProxier(cfg)
	q.Tracker().Replace(svcs, sl)
	if err := q.sync(t.Context(), true); err != nil {
		t.Fatal(err)
	}
	socks, err := q.ExportListeners()
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, s := range socks {
		keys = append(keys, s.Key)
	}
	// The shared TCP listener and its further ports (listeners.SharedRedirectPorts).
	want := []string{"tcp4 shared TCP listener"}
	for slot := 1; slot < listeners.SharedRedirectPorts; slot++ {
		want = append(want, fmt.Sprintf("tcp4 shared TCP listener #%d", slot))
	}
	slices.Sort(want)
	if diff := cmp.Diff(want, keys); diff != "" {
		t.Errorf("exported sockets (-want +got):\n%s", diff)
	}
	var first uint16
	for _, sh := range q.sockets.Shared() {
		if sh.Key == (listeners.Key{Name: service.SharedName(v1.ProtocolTCP)}) {
			first = sh.Port
		}
	}
	in := listeners.NewInherited(socks)
	q.StopListening()

	cfg.Inherited = in
	r, rules2 := startProxier(t, cfg)
	r.Tracker().Replace(svcs, sl)
	if got := rules2.port(t, "default/web:http"); got != int(first) {
		t.Errorf("the successor's shared listener is on %d, want the inherited %d", got, first)
	}
	end := rules2.intercept(t, "default/web:http").ListenPortEnd
	if want := first + listeners.SharedRedirectPorts - 1; end != want {
		t.Errorf("the successor's shared listener ends at port %d, want the inherited %d", end, want)
	}
	for _, port := range []uint16{first, first + 1, end} {
		if got, err := get(t, int(port)); err != nil || got != "a" {
			t.Errorf("through the adopted socket on port %d: %q, %v", port, got, err)
		}
	}
}

// TestSharedUDPListenerAsksOncePerFlow runs two UDP services on one
// shared listener in redirect mode, where UDPOriginalDst (conntrack, in
// uproxy) names each flow's service: each client reaches the service its
// original destination names, the lookup runs once per flow and not per
// datagram, and a destination no service has is dropped; and a client of
// a service that leaves the listener is refused. In request-reply mode,
// where no flow remembers a client, the event loop does (datapath/udppool.go).
func TestSharedUDPListenerAsksOncePerFlow(t *testing.T) {
	for _, tt := range []struct {
		mode  string
		flows int
	}{{"flow", 2}, {"request-reply", 0}} {
		t.Run(tt.mode, func(t *testing.T) {
			a, b := udpBackend(t, "a", false), udpBackend(t, "b", false)
			var mu sync.Mutex
			dsts := map[uint16]netip.AddrPort{} // by client port
			lookups := map[uint16]int{}
			var locals []netip.AddrPort // the local addresses asked about
			p, rules := startProxier(t, Config{
				Config: datapath.Config{
					OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) {
						return netip.AddrPort{}, errors.New("no TCP here")
					},
					UDPOriginalDst: func(client, local netip.AddrPort) (netip.AddrPort, error) {
						mu.Lock()
						defer mu.Unlock()
						lookups[client.Port()]++
						locals = append(locals, local)
						d, ok := dsts[client.Port()]
						if !ok {
							return d, errors.New("no conntrack entry")
						}
						return d, nil
					},
				},
				PortRange:       quietPorts(t),
				SharedListeners: []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP},
			})
			p.Tracker().Replace(
				[]*v1.Service{udpMode(svc("dns-a", "10.96.0.53", "dns:53/UDP"), tt.mode), udpMode(svc("dns-b", "10.96.0.54", "dns:53/UDP"), tt.mode)},
				append(udpSlices("dns-a", a), udpSlices("dns-b", b)...))
			port := rules.port(t, "default/dns-a:dns")
			if got := rules.port(t, "default/dns-b:dns"); got != port {
				t.Fatalf("dns-b on port %d, dns-a on %d: want one shared listener", got, port)
			}
			client := func(dst string) (*net.UDPConn, uint16) {
				c := dialUDP(t, port)
				cp := netip.MustParseAddrPort(c.LocalAddr().String()).Port()
				mu.Lock()
				if dst != "" {
					dsts[cp] = netip.MustParseAddrPort(dst)
				}
				mu.Unlock()
				return c, cp
			}
			ca, pa := client("10.96.0.53:53")
			cb, pb := client("10.96.0.54:53")
			for range 3 {
				if got := exchange(t, ca, []byte("q")); got != "a:1" {
					t.Errorf("client of dns-a got %q", got)
				}
				if got := exchange(t, cb, []byte("qq")); got != "b:2" {
					t.Errorf("client of dns-b got %q", got)
				}
			}
			mu.Lock()
			if diff := cmp.Diff(map[uint16]int{pa: 1, pb: 1}, lookups); diff != "" {
				t.Errorf("original destination lookups by client port (-want +got):\n%s", diff)
			}
			// Conntrack's reply tuple starts at the listener's address and port.
			want := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port))
			for _, l := range locals {
				if l != want {
					t.Errorf("asked about local address %s, want %s", l, want)
				}
			}
			mu.Unlock()

			cx, _ := client("") // conntrack knows nothing of it
			cx.Write([]byte("lost"))
			cx.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			if n, err := cx.Read(make([]byte, 100)); err == nil {
				t.Errorf("a datagram without an original destination got a %d-byte reply", n)
			}
			if p.UDPFlows() != tt.flows {
				t.Errorf("%d flows, want %d", p.UDPFlows(), tt.flows)
			}

			// dns-a leaves the listener: its client is refused, whatever the
			// listener remembered of it.
			p.Tracker().Replace([]*v1.Service{udpMode(svc("dns-b", "10.96.0.54", "dns:53/UDP"), tt.mode)}, udpSlices("dns-b", b))
			testwait.Until(t, 5*time.Second, "dns-a's client is refused", func() bool {
				ca.Write([]byte("q"))
				ca.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
				_, err := ca.Read(make([]byte, 100))
				return err != nil
			})
			if got := exchange(t, cb, []byte("qq")); got != "b:2" {
				t.Errorf("client of dns-b got %q", got)
			}
		})
	}
}

// TestSharedListenerRangeInPortRange checks the shared TCP listener's
// range of ports under --proxy-port-range: the ports come from the range,
// a range too short for all of them gives fewer, and a per-service UDP
// listener takes a port after them.
func TestSharedListenerRangeInPortRange(t *testing.T) {
	for _, tt := range []struct {
		name    string
		size    int
		wantEnd int // offset of the last TCP port from the first
	}{
		{"room for all", listeners.SharedRedirectPorts + 1, listeners.SharedRedirectPorts - 1},
		{"room for 4", 4, 3},
	} {
		t.Run(tt.name, func(t *testing.T) {
			base := freePortRange(t, tt.size)
			p, rules := startProxier(t, Config{
				Config: datapath.Config{
					OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) {
						return netip.MustParseAddrPort("10.96.0.10:80"), nil
					},
				},
				SharedListeners: []v1.Protocol{v1.ProtocolTCP},
				PortRange:       listeners.PortRange{Base: base, Size: tt.size},
			})
			p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", nameBackend(t, "a")))
			i := rules.intercept(t, "default/web:http")
			if i.ListenPort != base || int(i.ListenPortEnd) != int(base)+tt.wantEnd {
				t.Errorf("shared TCP listener on %d-%d, want %d-%d", i.ListenPort, i.ListenPortEnd, base, int(base)+tt.wantEnd)
			}
			if got, err := get(t, int(i.ListenPortEnd)); err != nil || got != "a" {
				t.Errorf("through the last port of the range: %q, %v", got, err)
			}
		})
	}
}

// freePortRange returns the first of n consecutive ports that nothing
// listens on now. They lie below the ephemeral ports
// (ip_local_port_range), which other tests' connections take at any
// moment, from a random start, so that tests running at the same time
// seldom pick the same.
func freePortRange(t *testing.T, n int) uint16 {
	t.Helper()
	for range 50 {
		base := 20000 + rand.IntN(10000)
		free := true
		for port := base; port < base+n && free; port++ {
			ln, err := net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port))
			if err != nil {
				free = false
				continue
			}
			ln.Close()
		}
		if free {
			return uint16(base)
		}
	}
	t.Fatalf("no %d free consecutive ports below the ephemeral range", n)
	return 0
}

// quietPorts returns a proxy port range below the kernel's range for
// outgoing connections, where a shared listener's 16 consecutive ports
// cannot collide with the ephemeral ports of the package's other tests'
// connections, or their TIME_WAIT sockets (a range with a taken port ends
// there, by design: openSiblings). Zero (the kernel's range) if the
// kernel's range starts too low to leave room.
func quietPorts(t *testing.T) listeners.PortRange {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return listeners.PortRange{}
	}
	var lo int
	if _, err := fmt.Sscan(string(b), &lo); err != nil || lo < 12000 {
		return listeners.PortRange{}
	}
	const size = 256
	return listeners.PortRange{Base: uint16(10000 + rand.IntN(lo-10000-size)), Size: size}
}
