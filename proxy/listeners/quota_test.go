package listeners

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/service"
)

// fakeEngine binds TCP listeners that hold no socket: the port asked
// for, or for port 0 the next of 50000 and up. taken ports fail as
// another process's would.
type fakeEngine struct {
	next  uint16
	taken map[uint16]bool
}

func (e *fakeEngine) Listen(_ context.Context, _, addr string) (net.Listener, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, err
	}
	port := ap.Port()
	if port == 0 {
		if e.next == 0 {
			e.next = 50000
		}
		port, e.next = e.next, e.next+1
	}
	if e.taken[port] {
		return nil, errors.New("address already in use")
	}
	return fakeListener{netip.AddrPortFrom(ap.Addr(), port)}, nil
}

func (e *fakeEngine) ListenUDP(context.Context, string, string) (*net.UDPConn, error) {
	return nil, errors.New("no UDP in the fake engine")
}
func (e *fakeEngine) Claim(*datapath.Listener)                {}
func (e *fakeEngine) Prepare(*datapath.Listener) error        { return nil }
func (e *fakeEngine) StartAccepting(*datapath.Listener) error { return nil }
func (e *fakeEngine) StartAfter(*datapath.Listener, <-chan struct{}, <-chan struct{}) error {
	return nil
}
func (e *fakeEngine) Closed(*datapath.Listener) {}

type fakeListener struct{ addr netip.AddrPort }

func (l fakeListener) Accept() (net.Conn, error) { return nil, net.ErrClosed }
func (l fakeListener) Close() error              { return nil }
func (l fakeListener) Addr() net.Addr            { return net.TCPAddrFromAddrPort(l.addr) }

// tcpKeys returns the keys of n TCP ports p00, p01, … of Service ns/name,
// in the families given (IPv4 when none is).
func tcpKeys(ns, name string, n int, v6 ...bool) []Key {
	if len(v6) == 0 {
		v6 = []bool{false}
	}
	var keys []Key
	for i := range n {
		for _, six := range v6 {
			keys = append(keys, Key{Name: service.PortName{NamespacedName: types.NamespacedName{Namespace: ns, Name: name}, Port: fmt.Sprintf("p%02d", i), Protocol: v1.ProtocolTCP}, V6: six})
		}
	}
	return keys
}

// outcome names what Bind did: "ok", or the sentinel of its refusal.
func outcome(err error) string {
	for _, s := range []error{ErrBudget, ErrPorts, ErrServiceQuota, ErrNamespaceQuota} {
		if errors.Is(err, s) {
			return s.Error()
		}
	}
	if err != nil {
		return err.Error()
	}
	return "ok"
}

// outcomes binds keys in order and tallies the outcomes per Service.
func outcomes(t *testing.T, m *Manager, keys []Key) map[string]map[string]int {
	t.Helper()
	got := map[string]map[string]int{}
	for _, k := range keys {
		_, err := m.Bind(t.Context(), k, 0)
		name := k.Name.NamespacedName.String()
		if got[name] == nil {
			got[name] = map[string]int{}
		}
		got[name][outcome(err)]++
	}
	return got
}

func TestDefaultQuotas(t *testing.T) {
	for _, tt := range []struct {
		budget, perService, perNamespace int
	}{
		{0, 0, 0}, // no budget, no bound
		{1, 1, 1},
		{2, 1, 2},
		{32, 16, 28},
		{512, 16, 448},
		{2048, 32, 1792},
		{14116, 220, 12352}, // half of the kernel's default range
	} {
		got := [2]int{DefaultServiceQuota(tt.budget), DefaultNamespaceQuota(tt.budget)}
		if want := [2]int{tt.perService, tt.perNamespace}; got != want {
			t.Errorf("budget %d: quotas per Service and per namespace %v, want %v", tt.budget, got, want)
		}
	}
}

// TestQuotas checks the listeners refused by the quotas: one Service
// of many ports, or one namespace of many Services, can no longer take
// a whole port range or budget from the others; the budget and the ports
// are said before the quotas when they are spent too.
func TestQuotas(t *testing.T) {
	concat := func(ks ...[]Key) []Key {
		var out []Key
		for _, k := range ks {
			out = append(out, k...)
		}
		return out
	}
	const (
		ok      = "ok"
		svcQ    = "the Service's listener quota is spent"
		nsQ     = "the namespace's listener quota is spent"
		budget  = "the listener budget is spent"
		noPorts = "the listener ports are spent"
	)
	type tally = map[string]map[string]int
	tests := []struct {
		name string
		cfg  Config
		keys []Key
		want tally
	}{
		{
			"the defaults in a 32-port range",
			Config{PortRange: PortRange{Base: 30000, Size: 32}},
			concat(tcpKeys("aaa", "big", 40), tcpKeys("zzz", "web", 1)),
			tally{"aaa/big": {ok: 16, svcQ: 24}, "zzz/web": {ok: 1}},
		},
		{
			"no quotas in a 32-port range",
			Config{PortRange: PortRange{Base: 30000, Size: 32}, MaxPerService: -1, MaxPerNamespace: -1},
			concat(tcpKeys("aaa", "big", 40), tcpKeys("zzz", "web", 1)),
			tally{"aaa/big": {ok: 32, noPorts: 8}, "zzz/web": {noPorts: 1}},
		},
		{
			"a Service's quota counts both families",
			Config{MaxPerService: 3, MaxPerNamespace: -1},
			tcpKeys("default", "web", 2, false, true),
			tally{"default/web": {ok: 3, svcQ: 1}},
		},
		{
			"a namespace's quota",
			Config{MaxPerService: -1, MaxPerNamespace: 4},
			concat(tcpKeys("ns1", "a", 3), tcpKeys("ns1", "b", 3), tcpKeys("ns2", "c", 2)),
			tally{"ns1/a": {ok: 3}, "ns1/b": {ok: 1, nsQ: 2}, "ns2/c": {ok: 2}},
		},
		{
			"the budget before the quotas",
			Config{MaxListeners: 3, MaxPerService: 3, MaxPerNamespace: 3},
			tcpKeys("default", "web", 4),
			tally{"default/web": {ok: 3, budget: 1}},
		},
		{
			"the defaults of a small budget",
			Config{MaxListeners: 8},
			concat(tcpKeys("default", "a", 5), tcpKeys("default", "b", 5), tcpKeys("other", "c", 2)),
			// A Service may hold half of it, a namespace all but an eighth.
			tally{"default/a": {ok: 4, svcQ: 1}, "default/b": {ok: 3, nsQ: 2}, "other/c": {ok: 1, budget: 1}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := NewManager(tt.cfg, &fakeEngine{})
			m.ports.readEph = func() (*ephemeralPorts, error) { return nil, errors.New("no range in this test") }
			if diff := cmp.Diff(tt.want, outcomes(t, m, tt.keys)); diff != "" {
				t.Errorf("outcomes by Service (-want +got):\n%s", diff)
			}
		})
	}
}

// TestQuotaFreedByClose checks that a Service's closed listener gives
// its place in the quota to the next, and that the shared listeners are
// never refused.
func TestQuotaFreedByClose(t *testing.T) {
	m := NewManager(Config{MaxPerService: 1, MaxPerNamespace: 1}, &fakeEngine{})
	keys := tcpKeys("default", "web", 2)
	first, err := m.Bind(t.Context(), keys[0], 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Bind(t.Context(), keys[1], 0); !errors.Is(err, ErrServiceQuota) {
		t.Fatalf("a second listener: %v, want %v", err, ErrServiceQuota)
	}
	for slot := range 3 {
		if _, err := m.Bind(t.Context(), Key{Name: service.SharedName(v1.ProtocolTCP), Slot: slot}, 0); err != nil {
			t.Errorf("shared listener slot %d: %v; a shared listener is never refused", slot, err)
		}
	}
	m.Close(first)
	if _, err := m.Bind(t.Context(), keys[1], 0); err != nil {
		t.Errorf("a second listener after the first closed: %v", err)
	}
}

// TestEphemeralShare checks that, with no --proxy-port-range, listeners
// hold at most half of the ports the kernel hands out for bind(0) and
// connect(), per protocol, a port held in both families once: beyond it
// the node's own connections would find no port (EADDRNOTAVAIL).
func TestEphemeralShare(t *testing.T) {
	// Ten ports, one reserved: nine handed out, four for listeners.
	eph := func() (*ephemeralPorts, error) {
		return &ephemeralPorts{lo: 40000, hi: 40009, reserved: map[uint16]bool{40001: true}}, nil
	}
	m := NewManager(Config{MaxPerService: -1, MaxPerNamespace: -1}, &fakeEngine{})
	m.ports.readEph = eph
	m.ports.randN = func(int) int { return 0 }
	var keys []Key
	for i := range 5 {
		keys = append(keys, tcpKeys("default", fmt.Sprintf("s%d", i), 1)...)
	}
	var opened []*Listener
	var got []string
	for _, k := range keys {
		l, err := m.Bind(t.Context(), k, 0)
		got = append(got, outcome(err))
		if err == nil {
			opened = append(opened, l)
		}
	}
	want := []string{"ok", "ok", "ok", "ok", "the listener ports are spent"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("outcomes (-want +got):\n%s", diff)
	}
	// IPv6 takes its ports from the same TCP ports.
	if _, err := m.Bind(t.Context(), Key{Name: keys[0].Name, V6: true}, 0); !errors.Is(err, ErrPorts) {
		t.Errorf("an IPv6 listener: %v, want %v", err, ErrPorts)
	}
	if b := m.budget(); b != 4 {
		t.Errorf("budget() = %d, want the share, 4", b)
	}
	// A listener closed gives its port back to the share.
	m.Close(opened[0])
	if _, err := m.Bind(t.Context(), keys[4], 0); err != nil {
		t.Errorf("after a close: %v", err)
	}

	// The count, at the allocator: per protocol, once per port, only
	// ports the kernel hands out.
	a := &portAllocator{readEph: eph}
	for _, mk := range []struct {
		network string
		port    uint16
	}{{"tcp4", 40003}, {"tcp6", 40003}, {"tcp4", 40001}, {"tcp4", 50001}, {"udp4", 40005}} {
		a.mark(mk.network, mk.port)
	}
	if diff := cmp.Diff(map[string]int{"tcp": 1, "udp": 1}, a.ephHeld); diff != "" {
		t.Errorf("held ports (-want +got):\n%s", diff)
	}
	a.release("tcp4", 40003)
	if a.ephHeld["tcp"] != 1 {
		t.Errorf("after tcp4 released 40003 that tcp6 holds: %d TCP ports held, want 1", a.ephHeld["tcp"])
	}
	a.release("tcp6", 40003)
	a.release("tcp6", 40003) // twice: counted once
	if a.ephHeld["tcp"] != 0 {
		t.Errorf("after both families released 40003: %d TCP ports held, want 0", a.ephHeld["tcp"])
	}
	// With a range, the kernel's does not bound the listeners.
	r := &portAllocator{r: PortRange{Base: 40000, Size: 10}, readEph: eph}
	for p := range uint16(10) {
		r.mark("tcp4", 40000+p)
	}
	if err := r.checkShare("tcp4"); err != nil {
		t.Errorf("with a range: %v", err)
	}
}
