package source

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// TestWriteStateMatchesWholeEncoding checks that the state file written
// one object at a time decodes as the whole stateFile encoded at once,
// and that LoadState reads it back, with or without objects.
func TestWriteStateMatchesWholeEncoding(t *testing.T) {
	svc, sls := trimmedCopy(filledService(1), filledSlices(1))
	for name, tt := range map[string]struct {
		services []*v1.Service
		slices   []*discovery.EndpointSlice
	}{
		"none":     {},
		"services": {services: []*v1.Service{svc, svc}},
		"both":     {services: []*v1.Service{svc}, slices: sls},
	} {
		t.Run(name, func(t *testing.T) {
			var buf bytes.Buffer
			w := bufio.NewWriter(&buf)
			if err := writeState(w, tt.services, tt.slices); err != nil {
				t.Fatal(err)
			}
			w.Flush()
			var got, want stateFile
			if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
				t.Fatalf("the written file is not JSON: %v\n%s", err, buf.Bytes())
			}
			whole, err := json.Marshal(stateFile{Version: stateFileVersion, Services: tt.services, EndpointSlices: tt.slices})
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(whole, &want); err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(want, got, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("(-whole +one at a time):\n%s", diff)
			}
			path := filepath.Join(t.TempDir(), "state.json")
			if err := SaveState(path, tt.services, tt.slices); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(path); err != nil {
				t.Fatal(err)
			}
			gotSvcs, gotSls, err := LoadState(path)
			if err != nil {
				t.Fatal(err)
			}
			if len(gotSvcs) != len(tt.services) || len(gotSls) != len(tt.slices) {
				t.Fatalf("LoadState returned %d Services and %d EndpointSlices, want %d and %d", len(gotSvcs), len(gotSls), len(tt.services), len(tt.slices))
			}
			for i := range gotSvcs {
				if diff := cmp.Diff(tt.services[i], gotSvcs[i]); diff != "" {
					t.Errorf("Service %d (-saved +loaded):\n%s", i, diff)
				}
			}
			for i := range gotSls {
				if diff := cmp.Diff(tt.slices[i], gotSls[i]); diff != "" {
					t.Errorf("EndpointSlice %d (-saved +loaded):\n%s", i, diff)
				}
			}
		})
	}
}
