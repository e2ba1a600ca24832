package redirect

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestPreviousListenerPorts(t *testing.T) {
	vip := netip.MustParseAddr("10.96.0.10")
	r := Rules{
		Intercepts: []InterceptRule{
			{Comment: "default/web:http", Protocol: TCP, Dest: vip, Port: 80, ToPort: 35513},
			{Comment: "default/web:http", Protocol: TCP, Dest: netip.MustParseAddr("192.0.2.10"), Port: 80, ToPort: 35513},
			{Comment: "default/dns:dns", Protocol: UDP, Dest: netip.MustParseAddr("10.96.0.53"), Port: 53, ToPort: 41000},
			{Comment: "default/sticky", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.12"), Port: 8000, ToPort: 38901},
		},
		NodePorts: []NodePort{{Comment: "default/web:http", Family: IPv4, Protocol: TCP, Port: 30080, ToPort: 35513}},
	}
	want := map[PreviousListener]uint16{
		{"default/web:http", TCP}: 35513,
		{"default/dns:dns", UDP}:  41000,
		{"default/sticky", TCP}:   38901,
	}
	for _, tt := range []struct {
		name string
		r    Rules
		want map[PreviousListener]uint16
	}{
		{"redirect", r, want},
		{"tproxy", func() Rules { r := r; r.TProxy = &TProxy{}; return r }(), want},
		// The shared layout's rules name no service: their comments, with
		// spaces, name the shared listener of each protocol.
		{"shared", sharedOf(r, 40000, 40001), map[PreviousListener]uint16{
			{SharedComment(TCP), TCP}:         40000,
			{SharedComment(UDP), UDP}:         40001,
			{sharedNodePortComment(TCP), TCP}: 40000,
		}},
		// A range of ports names its first.
		{"shared range", withTCPRange(sharedOf(r, 40000, 40001), 16), map[PreviousListener]uint16{
			{SharedComment(TCP), TCP}:         40000,
			{SharedComment(UDP), UDP}:         40001,
			{sharedNodePortComment(TCP), TCP}: 40000,
		}},
		{"shared tproxy", func() Rules { r := sharedOf(r, 40000, 40001); r.TProxy = &TProxy{}; return r }(), map[PreviousListener]uint16{
			{SharedComment(TCP), TCP}:         40000,
			{SharedComment(UDP), UDP}:         40001,
			{sharedNodePortComment(TCP), TCP}: 40000,
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, PreviousListenerPorts(Render(IPv4, tt.r))); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
	// Rules of one service port that disagree name no port for it.
	conflicting := []byte(`-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 1000
-A UPROXY-SERVICES -d 10.96.0.11/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 2000
-A UPROXY-SERVICES -d 10.96.0.11/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 3000
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment "default/kubernetes:https" -j KUBE-SVC-X
`)
	if got := PreviousListenerPorts(conflicting); len(got) != 0 {
		t.Errorf("conflicting rules: %v, want nothing", got)
	}
}

// sharedOf returns r in the shared layout, with every TCP intercept and
// node port going to tcp and every UDP one to udp.
func sharedOf(r Rules, tcp, udp uint16) Rules {
	r.Shared = true
	r.Intercepts = slices.Clone(r.Intercepts)
	for i := range r.Intercepts {
		r.Intercepts[i].ToPort = map[Protocol]uint16{TCP: tcp, UDP: udp}[r.Intercepts[i].Protocol]
	}
	r.NodePorts = slices.Clone(r.NodePorts)
	for i := range r.NodePorts {
		r.NodePorts[i].ToPort = map[Protocol]uint16{TCP: tcp, UDP: udp}[r.NodePorts[i].Protocol]
	}
	return r
}

func TestRuleFields(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want []string
	}{
		{`-A X -p tcp -j REDIRECT`, []string{"-A", "X", "-p", "tcp", "-j", "REDIRECT"}},
		{`-A X --comment "a b" -j Y`, []string{"-A", "X", "--comment", "a b", "-j", "Y"}},
		{`-A X --comment "say \"hi\" \\ ok"  -j Y`, []string{"-A", "X", "--comment", `say "hi" \ ok`, "-j", "Y"}},
		{`-A X --comment "unterminated`, []string{"-A", "X", "--comment", "unterminated"}},
		{`  `, nil},
	} {
		if diff := cmp.Diff(tt.want, ruleFields(tt.in)); diff != "" {
			t.Errorf("ruleFields(%q) (-want +got):\n%s", tt.in, diff)
		}
	}
}
