package redirect

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// The listener ports of the shared-layout tests: one per family and
// protocol.
const (
	sharedTCP4, sharedUDP4 = 40000, 40001
	sharedTCP6, sharedUDP6 = 41000, 41001
)

// sharedPort returns the shared listener port of f and p.
func sharedPort(f Family, p Protocol) uint16 {
	return map[Family]map[Protocol]uint16{
		IPv4: {TCP: sharedTCP4, UDP: sharedUDP4},
		IPv6: {TCP: sharedTCP6, UDP: sharedUDP6},
	}[f][p]
}

// sharedSvc returns an intercept of the shared layout for the VIP dest:
// its listener port is the shared one of its family and protocol.
func sharedSvc(comment string, p Protocol, dest string, port uint16) InterceptRule {
	a := netip.MustParseAddr(dest)
	return svc(comment, p, dest, port, sharedPort(familyOf(a.Unmap()), p))
}

// sharedNP returns a node port of the shared layout.
func sharedNP(comment string, f Family, p Protocol, port uint16) NodePort {
	return np(comment, f, p, port, sharedPort(f, p))
}

// sharedListeners are the shared listeners of both families.
var sharedListeners = []Listener{
	{IPv4, TCP, sharedTCP4}, {IPv4, UDP, sharedUDP4}, {IPv6, TCP, sharedTCP6}, {IPv6, UDP, sharedUDP6},
}

// sharedServices is the shared layout with intercepts of both families
// and protocols, unsorted, an IPv4-mapped address among them, and the
// listeners; no node ports, no firewalls.
var sharedServices = Rules{
	Shared: true,
	Intercepts: []InterceptRule{
		sharedSvc("default/web:https", TCP, "10.96.0.10", 443),
		sharedSvc("default/web:http", TCP, "10.96.0.10", 80),
		sharedSvc("kube-system/kube-dns:dns", UDP, "10.96.0.2", 53),
		sharedSvc("kube-system/kube-dns:dns-tcp", TCP, "10.96.0.2", 53),
		sharedSvc("default/web:http", TCP, "192.0.2.10", 80),
		sharedSvc("mapped/v4:x", TCP, "::ffff:10.96.0.3", 8080),
		sharedSvc("default/web:http", TCP, "2001:db8::10", 80),
		sharedSvc("kube-system/kube-dns:dns", UDP, "2001:db8::a", 53),
		sharedSvc("default/web:quic", UDP, "2001:db8::10", 443),
	},
	Listeners: sharedListeners,
}

// withSharedNodePorts returns r with node ports of both families.
func withSharedNodePorts(r Rules) Rules {
	r.NodePorts = []NodePort{
		sharedNP("default/web:http", IPv4, TCP, 30080),
		sharedNP("default/web:https", IPv4, TCP, 30443),
		sharedNP("kube-system/kube-dns:dns", IPv4, UDP, 30053),
		sharedNP("default/web:http", IPv6, TCP, 30080),
	}
	return r
}

// withSharedFirewalls returns r with a LoadBalancer service whose
// intercepts a firewall guards, of both families, and a firewall without
// an intercept.
func withSharedFirewalls(r Rules) Rules {
	r.Intercepts = append(slices.Clone(r.Intercepts),
		sharedSvc("default/lb:https", TCP, "10.96.200.1", 443),
		sharedSvc("default/lb:https", TCP, "10.96.0.20", 443),
		sharedSvc("default/lb:dns", UDP, "10.96.200.1", 53),
		sharedSvc("default/lb:https", TCP, "2001:db8:96::c8:1", 443),
	)
	r.Firewalls = []Firewall{
		fw("default/lb:https", TCP, "10.96.200.1", 443, "203.0.113.0/24", "2001:db8:1::/48", "10.244.0.10/32"),
		fw("default/lb:dns", UDP, "10.96.200.1", 53, "2001:db8:1::/48"),
		fw("default/lb:https", TCP, "2001:db8:96::c8:1", 443, "2001:db8:1::/48", "10.244.0.10/32"),
		fw("default/gone:http", TCP, "10.96.200.4", 80, "10.244.0.0/16"),
	}
	return r
}

// sharedAll is the shared layout with every kind of rule of both
// families.
var sharedAll = withSharedFirewalls(withSharedNodePorts(sharedServices))

// withTCPRange returns r with the IPv4 TCP intercepts and node ports sent
// to the range of n listener ports from sharedTCP4, and those ports among
// the listeners, as uproxy's shared TCP listener has in redirect mode.
func withTCPRange(r Rules, n uint16) Rules {
	end := uint16(sharedTCP4) + n - 1
	r.Intercepts = slices.Clone(r.Intercepts)
	for k, i := range r.Intercepts {
		if i.Protocol == TCP && familyOf(i.Dest.Unmap()) == IPv4 {
			r.Intercepts[k].ToPortEnd = end
		}
	}
	r.NodePorts = slices.Clone(r.NodePorts)
	for k, np := range r.NodePorts {
		if np.Protocol == TCP && np.Family == IPv4 {
			r.NodePorts[k].ToPortEnd = end
		}
	}
	r.Listeners = slices.Clone(r.Listeners)
	for port := uint16(sharedTCP4) + 1; port <= end; port++ {
		r.Listeners = append(r.Listeners, Listener{IPv4, TCP, port})
	}
	return r
}

func TestRenderSharedGolden(t *testing.T) {
	withAddrs := sharedAll
	withAddrs.NodePortAddresses = pfx("192.168.1.7/24", "2001:db8::/64", "10.0.0.0/8", "0.0.0.0/0", "::/0")
	tests := []struct {
		name   string
		family Family
		rules  Rules
	}{
		// One REDIRECT per protocol matching the service set; the
		// listener guards as in the per-service layout.
		{"shared_v4", IPv4, sharedServices},
		{"shared_v6", IPv6, sharedServices},
		// One REDIRECT per protocol matching its node-port set, after
		// the jump that checks the destination.
		{"shared_nodeports", IPv4, withSharedNodePorts(sharedServices)},
		{"shared_nodeports_v6", IPv6, withSharedNodePorts(sharedServices)},
		{"shared_nodeport_addresses", IPv4, withAddrs},
		// The guarded intercepts keep their rules, one per allowed
		// source prefix, before the set's; the firewalls' DROPs are as
		// in the per-service layout.
		{"shared_firewall", IPv4, withSharedFirewalls(sharedServices)},
		{"shared_firewall_v6", IPv6, withSharedFirewalls(sharedServices)},
		{"shared_all_v4", IPv4, sharedAll},
		// The IPv4 TCP listener has a range of ports: its rules, the
		// guarded intercepts' and the node ports' REDIRECT to the range.
		{"shared_port_range", IPv4, withTCPRange(sharedAll, 16)},
		// Tproxy mode: one TPROXY per protocol matching the service set
		// after the guarded intercepts and firewalls, one per protocol
		// and node-port address matching the node-port set, and one
		// MARK per protocol matching the service set for the node's
		// own traffic.
		{"shared_tproxy_v4", IPv4, tproxied(sharedAll, Routing{})},
		{"shared_tproxy_v6", IPv6, tproxied(sharedAll, Routing{})},
		{"shared_tproxy_nodeport_addresses", IPv4, tproxied(withAddrs, Routing{Mark: 0x10, Mask: 0xf0})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.rules.validate(); err != nil {
				t.Fatalf("invalid test rules: %v", err)
			}
			checkGolden(t, tt.name, Render(tt.family, tt.rules))
		})
	}
}

func TestRenderSharedSetUpdateGolden(t *testing.T) {
	// One service port added and one removed, a node port moved, a
	// listener added (its own set).
	changed := sharedAll
	changed.Intercepts = slices.DeleteFunc(slices.Clone(sharedAll.Intercepts), func(i InterceptRule) bool { return i.Comment == "default/web:https" })
	changed.Intercepts = append(changed.Intercepts, sharedSvc("default/new:http", TCP, "10.96.0.11", 80))
	changed.NodePorts = append(slices.Clone(sharedAll.NodePorts[1:]), sharedNP("default/web:http", IPv4, TCP, 30081))
	changed.Listeners = append(slices.Clone(sharedAll.Listeners), Listener{IPv4, TCP, 40002})
	// A firewall added to an intercept takes it out of the set.
	guarded := sharedServices
	guarded.Firewalls = []Firewall{fw("default/web:http", TCP, "192.0.2.10", 80, "10.244.0.0/16")}
	perService := sharedAll
	perService.Shared = false
	tests := []struct {
		name     string
		family   Family
		old, new Rules
	}{
		// From nothing: the listener sets, then the service set and the
		// node-port sets, each created then filled in member order.
		{"shared_sets_create", IPv4, Rules{}, sharedAll},
		{"shared_sets_create_v6", IPv6, Rules{}, sharedAll},
		// Only the differences: no set is created again.
		{"shared_sets_update", IPv4, sharedAll, changed},
		{"shared_sets_firewall_added", IPv4, sharedServices, guarded},
		// Switching layouts: the service and node-port sets are created
		// (the listener sets stay), or left for the Syncer to destroy.
		{"shared_sets_from_per_service", IPv4, perService, sharedAll},
		{"shared_sets_to_per_service", IPv4, sharedAll, perService},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := RenderSetUpdate(tt.family, tt.old, tt.new)
			checkGolden(t, tt.name, got)
			old, new := wantSets(tt.family, tt.old), wantSets(tt.family, tt.new)
			if diff := cmp.Diff(new, applySetUpdate(t, old, got, setsToDestroy(old, new)),
				cmp.AllowUnexported(setContent{})); diff != "" {
				t.Errorf("old sets updated (-want +got):\n%s", diff)
			}
		})
	}
}

// TestSharedSetMembers checks what the shared layout puts in each set of
// both families: the intercepts no firewall guards and the node ports,
// and nothing in the per-service layout.
func TestSharedSetMembers(t *testing.T) {
	m := func(addr string, p Protocol, port uint16) setMember {
		return setMember{addr: netip.MustParseAddr(addr), proto: p, port: port}
	}
	want := map[string][]setMember{
		listenersTCP4: ports(sharedTCP4),
		listenersUDP4: ports(sharedUDP4),
		listenersTCP6: ports(sharedTCP6),
		listenersUDP6: ports(sharedUDP6),
		services4: {
			m("10.96.0.2", TCP, 53), m("10.96.0.2", UDP, 53), m("10.96.0.3", TCP, 8080),
			m("10.96.0.10", TCP, 80), m("10.96.0.10", TCP, 443), m("10.96.0.20", TCP, 443), m("192.0.2.10", TCP, 80),
		},
		nodePortsTCP4: ports(30080, 30443),
		nodePortsUDP4: ports(30053),
		services6: {
			m("2001:db8::a", UDP, 53), m("2001:db8::10", TCP, 80), m("2001:db8::10", UDP, 443),
		},
		nodePortsTCP6: ports(30080),
	}
	got := map[string][]setMember{}
	perService := map[string][]setMember{}
	notShared := sharedAll
	notShared.Shared = false
	for _, s := range sets {
		if ms := s.members(sharedAll); len(ms) > 0 {
			got[s.name] = ms
		}
		if ms := s.members(notShared); len(ms) > 0 {
			perService[s.name] = ms
		}
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("members of the shared layout (-want +got):\n%s", diff)
	}
	wantPerService := map[string][]setMember{
		listenersTCP4: ports(sharedTCP4), listenersUDP4: ports(sharedUDP4),
		listenersTCP6: ports(sharedTCP6), listenersUDP6: ports(sharedUDP6),
	}
	if diff := cmp.Diff(wantPerService, perService); diff != "" {
		t.Errorf("members of the per-service layout (-want +got):\n%s", diff)
	}
}

func TestSetMemberParse(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want setMember
		ok   bool
	}{
		{"40001", portMember(40001), true},
		{"0", portMember(0), true},
		{"10.96.0.10,tcp:80", setMember{addr: netip.MustParseAddr("10.96.0.10"), proto: TCP, port: 80}, true},
		{"2001:db8::10,udp:53", setMember{addr: netip.MustParseAddr("2001:db8::10"), proto: UDP, port: 53}, true},
		{"2001:db8::1:0:0:a,udp:53", setMember{addr: netip.MustParseAddr("2001:db8:0:0:1::a"), proto: UDP, port: 53}, true},
		{"10.96.0.10", setMember{}, false},
		{"10.96.0.10,sctp:80", setMember{}, false},
		{"10.96.0.10,tcp:http", setMember{}, false},
		{"10.96.0.10,80", setMember{}, false},
		{"fe80::1%eth0,tcp:80", setMember{}, false},
		{"65536", setMember{}, false},
		{"tcp:80", setMember{}, false},
	} {
		got, ok := parseMember(tt.in)
		if ok != tt.ok || ok && got != tt.want {
			t.Errorf("parseMember(%q) = %v, %v; want %v, %v", tt.in, got, ok, tt.want, tt.ok)
		}
		if ok && got.String() != tt.in {
			t.Errorf("parseMember(%q).String() = %q", tt.in, got)
		}
	}
}

// TestParseSetSaveHash checks that a hash:ip,port set's header loses the
// options the kernel chooses, and that its members, printed in hash
// order, come back sorted.
func TestParseSetSaveHash(t *testing.T) {
	text := "create uproxy-services4 hash:ip,port family inet hashsize 4096 maxelem 1048576 bucketsize 12 initval 0xd84c08e6\n" +
		"add uproxy-services4 10.96.0.2,udp:53\nadd uproxy-services4 10.96.0.10,tcp:80\nadd uproxy-services4 10.96.0.2,tcp:53\n" +
		"add uproxy-services4 10.96.0.9\nadd uproxy-services4 10.96.0.8,tcp:80 timeout 30\n" +
		"create uproxy-services6 hash:ip,port family inet6 hashsize 1024 maxelem 65536 timeout 0 bucketsize 12 initval 0x1\n"
	got := parseSetSave(services4, []byte(text))
	want := wantSets(IPv4, Rules{Shared: true, Intercepts: []InterceptRule{
		sharedSvc("a", TCP, "10.96.0.10", 80), sharedSvc("b", UDP, "10.96.0.2", 53), sharedSvc("c", TCP, "10.96.0.2", 53),
	}})[services4]
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(setContent{})); diff != "" {
		t.Errorf("parseSetSave(%s) (-want +got):\n%s", services4, diff)
	}
	// Options uproxy does not ask for stay, so the set is made anew.
	if got, want := parseSetSave(services6, []byte(text)).header, "hash:ip,port family inet6 maxelem 65536 timeout 0"; got != want {
		t.Errorf("header of %s = %q, want %q", services6, got, want)
	}
}

func TestRulesValidateShared(t *testing.T) {
	tests := []struct {
		name  string
		rules Rules
		want  []string
	}{
		{"ok", sharedAll, nil},
		{"ok in tproxy mode", tproxied(sharedAll, Routing{}), nil},
		{"per-service layout, ports differ", Rules{Intercepts: []InterceptRule{
			svc("a", TCP, "10.96.0.1", 80, 40001), svc("b", TCP, "10.96.0.2", 80, 40002),
		}}, nil},
		{"one port per family and protocol", Rules{Shared: true,
			Intercepts: []InterceptRule{
				svc("a", TCP, "10.96.0.1", 80, 40001), svc("b", UDP, "10.96.0.1", 53, 40002),
				svc("c", TCP, "2001:db8::1", 80, 40003), svc("d", UDP, "2001:db8::1", 53, 40004),
			},
			NodePorts: []NodePort{np("a", IPv4, TCP, 30080, 40001), np("c", IPv6, TCP, 30080, 40003)},
		}, nil},
		{"intercepts differ", Rules{Shared: true, Intercepts: []InterceptRule{
			svc("default/a:http", TCP, "10.96.0.1", 80, 40001),
			svc("default/b:http", TCP, "10.96.0.2", 80, 40001),
			svc("default/c:http", TCP, "10.96.0.3", 80, 40002),
		}}, []string{
			`shared layout: intercept 2 ("default/c:http", tcp 10.96.0.3:80) goes to listener port 40002, but intercept 0 ("default/a:http", tcp 10.96.0.1:80) goes to 40001: every IPv4 tcp intercept and node port must go to the same one`,
		}},
		// Every conflict, each against the first of its family and
		// protocol; a mapped address is IPv4.
		{"every conflict", Rules{Shared: true,
			Intercepts: []InterceptRule{
				svc("a", TCP, "2001:db8::1", 80, 41000),
				svc("b", TCP, "::ffff:10.96.0.1", 80, 40000),
				svc("c", TCP, "2001:db8::2", 80, 41009),
				svc("d", UDP, "10.96.0.1", 53, 40001),
			},
			NodePorts: []NodePort{np("e", IPv4, TCP, 30080, 40009), np("f", IPv4, UDP, 30053, 40001), np("g", IPv6, TCP, 30080, 41000)},
		}, []string{
			`shared layout: intercept 2 ("c", tcp [2001:db8::2]:80) goes to listener port 41009, but intercept 0 ("a", tcp [2001:db8::1]:80) goes to 41000: every IPv6 tcp intercept and node port must go to the same one`,
			`shared layout: node port 0 ("e", tcp port 30080) goes to listener port 40009, but intercept 1 ("b", tcp 10.96.0.1:80) goes to 40000: every IPv4 tcp intercept and node port must go to the same one`,
		}},
		// A guarded intercept goes to the shared listener too.
		{"guarded intercept differs", Rules{Shared: true,
			Intercepts: []InterceptRule{svc("a", TCP, "10.96.0.1", 80, 40000), svc("lb", TCP, "192.0.2.1", 80, 40005)},
			Firewalls:  []Firewall{fw("lb", TCP, "192.0.2.1", 80, "10.0.0.0/8")},
		}, []string{
			`shared layout: intercept 1 ("lb", tcp 192.0.2.1:80) goes to listener port 40005, but intercept 0 ("a", tcp 10.96.0.1:80) goes to 40000: every IPv4 tcp intercept and node port must go to the same one`,
		}},
		{"ok with a range of ports", withTCPRange(sharedAll, 16), nil},
		{"ranges differ", Rules{Shared: true,
			Intercepts: []InterceptRule{
				{Comment: "a", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.1"), Port: 80, ToPort: 40000, ToPortEnd: 40015},
				{Comment: "b", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.2"), Port: 80, ToPort: 40000},
			},
			NodePorts: []NodePort{{Comment: "c", Family: IPv4, Protocol: TCP, Port: 30080, ToPort: 40000, ToPortEnd: 40015}},
		}, []string{
			`shared layout: intercept 1 ("b", tcp 10.96.0.2:80) goes to listener port 40000, but intercept 0 ("a", tcp 10.96.0.1:80) goes to 40000-40015: every IPv4 tcp intercept and node port must go to the same one`,
		}},
		{"range backwards", Rules{Shared: true, Intercepts: []InterceptRule{
			{Comment: "a", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.1"), Port: 80, ToPort: 40015, ToPortEnd: 40000},
		}}, []string{`intercept 0 ("a"): listener ports 40015-40000: the range ends before it starts`}},
		{"node ports differ", Rules{Shared: true, NodePorts: []NodePort{
			np("a", IPv4, UDP, 30053, 40001), np("b", IPv4, UDP, 30054, 40002),
		}}, []string{
			`shared layout: node port 1 ("b", udp port 30054) goes to listener port 40002, but node port 0 ("a", udp port 30053) goes to 40001: every IPv4 udp intercept and node port must go to the same one`,
		}},
		// An invalid intercept is reported once, for what is wrong
		// with it, and does not count for the shared listener.
		{"invalid intercept", Rules{Shared: true, Intercepts: []InterceptRule{
			svc("bad", TCP, "10.96.0.1", 0, 40009), svc("a", TCP, "10.96.0.2", 80, 40000),
		}}, []string{`intercept 0 ("bad"): port 0`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			if err := tt.rules.validate(); err != nil {
				got = strings.Split(err.Error(), "\n")
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("validate() (-want +got):\n%s", diff)
			}
		})
	}
}

// TestRenderSharedIsConstant checks that in the shared layout the number
// of rules does not grow with the services and node ports, but only
// with the guarded intercepts' allowed sources.
func TestRenderSharedIsConstant(t *testing.T) {
	few := sharedAll
	many := sharedAll
	many.Intercepts = slices.Clone(sharedAll.Intercepts)
	many.NodePorts = slices.Clone(sharedAll.NodePorts)
	for i := range 5000 {
		many.Intercepts = append(many.Intercepts,
			sharedSvc(fmt.Sprintf("ns/svc-%d:http", i), TCP, netip.AddrFrom4([4]byte{10, 96, 100 + byte(i>>8), byte(i)}).String(), 80),
			sharedSvc(fmt.Sprintf("ns/svc-%d:dns", i), UDP, netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, 1, 14: byte(i >> 8), 15: byte(i)}).String(), 53))
		if i < 1000 {
			many.NodePorts = append(many.NodePorts, sharedNP(fmt.Sprintf("ns/svc-%d:http", i), IPv4, TCP, uint16(31000+i)))
		}
	}
	if err := many.validate(); err != nil {
		t.Fatal(err)
	}
	for _, tproxy := range []bool{false, true} {
		for _, f := range []Family{IPv4, IPv6} {
			a, b := few, many
			if tproxy {
				a, b = tproxied(a, Routing{}), tproxied(b, Routing{})
			}
			if diff := cmp.Diff(string(Render(f, a)), string(Render(f, b))); diff != "" {
				t.Errorf("%s, tproxy %v: 10,000 more services change the rules (-few +many):\n%s", f, tproxy, diff)
			}
		}
	}
	if got, want := wantSets(IPv4, many).memberCount()-wantSets(IPv4, few).memberCount(), 6000; got != want {
		t.Errorf("IPv4: %d more set members, want %d", got, want)
	}
	if got, want := wantSets(IPv6, many).memberCount()-wantSets(IPv6, few).memberCount(), 5000; got != want {
		t.Errorf("IPv6: %d more set members, want %d", got, want)
	}
}

// TestRenderSharedDeterministic checks that the order of the input does
// not matter in the shared layout, and that Render does not modify it.
func TestRenderSharedDeterministic(t *testing.T) {
	// Ports that Sync rejects still render independently of order.
	conflicting := sharedAll
	conflicting.Intercepts = append(slices.Clone(sharedAll.Intercepts), svc("odd", TCP, "10.96.0.99", 80, 40099))
	for _, r := range []Rules{sharedAll, tproxied(sharedAll, Routing{}), conflicting, tproxied(conflicting, Routing{})} {
		for _, f := range []Family{IPv4, IPv6} {
			in := reversed(r)
			before := reversed(reversed(in))
			a, b := Render(f, r), Render(f, in)
			if diff := cmp.Diff(string(a), string(b)); diff != "" {
				t.Errorf("Render(%s) depends on input order (-forward +reversed):\n%s", f, diff)
			}
			if diff := cmp.Diff(wantSets(f, r), wantSets(f, in), cmp.AllowUnexported(setContent{})); diff != "" {
				t.Errorf("wantSets(%s) depends on input order (-forward +reversed):\n%s", f, diff)
			}
			if diff := cmp.Diff(before, in, cmp.Comparer(func(a, b netip.Addr) bool { return a == b }),
				cmp.Comparer(func(a, b netip.Prefix) bool { return a == b })); diff != "" {
				t.Errorf("Render modified its input (-before +after):\n%s", diff)
			}
		}
	}
}

// sharedSyncStep syncs r with s, not fully, and checks the Result, the
// calls, the ipset restore input and what the fake kernel then holds.
func sharedSyncStep(t *testing.T, k *fakeKernel, s *Syncer, name string, r Rules, full bool, want Result, wantCalls []string, wantSetInput ...string) {
	t.Helper()
	k.mu.Lock()
	k.setRestored = nil
	k.mu.Unlock()
	res, err := s.Sync(context.Background(), r, full)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if res != want {
		t.Errorf("%s: Sync = %+v, want %+v", name, res, want)
	}
	if diff := cmp.Diff(wantCalls, k.takeCalls()); diff != "" {
		t.Errorf("%s: calls (-want +got):\n%s", name, diff)
	}
	if diff := cmp.Diff(wantSetInput, k.setRestored); diff != "" {
		t.Errorf("%s: ipset restore input (-want +got):\n%s", name, diff)
	}
	if diff := cmp.Diff(wantSave(k.family, r), k.save()); diff != "" {
		t.Errorf("%s: kernel (-want +got):\n%s", name, diff)
	}
	if diff := cmp.Diff(wantSetsSave(k.family, r), k.saveSets()); diff != "" {
		t.Errorf("%s: sets (-want +got):\n%s", name, diff)
	}
}

// TestSyncShared checks the Syncer in the shared layout: services and
// node ports come and go as set members alone, without iptables-restore;
// a protocol's first member writes its rule; a full Sync repairs the
// members someone deleted or added, and the kernel's own hash options are
// no drift; switching layouts destroys the sets no rule names.
func TestSyncShared(t *testing.T) {
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	r := Rules{
		Shared: true,
		Intercepts: []InterceptRule{
			sharedSvc("default/web:http", TCP, "10.96.0.10", 80),
			sharedSvc("default/api:http", TCP, "10.96.0.11", 80),
			sharedSvc("default/db:pg", TCP, "10.96.0.12", 5432),
			sharedSvc("default/web:http", TCP, "2001:db8::10", 80),
		},
		NodePorts: []NodePort{sharedNP("default/web:http", IPv4, TCP, 30080)},
		Listeners: []Listener{{IPv4, TCP, sharedTCP4}, {IPv6, TCP, sharedTCP6}},
	}
	// 4 rules: the set's REDIRECT, the jump to node ports, the node-port
	// set's REDIRECT, the listener guard.
	const svcs, nps, lst = "uproxy-services4", "uproxy-nodeports-tcp4", "uproxy-listeners-tcp4"
	sharedSyncStep(t, k, s, "first", r, false,
		Result{Wrote: true, Rules: 6, WroteSets: true, SetMembers: 5, SetMembersWritten: 5},
		concat(callsRead, callSetRestore, callRestore, callsInsertJumps),
		"create "+lst+" bitmap:port range 0-65535 -exist\nadd "+lst+" 40000 -exist\n"+
			"create "+svcs+" hash:ip,port family inet maxelem 1048576 -exist\n"+
			"add "+svcs+" 10.96.0.10,tcp:80 -exist\nadd "+svcs+" 10.96.0.11,tcp:80 -exist\nadd "+svcs+" 10.96.0.12,tcp:5432 -exist\n"+
			"create "+nps+" bitmap:port range 0-65535 -exist\nadd "+nps+" 30080 -exist\n")
	rules := k.save()
	// The kernel printed the set's header with its own hashsize,
	// bucketsize and initval: not drift.
	sharedSyncStep(t, k, s, "unchanged full", r, true, Result{Rules: 6, SetMembers: 5}, concat(callsRead, callsJumps))

	// One service added, one removed, the node port moved: four
	// member changes, no rule.
	moved := r
	moved.Intercepts = append(slices.Clone(r.Intercepts[:2]), r.Intercepts[3], sharedSvc("default/new:dns", TCP, "10.96.0.13", 53))
	moved.NodePorts = []NodePort{sharedNP("default/web:http", IPv4, TCP, 30081)}
	sharedSyncStep(t, k, s, "one added, one removed", moved, false,
		Result{Rules: 6, WroteSets: true, SetMembers: 5, SetMembersWritten: 4},
		[]string{callSetRestore},
		"del "+svcs+" 10.96.0.12,tcp:5432 -exist\nadd "+svcs+" 10.96.0.13,tcp:53 -exist\n"+
			"del "+nps+" 30080 -exist\nadd "+nps+" 30081 -exist\n")
	if got := k.save(); got != rules {
		t.Errorf("the rules changed with the services (-before +after):\n%s", cmp.Diff(rules, got))
	}
	sharedSyncStep(t, k, s, "unchanged", moved, false, Result{Rules: 6, SetMembers: 5}, nil)

	// The first UDP service: its rule, after its member.
	withUDP := moved
	withUDP.Intercepts = append(slices.Clone(moved.Intercepts), sharedSvc("kube-system/dns:dns", UDP, "10.96.0.2", 53))
	withUDP.Listeners = append(slices.Clone(moved.Listeners), Listener{IPv4, UDP, sharedUDP4})
	sharedSyncStep(t, k, s, "first UDP service", withUDP, false,
		Result{Wrote: true, Rules: 10, WroteSets: true, SetMembers: 7, SetMembersWritten: 2},
		[]string{callSetRestore, callRestore},
		"create uproxy-listeners-udp4 bitmap:port range 0-65535 -exist\nadd uproxy-listeners-udp4 40001 -exist\n"+
			"add "+svcs+" 10.96.0.2,udp:53 -exist\n")

	// Drift: a member deleted, a stray one added, the node-port set
	// flushed; repaired by ipset alone.
	k.editSets(func(sets map[string]*fakeSet) {
		delete(sets[svcs].members, setMember{addr: netip.MustParseAddr("10.96.0.11"), proto: TCP, port: 80})
		sets[svcs].members[setMember{addr: netip.MustParseAddr("10.96.0.99"), proto: TCP, port: 22}] = true
		clear(sets[nps].members)
	})
	sharedSyncStep(t, k, s, "repair members", withUDP, true,
		Result{Rules: 10, Repaired: true, WroteSets: true, SetMembers: 7, SetMembersWritten: 3, SetsRepaired: true},
		concat(callsRead, callSetRestore, callsJumps),
		"del "+svcs+" 10.96.0.99,tcp:22 -exist\nadd "+svcs+" 10.96.0.11,tcp:80 -exist\nadd "+nps+" 30081 -exist\n")

	// Someone flushed the chain and destroyed the service set: the set
	// comes back before the rules that name it.
	k.edit("nat", func(order []string, rules map[string][]string) []string {
		rules[ServicesChain] = nil
		return order
	})
	k.editSets(func(sets map[string]*fakeSet) { delete(sets, svcs) })
	sharedSyncStep(t, k, s, "repair a destroyed set", withUDP, true,
		Result{Wrote: true, Rules: 10, Repaired: true, WroteSets: true, SetMembers: 7, SetMembersWritten: 4, SetsRepaired: true},
		concat(callsRead, callSetRestore, callRestore, callsJumps),
		"create "+svcs+" hash:ip,port family inet maxelem 1048576 -exist\n"+
			"add "+svcs+" 10.96.0.2,udp:53 -exist\nadd "+svcs+" 10.96.0.10,tcp:80 -exist\nadd "+svcs+" 10.96.0.11,tcp:80 -exist\nadd "+svcs+" 10.96.0.13,tcp:53 -exist\n")

	// A set of another type under the name: made anew (once no rule
	// names it, which whoever made it saw to).
	k.edit("nat", func(order []string, rules map[string][]string) []string {
		rules[ServicesChain] = nil
		return order
	})
	k.editSets(func(sets map[string]*fakeSet) {
		sets[svcs] = &fakeSet{header: "hash:ip,port family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x1", members: map[setMember]bool{}}
	})
	sharedSyncStep(t, k, s, "repair a set of other options", withUDP, true,
		Result{Wrote: true, Rules: 10, Repaired: true, WroteSets: true, SetMembers: 7, SetMembersWritten: 4, SetsRepaired: true},
		concat(callsRead, callSetRestore, callRestore, callsJumps),
		"destroy "+svcs+"\ncreate "+svcs+" hash:ip,port family inet maxelem 1048576 -exist\n"+
			"add "+svcs+" 10.96.0.2,udp:53 -exist\nadd "+svcs+" 10.96.0.10,tcp:80 -exist\nadd "+svcs+" 10.96.0.11,tcp:80 -exist\nadd "+svcs+" 10.96.0.13,tcp:53 -exist\n")

	// Back to the per-service layout: the rules no longer name the
	// service and node-port sets, which go after them. The listener
	// sets stay.
	perService := withUDP
	perService.Shared = false
	sharedSyncStep(t, k, s, "per-service layout", perService, false,
		Result{Wrote: true, Rules: 12, WroteSets: true, SetMembers: 2},
		[]string{callRestore, "ipset destroy " + svcs, "ipset destroy " + nps})
	sharedSyncStep(t, k, s, "shared layout again", withUDP, false,
		Result{Wrote: true, Rules: 10, WroteSets: true, SetMembers: 7, SetMembersWritten: 5},
		[]string{callSetRestore, callRestore},
		"create "+svcs+" hash:ip,port family inet maxelem 1048576 -exist\n"+
			"add "+svcs+" 10.96.0.2,udp:53 -exist\nadd "+svcs+" 10.96.0.10,tcp:80 -exist\nadd "+svcs+" 10.96.0.11,tcp:80 -exist\nadd "+svcs+" 10.96.0.13,tcp:53 -exist\n"+
			"create "+nps+" bitmap:port range 0-65535 -exist\nadd "+nps+" 30081 -exist\n")

	// Tproxy mode: the same sets, the rules in mangle, and the jumps to
	// them, which a change of mode reads the tables for.
	sharedSyncStep(t, k, s, "tproxy mode", tproxied(withUDP, Routing{}), false,
		Result{Wrote: true, Rules: 21, SetMembers: 7}, concat(callsRead, callRestore, "Insert mangle PREROUTING 1", "Insert mangle OUTPUT 1"))

	// Cleanup destroys every set, once the rules are gone.
	if err := Cleanup(context.Background(), Config{Exec: k, Jumps: k}); err != nil {
		t.Fatal(err)
	}
	if got, want := k.saveSets(), wantSetsSave(IPv4, Rules{}); got != want {
		t.Errorf("sets after Cleanup = %q, want %q", got, want)
	}
}

// TestSyncSharedIPv6 checks the IPv6 Syncer's sets in the shared layout.
func TestSyncSharedIPv6(t *testing.T) {
	k := newFakeKernel(IPv6)
	s := newFakeSyncer(t, k)
	res, err := s.Sync(context.Background(), sharedAll, false)
	if err != nil {
		t.Fatal(err)
	}
	// 8 rules: the guarded intercept's allowed prefix, a set REDIRECT
	// per protocol and the jump in UPROXY-SERVICES, one in
	// UPROXY-NODEPORTS, the firewall's DROP and two listener guards.
	if want := (Result{Wrote: true, Rules: 12, WroteSets: true, SetMembers: 6, SetMembersWritten: 6}); res != want {
		t.Errorf("Sync = %+v, want %+v", res, want)
	}
	if diff := cmp.Diff([]string{string(RenderSetUpdate(IPv6, Rules{}, sharedAll))}, k.setRestored); diff != "" {
		t.Errorf("ipset restore input (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSave(IPv6, sharedAll), k.save()); diff != "" {
		t.Errorf("kernel (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantSetsSave(IPv6, sharedAll), k.saveSets()); diff != "" {
		t.Errorf("sets (-want +got):\n%s", diff)
	}
	if !strings.Contains(k.saveSets(), "add uproxy-services6 2001:db8::10,udp:443\n") {
		t.Errorf("no IPv6 member in the sets:\n%s", k.saveSets())
	}
}

// TestSyncSharedInvalidRunsNothing checks that listener ports that differ
// within a family and protocol fail the Sync before anything runs, even
// when they are of the other family, as any invalid rule does.
func TestSyncSharedInvalidRunsNothing(t *testing.T) {
	k := newFakeKernel(IPv4)
	s := newFakeSyncer(t, k)
	bad := sharedAll
	bad.NodePorts = append(slices.Clone(sharedAll.NodePorts), np("x", IPv6, UDP, 30053, 41009))
	_, err := s.Sync(context.Background(), bad, true)
	if err == nil || !strings.Contains(err.Error(), `IPv4: invalid rules: shared layout: node port 4 ("x", udp port 30053) goes to listener port 41009, `+
		`but intercept 7 ("kube-system/kube-dns:dns", udp [2001:db8::a]:53) goes to 41001: every IPv6 udp intercept and node port must go to the same one`) {
		t.Errorf("Sync = %v", err)
	}
	if calls := k.takeCalls(); len(calls) != 0 {
		t.Errorf("invalid Sync ran %q", calls)
	}
}

// TestSyncSharedWithoutIpset checks that without ipset the shared layout,
// and tproxy mode's gates, fail, naming ipset, and run nothing.
func TestSyncSharedWithoutIpset(t *testing.T) {
	pathWithoutIpset(t)
	k := newFakeKernel(IPv4)
	s, err := New(Config{Jumps: k})
	if err != nil {
		t.Fatal(err)
	}
	s.exec = k
	noListeners := sharedServices
	noListeners.Listeners = nil
	for _, tt := range []struct {
		r    Rules
		want string
	}{
		{noListeners, "IPv4: the shared layout needs kernel sets, but ipset is not installed"},
		{sharedServices, "IPv4: the listener guards and the shared layout need kernel sets, but ipset is not installed"},
		{perServiceTProxy(noListeners), "IPv4: tproxy mode's gates need kernel sets, but ipset is not installed"},
		{perServiceTProxy(sharedServices), "IPv4: the listener guards and tproxy mode's gates need kernel sets, but ipset is not installed"},
	} {
		_, err := s.Sync(context.Background(), tt.r, false)
		if !errors.Is(err, exec.ErrNotFound) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Sync = %v, want an error containing %q", err, tt.want)
		}
	}
	if calls := k.takeCalls(); len(calls) != 0 {
		t.Errorf("Sync without ipset ran %q", calls)
	}
}

// perServiceTProxy returns r in tproxy mode with per-service rules.
func perServiceTProxy(r Rules) Rules {
	r.Shared, r.TProxy = false, &TProxy{}
	return r
}
