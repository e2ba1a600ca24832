package harness

import (
	"net/netip"
	"strings"
	"testing"
)

func TestRenderDNAT(t *testing.T) {
	eps := []netip.AddrPort{netip.MustParseAddrPort("10.244.0.10:8080"), netip.MustParseAddrPort("10.244.0.11:8080"), netip.MustParseAddrPort("10.244.0.12:8080")}
	p := DNATPort{Name: "default/web:http", ClusterIP: netip.MustParseAddr("10.96.0.10"), Port: 80, Protocol: "tcp", Endpoints: eps}
	rules := RenderDNAT([]DNATPort{p}, "10.244.0.0/16")
	for _, want := range []string{
		"-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment \"default/web:http cluster IP\" -m tcp --dport 80 -j " + SvcChain(p),
		"-m statistic --mode random --probability 0.33333333333 -j " + SepChain(p, eps[0]),
		"-m statistic --mode random --probability 0.50000000000 -j " + SepChain(p, eps[1]),
		"-A " + SvcChain(p) + " -m comment --comment \"default/web:http -> 10.244.0.12:8080\" -j " + SepChain(p, eps[2]),
		"-A " + SepChain(p, eps[2]) + " -p tcp -m comment --comment \"default/web:http\" -m tcp -j DNAT --to-destination 10.244.0.12:8080",
	} {
		if !strings.Contains(rules, want+"\n") {
			t.Errorf("rules lack %q:\n%s", want, rules)
		}
	}
	if len(SvcChain(p)) > 28 {
		t.Errorf("chain name %q is longer than iptables allows", SvcChain(p))
	}
	moved := p
	moved.Endpoints = eps[2:]
	change := RenderDNATChange(moved, eps, "10.244.0.0/16")
	if !strings.Contains(change, "-X "+SepChain(p, eps[0])+"\n") || strings.Contains(change, "-X "+SepChain(p, eps[2])) {
		t.Errorf("the change does not delete exactly the old endpoints' chains:\n%s", change)
	}
}
