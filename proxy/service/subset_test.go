package service

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// subsetEndpoint builds endpoint 10.244.x.y:8080 for n = x·256+y, with
// flags r(eady), s(erving), t(erminating) and a node name.
func subsetEndpoint(n int, flags, node string) Endpoint {
	e := Endpoint{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(n >> 8), byte(n)}), 8080), NodeName: node}
	for _, f := range flags {
		switch f {
		case 'r':
			e.Ready, e.Serving = true, true
		case 's':
			e.Serving = true
		case 't':
			e.Terminating = true
		}
	}
	return e
}

// subsetAddrs returns the endpoints' numbers (see subsetEndpoint).
func subsetAddrs(eps []Endpoint) []int {
	out := []int{}
	for _, e := range eps {
		a := e.Addr.Addr().As4()
		out = append(out, int(a[2])<<8|int(a[3]))
	}
	return out
}

func TestSubsetEndpoints(t *testing.T) {
	// Endpoints 1-4 are on other nodes and ready, 5 and 6 on this node
	// and ready, 7 and 8 serving while terminating (8 on this node), 9
	// not ready at all.
	mixed := []Endpoint{
		subsetEndpoint(1, "r", "b"), subsetEndpoint(2, "r", "b"), subsetEndpoint(9, "", "b"),
		subsetEndpoint(3, "r", "c"), subsetEndpoint(7, "st", "b"), subsetEndpoint(5, "r", "a"),
		subsetEndpoint(4, "r", "c"), subsetEndpoint(8, "st", "a"), subsetEndpoint(6, "r", "a"),
	}
	tests := []struct {
		name     string
		eps      []Endpoint
		limit    int
		node     string
		want     []int
		wantLeft int
	}{
		{"under the limit", mixed, 9, "a", []int{1, 2, 9, 3, 7, 5, 4, 8, 6}, 0},
		{"no limit", mixed, 0, "a", []int{1, 2, 9, 3, 7, 5, 4, 8, 6}, 0},
		{"negative: no limit", mixed, -1, "a", []int{1, 2, 9, 3, 7, 5, 4, 8, 6}, 0},
		{"this node's ready first", mixed, 2, "a", []int{5, 6}, 7},
		{"then the other ready", mixed, 6, "a", []int{1, 2, 3, 5, 4, 6}, 3},
		{"then this node's terminating", mixed, 7, "a", []int{1, 2, 3, 5, 4, 8, 6}, 2},
		{"then the other terminating", mixed, 8, "a", []int{1, 2, 3, 7, 5, 4, 8, 6}, 1},
		{"no node: none is local", mixed, 7, "", []int{1, 2, 3, 7, 5, 4, 6}, 2},
		{"empty", nil, 3, "a", []int{}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, left := SubsetEndpoints(tt.eps, tt.limit, tt.node, tt.node)
			if diff := cmp.Diff(tt.want, subsetAddrs(got)); diff != "" || left != tt.wantLeft {
				t.Errorf("kept (-want +got):\n%s\nleft out %d, want %d", diff, left, tt.wantLeft)
			}
		})
	}
}

// TestSubsetEndpointsStable checks that the subset is the same at every
// call, that an endpoint coming or going changes it by at most one, and
// that the nodes' subsets differ and together cover every endpoint.
func TestSubsetEndpointsStable(t *testing.T) {
	const n, limit = 3000, 1000
	var eps []Endpoint
	for i := range n {
		eps = append(eps, subsetEndpoint(i, "r", "other"))
	}
	set := func(eps []Endpoint) map[int]bool {
		m := map[int]bool{}
		for _, a := range subsetAddrs(eps) {
			m[a] = true
		}
		return m
	}
	base, _ := SubsetEndpoints(eps, limit, "node-a", "node-a")
	again, _ := SubsetEndpoints(slices.Clone(eps), limit, "node-a", "node-a")
	if diff := cmp.Diff(subsetAddrs(base), subsetAddrs(again)); diff != "" {
		t.Errorf("the same endpoints, another subset (-first +second):\n%s", diff)
	}
	kept := set(base)
	firstLeftOut := slices.IndexFunc(eps, func(e Endpoint) bool { return !kept[subsetAddrs([]Endpoint{e})[0]] })
	notReady := slices.Clone(eps)
	notReady[slices.IndexFunc(eps, func(e Endpoint) bool { return e.Addr == base[0].Addr })].Ready = false
	changes := map[string][]Endpoint{
		"one more":            append(slices.Clone(eps), subsetEndpoint(n, "r", "other")),
		"one kept fewer":      slices.DeleteFunc(slices.Clone(eps), func(e Endpoint) bool { return e.Addr == base[0].Addr }),
		"one left out fewer":  slices.Delete(slices.Clone(eps), firstLeftOut, firstLeftOut+1),
		"first moved last":    append(slices.Clone(eps[1:]), eps[0]),
		"one kept, not ready": notReady,
	}
	for name, changed := range changes {
		after, _ := SubsetEndpoints(changed, limit, "node-a", "node-a")
		was, is := set(base), set(after)
		gone, added := 0, 0
		for a := range was {
			if !is[a] {
				gone++
			}
		}
		for a := range is {
			if !was[a] {
				added++
			}
		}
		if gone > 1 || added > 1 {
			t.Errorf("%s: %d endpoints left the subset and %d joined it, want at most one each", name, gone, added)
		}
	}
	covered := map[int]bool{}
	overlap := 0
	other, _ := SubsetEndpoints(eps, limit, "node-b", "node-b")
	for a := range set(other) {
		if set(base)[a] {
			overlap++
		}
	}
	if overlap > limit/2 {
		t.Errorf("nodes a and b share %d of their %d endpoints, want different subsets", overlap, limit)
	}
	for i := range 30 {
		node := fmt.Sprintf("node-%d", i)
		sub, _ := SubsetEndpoints(eps, limit, node, node)
		for a := range set(sub) {
			covered[a] = true
		}
	}
	if len(covered) < n*99/100 {
		t.Errorf("30 nodes' subsets of %d cover %d of %d endpoints, want nearly all", limit, len(covered), n)
	}
	shared, _ := SubsetEndpoints(eps, limit, "node-b", "")
	same, _ := SubsetEndpoints(eps, limit, "node-c", "")
	if diff := cmp.Diff(subsetAddrs(shared), subsetAddrs(same)); diff != "" {
		t.Errorf("one seed, two nodes, two subsets (-b +c):\n%s", diff)
	}
}
