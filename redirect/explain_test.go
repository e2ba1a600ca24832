package redirect

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestMatchingRules(t *testing.T) {
	web := svc("default/web:http", TCP, "10.96.0.10", 80, 40001)
	dns := svc("kube-system/dns:dns", UDP, "10.96.0.53", 53, 40002)
	lb := svc("default/lb:http", TCP, "192.0.2.20", 80, 40003)
	web6 := svc("default/web:http", TCP, "2001:db8::10", 80, 40004)
	rules := Rules{
		Intercepts: []InterceptRule{web, dns, lb, web6},
		NodePorts: []NodePort{
			{Comment: "default/web:http", Family: IPv4, Protocol: TCP, Port: 30080, ToPort: 40001},
			{Comment: "default/web:http", Family: IPv6, Protocol: TCP, Port: 30080, ToPort: 40004},
		},
		Firewalls: []Firewall{{Comment: "default/lb:http", Protocol: TCP, Dest: lb.Dest, Port: 80, Allow: pfx("198.51.100.0/24")}},
		Listeners: []Listener{{IPv4, TCP, 40001}, {IPv4, UDP, 40002}, {IPv4, TCP, 40003}, {IPv6, TCP, 40004}},
	}
	tproxy := rules
	tproxy.TProxy, tproxy.Listeners = &TProxy{}, nil
	rejected := ServiceRules([]Intercept{
		{Comment: "default/web:http", Protocol: TCP, Dest: web.Dest, Port: 80, ToPort: 40001},
		{Comment: "default/empty:http", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.30"), Port: 80, ToPort: 40005, Reject: true},
	}, ServiceOptions{})
	shared := sharedOf(rules, 40010, 40011)
	shared.Firewalls = nil

	const (
		webRule = `[nat] -A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40001`
		lbRule  = `[nat] -A UPROXY-SERVICES -s 198.51.100.0/24 -d 192.0.2.20/32 -p tcp -m comment --comment "default/lb:http" -m tcp --dport 80 -j REDIRECT --to-ports 40003`
		lbDrop  = `[filter] -A UPROXY-FIREWALL -d 192.0.2.20/32 -p tcp -m comment --comment "default/lb:http" -m tcp --dport 80 -j DROP`
		// The bridged gate matches too: the explanation cannot know
		// whether the client is behind a bridge.
		tproxyBridged = `[mangle] -A UPROXY-TPROXY ! -i lo -p tcp -m physdev --physdev-is-in -m set --match-set uproxy-services4 dst,dst -j UPROXY-TPROXY-BRIDGED`
		tproxyGate    = `[mangle] -A UPROXY-TPROXY -p tcp -m set --match-set uproxy-services4 dst,dst -j UPROXY-TPROXY-SERVICES-TCP`
		tproxyMark    = `[mangle] -A UPROXY-TPROXY-OUTPUT -p tcp -m set --match-set uproxy-services4 dst,dst -j MARK --set-xmark 0x200000/0x200000`
	)
	tests := []struct {
		name   string
		rules  Rules
		tproxy bool
		family Family
		dst    string
		proto  Protocol
		client string
		// failSave makes the first iptables-save fail.
		failSave bool
		want     []string
		// wantCalls are the commands run, when not nil.
		wantCalls []string
	}{{
		name:  "a ClusterIP without endpoints: its REDIRECT and its REJECT",
		rules: rejected, dst: "10.96.0.30:80", proto: TCP,
		want: []string{
			`[nat] -A UPROXY-SERVICES -d 10.96.0.30/32 -p tcp -m comment --comment "default/empty:http" -m tcp --dport 80 -j REDIRECT --to-ports 40005`,
			`[filter] -A UPROXY-FIREWALL -p tcp -m comment --comment "default/empty:http" -m conntrack --ctorigdst 10.96.0.30 --ctorigdstport 80 -m mark ! --mark 0x400000/0x400000 -j REJECT --reject-with icmp-port-unreachable`,
		},
	}, {
		name:  "another address on the port of one without endpoints: neither",
		rules: rejected, dst: "10.96.0.10:80", proto: TCP,
		want: []string{webRule},
	}, {
		name:  "a ClusterIP",
		rules: rules, dst: "10.96.0.10:80", proto: TCP,
		want:      []string{webRule},
		wantCalls: []string{"iptables-save -t nat", "iptables-save -t filter"},
	}, {
		name:  "a ClusterIP over the other protocol",
		rules: rules, dst: "10.96.0.10:80", proto: UDP,
	}, {
		name:  "a ClusterIP on another port",
		rules: rules, dst: "10.96.0.10:81", proto: TCP,
	}, {
		name:  "an address no service has",
		rules: rules, dst: "10.96.0.99:80", proto: TCP,
	}, {
		name:  "a UDP service",
		rules: rules, dst: "10.96.0.53:53", proto: UDP,
		want: []string{`[nat] -A UPROXY-SERVICES -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 53 -j REDIRECT --to-ports 40002`},
	}, {
		name:  "a node port, on any address",
		rules: rules, dst: "192.0.2.1:30080", proto: TCP,
		want: []string{`[nat] -A UPROXY-NODEPORTS -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 40001`},
	}, {
		name:  "a firewalled load balancer, any client",
		rules: rules, dst: "192.0.2.20:80", proto: TCP,
		want: []string{lbRule, lbDrop},
	}, {
		name:  "a firewalled load balancer, an allowed client",
		rules: rules, dst: "192.0.2.20:80", proto: TCP, client: "198.51.100.7",
		want: []string{lbRule, lbDrop},
	}, {
		name:  "a firewalled load balancer, a client it drops",
		rules: rules, dst: "192.0.2.20:80", proto: TCP, client: "203.0.113.7",
		want: []string{lbDrop},
	}, {
		name:  "IPv6",
		rules: rules, family: IPv6, dst: "[2001:db8::10]:80", proto: TCP,
		want:      []string{`[nat] -A UPROXY-SERVICES -d 2001:db8::10/128 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40004`},
		wantCalls: []string{"ip6tables-save -t nat", "ip6tables-save -t filter"},
	}, {
		name:  "an IPv4-mapped address is looked up as IPv4",
		rules: rules, dst: "[::ffff:10.96.0.10]:80", proto: TCP,
		want: []string{webRule},
	}, {
		name:  "shared layout: a member of the service set",
		rules: shared, dst: "10.96.0.10:80", proto: TCP,
		want:      []string{`[nat] -A UPROXY-SERVICES -p tcp -m set --match-set uproxy-services4 dst,dst -m comment --comment "uproxy shared tcp listener" -j REDIRECT --to-ports 40010`},
		wantCalls: []string{"iptables-save -t nat", "ipset test uproxy-services4 10.96.0.10,tcp:80", "ipset test uproxy-nodeports-tcp4 80", "iptables-save -t filter"},
	}, {
		name:  "shared layout: not a member of the service set",
		rules: shared, dst: "10.96.0.10:81", proto: TCP,
	}, {
		name:  "shared layout: a member of the node-port set",
		rules: shared, dst: "192.0.2.1:30080", proto: TCP,
		want: []string{`[nat] -A UPROXY-NODEPORTS -p tcp -m set --match-set uproxy-nodeports-tcp4 dst -m comment --comment "uproxy shared tcp node ports" -j REDIRECT --to-ports 40010`},
	}, {
		name:  "tproxy mode",
		rules: tproxy, tproxy: true, dst: "10.96.0.10:80", proto: TCP,
		want: []string{tproxyBridged, tproxyGate, `[mangle] -A UPROXY-TPROXY-SERVICES-TCP -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j TPROXY --on-port 40001 --on-ip 127.0.0.1 --tproxy-mark 0x200000/0x200000`, tproxyMark},
		// Two rules match the service set: one ipset test per set.
		wantCalls: []string{"iptables-save -t mangle", "ipset test uproxy-services4 10.96.0.10,tcp:80", "ipset test uproxy-nodeports-tcp4 80", "iptables-save -t filter"},
	}, {
		name:  "tproxy mode, a firewalled load balancer, a client it drops",
		rules: tproxy, tproxy: true, dst: "192.0.2.20:80", proto: TCP, client: "203.0.113.7",
		want: []string{tproxyBridged, tproxyGate, `[mangle] -A UPROXY-TPROXY-SERVICES-TCP -d 192.0.2.20/32 -p tcp -m comment --comment "default/lb:http" -m tcp --dport 80 -j DROP`, tproxyMark},
	}, {
		name:  "a table that cannot be read",
		rules: rules, dst: "192.0.2.20:80", proto: TCP, failSave: true,
		want: []string{"# table nat: iptables-save -t nat: exit status 1: some error", lbDrop},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k := newFakeKernel(tt.family)
			if _, err := newFakeSyncer(t, k).Sync(context.Background(), tt.rules, true); err != nil {
				t.Fatal(err)
			}
			k.takeCalls()
			if tt.failSave {
				k.failSave = errors.New("iptables-save -t nat: exit status 1: some error")
			}
			var client netip.Addr
			if tt.client != "" {
				client = netip.MustParseAddr(tt.client)
			}
			before, beforeSets := k.save(), k.saveSets()
			got := MatchingRules(context.Background(), k, netip.MustParseAddrPort(tt.dst), tt.proto, client, tt.tproxy)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("MatchingRules (-want +got):\n%s", diff)
			}
			if calls := k.takeCalls(); tt.wantCalls != nil && !slices.Equal(calls, tt.wantCalls) {
				t.Errorf("commands run:\n%s\nwant\n%s", strings.Join(calls, "\n"), strings.Join(tt.wantCalls, "\n"))
			}
			if k.save() != before || k.saveSets() != beforeSets {
				t.Errorf("MatchingRules changed the kernel")
			}
		})
	}
}
