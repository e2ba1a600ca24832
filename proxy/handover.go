package proxy

import (
	"context"

	"github.com/uproxy/uproxy/proxy/listeners"
)

// Handing listeners over from one process to the next (hitless upgrade):
// the listeners package exports and adopts the sockets; the Proxier
// decides when.

// ExportListeners returns a duplicate of every listener's socket, keyed
// for Inherited and sorted by key. The listeners go on serving: call
// StopListening once the next process has taken over. The caller closes
// the Files. Call it only while Run is not running: the sync goroutine
// owns the listeners.
func (p *Proxier) ExportListeners() ([]listeners.HandoverSocket, error) {
	var all []*listeners.Listener
	for _, ls := range p.services {
		for _, l := range ls {
			all = append(all, l.Listener)
		}
	}
	return p.sockets.Export(all)
}

// StopListening closes this process's descriptors of every listener,
// after another process has taken the sockets over (or asked for their
// ports): accepting and reading end, established connections and UDP
// flows go on until Drain. Unlike Shutdown it does not refuse connections
// that were taken from the shared queue just before this process's
// descriptor was closed: those were accepted, and are served. Call it
// only while Run is not running; then call Drain, not Shutdown.
func (p *Proxier) StopListening() {
	for name, ls := range p.services {
		for _, l := range ls {
			p.sockets.Close(l.Listener)
		}
		delete(p.services, name)
		p.inspect.Store(name, nil)
	}
	p.endpoints = 0
	p.sockets.CloseShared()
	p.cfg.Inherited.Stop(p.log)
}

// Drain waits, after StopListening or as the end of Shutdown, for every
// loop and established connection to finish until ctx is done, then
// refuses connections still being accepted, closes the established ones
// and waits for them to end. It then stops the event loops. It leaves the
// kernel rules alone: they belong to the next process.
func (p *Proxier) Drain(ctx context.Context) error {
	return p.dp.Drain(ctx)
}

// Resync asks for a full sync as soon as Run runs: for a process that
// stopped Run to export its listeners and, the handover having failed,
// runs it again.
func (p *Proxier) Resync() {
	p.forceFull.Store(true)
	p.runner.Run()
}
