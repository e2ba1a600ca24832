package load

import (
	"math/bits"
	"time"
)

// histSubBits is the number of mantissa bits each power of two is split
// into: 32 buckets per octave, so a recorded value is off by at most
// 1/32 (about 3%), as with an HDR histogram of 1.5 significant digits.
const histSubBits = 5

// histBuckets covers every uint64 value.
const histBuckets = (64 - histSubBits + 1) << histSubBits

// Hist is a log-linear latency histogram in nanoseconds. The zero value is
// empty and ready to use; it is not safe for concurrent use (give each
// worker its own and merge them).
type Hist struct {
	counts [histBuckets]uint64
	n      uint64
	max    uint64
}

func histIndex(v uint64) int {
	if v < 1<<histSubBits {
		return int(v)
	}
	shift := bits.Len64(v) - histSubBits - 1
	return (shift+1)<<histSubBits + int(v>>shift) - 1<<histSubBits
}

// histValue is the middle of bucket i.
func histValue(i int) uint64 {
	if i < 1<<histSubBits {
		return uint64(i)
	}
	shift := i>>histSubBits - 1
	m := uint64(i&(1<<histSubBits-1)) + 1<<histSubBits
	return m<<shift + (uint64(1)<<shift)/2
}

func (h *Hist) Record(d time.Duration) {
	v := uint64(max(d, 0))
	h.counts[histIndex(v)]++
	h.n++
	h.max = max(h.max, v)
}

func (h *Hist) merge(o *Hist) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

// Quantile returns the value below which a fraction q of the recorded
// values lie (0 if none were recorded).
func (h *Hist) Quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(q*float64(h.n-1)) + 1
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			return time.Duration(min(histValue(i), h.max))
		}
	}
	return time.Duration(h.max)
}
