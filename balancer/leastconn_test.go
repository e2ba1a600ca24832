package balancer

import (
	"fmt"
	"math"
	"net/netip"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
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

// weightsCycling returns n weights: 1, 2, 3, 4, 1, 2, …
func weightsCycling(n int) []int {
	weights := make([]int, n)
	for i := range weights {
		weights[i] = 1 + i%4
	}
	return weights
}

// TestLeastConnLooksAtFewBackends checks that a pick looks at no more than
// MaxLeastConnScan backends, or a few draws, however many there are; where
// a scan of all of them would grow with the Service.
func TestLeastConnLooksAtFewBackends(t *testing.T) {
	type result struct{ Max, Total int }
	tests := []struct {
		n       int
		ejected int // every ejected-th backend is; 0 for none
		want    func(got result) bool
		wantDoc string
	}{
		{10, 0, func(r result) bool { return r.Max <= 10 }, "at most the 10"},
		{MaxLeastConnScan, 0, func(r result) bool { return r.Max <= MaxLeastConnScan }, "at most all"},
		{MaxLeastConnScan + 1, 0, func(r result) bool { return r.Max <= sampleTries }, "a few draws"},
		{1000, 0, func(r result) bool { return r.Max <= sampleTries }, "a few draws"},
		{10000, 0, func(r result) bool { return r.Max <= sampleTries }, "a few draws"},
		{40000, 0, func(r result) bool { return r.Max <= sampleTries }, "a few draws"},
		{40000, 4, func(r result) bool { return r.Total <= 3*picks }, "three a pick on average"},
		{40000, 2, func(r result) bool { return r.Total <= 5*picks }, "five a pick on average"},
	}
	for _, k := range []Kind{LeastConn, WeightedLeastConn} {
		for _, tt := range tests {
			t.Run(fmt.Sprintf("%s/n=%d/ejected=%d", k, tt.n, tt.ejected), func(t *testing.T) {
				bs := testBackends(weightsCycling(tt.n)...)
				if tt.ejected > 0 {
					for i := 0; i < len(bs); i += tt.ejected {
						bs[i].SetEjected(true)
					}
				}
				l := New(k, bs).(*leastConn)
				var got result
				for range picks {
					b, looked := l.pick()
					if b.Ejected() {
						t.Fatalf("picked ejected %v", b)
					}
					b.Acquire()
					got.Max = max(got.Max, looked)
					got.Total += looked
				}
				if !tt.want(got) {
					t.Errorf("backends looked at in %d picks: %+v, want %s", picks, got, tt.wantDoc)
				}
			})
		}
	}
}

// picks is how many picks the least-conn tests make per case.
const picks = 4000

// TestPowerOfTwoChoicesHeld opens connections that stay open, so each
// pick raises a backend's load: with two choices, no backend's load per
// unit of weight rises more than a few connections above the mean, for
// equal weights and for weights of 1 to 4. (One random choice would put
// the busiest backends a dozen or more above it.)
func TestPowerOfTwoChoicesHeld(t *testing.T) {
	for _, tt := range []struct {
		kind    Kind
		n       int
		maxOver float64 // most connections per unit of weight above the mean
	}{
		{LeastConn, 100, 3},
		{LeastConn, 1000, 3},
		{LeastConn, 10000, 3},
		{WeightedLeastConn, 100, 3},
		{WeightedLeastConn, 1000, 3},
		{WeightedLeastConn, 10000, 3},
	} {
		t.Run(fmt.Sprintf("%s/n=%d", tt.kind, tt.n), func(t *testing.T) {
			bs := testBackends(weightsCycling(tt.n)...)
			bal := New(tt.kind, bs)
			const perBackend = 20
			for i := range perBackend * tt.n {
				bal.Pick(clientAddr(i)).Acquire()
			}
			// Units of weight per backend: each one's for the weighted
			// kind, one for the other.
			unit := func(b *Backend) float64 {
				if tt.kind == WeightedLeastConn {
					return float64(b.weight())
				}
				return 1
			}
			var units, over float64
			for _, b := range bs {
				units += unit(b)
			}
			mean := perBackend * float64(tt.n) / units
			for _, b := range bs {
				over = max(over, float64(b.Active())/unit(b)-mean)
			}
			t.Logf("busiest: %.2f connections per unit of weight above the mean of %.2f", over, mean)
			if over > tt.maxOver {
				t.Errorf("busiest backend %.2f connections per unit of weight above the mean, want at most %.0f", over, tt.maxOver)
			}
		})
	}
}

// TestPowerOfTwoChoicesIdle checks that with idle backends (connections
// that end before the next pick), which all tie, the picks follow the
// weights for the weighted kind and spread evenly for the other.
func TestPowerOfTwoChoicesIdle(t *testing.T) {
	const n, rounds = 40, 2500
	for _, k := range []Kind{LeastConn, WeightedLeastConn} {
		bs := testBackends(weightsCycling(n)...)
		bal := New(k, bs)
		got := make([]int, 4) // picks by weight
		total := 0
		for i := range n * rounds {
			b := bal.Pick(clientAddr(i))
			got[b.Weight-1]++
			total++
		}
		want := []float64{0.25, 0.25, 0.25, 0.25}
		if k == WeightedLeastConn {
			want = []float64{0.1, 0.2, 0.3, 0.4}
		}
		for w := range got {
			if share := float64(got[w]) / float64(total); math.Abs(share-want[w]) > 0.01 {
				t.Errorf("%s: backends of weight %d got %.3f of the picks, want %.2f (picks by weight %v)", k, w+1, share, want[w], got)
			}
		}
	}
}

// TestPowerOfTwoChoicesEjection checks that ejected backends are never
// picked while another is not, however few remain, and that with every
// backend ejected the picks go to all of them.
func TestPowerOfTwoChoicesEjection(t *testing.T) {
	const n = 200
	tests := []struct {
		name    string
		healthy []int // the backends not ejected; nil for none
	}{
		{"half", func() []int {
			var out []int
			for i := range n / 2 {
				out = append(out, 2*i)
			}
			return out
		}()},
		{"two", []int{7, 150}},
		{"one", []int{123}},
		{"none", nil},
	}
	for _, k := range []Kind{LeastConn, WeightedLeastConn} {
		for _, tt := range tests {
			t.Run(fmt.Sprintf("%s/%s", k, tt.name), func(t *testing.T) {
				bs := testBackends(weightsCycling(n)...)
				for i, b := range bs {
					b.SetEjected(!slices.Contains(tt.healthy, i))
				}
				got := counts(t, New(k, bs), bs, 20*n)
				var picked []int
				for i, c := range got {
					if c > 0 {
						picked = append(picked, i)
					}
				}
				want := tt.healthy
				if want == nil {
					want = make([]int, n)
					for i := range want {
						want[i] = i
					}
				}
				if diff := cmp.Diff(want, picked); diff != "" {
					t.Errorf("backends picked (-want +got):\n%s", diff)
				}
			})
		}
	}
}

// TestPowerOfTwoChoicesRemoval checks that a rebuild without some
// backends never picks them, and that the others' loads carry over: the
// busy ones take the new connections only when both choices are busy, so
// the idle ones catch up.
func TestPowerOfTwoChoicesRemoval(t *testing.T) {
	bs := nBackends(100)
	for _, b := range bs[:50] {
		for range 10 {
			b.Acquire()
		}
	}
	kept := slices.Concat(bs[10:50], bs[60:])
	bal := New(LeastConn, kept)
	got := make(map[string]int)
	for i := range 400 {
		b := bal.Pick(clientAddr(i))
		b.Acquire()
		switch j := slices.Index(bs, b); {
		case j < 10 || j >= 50 && j < 60:
			got["removed"]++
		case j < 50:
			got["busy"]++
		default:
			got["idle"]++
		}
	}
	t.Logf("picks: %v", got)
	if got["removed"] != 0 || 2*got["busy"] > got["idle"] {
		t.Errorf("picks of the removed, the 40 busy and the 40 idle backends: %v; want none removed, and the busy half as many as the idle or fewer", got)
	}
}

// TestAliasTable checks that the alias table's columns give each index
// exactly its weight's share.
func TestAliasTable(t *testing.T) {
	tests := [][]uint64{
		{1, 2, 3, 4},
		{1, 1, 1, 100},
		{7},
		{5, 5},
		{1, 65536, 3, 3, 9, 2, 1, 1, 1, 40},
	}
	for _, weights := range tests {
		at := newAliasTable(weights)
		n := uint64(len(weights))
		got := make([]uint64, n)
		for col := range n {
			got[col] += at.cut[col]
			got[at.alias[col]] += at.total - at.cut[col]
		}
		want := make([]uint64, n)
		for i, w := range weights {
			want[i] = w * n
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("weights %v: mass per index (-want +got):\n%s", weights, diff)
		}
	}
}

func TestPowerOfTwoChoices(t *testing.T) {
	table := NewAffinityTable(AffinityConfig{})
	small, big := nBackends(MaxLeastConnScan), nBackends(MaxLeastConnScan+1)
	tests := []struct {
		name string
		bal  Balancer
		want bool
	}{
		{"least-conn, few", New(LeastConn, small), false},
		{"least-conn, many", New(LeastConn, big), true},
		{"weighted, many", New(WeightedLeastConn, big), true},
		{"wrapped, many", table.Wrap(New(LeastConn, big), big), true},
		{"round-robin, many", New(RoundRobin, big), false},
		{"none", New(LeastConn, nil), false},
	}
	for _, tt := range tests {
		if got := PowerOfTwoChoices(tt.bal); got != tt.want {
			t.Errorf("%s: PowerOfTwoChoices = %t, want %t", tt.name, got, tt.want)
		}
	}
}
