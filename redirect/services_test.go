package redirect

import (
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// claim returns an exact-destination claim of dest (an address literal).
func claim(comment string, p Protocol, dest string, port, toPort uint16) Intercept {
	return Intercept{Comment: comment, Protocol: p, Dest: netip.MustParseAddr(dest), Port: port, ToPort: toPort}
}

// nodePortClaim returns a node-port claim of the family of any (an
// unspecified address literal).
func nodePortClaim(comment string, p Protocol, any string, port, toPort uint16) Intercept {
	c := claim(comment, p, any, port, toPort)
	c.NodePort = true
	return c
}

// guarded returns c with source ranges.
func guarded(c Intercept, allow ...string) Intercept {
	c.SourceRanges = pfx(allow...)
	return c
}

// ranged returns c with the listener ports c.ToPort to end.
func ranged(c Intercept, end uint16) Intercept {
	c.ToPortEnd = end
	return c
}

func TestServiceRules(t *testing.T) {
	tproxy := &TProxy{Routing: DefaultRouting}
	tests := []struct {
		name   string
		claims []Intercept
		opts   ServiceOptions
		want   Rules
	}{{
		name: "nothing",
	}, {
		name: "every kind, both families",
		claims: []Intercept{
			claim("default/web:http", TCP, "10.96.0.10", 80, 40001),
			claim("default/web:http", TCP, "192.0.2.10", 80, 40001),
			guarded(claim("default/web:http", TCP, "192.0.2.20", 80, 40001), "192.0.2.0/24"),
			nodePortClaim("default/web:http", TCP, "0.0.0.0", 30080, 40001),
			claim("default/web:http", TCP, "2001:db8::10", 80, 40002),
			nodePortClaim("default/web:http", TCP, "::", 30080, 40002),
			claim("kube-system/dns:dns", UDP, "10.96.0.53", 53, 40003),
		},
		opts: ServiceOptions{NodePortAddresses: pfx("192.0.2.0/24")},
		want: Rules{
			Intercepts: []InterceptRule{
				svc("default/web:http", TCP, "10.96.0.10", 80, 40001),
				svc("default/web:http", TCP, "192.0.2.10", 80, 40001),
				svc("default/web:http", TCP, "192.0.2.20", 80, 40001),
				svc("default/web:http", TCP, "2001:db8::10", 80, 40002),
				svc("kube-system/dns:dns", UDP, "10.96.0.53", 53, 40003),
			},
			NodePorts: []NodePort{
				{Comment: "default/web:http", Family: IPv4, Protocol: TCP, Port: 30080, ToPort: 40001},
				{Comment: "default/web:http", Family: IPv6, Protocol: TCP, Port: 30080, ToPort: 40002},
			},
			NodePortAddresses: pfx("192.0.2.0/24"),
			Firewalls: []Firewall{
				{Comment: "default/web:http", Protocol: TCP, Dest: netip.MustParseAddr("192.0.2.20"), Port: 80, Allow: pfx("192.0.2.0/24")},
			},
			// Sorted by family, protocol and port; one each however many
			// claims name it.
			Listeners: []Listener{{IPv4, TCP, 40001}, {IPv4, UDP, 40003}, {IPv6, TCP, 40002}},
		},
	}, {
		// A service port without endpoints: its destinations are
		// intercepted as usual, and refused too; its node port is only
		// refused.
		name: "rejected",
		claims: []Intercept{
			rejected(claim("default/empty:http", TCP, "10.96.0.30", 80, 40005)),
			rejected(guarded(claim("default/empty:http", TCP, "192.0.2.30", 80, 40005), "192.0.2.0/24")),
			rejected(nodePortClaim("default/empty:http", TCP, "0.0.0.0", 30081, 40005)),
			rejected(claim("default/empty:dns", UDP, "2001:db8::30", 53, 40006)),
			claim("default/empty:http", TCP, "10.96.0.30", 80, 40007),
		},
		want: Rules{
			Intercepts: []InterceptRule{
				svc("default/empty:http", TCP, "10.96.0.30", 80, 40005),
				svc("default/empty:http", TCP, "192.0.2.30", 80, 40005),
				svc("default/empty:dns", UDP, "2001:db8::30", 53, 40006),
			},
			Firewalls: []Firewall{
				{Comment: "default/empty:http", Protocol: TCP, Dest: netip.MustParseAddr("192.0.2.30"), Port: 80, Allow: pfx("192.0.2.0/24")},
			},
			Rejects: []Reject{
				{Comment: "default/empty:http", Family: IPv4, Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.30"), Port: 80},
				{Comment: "default/empty:http", Family: IPv4, Protocol: TCP, Dest: netip.MustParseAddr("192.0.2.30"), Port: 80},
				{Comment: "default/empty:http", NodePort: true, Family: IPv4, Protocol: TCP, Dest: netip.IPv4Unspecified(), Port: 30081},
				{Comment: "default/empty:dns", Family: IPv6, Protocol: UDP, Dest: netip.MustParseAddr("2001:db8::30"), Port: 53},
			},
			Listeners: []Listener{{IPv4, TCP, 40005}, {IPv6, UDP, 40006}},
		},
	}, {
		// The proxier's order puts the ClusterIP first; the external
		// IP of another service on the same address and port loses.
		name: "a ClusterIP and another service's external IP: the first wins",
		claims: []Intercept{
			claim("default/a:http", TCP, "10.96.0.10", 80, 40001),
			claim("default/b:http", TCP, "10.96.0.10", 80, 40002),
			claim("default/b:http", TCP, "10.96.0.11", 80, 40002),
		},
		want: Rules{
			Intercepts: []InterceptRule{
				svc("default/a:http", TCP, "10.96.0.10", 80, 40001),
				svc("default/b:http", TCP, "10.96.0.11", 80, 40002),
			},
			Listeners: []Listener{{IPv4, TCP, 40001}, {IPv4, TCP, 40002}},
		},
	}, {
		name: "the same conflict in the other order: the other service wins",
		claims: []Intercept{
			claim("default/b:http", TCP, "10.96.0.10", 80, 40002),
			claim("default/a:http", TCP, "10.96.0.10", 80, 40001),
			claim("default/b:http", TCP, "10.96.0.11", 80, 40002),
		},
		want: Rules{
			Intercepts: []InterceptRule{
				svc("default/b:http", TCP, "10.96.0.10", 80, 40002),
				svc("default/b:http", TCP, "10.96.0.11", 80, 40002),
			},
			// The loser's listener port, claimed by nothing else, is
			// left out with its rule.
			Listeners: []Listener{{IPv4, TCP, 40002}},
		},
	}, {
		// The loser's source ranges would guard the winner's traffic:
		// they are left out with its rule.
		name: "two load balancers on one IP and port: the loser's firewall is left out",
		claims: []Intercept{
			claim("default/a:http", TCP, "192.0.2.10", 80, 40001),
			guarded(claim("default/b:http", TCP, "192.0.2.10", 80, 40002), "198.51.100.0/24"),
		},
		want: Rules{
			Intercepts: []InterceptRule{svc("default/a:http", TCP, "192.0.2.10", 80, 40001)},
			Listeners:  []Listener{{IPv4, TCP, 40001}},
		},
	}, {
		name: "two load balancers on one IP and port, the firewalled one first: its firewall stays",
		claims: []Intercept{
			guarded(claim("default/b:http", TCP, "192.0.2.10", 80, 40002), "198.51.100.0/24"),
			claim("default/a:http", TCP, "192.0.2.10", 80, 40001),
		},
		want: Rules{
			Intercepts: []InterceptRule{svc("default/b:http", TCP, "192.0.2.10", 80, 40002)},
			Firewalls: []Firewall{
				{Comment: "default/b:http", Protocol: TCP, Dest: netip.MustParseAddr("192.0.2.10"), Port: 80, Allow: pfx("198.51.100.0/24")},
			},
			Listeners: []Listener{{IPv4, TCP, 40002}},
		},
	}, {
		name: "an IPv4-mapped address is the IPv4 address it maps",
		claims: []Intercept{
			claim("default/a:http", TCP, "10.96.0.10", 80, 40001),
			claim("default/b:http", TCP, "::ffff:10.96.0.10", 80, 40002),
		},
		want: Rules{
			Intercepts: []InterceptRule{svc("default/a:http", TCP, "10.96.0.10", 80, 40001)},
			Listeners:  []Listener{{IPv4, TCP, 40001}},
		},
	}, {
		name: "one address and port, two protocols: no conflict",
		claims: []Intercept{
			claim("kube-system/dns:dns-tcp", TCP, "10.96.0.53", 53, 40001),
			claim("kube-system/dns:dns", UDP, "10.96.0.53", 53, 40002),
		},
		want: Rules{
			Intercepts: []InterceptRule{
				svc("kube-system/dns:dns-tcp", TCP, "10.96.0.53", 53, 40001),
				svc("kube-system/dns:dns", UDP, "10.96.0.53", 53, 40002),
			},
			Listeners: []Listener{{IPv4, TCP, 40001}, {IPv4, UDP, 40002}},
		},
	}, {
		name: "one port on an IPv4 and an IPv6 address: no conflict",
		claims: []Intercept{
			claim("default/a:http", TCP, "10.96.0.10", 80, 40001),
			claim("default/b:http", TCP, "2001:db8::10", 80, 40002),
		},
		want: Rules{
			Intercepts: []InterceptRule{
				svc("default/a:http", TCP, "10.96.0.10", 80, 40001),
				svc("default/b:http", TCP, "2001:db8::10", 80, 40002),
			},
			Listeners: []Listener{{IPv4, TCP, 40001}, {IPv6, TCP, 40002}},
		},
	}, {
		name: "two node ports of one family and protocol: the first wins",
		claims: []Intercept{
			nodePortClaim("default/b:http", TCP, "0.0.0.0", 30080, 40002),
			nodePortClaim("default/a:http", TCP, "0.0.0.0", 30080, 40001),
		},
		want: Rules{
			NodePorts: []NodePort{{Comment: "default/b:http", Family: IPv4, Protocol: TCP, Port: 30080, ToPort: 40002}},
			Listeners: []Listener{{IPv4, TCP, 40002}},
		},
	}, {
		name: "one node port in both families, and another protocol: no conflict",
		claims: []Intercept{
			nodePortClaim("default/a:http", TCP, "0.0.0.0", 30080, 40001),
			nodePortClaim("default/a:http", TCP, "::", 30080, 40002),
			nodePortClaim("default/b:dns", UDP, "0.0.0.0", 30080, 40003),
		},
		want: Rules{
			NodePorts: []NodePort{
				{Comment: "default/a:http", Family: IPv4, Protocol: TCP, Port: 30080, ToPort: 40001},
				{Comment: "default/a:http", Family: IPv6, Protocol: TCP, Port: 30080, ToPort: 40002},
				{Comment: "default/b:dns", Family: IPv4, Protocol: UDP, Port: 30080, ToPort: 40003},
			},
			Listeners: []Listener{{IPv4, TCP, 40001}, {IPv4, UDP, 40003}, {IPv6, TCP, 40002}},
		},
	}, {
		name: "a node port and an exact destination on the same port: no conflict",
		claims: []Intercept{
			claim("default/a:http", TCP, "192.0.2.10", 30080, 40001),
			nodePortClaim("default/b:http", TCP, "0.0.0.0", 30080, 40002),
		},
		want: Rules{
			Intercepts: []InterceptRule{svc("default/a:http", TCP, "192.0.2.10", 30080, 40001)},
			NodePorts:  []NodePort{{Comment: "default/b:http", Family: IPv4, Protocol: TCP, Port: 30080, ToPort: 40002}},
			Listeners:  []Listener{{IPv4, TCP, 40001}, {IPv4, TCP, 40002}},
		},
	}, {
		// Every claim of a family and protocol names the one shared
		// listener, whose every port is guarded; the policy is the
		// same, and the winner's firewall stays.
		name: "shared layout: a conflict, and a listener of a range of ports",
		claims: []Intercept{
			ranged(guarded(claim("default/a:http", TCP, "192.0.2.10", 80, 40001), "198.51.100.0/24"), 40003),
			ranged(claim("default/b:http", TCP, "192.0.2.10", 80, 40001), 40003),
			ranged(claim("default/b:http", TCP, "10.96.0.11", 80, 40001), 40003),
			claim("default/b:dns", UDP, "10.96.0.11", 53, 40010),
		},
		opts: ServiceOptions{Shared: true},
		want: Rules{
			Intercepts: []InterceptRule{
				{Comment: "default/a:http", Protocol: TCP, Dest: netip.MustParseAddr("192.0.2.10"), Port: 80, ToPort: 40001, ToPortEnd: 40003},
				{Comment: "default/b:http", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.11"), Port: 80, ToPort: 40001, ToPortEnd: 40003},
				svc("default/b:dns", UDP, "10.96.0.11", 53, 40010),
			},
			Firewalls: []Firewall{
				{Comment: "default/a:http", Protocol: TCP, Dest: netip.MustParseAddr("192.0.2.10"), Port: 80, Allow: pfx("198.51.100.0/24")},
			},
			Listeners: []Listener{{IPv4, TCP, 40001}, {IPv4, TCP, 40002}, {IPv4, TCP, 40003}, {IPv4, UDP, 40010}},
			Shared:    true,
		},
	}, {
		// The listeners of tproxy mode listen on loopback: no guard.
		name: "tproxy mode: no listener guards",
		claims: []Intercept{
			claim("default/a:http", TCP, "10.96.0.10", 80, 40001),
			claim("default/b:http", TCP, "10.96.0.10", 80, 40002),
			nodePortClaim("default/a:http", TCP, "::", 30080, 40003),
		},
		opts: ServiceOptions{TProxy: tproxy},
		want: Rules{
			Intercepts: []InterceptRule{svc("default/a:http", TCP, "10.96.0.10", 80, 40001)},
			NodePorts:  []NodePort{{Comment: "default/a:http", Family: IPv6, Protocol: TCP, Port: 30080, ToPort: 40003}},
			TProxy:     tproxy,
		},
	}, {
		// tproxy mode leaves a refused port's packets to routing, which
		// takes them to the REJECT (see Reject), from every source: no
		// firewall drops them first.
		name: "tproxy mode: rejected",
		claims: []Intercept{
			rejected(claim("default/empty:http", TCP, "10.96.0.30", 80, 40005)),
			rejected(guarded(claim("default/empty:dns", UDP, "192.0.2.30", 53, 40006), "192.0.2.0/24")),
			rejected(nodePortClaim("default/empty:http", TCP, "0.0.0.0", 30081, 40005)),
			claim("default/web:http", TCP, "10.96.0.10", 80, 40001),
		},
		opts: ServiceOptions{TProxy: tproxy},
		want: Rules{
			Intercepts: []InterceptRule{svc("default/web:http", TCP, "10.96.0.10", 80, 40001)},
			Rejects: []Reject{
				{Comment: "default/empty:http", Family: IPv4, Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.30"), Port: 80},
				{Comment: "default/empty:dns", Family: IPv4, Protocol: UDP, Dest: netip.MustParseAddr("192.0.2.30"), Port: 53},
				{Comment: "default/empty:http", NodePort: true, Family: IPv4, Protocol: TCP, Dest: netip.IPv4Unspecified(), Port: 30081},
			},
			TProxy: tproxy,
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := ServiceRules(tt.claims, tt.opts)
			if diff := cmp.Diff(tt.want, got, cmpopts.EquateComparable(netip.Addr{}, netip.Prefix{})); diff != "" {
				t.Errorf("ServiceRules (-want +got):\n%s", diff)
			}
			// The point of the policy: whatever the services claim,
			// the rules are valid, so no conflict fails the sync.
			if err := got.validate(); err != nil {
				t.Errorf("the rules are invalid: %v", err)
			}
		})
	}
}

// rejected returns c marked as a service port without endpoints.
func rejected(c Intercept) Intercept {
	c.Reject = true
	return c
}
