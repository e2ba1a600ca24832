package balancer

import (
	"math"
	"slices"
	"strings"
	"testing"
)

// sequence returns the next n picks of bal as letters, a for bs[0], b for
// bs[1] and so on.
func sequence(t *testing.T, bal Balancer, bs []*Backend, n int) string {
	t.Helper()
	idx := index(bs)
	var sb strings.Builder
	for i := range n {
		j, ok := idx[bal.Pick(clientAddr(i))]
		if !ok {
			t.Fatal("Pick returned a backend not in the list")
		}
		sb.WriteByte(byte('a' + j))
	}
	return sb.String()
}

func TestRoundRobin(t *testing.T) {
	bs := testBackends(1, 5, 9) // weights are ignored
	if got, want := sequence(t, New(RoundRobin, bs), bs, 7), "abcabca"; got != want {
		t.Errorf("sequence = %q, want %q", got, want)
	}
	if got, want := counts(t, New(RoundRobin, bs), bs, 300), []int{100, 100, 100}; !slices.Equal(got, want) {
		t.Errorf("picks per backend = %v, want %v", got, want)
	}
}

func TestWeightedRoundRobinSequence(t *testing.T) {
	tests := []struct {
		weights []int
		want    string // one cycle, which then repeats
	}{
		{[]int{5, 1, 1}, "aabacaa"}, // the example in nginx's commit message
		{[]int{3, 1}, "aaba"},
		{[]int{1, 1, 1}, "abc"},
		{[]int{4, 4}, "ab"}, // reduced by the GCD
		{[]int{0, -3, 2}, "cabc"},
		{[]int{2, 3}, "babab"},
		{[]int{1}, "a"},
	}
	for _, tt := range tests {
		bs := testBackends(tt.weights...)
		got := sequence(t, New(WeightedRoundRobin, bs), bs, 3*len(tt.want))
		if want := strings.Repeat(tt.want, 3); got != want {
			t.Errorf("weights %v: sequence = %q, want %q", tt.weights, got, want)
		}
	}
}

// TestWeightedRoundRobinSmooth checks the exact ratio over whole cycles,
// and that the heaviest backend's picks are interleaved with the others'
// (across cycle boundaries too) instead of coming in one burst of its
// whole weight, as a naive weighted round-robin would send them.
func TestWeightedRoundRobinSmooth(t *testing.T) {
	tests := []struct {
		weights []int
		maxRun  int
	}{
		{[]int{5, 1, 1}, 4},
		{[]int{7, 5, 3}, 2},
		{[]int{10, 2}, 6},
		{[]int{100, 1, 1, 1, 1}, 40},
	}
	for _, tt := range tests {
		bs := testBackends(tt.weights...)
		total := 0
		for _, w := range tt.weights {
			total += w
		}
		got := counts(t, New(WeightedRoundRobin, bs), bs, 100*total)
		want := make([]int, len(tt.weights))
		for i, w := range tt.weights {
			want[i] = 100 * w
		}
		if !slices.Equal(got, want) {
			t.Errorf("weights %v: picks per backend = %v, want %v", tt.weights, got, want)
		}
		seq := sequence(t, New(WeightedRoundRobin, bs), bs, 3*total)
		if run := longestRun(seq, 'a'); run > tt.maxRun {
			t.Errorf("weights %v: %d consecutive picks of the heaviest backend in %q, want at most %d", tt.weights, run, seq, tt.maxRun)
		}
	}
}

// longestRun returns the length of the longest run of c in s.
func longestRun(s string, c byte) int {
	longest, run := 0, 0
	for i := range len(s) {
		if s[i] != c {
			run = 0
			continue
		}
		run++
		longest = max(longest, run)
	}
	return longest
}

func TestReduceWeights(t *testing.T) {
	tests := []struct {
		weights []int
		want    []uint64
	}{
		{[]int{6, 4, 2}, []uint64{3, 2, 1}},
		{[]int{0, -1, 5}, []uint64{1, 1, 5}},
		{[]int{1 << 20, 1 << 19}, []uint64{2, 1}},
		{[]int{math.MaxInt, math.MaxInt, math.MaxInt}, []uint64{1, 1, 1}},
		{[]int{1 << 20, 1}, []uint64{maxSchedule - 1, 1}},
		{[]int{3 << 15, 1 << 15, 1}, []uint64{49151, 16383, 1}},
	}
	for _, tt := range tests {
		if got := reduceWeights(testBackends(tt.weights...)); !slices.Equal(got, tt.want) {
			t.Errorf("reduceWeights(%v) = %v, want %v", tt.weights, got, tt.want)
		}
	}
}

func TestWeightedRoundRobinScheduleBound(t *testing.T) {
	weights := make([]int, 200) // summing to 219900
	for i := range weights {
		weights[i] = 1000 + i
	}
	w := newWeightedRoundRobin(testBackends(weights...))
	if n := len(w.schedule); n > maxSchedule+len(weights) {
		t.Errorf("schedule length %d, want at most %d", n, maxSchedule+len(weights))
	}
}
