package redirect

import (
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

var update = flag.Bool("update", false, "rewrite the testdata/*.golden files from the current output")

// svc returns an intercept for the VIP dest (an address literal).
func svc(comment string, p Protocol, dest string, port, toPort uint16) InterceptRule {
	return InterceptRule{Comment: comment, Protocol: p, Dest: netip.MustParseAddr(dest), Port: port, ToPort: toPort}
}

// pfx returns the prefixes named by the literals.
func pfx(literals ...string) []netip.Prefix {
	ps := make([]netip.Prefix, len(literals))
	for i, l := range literals {
		ps[i] = netip.MustParsePrefix(l)
	}
	return ps
}

// np returns a node port.
func np(comment string, f Family, p Protocol, port, toPort uint16) NodePort {
	return NodePort{Comment: comment, Family: f, Protocol: p, Port: port, ToPort: toPort}
}

// fw returns a firewall for dest (an address literal) allowing the
// prefixes.
func fw(comment string, p Protocol, dest string, port uint16, allow ...string) Firewall {
	return Firewall{Comment: comment, Protocol: p, Dest: netip.MustParseAddr(dest), Port: port, Allow: pfx(allow...)}
}

// all has every kind of rule, of both families, unsorted: a ClusterIP
// and a LoadBalancer service of TCP and UDP ports, with node ports and
// source ranges.
var all = Rules{
	Intercepts: []InterceptRule{
		svc("default/lb:https", TCP, "10.96.200.1", 443, 40011),
		svc("default/web:http", TCP, "10.96.0.10", 80, 40001),
		svc("default/lb:https", TCP, "10.96.0.20", 443, 40011),
		svc("default/lb:dns", UDP, "10.96.200.1", 53, 40012),
		svc("default/lb:dns", UDP, "10.96.0.20", 53, 40012),
		svc("default/lb:https", TCP, "2001:db8:96::c8:1", 443, 41011),
		svc("default/lb:https", TCP, "2001:db8:96::20", 443, 41011),
		svc("default/web:http", TCP, "2001:db8:96::10", 80, 41001),
	},
	NodePorts: []NodePort{
		np("default/lb:https", IPv4, TCP, 30443, 40011),
		np("default/lb:dns", IPv4, UDP, 30053, 40012),
		np("default/lb:https", IPv6, TCP, 30443, 41011),
	},
	Firewalls: []Firewall{
		fw("default/lb:https", TCP, "10.96.200.1", 443, "203.0.113.0/24", "2001:db8:1::/48", "10.244.0.10/32"),
		fw("default/lb:dns", UDP, "10.96.200.1", 53, "2001:db8:1::/48"),
		fw("default/lb:https", TCP, "2001:db8:96::c8:1", 443, "2001:db8:1::/48", "10.244.0.10/32"),
	},
	Listeners: []Listener{
		{IPv4, UDP, 40012}, {IPv4, TCP, 40011}, {IPv4, TCP, 40001},
		{IPv6, TCP, 41011}, {IPv6, TCP, 41001},
	},
}

// mixed has IPv4 and IPv6 intercepts, unsorted.
var mixed = Rules{Intercepts: []InterceptRule{
	svc("default/web:http", TCP, "2001:db8::10", 80, 40001),
	svc("default/web:http", TCP, "10.96.0.10", 80, 40002),
	svc("kube-system/kube-dns:dns", UDP, "2001:db8::a", 53, 40003),
	svc("kube-system/kube-dns:dns", UDP, "10.96.0.2", 53, 40004),
	svc("mapped/v4:x", TCP, "::ffff:10.96.0.3", 8080, 40005),
}}

// tproxied returns r in tproxy mode with routing rt.
func tproxied(r Rules, rt Routing) Rules {
	r.TProxy = &TProxy{Routing: rt}
	return r
}

// firewalled is the rules of the golden file firewall: intercepts of
// a LoadBalancer IP guarded for TCP and UDP, a guard allowing everyone,
// one allowing only the other family, and one without an intercept.
var firewalled = Rules{
	Intercepts: []InterceptRule{
		svc("default/lb:http", TCP, "10.96.200.1", 80, 40001),
		svc("default/lb:dns", UDP, "10.96.200.1", 53, 40002),
		svc("default/open:http", TCP, "10.96.200.2", 80, 40003),
		svc("default/v6only:http", TCP, "10.96.200.3", 80, 40004),
		svc("default/lb:http", TCP, "10.96.0.10", 80, 40001),
	},
	Firewalls: []Firewall{
		fw("default/lb:http", TCP, "10.96.200.1", 80, "2001:db8::/32", "192.0.2.77/24", "10.244.0.10/32", "10.244.0.10/32", "::ffff:198.51.100.0/120"),
		fw("default/lb:dns", UDP, "10.96.200.1", 53, "10.244.0.0/16"),
		fw("default/open:http", TCP, "10.96.200.2", 80, "0.0.0.0/0"),
		fw("default/v6only:http", TCP, "10.96.200.3", 80, "2001:db8::/32"),
		fw("default/gone:http", TCP, "10.96.200.4", 80, "10.244.0.0/16"),
	},
}

// rejecting is the rules of the golden files rejects and rejects_v6:
// service ports without endpoints beside one with, and a firewall.
var rejecting = Rules{
	Intercepts: []InterceptRule{svc("default/web:http", TCP, "10.96.0.10", 80, 40001)},
	Rejects: []Reject{
		{Comment: "default/empty:http", Family: IPv4, Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.30"), Port: 80},
		{Comment: "default/empty:http", NodePort: true, Family: IPv4, Protocol: TCP, Port: 30081},
		{Comment: "default/empty:dns", Family: IPv4, Protocol: UDP, Dest: netip.MustParseAddr("10.96.0.30"), Port: 53},
		{Comment: "default/empty:http", Family: IPv6, Protocol: TCP, Dest: netip.MustParseAddr("2001:db8::30"), Port: 80},
		{Comment: "default/empty:http", NodePort: true, Family: IPv6, Protocol: TCP, Port: 30081},
	},
	Firewalls: []Firewall{fw("default/lb:http", TCP, "10.96.200.1", 80, "10.244.0.0/16")},
	Listeners: []Listener{{IPv4, TCP, 40001}, {IPv4, TCP, 40005}},
}

// firewalled6 is the rules of the golden file firewall_v6.
var firewalled6 = Rules{
	Intercepts: []InterceptRule{
		svc("default/lb:http", TCP, "2001:db8:96::c8:1", 80, 41001),
		svc("default/lb:http", TCP, "10.96.200.1", 80, 40001),
	},
	Firewalls: []Firewall{
		fw("default/lb:http", TCP, "2001:db8:96::c8:1", 80, "2001:db8:244::a/128", "10.0.0.0/8", "2001:db8:1::1/48"),
		fw("default/lb:http", TCP, "10.96.200.1", 80, "10.0.0.0/8"),
		fw("default/gone:http", UDP, "2001:db8:96::c8:2", 53),
	},
}

func TestRenderGolden(t *testing.T) {
	tests := []struct {
		name   string
		family Family
		rules  Rules
	}{
		{"empty", IPv4, Rules{}},
		{"empty_v6", IPv6, Rules{}},
		{"one", IPv4, Rules{Intercepts: []InterceptRule{svc("default/web:http", TCP, "10.96.0.10", 80, 40001)}}},
		{"many_unsorted", IPv4, Rules{Intercepts: []InterceptRule{
			svc("default/web:https", TCP, "10.96.0.10", 443, 40002),
			svc("kube-system/kube-dns:dns-tcp", TCP, "10.96.0.2", 53, 40011),
			svc("default/web:http", TCP, "10.96.0.10", 80, 40001),
			svc("shop/cart:grpc", TCP, "10.96.100.7", 9000, 40020),
			svc("kube-system/kube-dns:dns", UDP, "10.96.0.2", 53, 40010),
			svc("default/kubernetes:https", TCP, "10.96.0.1", 443, 40000),
			svc("shop/cart:metrics", TCP, "10.96.12.1", 9100, 40021),
		}}},
		{"mixed_v4", IPv4, mixed},
		{"mixed_v6", IPv6, mixed},
		{"ipv6", IPv6, Rules{Intercepts: []InterceptRule{
			svc("default/web:http", TCP, "2001:db8::10", 80, 40001),
			svc("default/web:quic", UDP, "2001:db8::10", 443, 40002),
			svc("default/api", TCP, "2001:db8:0:1::1", 443, 40003),
		}}},
		{"comments", IPv4, Rules{Intercepts: []InterceptRule{
			svc("plain", TCP, "10.96.0.1", 1, 40001),
			svc("with space", TCP, "10.96.0.1", 2, 40002),
			svc(`double "quoted"`, TCP, "10.96.0.1", 3, 40003),
			svc(`back\slash`, TCP, "10.96.0.1", 4, 40004),
			svc("single 'quoted'", TCP, "10.96.0.1", 5, 40005),
			svc("", TCP, "10.96.0.1", 6, 40006),
			svc("new\nline\r\n-A PREROUTING -j ACCEPT", TCP, "10.96.0.1", 7, 40007),
			svc("tab\there", TCP, "10.96.0.1", 8, 40008),
			svc("ünïcödé/名前:port", TCP, "10.96.0.1", 9, 40009),
			svc(strings.Repeat("x", 300), TCP, "10.96.0.1", 10, 40010),
			svc(strings.Repeat("x", 254)+"é", TCP, "10.96.0.1", 11, 40011),
		}}},
		{"all_v4", IPv4, all},
		{"all_v6", IPv6, all},
		{"nodeports", IPv4, Rules{NodePorts: []NodePort{
			np("default/web:http", IPv4, TCP, 30080, 40001),
			np("kube-system/dns:dns", IPv4, UDP, 30053, 40002),
			np("default/web:http", IPv6, TCP, 30080, 41001),
		}}},
		{"nodeports_v6", IPv6, Rules{NodePorts: []NodePort{
			np("default/web:http", IPv4, TCP, 30080, 40001),
			np("default/web:http", IPv6, TCP, 30080, 41001),
			np("default/web:quic", IPv6, UDP, 30443, 41002),
		}}},
		// The jumps are from the node's own addresses in the prefixes
		// of the family, masked, sorted, without duplicates; a /0 matches
		// every address, so it has no -d.
		{"nodeport_addresses", IPv4, Rules{
			NodePorts:         []NodePort{np("default/web:http", IPv4, TCP, 30080, 40001)},
			NodePortAddresses: pfx("192.168.1.7/24", "2001:db8::/64", "10.0.0.0/8", "::ffff:172.16.0.0/108", "192.168.1.0/24"),
		}},
		{"nodeport_addresses_v6", IPv6, Rules{
			NodePorts:         []NodePort{np("default/web:http", IPv6, TCP, 30080, 41001)},
			NodePortAddresses: pfx("10.0.0.0/8", "2001:db8:1::1/64", "fd00::/8"),
		}},
		{"nodeport_addresses_all", IPv4, Rules{
			NodePorts:         []NodePort{np("default/web:http", IPv4, TCP, 30080, 40001)},
			NodePortAddresses: pfx("0.0.0.0/0"),
		}},
		{"nodeport_addresses_all_v6", IPv6, Rules{
			NodePorts:         []NodePort{np("default/web:http", IPv6, TCP, 30080, 41001)},
			NodePortAddresses: pfx("::/0"),
		}},
		// --iptables-localhost-nodeports, kube-proxy's default: IPv4
		// loopback is a node-port address too; IPv6's never is.
		{"nodeport_addresses_localhost", IPv4, Rules{
			NodePorts:          []NodePort{np("default/web:http", IPv4, TCP, 30080, 40001)},
			NodePortAddresses:  pfx("0.0.0.0/0", "127.0.0.0/8"),
			LocalhostNodePorts: true,
		}},
		{"nodeport_addresses_localhost_v6", IPv6, Rules{
			NodePorts:          []NodePort{np("default/web:http", IPv6, TCP, 30080, 41001)},
			NodePortAddresses:  pfx("::/0"),
			LocalhostNodePorts: true,
		}},
		// Without it, a prefix inside loopback is left out, and one that
		// covers it partly is split around it.
		{"nodeport_addresses_no_localhost", IPv4, Rules{
			NodePorts:         []NodePort{np("default/web:http", IPv4, TCP, 30080, 40001)},
			NodePortAddresses: pfx("127.0.0.1/32", "0.0.0.0/1", "192.168.0.0/16"),
		}},
		// Node-port addresses of only the other family: no jump.
		{"nodeport_addresses_other_family", IPv6, Rules{
			NodePorts:         []NodePort{np("default/web:http", IPv6, TCP, 30080, 41001)},
			NodePortAddresses: pfx("10.0.0.0/8"),
		}},
		// Node-port addresses but no node ports: no jump.
		{"nodeport_addresses_no_nodeports", IPv4, Rules{
			Intercepts:        []InterceptRule{svc("default/web:http", TCP, "10.96.0.10", 80, 40001)},
			NodePorts:         []NodePort{np("default/web:http", IPv6, TCP, 30080, 41001)},
			NodePortAddresses: pfx("10.0.0.0/8"),
		}},
		// One REDIRECT per allowed prefix of the family (the IPv6 one
		// is skipped), host bits cleared, a /0 without -s; a firewall
		// with no allowed prefix of the family redirects nothing; one
		// without an intercept only drops.
		{"firewall", IPv4, firewalled},
		{"firewall_v6", IPv6, firewalled6},
		// Service ports without endpoints: a REJECT per destination of
		// the family, node ports on any local address, before the
		// firewall's drops and the listener guard.
		{"rejects", IPv4, rejecting},
		{"rejects_v6", IPv6, rejecting},
		{"tproxy_rejects", IPv4, tproxied(rejecting, Routing{})},
		{"tproxy_rejects_v6", IPv6, tproxied(rejecting, Routing{})},
		{"listeners", IPv4, Rules{Listeners: []Listener{
			{IPv4, TCP, 40002}, {IPv4, UDP, 40002}, {IPv4, TCP, 40001}, {IPv4, TCP, 40001}, {IPv6, TCP, 41001},
		}}},
		{"listeners_v6", IPv6, Rules{Listeners: []Listener{
			{IPv4, TCP, 40001}, {IPv6, TCP, 41001}, {IPv6, UDP, 41002},
		}}},
		{"invalid_skipped", IPv4, Rules{Intercepts: []InterceptRule{
			svc("ok", TCP, "10.96.0.1", 80, 40001),
			svc("bad protocol", Protocol("sctp"), "10.96.0.1", 81, 40002),
			svc("bad port", TCP, "10.96.0.1", 0, 40003),
			svc("bad listener", TCP, "10.96.0.1", 82, 0),
			{Comment: "no address", Protocol: TCP, Port: 83, ToPort: 40004},
		}}},
		// Invalid node ports, firewalls and listeners are skipped; an
		// invalid allowed prefix lets nobody more in.
		{"invalid_skipped_others", IPv4, Rules{
			Intercepts: []InterceptRule{svc("lb", TCP, "10.96.200.1", 80, 40001)},
			NodePorts: []NodePort{
				np("ok", IPv4, TCP, 30080, 40001),
				np("bad family", Family(7), TCP, 30081, 40001),
				np("bad protocol", IPv4, "sctp", 30082, 40001),
				np("bad port", IPv4, TCP, 0, 40001),
				np("bad listener", IPv4, TCP, 30083, 0),
			},
			NodePortAddresses: []netip.Prefix{{}, netip.MustParsePrefix("::ffff:0.0.0.0/80"), netip.MustParsePrefix("10.0.0.0/8")},
			Firewalls: []Firewall{
				{Comment: "lb", Protocol: TCP, Dest: netip.MustParseAddr("10.96.200.1"), Port: 80, Allow: []netip.Prefix{{}, netip.MustParsePrefix("10.244.0.0/24")}},
				fw("bad port", TCP, "10.96.200.1", 0, "10.0.0.0/8"),
				{Comment: "no address", Protocol: TCP, Port: 81},
			},
			Listeners: []Listener{{IPv4, TCP, 40001}, {IPv4, TCP, 0}, {IPv4, "sctp", 40002}, {Family(7), TCP, 40003}},
		}},

		// Tproxy mode: the nat chains and UPROXY-FIREWALL's firewall
		// rules are empty (the listener guards stay); UPROXY-TPROXY has
		// a TPROXY to the loopback listener per intercept, or per
		// allowed prefix followed by the firewall's DROP, then the node
		// ports (on every local address but loopback, or on those in
		// NodePortAddresses), then the marks of the transparent sockets'
		// packets; UPROXY-TPROXY-OUTPUT marks the node's packets to
		// every intercepted or guarded destination.
		{"tproxy_empty", IPv4, tproxied(Rules{}, Routing{})},
		{"tproxy_empty_v6", IPv6, tproxied(Rules{}, Routing{})},
		{"tproxy_all_v4", IPv4, tproxied(all, Routing{})},
		{"tproxy_all_v6", IPv6, tproxied(all, Routing{})},
		{"tproxy_mixed_v4", IPv4, tproxied(mixed, Routing{})},
		{"tproxy_mixed_v6", IPv6, tproxied(mixed, Routing{})},
		// A firewall with only the other family's prefixes, or without
		// an intercept, only drops; a /0 TPROXYs without -s.
		{"tproxy_firewall", IPv4, tproxied(firewalled, Routing{})},
		{"tproxy_firewall_v6", IPv6, tproxied(firewalled6, Routing{})},
		{"tproxy_nodeports", IPv4, tproxied(Rules{NodePorts: []NodePort{
			np("default/web:http", IPv4, TCP, 30080, 40001),
			np("kube-system/dns:dns", IPv4, UDP, 30053, 40002),
			np("default/web:http", IPv6, TCP, 30080, 41001),
		}}, Routing{})},
		{"tproxy_nodeports_v6", IPv6, tproxied(Rules{NodePorts: []NodePort{
			np("default/web:http", IPv4, TCP, 30080, 40001),
			np("default/web:http", IPv6, TCP, 30080, 41001),
			np("default/web:quic", IPv6, UDP, 30443, 41002),
		}}, Routing{})},
		// One rule per node port and prefix of the family; a /0 has no -d.
		{"tproxy_nodeport_addresses", IPv4, tproxied(Rules{
			NodePorts: []NodePort{
				np("default/web:http", IPv4, TCP, 30080, 40001),
				np("kube-system/dns:dns", IPv4, UDP, 30053, 40002),
			},
			NodePortAddresses: pfx("192.168.1.7/24", "2001:db8::/64", "10.0.0.0/8", "::ffff:172.16.0.0/108", "192.168.1.0/24"),
		}, Routing{})},
		{"tproxy_nodeport_addresses_v6", IPv6, tproxied(Rules{
			NodePorts:         []NodePort{np("default/web:http", IPv6, TCP, 30080, 41001)},
			NodePortAddresses: pfx("10.0.0.0/8", "2001:db8:1::1/64", "fd00::/8"),
		}, Routing{})},
		{"tproxy_nodeport_addresses_all", IPv4, tproxied(Rules{
			NodePorts:         []NodePort{np("default/web:http", IPv4, TCP, 30080, 40001)},
			NodePortAddresses: pfx("0.0.0.0/0"),
		}, Routing{})},
		{"tproxy_nodeport_addresses_all_v6", IPv6, tproxied(Rules{
			NodePorts:         []NodePort{np("default/web:http", IPv6, TCP, 30080, 41001)},
			NodePortAddresses: pfx("::/0", "10.0.0.0/8"),
		}, Routing{})},
		{"tproxy_nodeport_addresses_other_family", IPv6, tproxied(Rules{
			NodePorts:         []NodePort{np("default/web:http", IPv6, TCP, 30080, 41001)},
			NodePortAddresses: pfx("10.0.0.0/8"),
		}, Routing{})},
		// Another mark and mask, in both targets.
		{"tproxy_mark", IPv4, tproxied(Rules{
			Intercepts: []InterceptRule{svc("default/web:http", TCP, "10.96.0.10", 80, 40001)},
		}, Routing{Mark: 0x10, Mask: 0xf0, Table: 200})},
		// Without br_netfilter: no gate for bridged clients, whose
		// physdev match would load it.
		{"tproxy_no_bridged", IPv4, Rules{
			Intercepts: []InterceptRule{svc("default/web:http", TCP, "10.96.0.10", 80, 40001)},
			NodePorts:  []NodePort{{Family: IPv4, Protocol: TCP, Port: 30080, ToPort: 40001, Comment: "default/web:http"}},
			TProxy:     &TProxy{NoBridged: true},
		}},
		// Redirect mode with the replies to transparent dials brought
		// back: bridged ones cloned to the IP layer, the rest marked;
		// without br_netfilter only the mark. In tproxy mode Replies
		// changes nothing.
		{"replies", IPv4, Rules{
			Intercepts: []InterceptRule{svc("default/web:http", TCP, "10.96.0.10", 80, 40001)},
			Replies:    &Replies{},
		}},
		{"replies_v6", IPv6, Rules{
			Intercepts: []InterceptRule{svc("default/web:http", TCP, "2001:db8::10", 80, 41001)},
			Replies:    &Replies{},
		}},
		{"replies_no_bridged", IPv4, Rules{
			Intercepts: []InterceptRule{svc("default/web:http", TCP, "10.96.0.10", 80, 40001)},
			Replies:    &Replies{Routing: Routing{Mark: 0x10, Mask: 0xf0}, NoBridged: true},
		}},
		{"replies_tproxy", IPv4, Rules{
			Intercepts: []InterceptRule{svc("default/web:http", TCP, "10.96.0.10", 80, 40001)},
			TProxy:     &TProxy{NoBridged: true},
			Replies:    &Replies{},
		}},
		{"tproxy_invalid_skipped", IPv4, tproxied(Rules{
			Intercepts: []InterceptRule{
				svc("ok", TCP, "10.96.0.1", 80, 40001),
				svc("bad port", TCP, "10.96.0.1", 0, 40003),
				{Comment: "no address", Protocol: TCP, Port: 83, ToPort: 40004},
			},
			NodePorts: []NodePort{np("ok", IPv4, TCP, 30080, 40001), np("bad listener", IPv4, TCP, 30083, 0)},
			Firewalls: []Firewall{
				{Comment: "ok", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.1"), Port: 80, Allow: []netip.Prefix{{}, netip.MustParsePrefix("10.244.0.0/24")}},
				fw("bad port", TCP, "10.96.200.1", 0, "10.0.0.0/8"),
			},
		}, Routing{})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkGolden(t, tt.name, Render(tt.family, tt.rules))
		})
	}
}

// TestRenderDeterministic checks that the order of the input does not
// matter.
func TestRenderDeterministic(t *testing.T) {
	withAddrs := all
	withAddrs.NodePortAddresses = pfx("10.0.0.0/8", "2001:db8::/32", "192.168.0.0/16", "fd00::/8")
	for _, r := range []Rules{mixed, all, withAddrs, firewalled, rejecting, tproxied(all, Routing{}), tproxied(withAddrs, Routing{}), tproxied(firewalled, Routing{})} {
		for _, f := range []Family{IPv4, IPv6} {
			a, b := Render(f, r), Render(f, reversed(r))
			if diff := cmp.Diff(string(a), string(b)); diff != "" {
				t.Errorf("Render(%s) depends on input order (-forward +reversed):\n%s", f, diff)
			}
		}
	}
}

// TestRenderDoesNotModifyInput checks that Render sorts copies.
func TestRenderDoesNotModifyInput(t *testing.T) {
	in := reversed(all)
	in.NodePortAddresses = pfx("192.168.0.0/16", "10.1.2.3/8")
	before := reversed(reversed(in))
	Render(IPv4, in)
	Render(IPv6, in)
	if diff := cmp.Diff(before, in, cmp.Comparer(func(a, b netip.Addr) bool { return a == b }),
		cmp.Comparer(func(a, b netip.Prefix) bool { return a == b })); diff != "" {
		t.Errorf("Render modified its input (-before +after):\n%s", diff)
	}
}

func TestQuoteComment(t *testing.T) {
	tests := []struct{ in, want string }{
		{"plain", "plain"},
		{"a-b_C9", "a-b_C9"},
		{"", `""`},
		{"default/web:http", `"default/web:http"`},
		{"a b", `"a b"`},
		{`say "hi"`, `"say \"hi\""`},
		{`c:\dir`, `"c:\\dir"`},
		{"it's", `"it\'s"`},
		{"a\nb", `"a b"`},
		{"a\x00b\x7f", `"a b "`},
		{"a\xffb", "\"a\uFFFDb\""},
		{strings.Repeat("a", 256), strings.Repeat("a", 255)},
		{strings.Repeat("a", 254) + "éé", strings.Repeat("a", 254)},
	}
	for _, tt := range tests {
		if got := quoteComment(tt.in); got != tt.want {
			t.Errorf("quoteComment(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestRulesValidate(t *testing.T) {
	tests := []struct {
		name    string
		rules   Rules
		wantErr string
	}{
		{"empty", Rules{}, ""},
		{"ok mixed", mixed, ""},
		{"same port other protocol", Rules{Intercepts: []InterceptRule{
			svc("a", TCP, "10.96.0.2", 53, 40001), svc("b", UDP, "10.96.0.2", 53, 40002),
		}}, ""},
		{"protocol", Rules{Intercepts: []InterceptRule{svc("x", "sctp", "10.96.0.1", 80, 1)}}, `intercept 0 ("x"): protocol "sctp"`},
		{"no address", Rules{Intercepts: []InterceptRule{{Protocol: TCP, Port: 80, ToPort: 1}}}, "no destination address"},
		{"zone", Rules{Intercepts: []InterceptRule{svc("x", TCP, "fe80::1%eth0", 80, 1)}}, "has a zone"},
		{"port", Rules{Intercepts: []InterceptRule{svc("x", TCP, "10.96.0.1", 0, 1)}}, "port 0"},
		{"listener", Rules{Intercepts: []InterceptRule{svc("x", TCP, "10.96.0.1", 80, 0)}}, "listener port 0"},
		{"duplicate", Rules{Intercepts: []InterceptRule{
			svc("a", TCP, "10.96.0.1", 80, 40001), svc("b", TCP, "::ffff:10.96.0.1", 80, 40002),
		}}, `intercept 0 ("a") and 1 ("b") both match 10.96.0.1 tcp port 80`},
		{"ok all", all, ""},
		{"node port same port other family or protocol", Rules{NodePorts: []NodePort{
			np("a", IPv4, TCP, 30080, 1), np("b", IPv6, TCP, 30080, 2), np("c", IPv4, UDP, 30080, 3),
		}}, ""},
		{"node port family", Rules{NodePorts: []NodePort{np("x", Family(2), TCP, 30080, 1)}}, `node port 0 ("x"): unknown family Family(2)`},
		{"node port protocol", Rules{NodePorts: []NodePort{np("x", IPv4, "sctp", 30080, 1)}}, `node port 0 ("x"): protocol "sctp"`},
		{"node port port", Rules{NodePorts: []NodePort{np("x", IPv4, TCP, 0, 1)}}, `node port 0 ("x"): port 0`},
		{"node port listener", Rules{NodePorts: []NodePort{np("x", IPv4, TCP, 30080, 0)}}, `node port 0 ("x"): listener port 0`},
		{"node port duplicate", Rules{NodePorts: []NodePort{
			np("a", IPv4, TCP, 30080, 1), np("b", IPv6, TCP, 30080, 2), np("c", IPv4, TCP, 30080, 3),
		}}, `node port 0 ("a") and 2 ("c") both match IPv4 tcp port 30080`},
		{"node port address", Rules{NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), {}}}, "node port address 1: invalid prefix"},
		{"node port address mapped", Rules{NodePortAddresses: pfx("::ffff:0.0.0.0/95")}, "node port address 0: prefix ::ffff:0.0.0.0/95 covers IPv4-mapped and other IPv6 addresses"},
		{"node port address mapped ok", Rules{NodePortAddresses: pfx("::ffff:10.0.0.0/104")}, ""},
		{"firewall empty allow", Rules{Firewalls: []Firewall{fw("x", TCP, "10.96.0.1", 80)}}, ""},
		{"firewall same dest other port or protocol", Rules{Firewalls: []Firewall{
			fw("a", TCP, "10.96.0.1", 80), fw("b", TCP, "10.96.0.1", 81), fw("c", UDP, "10.96.0.1", 80),
		}}, ""},
		{"firewall protocol", Rules{Firewalls: []Firewall{fw("x", "sctp", "10.96.0.1", 80)}}, `firewall 0 ("x"): protocol "sctp"`},
		{"firewall no address", Rules{Firewalls: []Firewall{{Comment: "x", Protocol: TCP, Port: 80}}}, `firewall 0 ("x"): no destination address`},
		{"firewall zone", Rules{Firewalls: []Firewall{fw("x", TCP, "fe80::1%eth0", 80)}}, "has a zone"},
		{"firewall port", Rules{Firewalls: []Firewall{fw("x", TCP, "10.96.0.1", 0)}}, `firewall 0 ("x"): port 0`},
		{"firewall prefix", Rules{Firewalls: []Firewall{{Comment: "x", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.1"), Port: 80,
			Allow: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), {}}}}}, `firewall 0 ("x"): allow 1: invalid prefix`},
		{"firewall duplicate", Rules{Firewalls: []Firewall{
			fw("a", TCP, "10.96.0.1", 80, "10.0.0.0/8"), fw("b", TCP, "::ffff:10.96.0.1", 80),
		}}, `firewall 0 ("a") and 1 ("b") both guard 10.96.0.1 tcp port 80`},
		{"listener duplicate is fine", Rules{Listeners: []Listener{{IPv4, TCP, 40001}, {IPv4, TCP, 40001}}}, ""},
		{"listener port", Rules{Listeners: []Listener{{IPv4, TCP, 40001}, {IPv4, TCP, 0}}}, "listener 1: port 0"},
		{"listener protocol", Rules{Listeners: []Listener{{IPv6, "sctp", 1}}}, `listener 0: protocol "sctp"`},
		{"listener family", Rules{Listeners: []Listener{{Family(9), TCP, 1}}}, "listener 0: unknown family Family(9)"},
		{"tproxy", tproxied(all, Routing{}), ""},
		{"tproxy mark and mask", tproxied(all, Routing{Mark: 0x10, Mask: 0xf0}), ""},
		{"tproxy mask only", tproxied(all, Routing{Mask: 0xff0000}), ""},
		{"tproxy mark outside mask", tproxied(all, Routing{Mark: 0x3, Mask: 0x1}), "tproxy: mark 0x3 has bits outside its mask 0x1"},
		{"tproxy default mark outside mask", tproxied(all, Routing{Mask: 0xff}), "tproxy: mark 0x200000 has bits outside its mask 0xff"},
		{"every error", Rules{
			Intercepts: []InterceptRule{svc("x", TCP, "10.96.0.1", 0, 1)},
			NodePorts:  []NodePort{np("y", IPv4, TCP, 0, 1)},
			Listeners:  []Listener{{IPv4, TCP, 0}},
		}, `intercept 0 ("x"): port 0` + "\n" + `node port 0 ("y"): port 0` + "\n" + "listener 0: port 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.rules.validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("validate() = %v, want nil", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("validate() = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestParseStateOfRender(t *testing.T) {
	st := parseState(Render(IPv4, mixed))
	want := state{
		{"nat", "UPROXY-SERVICES"}: {exists: true, rules: []string{
			`-A UPROXY-SERVICES -d 10.96.0.2/32 -p udp -m comment --comment "kube-system/kube-dns:dns" -m udp --dport 53 -j REDIRECT --to-ports 40004`,
			`-A UPROXY-SERVICES -d 10.96.0.3/32 -p tcp -m comment --comment "mapped/v4:x" -m tcp --dport 8080 -j REDIRECT --to-ports 40005`,
			`-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40002`,
		}},
		{"nat", "UPROXY-NODEPORTS"}:        {exists: true},
		{"mangle", "UPROXY-TPROXY"}:        {exists: true},
		{"mangle", "UPROXY-TPROXY-DIVERT"}: {exists: true},
		{"mangle", tproxyBridgedChain}:     {exists: true},
		{"mangle", tproxyServicesTCP}:      {exists: true},
		{"mangle", tproxyServicesUDP}:      {exists: true},
		{"mangle", tproxyNodePortsTCP}:     {exists: true},
		{"mangle", tproxyNodePortsUDP}:     {exists: true},
		{"mangle", "UPROXY-TPROXY-OUTPUT"}: {exists: true},
		{"mangle", RepliesChain}:           {exists: true},
		{"filter", "UPROXY-FIREWALL"}:      {exists: true},
		{"filter", "UPROXY-LISTENERS"}:     {exists: true},
	}
	if diff := cmp.Diff(want, st, cmp.AllowUnexported(chainState{})); diff != "" {
		t.Errorf("parseState(Render(...)) (-want +got):\n%s", diff)
	}
	if n := st.ruleCount(); n != 3 {
		t.Errorf("ruleCount() = %d, want 3", n)
	}
}

// TestParseStateTables checks that parseState keeps chains of the same
// name in different tables apart and ignores other chains.
func TestParseStateTables(t *testing.T) {
	text := "*filter\n:INPUT ACCEPT [0:0]\n:UPROXY-FIREWALL - [0:0]\n:UPROXY-SERVICES - [0:0]\n" +
		"-A INPUT -j UPROXY-FIREWALL\n-A UPROXY-FIREWALL -j DROP\n-A UPROXY-SERVICES -j ACCEPT\nCOMMIT\n" +
		"*nat\n:UPROXY-NODEPORTS - [0:0]\n:UPROXY-FIREWALL - [0:0]\n-A UPROXY-NODEPORTS -j RETURN\n-A UPROXY-FIREWALL -j RETURN\nCOMMIT\n" +
		"*mangle\n:PREROUTING ACCEPT [0:0]\n:UPROXY-TPROXY-OUTPUT - [0:0]\n:UPROXY-SERVICES - [0:0]\n-A PREROUTING -j UPROXY-TPROXY-OUTPUT\n" +
		"-A UPROXY-TPROXY-OUTPUT -j MARK --set-xmark 0x200000/0x200000\n-A UPROXY-SERVICES -j RETURN\nCOMMIT\n"
	want := state{
		{"nat", "UPROXY-SERVICES"}:         {},
		{"nat", "UPROXY-NODEPORTS"}:        {exists: true, rules: []string{"-A UPROXY-NODEPORTS -j RETURN"}},
		{"mangle", "UPROXY-TPROXY"}:        {},
		{"mangle", "UPROXY-TPROXY-DIVERT"}: {},
		{"mangle", tproxyBridgedChain}:     {},
		{"mangle", tproxyServicesTCP}:      {},
		{"mangle", tproxyServicesUDP}:      {},
		{"mangle", tproxyNodePortsTCP}:     {},
		{"mangle", tproxyNodePortsUDP}:     {},
		{"mangle", "UPROXY-TPROXY-OUTPUT"}: {exists: true, rules: []string{"-A UPROXY-TPROXY-OUTPUT -j MARK --set-xmark 0x200000/0x200000"}},
		{"mangle", RepliesChain}:           {},
		{"filter", "UPROXY-FIREWALL"}:      {exists: true, rules: []string{"-A UPROXY-FIREWALL -j DROP"}},
		{"filter", "UPROXY-LISTENERS"}:     {},
	}
	if diff := cmp.Diff(want, parseState([]byte(text)), cmp.AllowUnexported(chainState{})); diff != "" {
		t.Errorf("parseState (-want +got):\n%s", diff)
	}
}

// TestChainTable checks the chain table's invariants: unique names, a
// comment on every jump from a built-in chain, and tables in the order
// Render writes them.
func TestChainTable(t *testing.T) {
	seen := map[string]bool{}
	for _, c := range chains {
		if seen[c.name] {
			t.Errorf("chain %s is listed twice", c.name)
		}
		seen[c.name] = true
		if len(c.from) > 0 && c.jumpComment == "" {
			t.Errorf("chain %s has jumps without a comment", c.name)
		}
		if c.rules == nil {
			t.Errorf("chain %s has no rules function", c.name)
		}
	}
	if diff := cmp.Diff([]string{"nat", "mangle", "filter"}, tables()); diff != "" {
		t.Errorf("tables() (-want +got):\n%s", diff)
	}
}

func TestNormPrefix(t *testing.T) {
	for _, tt := range []struct{ in, want, err string }{
		{"10.1.2.3/8", "10.0.0.0/8", ""},
		{"10.1.2.3/32", "10.1.2.3/32", ""},
		{"0.0.0.0/0", "0.0.0.0/0", ""},
		{"2001:db8::1/64", "2001:db8::/64", ""},
		{"::ffff:10.1.2.3/104", "10.0.0.0/8", ""},
		{"::ffff:10.1.2.3/128", "10.1.2.3/32", ""},
		{"::ffff:0.0.0.0/96", "0.0.0.0/0", ""},
		{"::ffff:0.0.0.0/95", "", "covers IPv4-mapped and other IPv6 addresses"},
		{"", "", "invalid prefix"},
	} {
		var p netip.Prefix
		if tt.in != "" {
			p = netip.MustParsePrefix(tt.in)
		}
		got, err := normPrefix(p)
		switch {
		case tt.err != "":
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("normPrefix(%s) = %s, %v; want error %q", tt.in, got, err, tt.err)
			}
		case err != nil || got.String() != tt.want:
			t.Errorf("normPrefix(%s) = %s, %v; want %s", tt.in, got, err, tt.want)
		}
	}
}

// ports returns the members of a bitmap:port set for the ports.
func ports(ps ...uint16) []setMember {
	ms := make([]setMember, len(ps))
	for i, p := range ps {
		ms[i] = portMember(p)
	}
	return ms
}

// listenerRules returns rules with only the listeners.
func listenerRules(ls ...Listener) Rules { return Rules{Listeners: ls} }

func TestRenderSetUpdateGolden(t *testing.T) {
	both := []Listener{
		{IPv4, TCP, 40002}, {IPv4, UDP, 40002}, {IPv4, TCP, 40001}, {IPv4, TCP, 40001}, {IPv4, TCP, 65535},
		{IPv6, TCP, 41001}, {IPv6, UDP, 41002}, {IPv6, UDP, 41002},
	}
	tests := []struct {
		name     string
		family   Family
		old, new Rules
	}{
		// From nothing: each set with listeners is created, then filled,
		// in ascending port order without duplicates; the other
		// family's listeners are left out.
		{"sets_create", IPv4, Rules{}, listenerRules(both...)},
		{"sets_create_v6", IPv6, Rules{}, listenerRules(both...)},
		{"sets_all_v4", IPv4, Rules{}, all},
		{"sets_all_v6", IPv6, Rules{}, all},
		// Only the difference: deletes, then adds; an unchanged set
		// writes nothing.
		{"sets_update", IPv4,
			listenerRules(Listener{IPv4, TCP, 40001}, Listener{IPv4, TCP, 40002}, Listener{IPv4, TCP, 40003}, Listener{IPv4, UDP, 40010}),
			listenerRules(Listener{IPv4, TCP, 40005}, Listener{IPv4, TCP, 40002}, Listener{IPv4, TCP, 40004}, Listener{IPv4, UDP, 40010})},
		// A protocol's first listener creates its set.
		{"sets_new_protocol", IPv4,
			listenerRules(Listener{IPv4, TCP, 40001}),
			listenerRules(Listener{IPv4, TCP, 40001}, Listener{IPv4, UDP, 40002}, Listener{IPv4, UDP, 40001})},
		// A protocol's last listener going away writes nothing for its
		// set: the Syncer destroys it after iptables-restore.
		{"sets_drop_protocol", IPv6,
			listenerRules(Listener{IPv6, TCP, 41001}, Listener{IPv6, UDP, 41002}),
			listenerRules(Listener{IPv6, TCP, 41001}, Listener{IPv6, TCP, 41003})},
		{"sets_unchanged", IPv4, listenerRules(both...), listenerRules(reversed(listenerRules(both...)).Listeners...)},
		{"sets_other_family_changed", IPv4, listenerRules(both...), listenerRules(append(slices.Clone(both), Listener{IPv6, TCP, 41009})...)},
		// Tproxy mode with per-service rules: the service set holds
		// every intercept's and firewall's destination, protocol and
		// port, the node-port sets the node ports; they gate the
		// per-service rules. From the shared layout, the guarded
		// destinations join the service set.
		{"sets_tproxy_v4", IPv4, Rules{}, tproxied(all, Routing{})},
		{"sets_tproxy_v6", IPv6, Rules{}, tproxied(all, Routing{})},
		{"sets_tproxy_from_shared", IPv4, sharedTProxy(all), tproxied(all, Routing{})},
		{"sets_invalid_skipped", IPv4, Rules{}, listenerRules(
			Listener{IPv4, TCP, 40001}, Listener{IPv4, TCP, 0}, Listener{IPv4, "sctp", 40002}, Listener{Family(7), TCP, 40003})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := RenderSetUpdate(tt.family, tt.old, tt.new)
			checkGolden(t, tt.name, got)
			// Applying the update to the old sets, then destroying the
			// sets no longer wanted, gives the new ones.
			old, new := wantSets(tt.family, tt.old), wantSets(tt.family, tt.new)
			if diff := cmp.Diff(new, applySetUpdate(t, old, got, setsToDestroy(old, new)),
				cmp.AllowUnexported(setContent{})); diff != "" {
				t.Errorf("old sets updated (-want +got):\n%s", diff)
			}
		})
	}
}

// applySetUpdate applies ipset restore input to a copy of st, as the
// kernel would, then destroys the sets named by destroy; it fails the
// test on a line that would fail.
func applySetUpdate(t *testing.T, st setState, input []byte, destroy []string) setState {
	t.Helper()
	out := setState{}
	for k, v := range st {
		v.members = slices.Clone(v.members)
		out[k] = v
	}
	for line := range strings.Lines(string(input)) {
		f := strings.Fields(line)
		c, ok := out[f[1]]
		if !ok {
			t.Fatalf("%q: not a set of the family", line)
		}
		switch f[0] {
		case "destroy":
			c = setContent{}
		case "create":
			if c.exists {
				t.Fatalf("%q: set exists", line)
			}
			c = setContent{exists: true, header: strings.Join(f[2:len(f)-1], " ")}
		case "add", "del":
			if !c.exists {
				t.Fatalf("%q: no set", line)
			}
			m, ok := parseMember(f[2])
			if !ok {
				t.Fatalf("%q: not a member", line)
			}
			c.members = slices.DeleteFunc(c.members, func(o setMember) bool { return o == m })
			if f[0] == "add" {
				c.members = append(c.members, m)
				slices.SortFunc(c.members, setMember.compare)
			}
		default:
			t.Fatalf("unexpected line %q", line)
		}
		out[f[1]] = c
	}
	for _, name := range destroy {
		if !out[name].exists {
			t.Fatalf("destroy %s: no set", name)
		}
		out[name] = setContent{}
	}
	return out
}

// TestRenderSetUpdateDrift checks the update from a kernel that drifted:
// a set missing, emptied, with a stray member, or of another type.
func TestRenderSetUpdateDrift(t *testing.T) {
	want := wantSets(IPv4, listenerRules(Listener{IPv4, TCP, 40001}, Listener{IPv4, TCP, 40002}, Listener{IPv4, UDP, 40003}))
	full := want[listenersTCP4]
	tests := []struct {
		name string
		tcp  setContent
		want string
	}{
		{"missing", setContent{}, "create uproxy-listeners-tcp4 bitmap:port range 0-65535 -exist\n" +
			"add uproxy-listeners-tcp4 40001 -exist\nadd uproxy-listeners-tcp4 40002 -exist\n"},
		{"flushed", setContent{exists: true, header: setType}, "add uproxy-listeners-tcp4 40001 -exist\nadd uproxy-listeners-tcp4 40002 -exist\n"},
		{"stray and missing member", setContent{exists: true, header: setType, members: ports(22, 40002)},
			"del uproxy-listeners-tcp4 22 -exist\nadd uproxy-listeners-tcp4 40001 -exist\n"},
		{"other type", setContent{exists: true, header: "hash:ip family inet hashsize 1024 maxelem 65536", members: full.members},
			"destroy uproxy-listeners-tcp4\ncreate uproxy-listeners-tcp4 bitmap:port range 0-65535 -exist\n" +
				"add uproxy-listeners-tcp4 40001 -exist\nadd uproxy-listeners-tcp4 40002 -exist\n"},
		{"same", full, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			have := setState{listenersTCP4: tt.tcp, listenersUDP4: want[listenersUDP4]}
			if got := string(renderSetUpdate(have, want).input); got != tt.want {
				t.Errorf("renderSetUpdate = %q, want %q", got, tt.want)
			}
			if got, wantEq := have.equal(want), tt.want == ""; got != wantEq {
				t.Errorf("equal = %v, want %v", got, wantEq)
			}
		})
	}
	// Sets no longer wanted are destroyed, not updated.
	have := wantSets(IPv4, all)
	none := wantSets(IPv4, Rules{})
	if got := renderSetUpdate(have, none).input; len(got) != 0 {
		t.Errorf("update to no sets = %q, want nothing", got)
	}
	if diff := cmp.Diff([]string{listenersTCP4, listenersUDP4}, setsToDestroy(have, none)); diff != "" {
		t.Errorf("setsToDestroy (-want +got):\n%s", diff)
	}
	if got := setsToDestroy(none, have); got != nil {
		t.Errorf("setsToDestroy of missing sets = %q", got)
	}
}

func TestParseSetSave(t *testing.T) {
	text := "create uproxy-listeners-tcp4 bitmap:port range 0-65535\n" +
		"add uproxy-listeners-tcp4 40002\nadd uproxy-listeners-tcp4 40001\nadd uproxy-listeners-tcp4 40001\n" +
		"create other hash:ip family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x1\nadd other 10.0.0.1\n" +
		"create uproxy-listeners-udp4 hash:ip family inet\nadd uproxy-listeners-udp4 10.0.0.1\n"
	for _, tt := range []struct {
		name string
		want setContent
	}{
		{listenersTCP4, setContent{exists: true, header: setType, members: ports(40001, 40002)}},
		{listenersUDP4, setContent{exists: true, header: "hash:ip family inet"}},
		{listenersTCP6, setContent{}},
		{"uproxy-listeners", setContent{}},
	} {
		if diff := cmp.Diff(tt.want, parseSetSave(tt.name, []byte(text)), cmp.AllowUnexported(setContent{})); diff != "" {
			t.Errorf("parseSetSave(%s) (-want +got):\n%s", tt.name, diff)
		}
	}
}

// TestSetTable checks the set table's invariants: unique names that the
// kernel takes; per family, a listener and a node-port set per protocol
// and one service set, whose members carry their protocol; and that
// setOf finds each.
func TestSetTable(t *testing.T) {
	seen := map[string]bool{}
	type kindKey struct {
		family Family
		kind   setKind
	}
	perKind := map[kindKey][]Protocol{}
	for _, s := range sets {
		if seen[s.name] {
			t.Errorf("set %s is listed twice", s.name)
		}
		seen[s.name] = true
		if len(s.name) > 31 || s.name == "" || strings.ContainsAny(s.name, " \t\n") {
			t.Errorf("set name %q is not a valid ipset name", s.name)
		}
		wantProto := s.proto == TCP || s.proto == UDP
		if s.kind == serviceSet {
			wantProto = s.proto == ""
		}
		if !s.family.valid() || !wantProto {
			t.Errorf("set %s: family %s, protocol %q", s.name, s.family, s.proto)
		}
		perKind[kindKey{s.family, s.kind}] = append(perKind[kindKey{s.family, s.kind}], s.proto)
		if got := setOf(s.kind, s.family, s.proto); got != s {
			t.Errorf("setOf(%d, %s, %q) = %+v, want %+v", s.kind, s.family, s.proto, got, s)
		}
	}
	want := map[kindKey][]Protocol{
		{IPv4, listenerSet}: {TCP, UDP}, {IPv6, listenerSet}: {TCP, UDP},
		{IPv4, serviceSet}: {""}, {IPv6, serviceSet}: {""},
		{IPv4, nodePortSet}: {TCP, UDP}, {IPv6, nodePortSet}: {TCP, UDP},
	}
	if diff := cmp.Diff(want, perKind); diff != "" {
		t.Errorf("protocols per family and kind (-want +got):\n%s", diff)
	}
}

// TestRenderListenerGuardIsConstant checks that the number of rules does
// not grow with the number of listeners.
func TestRenderListenerGuardIsConstant(t *testing.T) {
	var r Rules
	for i := range 5000 {
		r.Listeners = append(r.Listeners, Listener{IPv4, TCP, uint16(20000 + i)}, Listener{IPv6, UDP, uint16(20000 + i)})
	}
	for _, f := range []Family{IPv4, IPv6} {
		st := parseState(Render(f, r))
		if n := len(st[chainKey{"filter", FirewallChain}].rules); n != 1 {
			t.Errorf("%s: %d rules for 5000 listeners, want 1", f, n)
		}
		if n := wantSets(f, r).memberCount(); n != 5000 {
			t.Errorf("%s: %d set members, want 5000", f, n)
		}
	}
}

// checkGolden compares got with testdata/NAME.golden, which -update
// rewrites.
func checkGolden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./redirect -update to create it)", err)
	}
	if diff := cmp.Diff(string(want), string(got)); diff != "" {
		t.Errorf("differs from %s (-want +got):\n%s", path, diff)
	}
}

// sharedTProxy returns r in tproxy mode in the shared layout.
func sharedTProxy(r Rules) Rules {
	r.Shared, r.TProxy = true, &TProxy{}
	return r
}

func TestExcludePrefix(t *testing.T) {
	for _, tt := range []struct {
		p, x string
		want []string
	}{
		{"10.0.0.0/8", "127.0.0.0/8", []string{"10.0.0.0/8"}},
		{"127.0.0.1/32", "127.0.0.0/8", nil},
		{"127.0.0.0/8", "127.0.0.0/8", nil},
		{"0.0.0.0/1", "127.0.0.0/8", []string{"0.0.0.0/2", "64.0.0.0/3", "96.0.0.0/4", "112.0.0.0/5", "120.0.0.0/6", "124.0.0.0/7", "126.0.0.0/8"}},
		{"::/1", "::1/128", nil}, // checked below by count: 127 prefixes
	} {
		var got []string
		for _, q := range excludePrefix(netip.MustParsePrefix(tt.p), netip.MustParsePrefix(tt.x)) {
			got = append(got, q.String())
		}
		if tt.p == "::/1" {
			if len(got) != 127 || slices.Contains(got, "::1/128") {
				t.Errorf("excludePrefix(::/1, ::1/128): %d prefixes", len(got))
			}
			continue
		}
		if diff := cmp.Diff(tt.want, got); diff != "" {
			t.Errorf("excludePrefix(%s, %s) (-want +got):\n%s", tt.p, tt.x, diff)
		}
	}
}
