package changes

import (
	"context"
	"errors"
	"time"

	"k8s.io/utils/clock"
)

// RunnerConfig configures a Runner.
type RunnerConfig struct {
	// MinInterval is the shortest time between two runs: changes arriving
	// faster are batched. Zero means 1s (kube-proxy's
	// --iptables-min-sync-period).
	MinInterval time.Duration
	// MaxInterval is the longest time between two runs: a full run happens
	// at least this often, even with no change. Zero means 30s (kube-proxy's
	// --iptables-sync-period).
	MaxInterval time.Duration
	// Clock is the time source; nil means the real clock.
	Clock clock.WithTickerAndDelayedExecution
}

func (c RunnerConfig) minInterval() time.Duration {
	if c.MinInterval <= 0 {
		return time.Second
	}
	return c.MinInterval
}

func (c RunnerConfig) maxInterval() time.Duration {
	if c.MaxInterval <= 0 {
		return 30 * time.Second
	}
	return max(c.MaxInterval, c.minInterval())
}

func (c RunnerConfig) clock() clock.WithTickerAndDelayedExecution {
	if c.Clock == nil {
		return clock.RealClock{}
	}
	return c.Clock
}

// SyncFunc applies recorded changes. full asks it to verify everything, not
// only what changed. An error makes the Runner retry with full set, except
// ErrSyncSkipped.
type SyncFunc func(ctx context.Context, full bool) error

// ErrSyncSkipped is what a SyncFunc returns when it did nothing because
// its input is not complete yet (the initial lists have not all
// arrived). The run does not count: the next request is served at once
// instead of MinInterval after it, and the next run is still full.
// Without this, the first real sync of a starting uproxy waited out
// --iptables-min-sync-period (1s) behind an early request that found
// nothing to do.
var ErrSyncSkipped = errors.New("sync skipped: the initial state is not complete")

// Runner calls a SyncFunc at a bounded frequency, the way kube-proxy's
// BoundedFrequencyRunner does: Run requests a run soon, but never sooner
// than MinInterval after the previous one; a full run happens every
// MaxInterval regardless; a failed run is retried, with exponential backoff
// from MinInterval up to MaxInterval, as a full run.
//
// Loop owns the only goroutine that calls the SyncFunc; Run may be called
// from any goroutine and never blocks.
type Runner struct {
	cfg   RunnerConfig
	fn    SyncFunc
	wake  chan struct{}
	clock clock.WithTickerAndDelayedExecution
}

// NewRunner returns a Runner for fn.
func NewRunner(cfg RunnerConfig, fn SyncFunc) *Runner {
	return &Runner{cfg: cfg, fn: fn, wake: make(chan struct{}, 1), clock: cfg.clock()}
}

// Run requests a run. Requests made while a run is pending are merged.
func (r *Runner) Run() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Loop runs until ctx is done. The first run waits for a Run request, so
// the caller decides when the initial state is complete.
func (r *Runner) Loop(ctx context.Context) {
	minI, maxI := r.cfg.minInterval(), r.cfg.maxInterval()
	var (
		last    time.Time // start of the previous run; zero before the first
		pending bool      // a Run request not yet served
		full    = true    // the next run must be full
		backoff time.Duration
	)
	timer := r.clock.NewTimer(maxI)
	defer timer.Stop()
	for {
		// When is the next run due?
		var due time.Time
		switch {
		case backoff > 0:
			due = last.Add(backoff)
		case pending:
			due = last.Add(minI)
		case !last.IsZero():
			due = last.Add(maxI)
		}
		var fire bool
		switch {
		case !due.IsZero() && !r.clock.Now().Before(due):
			// Due already: the clock passed it while the previous run
			// ran. Run now, as the expired timer would have; a timer
			// reset to zero fires only once the clock moves again, which
			// a fake clock may never do.
			fire = true
			if ctx.Err() != nil {
				return
			}
			if !pending && backoff == 0 {
				full = true // the periodic resync
			}
		default:
			if !due.IsZero() {
				if !timer.Stop() {
					select {
					case <-timer.C():
					default:
					}
				}
				timer.Reset(due.Sub(r.clock.Now()))
			}
			select {
			case <-ctx.Done():
				return
			case <-r.wake:
				pending = true
				fire = !last.IsZero() && !r.clock.Now().Before(last.Add(minI)) || last.IsZero()
			case <-timer.C():
				fire = !due.IsZero()
				if !pending && backoff == 0 {
					full = true // the periodic resync
				}
			}
		}
		if !fire {
			continue
		}
		prev := last
		last = r.clock.Now()
		pending = false
		err := r.fn(ctx, full)
		if errors.Is(err, ErrSyncSkipped) {
			last = prev
			continue
		}
		if err != nil {
			full = true
			if backoff == 0 {
				backoff = minI
			} else {
				backoff = min(2*backoff, maxI)
			}
			continue
		}
		full, backoff = false, 0
	}
}
