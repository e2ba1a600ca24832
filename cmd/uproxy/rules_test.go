package main

import (
	"net/netip"
	"testing"

	"github.com/uproxy/uproxy/proxy/routing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/proxy/service"
	"github.com/uproxy/uproxy/redirect"
)

// TestClaims checks the translation of the proxier's intercepts into
// redirect's claims: the order is kept (the first of two conflicting
// claims wins), node ports are marked, and only a load-balancer IP
// carries its source ranges.
func TestClaims(t *testing.T) {
	web := service.PortName{NamespacedName: types.NamespacedName{Namespace: "default", Name: "web"}, Port: "http", Protocol: v1.ProtocolTCP}
	dns := service.PortName{NamespacedName: types.NamespacedName{Namespace: "kube-system", Name: "dns"}, Port: "dns", Protocol: v1.ProtocolUDP}
	ranges := []netip.Prefix{netip.MustParsePrefix("198.51.100.0/24")}
	ip := netip.MustParseAddr
	in := []routing.Intercept{
		{Service: web, Kind: routing.ClusterIP, Protocol: v1.ProtocolTCP, VIP: ip("10.96.0.10"), Port: 80, ListenPort: 40001},
		{Service: web, Kind: routing.ExternalIP, Protocol: v1.ProtocolTCP, VIP: ip("192.0.2.10"), Port: 80, ListenPort: 40001, SourceRanges: ranges},
		{Service: web, Kind: routing.LoadBalancerIP, Protocol: v1.ProtocolTCP, VIP: ip("192.0.2.20"), Port: 80, ListenPort: 40001, SourceRanges: ranges},
		{Service: web, Kind: routing.NodePort, Protocol: v1.ProtocolTCP, VIP: ip("::"), Port: 30080, ListenPort: 40002, ListenPortEnd: 40004},
		{Service: dns, Kind: routing.ClusterIP, Protocol: v1.ProtocolUDP, VIP: ip("10.96.0.53"), Port: 53, ListenPort: 40005},
	}
	want := []redirect.Intercept{
		{Comment: "default/web:http", Protocol: redirect.TCP, Dest: ip("10.96.0.10"), Port: 80, ToPort: 40001},
		{Comment: "default/web:http", Protocol: redirect.TCP, Dest: ip("192.0.2.10"), Port: 80, ToPort: 40001},
		{Comment: "default/web:http", Protocol: redirect.TCP, Dest: ip("192.0.2.20"), Port: 80, ToPort: 40001, SourceRanges: ranges},
		{Comment: "default/web:http", NodePort: true, Protocol: redirect.TCP, Dest: ip("::"), Port: 30080, ToPort: 40002, ToPortEnd: 40004},
		{Comment: "kube-system/dns:dns", Protocol: redirect.UDP, Dest: ip("10.96.0.53"), Port: 53, ToPort: 40005},
	}
	if diff := cmp.Diff(want, claims(in), cmpopts.EquateComparable(netip.Addr{}, netip.Prefix{})); diff != "" {
		t.Errorf("claims (-want +got):\n%s", diff)
	}
}
