package results

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// Series is one figure of one subject (a data path, or a proxy at one
// scale): a value per run, or the reason why there is none.
type Series struct {
	Values []float64 `json:"values,omitempty"`
	// NA says why the figure could not be measured; empty when Values
	// holds the figure.
	NA string `json:"na,omitempty"`
}

func (s *Series) Add(v float64) { s.Values = append(s.Values, v) }

// Filled reports whether the series has a figure or a reason.
func (s *Series) Filled() bool { return s != nil && (len(s.Values) > 0 || s.NA != "") }

// Stats returns the minimum, median and maximum.
func (s *Series) Stats() (lo, med, hi float64) {
	v := slices.Clone(s.Values)
	slices.Sort(v)
	n := len(v)
	if n == 0 {
		return math.NaN(), math.NaN(), math.NaN()
	}
	med = v[n/2]
	if n%2 == 0 {
		med = (v[n/2-1] + v[n/2]) / 2
	}
	return v[0], med, v[n-1]
}

// Quantile returns the q-quantile of the values (nearest rank).
func (s *Series) Quantile(q float64) float64 {
	v := slices.Clone(s.Values)
	slices.Sort(v)
	if len(v) == 0 {
		return math.NaN()
	}
	i := int(math.Ceil(q*float64(len(v)))) - 1
	return v[max(0, min(i, len(v)-1))]
}

// Metric describes one figure.
type Metric struct {
	ID    string `json:"id"`
	Title string `json:"title"`
	Unit  string `json:"unit"`
	// Higher is true when a higher value is better.
	Higher bool `json:"higher"`
}

// RunMeta says when and how a part ran.
type RunMeta struct {
	Start    time.Time `json:"start"`
	Seconds  float64   `json:"seconds"`
	Smoke    bool      `json:"smoke"`
	Runs     int       `json:"runs"`
	Commit   string    `json:"commit"`
	Settings string    `json:"settings"`
	// Command is the command line that made the part, as
	// "cd bench && go run . datapath --runs 5 …"; empty in older results.
	Command string `json:"command,omitempty"`
	// Errors are failures that are not a known limitation: a part with
	// errors is reported, but `bench all` exits non-zero.
	Errors []string `json:"errors,omitempty"`
}

func (m *RunMeta) Finish() { m.Seconds = time.Since(m.Start).Seconds() }

// Subject is a data path or proxy, as the report names it.
type Subject struct {
	ID    string `json:"id"`
	Title string `json:"title"`
	// How says how the subject is set up and reached.
	How string `json:"how"`
}

// NAError marks a figure that cannot be measured here, and why: the
// report prints "n/a: <reason>". Any other error is a failure.
type NAError struct{ Reason string }

func (e *NAError) Error() string { return "n/a: " + e.Reason }

func NA(format string, args ...any) error { return &NAError{Reason: fmt.Sprintf(format, args...)} }
