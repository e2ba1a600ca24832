package upgrade

import "context"

// SyncLoop runs the proxier's sync loop, and lets the upgrade server
// stop it while it exports the listeners (the sync goroutine owns them)
// and start it again if the handover fails.
type SyncLoop struct {
	p       Syncer
	pauses  chan chan struct{}
	resumes chan struct{}
}

// Syncer is the sync loop that SyncLoop runs: the proxier. Run syncs
// until its context ends; Resync asks for a full sync at once. SyncLoop
// calls both from the goroutine it owns.
type Syncer interface {
	Run(ctx context.Context)
	Resync()
}

// NewSyncLoop returns the SyncLoop of p; it syncs once Run is called.
func NewSyncLoop(p Syncer) *SyncLoop {
	return &SyncLoop{p: p, pauses: make(chan chan struct{}), resumes: make(chan struct{})}
}

// Run syncs until ctx is done. It owns the goroutine that runs p.Run,
// which it ends on Pause and on ctx's end.
func (r *SyncLoop) Run(ctx context.Context) {
	for {
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { r.p.Run(rctx); close(done) }() // ends with cancel, below
		var ack chan struct{}
		select {
		case <-ctx.Done():
		case ack = <-r.pauses:
		}
		cancel()
		<-done
		if ack == nil {
			return
		}
		close(ack)
		select {
		case <-ctx.Done():
			return
		case <-r.resumes:
			r.p.Resync()
		}
	}
}

// Pause stops the sync loop and returns once no sync runs; false if ctx
// ended first.
func (r *SyncLoop) Pause(ctx context.Context) bool {
	ack := make(chan struct{})
	select {
	case r.pauses <- ack:
		<-ack
		return true
	case <-ctx.Done():
		return false
	}
}

// Resume starts the sync loop again after Pause.
func (r *SyncLoop) Resume(ctx context.Context) {
	select {
	case r.resumes <- struct{}{}:
	case <-ctx.Done():
	}
}
