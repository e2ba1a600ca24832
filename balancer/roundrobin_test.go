package balancer

import (
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
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

// scanSchedule is smooth weighted round-robin as nginx runs it, a scan of
// every backend per step: what smoothSchedule must pick, exactly.
func scanSchedule(weights []uint64) []uint32 {
	var total uint64
	for _, w := range weights {
		total += w
	}
	current := make([]int64, len(weights))
	schedule := make([]uint32, total)
	for s := range schedule {
		best := 0
		for i, w := range weights {
			current[i] += int64(w)
			if current[i] > current[best] {
				best = i
			}
		}
		current[best] -= int64(total)
		schedule[s] = uint32(best)
	}
	return schedule
}

// TestSmoothScheduleMatchesScan checks that the tournament picks exactly
// as the scan does, ties included, for hand-picked weights and random ones.
func TestSmoothScheduleMatchesScan(t *testing.T) {
	tests := []struct {
		name    string
		weights []int
	}{
		{"nginx's example", []int{5, 1, 1}},
		{"two", []int{2, 3}},
		{"heavy last", []int{1, 1, 1, 1, 9}},
		{"ties everywhere", []int{2, 2, 3, 3, 2, 2, 3, 3}},
		{"powers of two", []int{1, 2, 4, 8, 16, 32, 64}},
		{"descending", []int{9, 8, 7, 6, 5, 4, 3, 2, 1}},
		{"scaled down", []int{1 << 20, 3, 1 << 19, 7}},
		{"one heavy among many", append([]int{500}, make([]int, 300)...)},
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{2, 3, 7, 64, 333} {
		for _, maxWeight := range []int{2, 10, 1000, 1000000} {
			if n*maxWeight > 100000 && n > 64 {
				continue // the scan would take long, for nothing new
			}
			weights := make([]int, n)
			for i := range weights {
				weights[i] = 1 + rng.IntN(maxWeight)
			}
			tests = append(tests, struct {
				name    string
				weights []int
			}{fmt.Sprintf("random n=%d weights<=%d", n, maxWeight), weights})
		}
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			weights := reduceWeights(testBackends(tt.weights...))
			got, _ := smoothSchedule(weights)
			if got == nil { // equal weights: the backends in order
				for i := range weights {
					got = append(got, uint32(i))
				}
			}
			if diff := cmp.Diff(scanSchedule(weights), got); diff != "" {
				t.Errorf("schedule (-scan +tournament):\n%s", diff)
			}
		})
	}
}

// TestSmoothScheduleWork checks that building a schedule evaluates
// O(log n) tree nodes per step, where a scan of every backend per step
// costs O(n), and that equal weights need no schedule at all.
func TestSmoothScheduleWork(t *testing.T) {
	tests := []struct {
		name   string
		n      int
		weight func(i int) int
	}{
		{"1 to 4", 1000, func(i int) int { return 1 + i%4 }},
		{"1 to 4", 10000, func(i int) int { return 1 + i%4 }},
		{"distinct", 1000, func(i int) int { return 1 + i }},
		{"distinct", 10000, func(i int) int { return 1 + i }},
		{"one heavy", 10000, func(i int) int {
			if i == 0 {
				return 1000
			}
			return 1
		}},
		{"two levels", 40000, func(i int) int { return 1 + i%2 }},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s/n=%d", tt.name, tt.n), func(t *testing.T) {
			raw := make([]int, tt.n)
			for i := range raw {
				raw[i] = tt.weight(i)
			}
			weights := reduceWeights(testBackends(raw...))
			schedule, work := smoothSchedule(weights)
			bound := 3 * len(schedule) * bits.Len(uint(tt.n))
			t.Logf("%d steps, %d nodes evaluated (bound %d)", len(schedule), work, bound)
			if work > bound {
				t.Errorf("%d nodes evaluated for %d steps over %d backends, want at most %d (3 per step and tree level)", work, len(schedule), tt.n, bound)
			}
		})
	}
	schedule, work := smoothSchedule(reduceWeights(testBackends(make([]int, 40000)...)))
	if schedule != nil || work != 0 {
		t.Errorf("equal weights: a schedule of %d steps, %d nodes evaluated; want none", len(schedule), work)
	}
}

// TestWeightedRoundRobinEqualWeights checks that equal weights, which need
// no schedule, hand out the backends in order, and spill an ejected one's
// turns over the others.
func TestWeightedRoundRobinEqualWeights(t *testing.T) {
	bs := testBackends(3, 3, 3, 3)
	if got, want := sequence(t, New(WeightedRoundRobin, bs), bs, 10), "abcdabcdab"; got != want {
		t.Errorf("sequence = %q, want %q", got, want)
	}
	bal := New(WeightedRoundRobin, bs)
	bs[2].SetEjected(true)
	if diff := cmp.Diff([]int{400, 400, 0, 400}, counts(t, bal, bs, 1200)); diff != "" {
		t.Errorf("picks per backend with c ejected (-want +got):\n%s", diff)
	}
}

// TestWeightedRoundRobinRemoval checks that a rebuild without a backend
// keeps the others' shares in proportion, over a schedule the tournament
// built.
func TestWeightedRoundRobinRemoval(t *testing.T) {
	tests := []struct {
		name    string
		weights []int
		remove  int
		want    []int // picks per remaining backend over 100 cycles
	}{
		{"heaviest", []int{5, 1, 1, 2}, 0, []int{100, 100, 200}},
		{"lightest", []int{5, 1, 1, 2}, 1, []int{500, 100, 200}},
		{"to equal weights", []int{2, 4, 2}, 1, []int{100, 100}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bs := slices.Delete(testBackends(tt.weights...), tt.remove, tt.remove+1)
			total := 0
			for _, n := range tt.want {
				total += n
			}
			if diff := cmp.Diff(tt.want, counts(t, New(WeightedRoundRobin, bs), bs, total)); diff != "" {
				t.Errorf("picks per backend (-want +got):\n%s", diff)
			}
		})
	}
}
