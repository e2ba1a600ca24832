package results

import "testing"

func TestSeriesStats(t *testing.T) {
	s := Series{Values: []float64{3, 1, 2, 10}}
	if lo, med, hi := s.Stats(); lo != 1 || med != 2.5 || hi != 10 {
		t.Errorf("stats = %v %v %v, want 1 2.5 10", lo, med, hi)
	}
	if q := s.Quantile(0.5); q != 2 {
		t.Errorf("p50 = %v, want 2", q)
	}
}
