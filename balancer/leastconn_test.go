package balancer

import (
	"math"
	"net/netip"
	"slices"
	"testing"
)

func TestLeastConnPicksLeastLoaded(t *testing.T) {
	for _, k := range []Kind{LeastConn, WeightedLeastConn} {
		bs := nBackends(3)
		bal := New(k, bs)
		bs[0].Acquire()
		bs[0].Acquire()
		bs[1].Acquire()
		for range 5 {
			if got := bal.Pick(clientAddr(0)); got != bs[2] {
				t.Fatalf("%s: Pick = %v with loads 2,1,0; want %v", k, got, bs[2])
			}
		}
		bs[0].Release()
		bs[0].Release()
		bs[2].Acquire()
		bs[2].Acquire()
		if got := bal.Pick(clientAddr(0)); got != bs[0] {
			t.Errorf("%s: Pick = %v with loads 0,1,2; want %v", k, got, bs[0])
		}
	}
}

// TestLeastConnTies checks that tied backends take turns in proportion to
// weight, and that a busy backend's turns are shared by all the others
// rather than going to its neighbour.
func TestLeastConnTies(t *testing.T) {
	tests := []struct {
		kind    Kind
		weights []int
		busy    []int
		want    []int
	}{
		{LeastConn, []int{1, 1, 1, 1}, nil, []int{120, 120, 120, 120}},
		{LeastConn, []int{1, 1, 1, 1}, []int{3}, []int{160, 160, 160, 0}},
		{LeastConn, []int{1, 1, 1, 1}, []int{0, 1}, []int{0, 0, 240, 240}},
		{LeastConn, []int{3, 1}, nil, []int{240, 240}},
		{WeightedLeastConn, []int{3, 1}, nil, []int{360, 120}},
		{WeightedLeastConn, []int{1, 2, 3, 6}, []int{3}, []int{80, 160, 240, 0}},
	}
	for _, tt := range tests {
		bs := testBackends(tt.weights...)
		for _, i := range tt.busy {
			bs[i].Acquire()
		}
		if got := counts(t, New(tt.kind, bs), bs, 480); !slices.Equal(got, tt.want) {
			t.Errorf("%s %v, busy %v: picks per backend = %v, want %v", tt.kind, tt.weights, tt.busy, got, tt.want)
		}
	}
}

// TestLeastConnHeld opens connections that are never closed, so each pick
// raises a backend's load: the loads must then follow the weights exactly
// (weighted) or evenly (unweighted).
func TestLeastConnHeld(t *testing.T) {
	tests := []struct {
		kind    Kind
		weights []int
		want    []int64
	}{
		{LeastConn, []int{3, 1}, []int64{200, 200}},
		{WeightedLeastConn, []int{3, 1}, []int64{300, 100}},
		{WeightedLeastConn, []int{5, 3, 2}, []int64{200, 120, 80}},
		{WeightedLeastConn, []int{0, 1, 2}, []int64{100, 100, 200}},
		{WeightedLeastConn, []int{math.MaxInt, math.MaxInt / 3}, []int64{300, 100}},
	}
	for _, tt := range tests {
		bs := testBackends(tt.weights...)
		bal := New(tt.kind, bs)
		for i := range 400 {
			bal.Pick(clientAddr(i)).Acquire()
		}
		got := make([]int64, len(bs))
		for i, b := range bs {
			got[i] = b.Active()
		}
		if !slices.Equal(got, tt.want) {
			t.Errorf("%s %v: active connections = %v, want %v", tt.kind, tt.weights, got, tt.want)
		}
	}
}

// TestLeastLoaded checks that LeastLoaded names the backends a least-conn
// balancer picks among, by the balancer's own comparison, and that the
// picks that follow stay among them.
func TestLeastLoaded(t *testing.T) {
	tests := []struct {
		name    string
		kind    Kind
		weights []int
		active  []int
		ejected []int
		want    []int // indexes
	}{
		{"one least loaded", LeastConn, []int{1, 1, 1}, []int{2, 1, 0}, nil, []int{2}},
		{"ties", LeastConn, []int{1, 1, 1}, []int{1, 0, 0}, nil, []int{1, 2}},
		{"unweighted ignores weights", LeastConn, []int{3, 1}, []int{2, 1}, nil, []int{1}},
		{"per unit of weight", WeightedLeastConn, []int{3, 1}, []int{2, 1}, nil, []int{0}},
		{"weighted ties", WeightedLeastConn, []int{2, 1}, []int{2, 1}, nil, []int{0, 1}},
		{"ejected skipped", LeastConn, []int{1, 1, 1}, []int{0, 1, 2}, []int{0}, []int{1}},
		{"all ejected: all count", LeastConn, []int{1, 1}, []int{1, 0}, []int{0, 1}, []int{1}},
		{"round robin is not least-conn", RoundRobin, []int{1, 1}, []int{0, 0}, nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bs := testBackends(tt.weights...)
			for i, n := range tt.active {
				for range n {
					bs[i].Acquire()
				}
			}
			for _, i := range tt.ejected {
				bs[i].SetEjected(true)
			}
			bal := New(tt.kind, bs)
			var want []*Backend
			for _, i := range tt.want {
				want = append(want, bs[i])
			}
			got := LeastLoaded(NewAffinityTable(AffinityConfig{}).Wrap(bal, bs))
			if !slices.Equal(got, want) {
				t.Fatalf("LeastLoaded = %v, want %v", got, want)
			}
			for range 2 * len(bs) {
				if want != nil && !slices.Contains(want, bal.Pick(netip.Addr{})) {
					t.Fatalf("Pick left the least loaded %v", want)
				}
			}
		})
	}
}
