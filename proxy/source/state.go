package source

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

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

// SaveState writes the tracker's objects to path, through a temporary
// file renamed over it, so that a crash meanwhile leaves the previous
// file whole.
func SaveState(path string, services []*v1.Service, slices []*discovery.EndpointSlice) error {
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
