package balancer

import (
	"net/netip"
	"slices"
	"sync"
	"testing"
)

// testBackends returns one backend per weight, at 10.0.0.1:80, 10.0.0.2:80
// and so on.
func testBackends(weights ...int) []*Backend {
	bs := make([]*Backend, len(weights))
	for i, w := range weights {
		bs[i] = NewBackend(netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i + 1)}), 80), w)
	}
	return bs
}

// nBackends returns n backends of weight 1.
func nBackends(n int) []*Backend { return testBackends(make([]int, n)...) }

// clientAddr returns a distinct client address for each i.
func clientAddr(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{192, 168, byte(i >> 8), byte(i)})
}

// index maps each backend to its position in bs.
func index(bs []*Backend) map[*Backend]int {
	m := make(map[*Backend]int, len(bs))
	for i, b := range bs {
		m[b] = i
	}
	return m
}

// counts picks n times for distinct clients and counts the picks of each
// backend in bs.
func counts(t *testing.T, bal Balancer, bs []*Backend, n int) []int {
	t.Helper()
	idx := index(bs)
	got := make([]int, len(bs))
	for i := range n {
		b := bal.Pick(clientAddr(i))
		j, ok := idx[b]
		if !ok {
			t.Fatalf("Pick returned %v, not one of the backends", b)
		}
		got[j]++
	}
	return got
}

func TestParseKind(t *testing.T) {
	tests := []struct {
		in      string
		want    Kind
		wantErr bool
	}{
		{"round-robin", RoundRobin, false},
		{"weighted-round-robin", WeightedRoundRobin, false},
		{"least-conn", LeastConn, false},
		{"weighted-least-conn", WeightedLeastConn, false},
		{"source-hash", SourceHash, false},
		{"", "", true},
		{"Round-Robin", "", true},
		{"maglev", "", true},
	}
	for _, tt := range tests {
		got, err := ParseKind(tt.in)
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("ParseKind(%q) = %q, %v; want %q, error %t", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestEmpty(t *testing.T) {
	for _, k := range Kinds {
		for _, bs := range [][]*Backend{nil, {}} {
			if b := New(k, bs).Pick(clientAddr(1)); b != nil {
				t.Errorf("New(%s, %v).Pick = %v, want nil", k, bs, b)
			}
			bal := NewAffinityTable(AffinityConfig{}).Wrap(New(k, bs), bs)
			if b := bal.Pick(clientAddr(1)); b != nil {
				t.Errorf("wrapped New(%s, %v).Pick = %v, want nil", k, bs, b)
			}
		}
	}
}

func TestNewCopiesBackends(t *testing.T) {
	for _, k := range Kinds {
		bs := nBackends(3)
		slices.Reverse(bs)
		want := slices.Clone(bs)
		bal := New(k, bs)
		if !slices.Equal(bs, want) {
			t.Errorf("%s: New reordered the caller's slice", k)
		}
		clear(bs)
		for i := range 10 {
			if b := bal.Pick(clientAddr(i)); b == nil {
				t.Fatalf("%s: Pick = nil after the caller cleared its slice", k)
			}
		}
	}
}

func TestUnknownKindIsRoundRobin(t *testing.T) {
	bs := nBackends(3)
	got := counts(t, New("no-such-kind", bs), bs, 300)
	if want := []int{100, 100, 100}; !slices.Equal(got, want) {
		t.Errorf("picks per backend = %v, want %v", got, want)
	}
}

func TestEjection(t *testing.T) {
	for _, k := range Kinds {
		t.Run(string(k), func(t *testing.T) {
			bs := testBackends(1, 2, 3, 4, 5)
			bal := New(k, bs)
			bs[0].SetEjected(true)
			bs[3].SetEjected(true)
			got := counts(t, bal, bs, 1000)
			if got[0] != 0 || got[3] != 0 {
				t.Errorf("picks per backend = %v; ejected backends 0 and 3 were picked", got)
			}
			for _, b := range bs {
				b.SetEjected(true)
			}
			got = counts(t, bal, bs, 1000)
			for i, n := range got {
				if n == 0 {
					t.Errorf("all ejected: backend %d never picked (picks %v)", i, got)
				}
			}
			for _, b := range bs {
				b.SetEjected(false)
			}
			if got := counts(t, bal, bs, 1000); got[0] == 0 || got[3] == 0 {
				t.Errorf("picks per backend = %v; readmitted backends 0 and 3 were not picked", got)
			}
		})
	}
}

// TestSpill checks that the share of an ejected backend is spread over the
// others rather than landing on its neighbour.
func TestSpill(t *testing.T) {
	tests := []struct {
		kind    Kind
		weights []int
		eject   int
		want    []int
	}{
		{RoundRobin, []int{1, 1, 1, 1}, 1, []int{400, 0, 400, 400}},
		{WeightedRoundRobin, []int{1, 2, 3, 6}, 3, []int{200, 400, 600, 0}},
	}
	for _, tt := range tests {
		bs := testBackends(tt.weights...)
		bal := New(tt.kind, bs)
		bs[tt.eject].SetEjected(true)
		if got := counts(t, bal, bs, 1200); !slices.Equal(got, tt.want) {
			t.Errorf("%s %v with %d ejected: picks per backend = %v, want %v", tt.kind, tt.weights, tt.eject, got, tt.want)
		}
	}
}

// TestConcurrent is for the race detector: every kind, plain and with
// affinity, over few backends and over more than MaxLeastConnScan, picked
// from many goroutines while ejections toggle.
func TestConcurrent(t *testing.T) {
	few, many := testBackends(1, 2, 3, 4, 5, 6, 7, 8), testBackends(weightsCycling(100)...)
	bs := slices.Concat(few, many)
	table := NewAffinityTable(AffinityConfig{MaxEntries: 100})
	var bals []Balancer
	for _, k := range Kinds {
		for _, set := range [][]*Backend{few, many} {
			bals = append(bals, New(k, set), table.Wrap(New(k, set), set))
		}
	}
	done := make(chan struct{})
	var toggler sync.WaitGroup
	toggler.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-done:
				return
			default:
			}
			bs[i%len(bs)].SetEjected(i%3 == 0)
			table.Lookup(clientAddr(i))
			table.Len()
		}
	})
	var pickers sync.WaitGroup
	for g := range 16 {
		pickers.Go(func() {
			for i := range 2000 {
				bal := bals[(g+i)%len(bals)]
				b := bal.Pick(clientAddr(g*1000 + i%300))
				if b == nil {
					t.Error("Pick = nil")
					return
				}
				b.Acquire()
				b.Release()
			}
		})
	}
	pickers.Wait()
	close(done)
	toggler.Wait()
	for _, b := range bs {
		if n := b.Active(); n != 0 {
			t.Errorf("%v: Active = %d after all releases", b, n)
		}
	}
}

func TestPickAllocs(t *testing.T) {
	client := clientAddr(7)
	for _, k := range Kinds {
		for _, n := range []int{10, 100} {
			for _, state := range []string{"healthy", "one-ejected", "all-ejected"} {
				bs := testBackends(weightsCycling(n)...)
				bal := New(k, bs)
				switch state {
				case "one-ejected": // the client's own, so that Pick takes the fallback path
					bal.Pick(client).SetEjected(true)
				case "all-ejected":
					for _, b := range bs {
						b.SetEjected(true)
					}
				}
				allocs := testing.AllocsPerRun(1000, func() { bal.Pick(client) })
				t.Logf("%s/n=%d/%s: %v allocs/Pick", k, n, state, allocs)
				if allocs != 0 {
					t.Errorf("%s/n=%d/%s: %v allocs/Pick, want 0", k, n, state, allocs)
				}
			}
		}
		bs := nBackends(10)
		bal := NewAffinityTable(AffinityConfig{}).Wrap(New(k, bs), bs)
		bal.Pick(client)
		allocs := testing.AllocsPerRun(1000, func() { bal.Pick(client) })
		t.Logf("%s/affinity-hit: %v allocs/Pick", k, allocs)
		if allocs != 0 {
			t.Errorf("%s/affinity-hit: %v allocs/Pick, want 0", k, allocs)
		}
	}
}
