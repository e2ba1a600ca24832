package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// A state file holds the Services and EndpointSlices of a proxier's last
// successful sync, so that an instance restarted while the API server is
// down serves what the rules left in the kernel still send to it:
// the rules outlive the process, and without their listeners and
// endpoints every Service on the node would refuse connections until the
// initial lists arrive.

// stateFileVersion is the version of the file's format.
const stateFileVersion = 1

// defaultStateInterval is the least time between two writes of the state
// file: a sync that follows a write more closely leaves the file to a
// later sync (the periodic one at the latest).
const defaultStateInterval = 10 * time.Second

type stateFile struct {
	Version        int                        `json:"version"`
	Services       []*v1.Service              `json:"services"`
	EndpointSlices []*discovery.EndpointSlice `json:"endpointSlices"`
}

// LoadState reads the Services and EndpointSlices that a state file
// holds. A missing file is no error: it returns nothing.
func LoadState(path string) ([]*v1.Service, []*discovery.EndpointSlice, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("reading the state file: %w", err)
	}
	defer f.Close()
	var st stateFile
	if err := json.NewDecoder(bufio.NewReader(f)).Decode(&st); err != nil {
		return nil, nil, fmt.Errorf("decoding the state file %s: %w", path, err)
	}
	if st.Version != stateFileVersion {
		return nil, nil, fmt.Errorf("the state file %s has version %d, not %d", path, st.Version, stateFileVersion)
	}
	// A file written before the informers trimmed their objects holds
	// whole ones: trim them as the informers would.
	for _, svc := range st.Services {
		TrimService(svc)
	}
	for _, sl := range st.EndpointSlices {
		TrimSlice(sl)
	}
	return st.Services, st.EndpointSlices, nil
}

// saveState writes the tracker's objects to path, through a temporary
// file renamed over it, so that a crash meanwhile leaves the previous
// file whole.
func saveState(path string, services []*v1.Service, slices []*discovery.EndpointSlice) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("saving the state: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("saving the state: %w", err)
	}
	defer os.Remove(tmp.Name()) // after the rename, nothing is there
	w := bufio.NewWriter(tmp)
	err = writeState(w, services, slices)
	if err == nil {
		err = w.Flush()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		return fmt.Errorf("saving the state to %s: %w", path, err)
	}
	return nil
}

// writeState writes a stateFile of services and slices to w one object
// at a time: encoding the whole file at once would hold all of it in
// memory, as large as the objects themselves, at every save.
func writeState(w *bufio.Writer, services []*v1.Service, slices []*discovery.EndpointSlice) error {
	enc := json.NewEncoder(w)
	fmt.Fprintf(w, `{"version":%d,"services":[`, stateFileVersion)
	for i, svc := range services {
		if i > 0 {
			w.WriteByte(',')
		}
		if err := enc.Encode(svc); err != nil {
			return fmt.Errorf("encoding Service %s/%s: %w", svc.Namespace, svc.Name, err)
		}
	}
	w.WriteString(`],"endpointSlices":[`)
	for i, sl := range slices {
		if i > 0 {
			w.WriteByte(',')
		}
		if err := enc.Encode(sl); err != nil {
			return fmt.Errorf("encoding EndpointSlice %s/%s: %w", sl.Namespace, sl.Name, err)
		}
	}
	_, err := w.WriteString("]}\n")
	return err
}

// ServePrevious records the Services and EndpointSlices of a previous
// instance's last sync (LoadState), to be served before the sources'
// initial lists arrive: the sync loop's first run opens their listeners,
// on the ports the previous rules name (Config.PreviousPort), and
// balances over their endpoints, but writes no rule. Once the initial
// lists have arrived, the objects they lack are deleted and the first
// sync reconciles everything as usual. Call it before Run.
func (p *Proxier) ServePrevious(services []*v1.Service, slices []*discovery.EndpointSlice) {
	p.tracker.seed(services, slices)
	p.runner.Run()
}

// applyPrevious applies the seeded objects before the initial lists:
// listeners and balancers only, no rule, and no successful sync
// recorded (health, OnSync and the state file wait for a real one).
func (p *Proxier) applyPrevious(ctx context.Context) {
	p.refreshLocalAddrs()
	p.applyServices(ctx, p.tracker.Take(false, nil).Services)
	if p.rulesDirty {
		p.rebuildRoutes()
	}
	nsvc, neps := p.counts()
	p.log.Info("serving the previous instance's Services until the initial lists arrive; no rule is written before them",
		zap.Int("services", nsvc), zap.Int("endpoints", neps))
}

// saveStateAfterSync writes the state file after a successful sync that
// changed something, at most once per defaultStateInterval; the periodic
// full sync writes what a closer one left.
func (p *Proxier) saveStateAfterSync(changed bool) {
	if p.cfg.StateFile == "" {
		return
	}
	p.stateDirty = p.stateDirty || changed
	now := p.cfg.clock().Now()
	if !p.stateDirty || (!p.stateSaved.IsZero() && now.Sub(p.stateSaved) < defaultStateInterval) {
		return
	}
	services, slices := p.tracker.objects()
	if err := saveState(p.cfg.StateFile, services, slices); err != nil {
		p.log.Warn("cannot save the state for a restart without the API server", zap.Error(err))
		return
	}
	p.stateDirty, p.stateSaved = false, now
}
