package datapath

import (
	"context"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/internal/testbackend"
)

// The data path's tests run an Engine with listeners built here, as the
// control plane (package proxy) builds them, each serving one service
// port from fixed backends: see proxy's tests for the same data path
// driven by Services.

// portName names a test listener's service port in the logs.
type portName string

func (n portName) String() string { return string(n) }

// outsideClients is the Clients of the tests' Engines: every client is
// outside the cluster, which has pod networks.
type outsideClients struct{}

func (outsideClients) Node(netip.Addr) bool             { return false }
func (outsideClients) Pod(netip.Addr) (pod, known bool) { return false, true }

// podClients is the Clients of a test whose clients on loopback stand for
// pods.
type podClients struct{}

func (podClients) Node(netip.Addr) bool             { return false }
func (podClients) Pod(netip.Addr) (pod, known bool) { return true, true }

// startEngine runs an Engine configured by cfg until the test ends, then
// drains it and checks that no session is left. Every client is outside
// the cluster (outsideClients).
func startEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	if cfg.Stats == nil {
		cfg.Stats = new(Stats) // for the tests that tell the data paths apart
	}
	p := NewEngine(cfg, outsideClients{})
	startedEngines.Add(t, p)
	t.Cleanup(func() {
		p.Refuse()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := p.Drain(ctx); err != nil {
			t.Errorf("Drain: %v", err)
		}
	})
	return p
}

// testSnapshot routes to bs round robin, whatever the destination.
func testSnapshot(name string, bs ...netip.AddrPort) *Snapshot {
	s := &Snapshot{Name: portName(name)}
	for _, a := range bs {
		s.Backends = append(s.Backends, balancer.NewBackend(a, 0))
	}
	s.ClusterBackends = s.Backends
	s.Cluster, s.Local = balancer.New(balancer.RoundRobin, s.Backends), balancer.New(balancer.RoundRobin, nil)
	return s
}

// serve opens a listener of p's for network ("tcp4", "udp6", …),
// serving the service port name from bs, until the
// test ends (or the caller closes it).
func serve(t testing.TB, p *Engine, network, name string, bs ...netip.AddrPort) *Listener {
	t.Helper()
	l := &Listener{Name: portName(name), Network: network, V6: strings.HasSuffix(network, "6"), UDP: strings.HasPrefix(network, "udp")}
	// As the proxier binds them: every address in redirect mode, loopback
	// in tproxy mode.
	host := map[bool]string{false: "0.0.0.0", true: "::"}[l.V6]
	if p.cfg.Transparent {
		host = map[bool]string{false: "127.0.0.1", true: "::1"}[l.V6]
	}
	var local net.Addr
	if l.UDP {
		pc, err := p.ListenUDP(context.Background(), network, net.JoinHostPort(host, "0"))
		if err != nil {
			t.Skipf("no %s listener: %v", network, err)
		}
		l.PC, local = pc, pc.LocalAddr()
	} else {
		ln, err := p.Listen(context.Background(), network, net.JoinHostPort(host, "0"))
		if err != nil {
			t.Skipf("no %s listener: %v", network, err)
		}
		l.LN, local = ln, ln.Addr()
	}
	l.Port = netip.MustParseAddrPort(local.String()).Port()
	l.Snap.Store(testSnapshot(name, bs...))
	if err := p.Prepare(l); err != nil {
		l.Close()
		t.Fatal(err)
	}
	if err := p.StartAccepting(l); err != nil {
		l.Close()
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	return l
}

// proxyWeb starts an Engine with cfg that serves default/web:http from
// be, and returns it with the listener's port.
func proxyWeb(t *testing.T, cfg Config, be *backend) (*Engine, int) {
	t.Helper()
	p := startEngine(t, cfg)
	return p, int(serve(t, p, "tcp4", "default/web:http", be.addr).Port)
}

// backend is a TCP server on 127.0.0.1 (testbackend.TCP); ln and addr
// are its listener and address.
type backend struct {
	*testbackend.TCP
	ln   net.Listener
	addr netip.AddrPort
}

func wrapBackend(b *testbackend.TCP) *backend { return &backend{TCP: b, ln: b.LN, addr: b.Addr} }

func startBackend(t *testing.T, handle func(net.Conn)) *backend {
	return wrapBackend(testbackend.StartTCP(t, handle))
}

// nameBackend answers every connection with its name and closes.
func nameBackend(t *testing.T, name string) *backend { return wrapBackend(testbackend.Name(t, name)) }

// echoBackend echoes until EOF (testbackend.Echo).
func echoBackend(t *testing.T) *backend { return wrapBackend(testbackend.Echo(t)) }

func countFDs(t *testing.T) int {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip("no /proc/self/fd")
	}
	return len(entries)
}

// eachDataPath runs f once per TCP data path: the event loops on epoll
// (the default) and with io_uring (Config.IOURing).
func eachDataPath(t *testing.T, f func(t *testing.T, dp dataPath)) {
	for _, tt := range []struct {
		name string
		dp   dataPath
	}{{"loops", dataPath{}}, {"ring", dataPath{ring: true}}} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.dp.ring {
				if err := IOURingSupported(); err != nil {
					t.Skipf("skipping: the event loops cannot use io_uring here: %v", err)
				}
			}
			f(t, tt.dp)
			if tt.dp.ring {
				for _, p := range startedEngines.Of(t) {
					checkRingCarried(t, p.cfg.Stats)
				}
			}
		})
	}
}

// checkRingCarried fails t unless the ring carried the sessions that s
// counted: each one a ring could take went on one, and the ring
// received bytes of some if any session moved bytes. A loop whose ring
// failed to set up carries its sessions on epoll, and the traffic of a
// test of the ring would flow all the same.
func checkRingCarried(t *testing.T, s *Stats) {
	t.Helper()
	eligible, onRing, served, carried := s.Eligible.Load(), s.OnRing.Load(), s.RingServed.Load(), s.Carried.Load()
	if n := s.NoRing.Load(); n > 0 {
		t.Errorf("%d event loops could not set up their ring, and carried the test's traffic on epoll", n)
	}
	if onRing != eligible || (carried > 0 && served == 0) {
		t.Errorf("the ring did not carry the traffic: of %d sessions it could take, %d went on a ring; %d sessions moved bytes, %d of them on a ring",
			eligible, onRing, carried, served)
	}
}

// startedEngines records the engines each test started (startEngine),
// so that eachDataPath can check how they carried the test's traffic.
var startedEngines testbackend.Registry[*Engine]

// dataPath is a data path of the engine's: ring is Config.IOURing.
type dataPath struct {
	ring bool
}
