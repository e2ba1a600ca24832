package load

import (
	"testing"
	"time"
)

func TestHistQuantiles(t *testing.T) {
	var h Hist
	for i := 1; i <= 1000; i++ {
		h.Record(time.Duration(i) * time.Microsecond)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Microsecond}, {0.99, 990 * time.Microsecond}, {1, 1000 * time.Microsecond}} {
		got := h.Quantile(c.q)
		if d := float64(got-c.want) / float64(c.want); d < -0.035 || d > 0.035 {
			t.Errorf("quantile(%v) = %v, want %v ± 3.5%%", c.q, got, c.want)
		}
	}
	var empty Hist
	if empty.Quantile(0.5) != 0 {
		t.Error("an empty histogram's quantile is not 0")
	}
}
