package proxy

import (
	"context"
	"time"

	"github.com/uproxy/uproxy/proxy/source"

	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// defaultStateInterval is the least time between two writes of the state
// file: a sync that follows a write more closely leaves the file to a
// later sync (the periodic one at the latest).
const defaultStateInterval = 10 * time.Second

// StateRefreshInterval is the longest time between two writes of the
// state file while syncs succeed and nothing changes, so that its time
// tells how long ago a uproxy last synced it: a restart refuses a state
// older than a limit (source.LoadFreshState), and a quiet cluster's must
// pass. A write waits for a sync, so the file can be as old as this plus
// the longest time between syncs (the periodic full sync's).
const StateRefreshInterval = time.Minute

// ServePrevious records the Services and EndpointSlices of a previous
// instance's last sync (source.LoadFreshState), to be served before the sources'
// initial lists arrive: the sync loop's first run opens their listeners,
// on the ports the previous rules name (Config.PreviousPort), and
// balances over their endpoints, but writes no rule. Once the initial
// lists have arrived, the objects they lack are deleted and the first
// sync reconciles everything as usual. Call it before Run.
func (p *Proxier) ServePrevious(services []*v1.Service, slices []*discovery.EndpointSlice) {
	p.tracker.Seed(services, slices)
	p.runner.Run()
}

// applyPrevious applies the seeded objects before the initial lists:
// listeners and balancers only, no rule, and no successful sync
// recorded (health, OnSync and the state file wait for a real one).
func (p *Proxier) applyPrevious(ctx context.Context) {
	p.addrs.refresh()
	p.applyServices(ctx, p.tracker.Take(false, nil).Services)
	if p.rulesDirty {
		p.rebuildRoutes()
	}
	nsvc, neps := p.counts()
	p.log.Info("serving the previous instance's Services until the initial lists arrive; no rule is written before them",
		zap.Int("services", nsvc), zap.Int("endpoints", neps))
}

// saveStateAfterSync writes the state file after a successful sync that
// changed something, at most once per defaultStateInterval, and after
// one that changed nothing once StateRefreshInterval has passed; the
// periodic full sync writes what a closer one left.
func (p *Proxier) saveStateAfterSync(changed bool) {
	if p.cfg.StateFile == "" {
		return
	}
	p.stateDirty = p.stateDirty || changed
	now := p.cfg.clock().Now()
	since := now.Sub(p.stateSaved)
	switch {
	case p.stateSaved.IsZero():
	case since < defaultStateInterval:
		return
	case !p.stateDirty && since < StateRefreshInterval:
		return
	}
	services, slices := p.tracker.Objects()
	if err := source.SaveState(p.cfg.StateFile, source.State{Services: services, EndpointSlices: slices, SavedAt: now}); err != nil {
		p.log.Warn("cannot save the state for a restart without the API server", zap.Error(err))
		return
	}
	p.stateDirty, p.stateSaved = false, now
}
