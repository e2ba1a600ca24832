package results

import (
	"fmt"
	"image/color"
	"math"
	"path/filepath"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// BarChart draws one figure of every subject that has it: a bar at the
// median, and a line from the minimum to the maximum. It returns the
// file's name (in dir), or "" when no subject has a value.
func BarChart(dir, name, title, unit string, subjects []Subject, series func(id string) *Series) (string, error) {
	var labels []string
	var meds plotter.Values
	var spread errPoints
	top := 0.0
	for _, s := range subjects {
		sr := series(s.ID)
		if sr == nil || len(sr.Values) == 0 {
			continue
		}
		lo, med, hi := sr.Stats()
		top = math.Max(top, hi)
		labels = append(labels, s.ID)
		meds = append(meds, med)
		spread.XYs = append(spread.XYs, plotter.XY{X: float64(len(meds) - 1), Y: med})
		spread.YErrors = append(spread.YErrors, struct{ Low, High float64 }{med - lo, hi - med})
	}
	if len(meds) == 0 {
		return "", nil
	}
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = unit
	p.Y.Min = 0
	bars, err := plotter.NewBarChart(meds, vg.Points(28))
	if err != nil {
		return "", fmt.Errorf("chart %s: %w", name, err)
	}
	bars.Color = color.RGBA{R: 0x4c, G: 0x72, B: 0xb0, A: 0xff}
	bars.LineStyle.Width = 0
	p.Add(bars)
	eb, err := plotter.NewYErrorBars(spread)
	if err != nil {
		return "", fmt.Errorf("chart %s: %w", name, err)
	}
	eb.LineStyle.Width = vg.Points(1.2)
	p.Add(eb)
	p.NominalX(labels...)
	p.X.Min, p.X.Max = -0.6, float64(len(meds))-0.4
	p.Y.Max = 1.08 * top
	p.X.Tick.Label.Rotation = math.Pi / 6
	p.X.Tick.Label.XAlign = draw.XRight
	p.X.Tick.Label.YAlign = draw.YCenter
	p.Add(plotter.NewGrid())
	file := name + ".png"
	if err := p.Save(8*vg.Inch, 4*vg.Inch, filepath.Join(dir, file)); err != nil {
		return "", fmt.Errorf("chart %s: %w", name, err)
	}
	return file, nil
}

// errPoints are points with asymmetric Y errors, for NewYErrorBars.
type errPoints struct {
	plotter.XYs
	plotter.YErrors
}

// ScaleChart draws one control-plane figure against the number of
// services: a line per proxy through the medians.
func ScaleChart(dir, name, title, unit string, scales []int, proxies []Subject, series func(proxy string, scale int) (float64, bool)) (string, error) {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "services"
	p.Y.Label.Text = unit
	p.Y.Min = 0
	p.Legend.Top = true
	p.Legend.Left = true
	drawn := 0
	top := 0.0
	for i, px := range proxies {
		var xys plotter.XYs
		for _, n := range scales {
			if v, ok := series(px.ID, n); ok {
				xys = append(xys, plotter.XY{X: float64(n), Y: v})
				top = math.Max(top, v)
			}
		}
		if len(xys) == 0 {
			continue
		}
		line, pts, err := plotter.NewLinePoints(xys)
		if err != nil {
			return "", fmt.Errorf("chart %s: %w", name, err)
		}
		line.Color = plotutil.Color(i)
		line.Dashes = plotutil.Dashes(0)
		pts.Color = plotutil.Color(i)
		pts.Shape = plotutil.Shape(i)
		p.Add(line, pts)
		p.Legend.Add(px.ID, line, pts)
		drawn++
	}
	if drawn == 0 {
		return "", nil
	}
	var ticks []plot.Tick
	for _, n := range scales {
		ticks = append(ticks, plot.Tick{Value: float64(n), Label: strconv.Itoa(n)})
	}
	p.X.Tick.Marker = plot.ConstantTicks(ticks)
	p.Y.Max = 1.4 * top // room for the legend
	if len(scales) == 1 {
		p.X.Min, p.X.Max = 0, float64(2*scales[0])
	}
	p.Add(plotter.NewGrid())
	file := name + ".png"
	if err := p.Save(8*vg.Inch, 4*vg.Inch, filepath.Join(dir, file)); err != nil {
		return "", fmt.Errorf("chart %s: %w", name, err)
	}
	return file, nil
}
