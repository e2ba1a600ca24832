package service

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestCategorizeEndpoints(t *testing.T) {
	// e builds an endpoint: name's last octet, flags r(eady) s(erving)
	// t(erminating), node, zone hints, node hints.
	e := func(n int, flags, node string, zones, nodes []string) Endpoint {
		ep := Endpoint{Addr: netip.MustParseAddrPort(fmt.Sprintf("10.244.0.%d:80", n)), NodeName: node}
		if zones != nil || nodes != nil {
			ep.Hints = &EndpointHints{Zones: zones, Nodes: nodes}
		}
		for _, f := range flags {
			switch f {
			case 'r':
				ep.Ready = true
			case 's':
				ep.Serving = true
			case 't':
				ep.Terminating = true
			}
		}
		return ep
	}
	addrs := func(eps []Endpoint) []int {
		var out []int
		for _, ep := range eps {
			out = append(out, int(ep.Addr.Addr().As4()[3]))
		}
		return out
	}
	z := func(s ...string) []string { return s }
	clusterSvc := &Port{}
	internalLocal := &Port{InternalPolicyLocal: true}
	externalLocal := &Port{NodePort: 30080, ExternalPolicyLocal: true}
	tests := []struct {
		name         string
		sp           *Port
		eps          []Endpoint
		cluster      []int
		local        []int
		topologyMode string
	}{
		{"ready only", clusterSvc, []Endpoint{e(1, "rs", "n1", nil, nil), e(2, "st", "n2", nil, nil), e(3, "", "n1", nil, nil)}, []int{1}, nil, ""},
		{"fallback to serving terminating", clusterSvc, []Endpoint{e(2, "st", "n2", nil, nil), e(3, "t", "n1", nil, nil)}, []int{2}, nil, ""},
		{"internal local uses only local endpoints", internalLocal, []Endpoint{e(1, "rs", "me", nil, nil), e(2, "rs", "n2", nil, nil)}, nil, []int{1}, ""},
		{"external local keeps both sets", externalLocal, []Endpoint{e(1, "rs", "me", nil, nil), e(2, "rs", "n2", nil, nil)}, []int{1, 2}, []int{1}, ""},
		{"local falls back separately from cluster", externalLocal, []Endpoint{e(1, "st", "me", nil, nil), e(2, "rs", "n2", nil, nil)}, []int{2}, []int{1}, ""},
		{"no local endpoints", externalLocal, []Endpoint{e(2, "rs", "n2", nil, nil)}, []int{2}, nil, ""},
		{"zone hints", clusterSvc, []Endpoint{e(1, "rs", "n1", z("zone-a"), nil), e(2, "rs", "n2", z("zone-b"), nil), e(3, "rs", "n3", z("zone-a"), nil)}, []int{1, 3}, nil, "PreferSameZone"},
		{"partial zone hints are ignored", clusterSvc, []Endpoint{e(1, "rs", "n1", z("zone-a"), nil), e(2, "rs", "n2", nil, nil)}, []int{1, 2}, nil, ""},
		{"no hint for our zone is ignored", clusterSvc, []Endpoint{e(1, "rs", "n1", z("zone-b"), nil), e(2, "rs", "n2", z("zone-c"), nil)}, []int{1, 2}, nil, ""},
		{"node hints win over zone hints", clusterSvc, []Endpoint{e(1, "rs", "me", z("zone-a"), z("me")), e(2, "rs", "n2", z("zone-a"), z("n2"))}, []int{1}, nil, "PreferSameNode"},
		{"node hints for other nodes fall back to zone", clusterSvc, []Endpoint{e(1, "rs", "n1", z("zone-a"), z("n1")), e(2, "rs", "n2", z("zone-b"), z("n2"))}, []int{1}, nil, "PreferSameZone"},
		{"hints of unready endpoints do not count", clusterSvc, []Endpoint{e(1, "rs", "n1", z("zone-a"), nil), e(2, "", "n2", nil, nil)}, []int{1}, nil, "PreferSameZone"},
		{"no endpoints", externalLocal, nil, nil, nil, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := CategorizeEndpoints(tt.eps, tt.sp, "me", "zone-a")
			if diff := cmp.Diff([]any{tt.cluster, tt.local, tt.topologyMode}, []any{addrs(got.Cluster), addrs(got.Local), got.TopologyMode}); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}
