package source

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// A state file holds the Services and EndpointSlices of a proxier's last
// successful sync, so that an instance restarted while the API server is
// down serves what the rules left in the kernel still send to it:
// the rules outlive the process, and without their listeners and
// endpoints every Service on the node would refuse connections until the
// initial lists arrive. It holds the time it was saved too, for the
// restart serves it only while it is recent (LoadFreshState).

// stateFileVersion is the version of the file's format. savedAt came
// later within version 1: a reader of the first files ignores it, and a
// file without it is dated by its modification time.
const stateFileVersion = 1

type stateFile struct {
	Version        int                        `json:"version"`
	SavedAt        time.Time                  `json:"savedAt,omitzero"`
	Services       []*v1.Service              `json:"services"`
	EndpointSlices []*discovery.EndpointSlice `json:"endpointSlices"`
}

// State is what a state file holds.
type State struct {
	Services       []*v1.Service
	EndpointSlices []*discovery.EndpointSlice
	// SavedAt is when the sync whose objects these are was saved. Zero
	// when saving means the current time. LoadState gives, for a file
	// written before the file held it, the file's modification time,
	// which the rename that wrote the file kept.
	SavedAt time.Time
}

// LoadState reads the state file at path. A missing file is no error: it
// returns the zero State.
func LoadState(path string) (State, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return State{}, nil
	}
	if err != nil {
		return State{}, fmt.Errorf("reading the state file: %w", err)
	}
	defer f.Close()
	var st stateFile
	if err := json.NewDecoder(bufio.NewReader(f)).Decode(&st); err != nil {
		return State{}, fmt.Errorf("decoding the state file %s: %w", path, err)
	}
	if st.Version != stateFileVersion {
		return State{}, fmt.Errorf("the state file %s has version %d, not %d", path, st.Version, stateFileVersion)
	}
	if st.SavedAt.IsZero() {
		fi, err := f.Stat()
		if err != nil {
			return State{}, fmt.Errorf("dating the state file %s, which has no savedAt: %w", path, err)
		}
		st.SavedAt = fi.ModTime()
	}
	// A file written before the informers trimmed their objects holds
	// whole ones: trim them as the informers would.
	for _, svc := range st.Services {
		TrimService(svc)
	}
	for _, sl := range st.EndpointSlices {
		TrimSlice(sl)
	}
	return State{Services: st.Services, EndpointSlices: st.EndpointSlices, SavedAt: st.SavedAt}, nil
}

// StaleStateError is LoadFreshState's refusal of a state too old to
// serve.
type StaleStateError struct {
	Path    string
	SavedAt time.Time
	// Age is how long before now the state was saved; negative when its
	// time is ahead of the clock's.
	Age    time.Duration
	MaxAge time.Duration
}

func (e *StaleStateError) Error() string {
	if e.Age < 0 {
		return fmt.Sprintf("the state file %s was saved at %s, %v ahead of the clock, which was set back since: its age is unknown (limit %v)",
			e.Path, e.SavedAt.Format(time.RFC3339), -e.Age, e.MaxAge)
	}
	return fmt.Sprintf("the state file %s was saved %v ago, at %s, longer ago than the limit of %v: its endpoints' pod IPs may belong to other pods by now",
		e.Path, e.Age, e.SavedAt.Format(time.RFC3339), e.MaxAge)
}

// LoadFreshState is LoadState for a restart: it refuses, with a
// *StaleStateError, a state saved more than maxAge before now. The
// endpoints of a state that old may name pod IPs that other pods, of
// other tenants, have since been given. A state saved more than maxAge
// after now is refused too: the clock was set back, and the state's age
// cannot be told. Zero maxAge means states of any age are served.
func LoadFreshState(path string, maxAge time.Duration, now time.Time) (State, error) {
	st, err := LoadState(path)
	if err != nil || maxAge == 0 || st.SavedAt.IsZero() { // zero: no file
		return st, err
	}
	if age := now.Sub(st.SavedAt); age > maxAge || age < -maxAge {
		return State{}, &StaleStateError{Path: path, SavedAt: st.SavedAt, Age: age, MaxAge: maxAge}
	}
	return st, nil
}

// SaveState writes st to path, through a temporary file renamed over
// it, so that a crash meanwhile leaves the previous file whole.
func SaveState(path string, st State) error {
	if st.SavedAt.IsZero() {
		st.SavedAt = time.Now()
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("saving the state: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("saving the state: %w", err)
	}
	defer os.Remove(tmp.Name()) // after the rename, nothing is there
	w := bufio.NewWriter(tmp)
	err = writeState(w, st)
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

// writeState writes a stateFile of st to w one object at a time:
// encoding the whole file at once would hold all of it in memory, as
// large as the objects themselves, at every save.
func writeState(w *bufio.Writer, st State) error {
	enc := json.NewEncoder(w)
	savedAt, err := st.SavedAt.UTC().MarshalJSON()
	if err != nil {
		return fmt.Errorf("encoding the time of the state: %w", err)
	}
	fmt.Fprintf(w, `{"version":%d,"savedAt":%s,"services":[`, stateFileVersion, savedAt)
	for i, svc := range st.Services {
		if i > 0 {
			w.WriteByte(',')
		}
		if err := enc.Encode(svc); err != nil {
			return fmt.Errorf("encoding Service %s/%s: %w", svc.Namespace, svc.Name, err)
		}
	}
	w.WriteString(`],"endpointSlices":[`)
	for i, sl := range st.EndpointSlices {
		if i > 0 {
			w.WriteByte(',')
		}
		if err := enc.Encode(sl); err != nil {
			return fmt.Errorf("encoding EndpointSlice %s/%s: %w", sl.Namespace, sl.Name, err)
		}
	}
	_, err = w.WriteString("]}\n")
	return err
}
