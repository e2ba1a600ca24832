// Package promtest owns how tests read Prometheus metrics: the sum of a
// gathered or scraped metric family's samples that carry given labels.
package promtest

import (
	dto "github.com/prometheus/client_model/go"
)

// Sum adds up the samples of mf whose labels include every pair of want
// (for histograms, their sample counts), and says how many series
// matched. A nil mf matches nothing.
func Sum(mf *dto.MetricFamily, want map[string]string) (sum float64, series int) {
	if mf == nil {
		return 0, 0
	}
next:
	for _, m := range mf.GetMetric() {
		have := make(map[string]string, len(m.GetLabel()))
		for _, lp := range m.GetLabel() {
			have[lp.GetName()] = lp.GetValue()
		}
		for k, v := range want {
			if have[k] != v {
				continue next
			}
		}
		series++
		switch mf.GetType() {
		case dto.MetricType_COUNTER:
			sum += m.GetCounter().GetValue()
		case dto.MetricType_GAUGE:
			sum += m.GetGauge().GetValue()
		case dto.MetricType_HISTOGRAM:
			sum += float64(m.GetHistogram().GetSampleCount())
		}
	}
	return sum, series
}
