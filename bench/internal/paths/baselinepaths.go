package paths

import (
	"fmt"
	"slices"
	"strings"

	"github.com/uproxy/uproxy/bench/internal/harness"

	"github.com/uproxy/uproxy/bench/internal/results"
)

// CheckPath returns an error unless id names a data path: one of
// All, or, with a baseline, a uproxy path's baseline twin.
func CheckPath(c harness.Config, id string) error {
	if pathByID(id) != nil {
		return nil
	}
	if base, ok := strings.CutSuffix(id, results.BaselineSuffix); ok {
		if p := pathByID(base); p != nil && p.baseline != nil {
			if !c.HasBaseline() {
				return fmt.Errorf("data path %q needs a baseline binary (--baseline or --baseline-rev)", id)
			}
			return nil
		}
	}
	return fmt.Errorf("unknown data path %q (have %s)", id, strings.Join(IDs(), ", "))
}

// selectedPaths returns the data paths that c selects, in table order.
// With a baseline, every selected uproxy path is followed by its twin run
// by the baseline binary (selecting either selects both), so that the
// interleaved runs measure the two one right after the other.
func selectedPaths(c harness.Config) []dataPath {
	var out []dataPath
	for _, p := range All {
		twin := c.HasBaseline() && p.baseline != nil
		if len(c.Paths) > 0 && !slices.Contains(c.Paths, p.ID) && !(twin && slices.Contains(c.Paths, p.ID+results.BaselineSuffix)) {
			continue
		}
		out = append(out, p)
		if twin {
			out = append(out, p.baselineTwin())
		}
	}
	return out
}

// baselineTwin returns p run by the baseline binary, with the same flags.
func (p dataPath) baselineTwin() dataPath {
	return dataPath{
		Subject: results.Subject{ID: p.ID + results.BaselineSuffix, Title: p.Title + ", baseline",
			How: "As " + p.Title + ", with the same flags, run by the baseline binary (see [Before and after](#before-and-after))."},
		setup: p.baseline,
	}
}
