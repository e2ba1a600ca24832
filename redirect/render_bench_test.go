package redirect

import (
	"fmt"
	"net/netip"
	"testing"
)

// scaleRules is n services, each a ClusterIP in 10.96.0.0/16 on port 80
// redirected to its own listener, every tenth also with a node port and
// every hundredth with a load-balancer IP restricted to a source range:
// the shape of a large cluster's rule set.
func scaleRules(n int) Rules {
	var r Rules
	for i := range n {
		comment := fmt.Sprintf("ns-%d/svc-%d:http", i%50, i)
		vip := netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})
		to := uint16(20000 + i)
		r.Intercepts = append(r.Intercepts, InterceptRule{Comment: comment, Protocol: TCP, Dest: vip, Port: 80, ToPort: to})
		r.Listeners = append(r.Listeners, Listener{Family: IPv4, Protocol: TCP, Port: to})
		if i%10 == 0 {
			r.NodePorts = append(r.NodePorts, NodePort{Comment: comment, Family: IPv4, Protocol: TCP, Port: uint16(30000 + i/10), ToPort: to})
		}
		if i%100 == 0 {
			lb := netip.AddrFrom4([4]byte{192, 0, 2, byte(i / 100)})
			r.Intercepts = append(r.Intercepts, InterceptRule{Comment: comment, Protocol: TCP, Dest: lb, Port: 80, ToPort: to})
			r.Firewalls = append(r.Firewalls, Firewall{Comment: comment, Protocol: TCP, Dest: lb, Port: 80, Allow: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}})
		}
	}
	return r
}

// BenchmarkRender10k renders the iptables-restore input for 10,000
// services: the work of every sync that changes a rule.
func BenchmarkRender10k(b *testing.B) {
	r := scaleRules(10000)
	if err := r.validate(); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	var size int
	for b.Loop() {
		size = len(Render(IPv4, r))
	}
	b.ReportMetric(float64(size), "bytes/op")
}

// BenchmarkRenderTProxy10k renders what a sync writes for 10,000 services
// in tproxy mode with per-service listeners: the rules, and the gates'
// sets, which hold every service address and node port.
func BenchmarkRenderTProxy10k(b *testing.B) {
	r := tproxied(scaleRules(10000), Routing{})
	r.Listeners = nil // on loopback in tproxy mode
	if err := r.validate(); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	var size int
	for b.Loop() {
		size = len(Render(IPv4, r)) + len(RenderSetUpdate(IPv4, Rules{}, r))
	}
	b.ReportMetric(float64(size), "bytes/op")
}

// sharedScaleRules is scaleRules(n) in the shared layout: every intercept
// and node port goes to the one TCP listener.
func sharedScaleRules(n int) Rules {
	r := sharedOf(scaleRules(n), 20000, 20000)
	r.Listeners = []Listener{{Family: IPv4, Protocol: TCP, Port: 20000}}
	return r
}

// BenchmarkRenderShared10k renders the iptables-restore input for 10,000
// services in the shared layout: a handful of rules (the set's, the node
// ports', the load balancers' source ranges), whatever the number of
// services. Every Sync renders it, and its set content (see
// BenchmarkRenderSetUpdateShared10k).
func BenchmarkRenderShared10k(b *testing.B) {
	r := sharedScaleRules(10000)
	if err := r.validate(); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	var size int
	for b.Loop() {
		size = len(Render(IPv4, r))
	}
	b.ReportMetric(float64(size), "bytes/op")
	b.ReportMetric(float64(parseState(Render(IPv4, r)).ruleCount()), "rules")
}

// BenchmarkRenderSetUpdateShared10k renders the ipset restore input that
// creates the sets of 10,000 services in the shared layout: the members a
// first Sync writes, and the set content every Sync computes.
func BenchmarkRenderSetUpdateShared10k(b *testing.B) {
	r := sharedScaleRules(10000)
	b.ReportAllocs()
	var size int
	for b.Loop() {
		size = len(RenderSetUpdate(IPv4, Rules{}, r))
	}
	b.ReportMetric(float64(size), "bytes/op")
	b.ReportMetric(float64(wantSets(IPv4, r).memberCount()), "members")
}

// BenchmarkParseState10k parses iptables-save's view of 10,000 services'
// chains: the work of every full sync's drift check.
func BenchmarkParseState10k(b *testing.B) {
	text := Render(IPv4, scaleRules(10000))
	b.ReportAllocs()
	b.SetBytes(int64(len(text)))
	var rules int
	for b.Loop() {
		rules = parseState(text).ruleCount()
	}
	if rules < 10000 {
		b.Fatalf("parsed %d rules, want at least 10,000", rules)
	}
}
