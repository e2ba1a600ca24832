package main

import (
	"context"

	"go.uber.org/zap"

	"github.com/uproxy/uproxy/internal/upgrade"
	"github.com/uproxy/uproxy/proxy"
	"github.com/uproxy/uproxy/proxy/healthcheck"
)

// drainHandedOver ends a process whose sockets a successor has taken
// over: it stops accepting (the sockets live on in the successor),
// confirms a release, drains its connections for up to --drain-timeout,
// and returns; with --linger-after-upgrade it first waits for a signal.
// The rules are the successor's.
func drainHandedOver(signals context.Context, o *runOptions, p *proxy.Proxier, svcHealth *healthcheck.ServiceHealth, h *upgrade.Handover, log *zap.Logger) error {
	svcHealth.Close() // the other servers closed when run's context ended
	p.StopListening()
	h.Done(log)
	log.Info("handed over: draining connections", zap.Int("successor", h.PID), zap.Int("active", p.ActiveConnections()), zap.Duration("timeout", o.drainTimeout))
	dctx, cancel := context.WithTimeout(context.Background(), o.drainTimeout)
	defer cancel()
	if err := p.Drain(dctx); err != nil {
		log.Warn("drain incomplete", zap.Error(err))
	}
	log.Info("stopped; the new process serves", zap.Int("successor", h.PID))
	if o.lingerAfterUpgrade {
		log.Info("waiting for SIGTERM (--linger-after-upgrade)")
		<-signals.Done()
	}
	return nil
}
