package source

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

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
			savedAt := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
			if err := writeState(w, State{Services: tt.services, EndpointSlices: tt.slices, SavedAt: savedAt}); err != nil {
				t.Fatal(err)
			}
			w.Flush()
			var got, want stateFile
			if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
				t.Fatalf("the written file is not JSON: %v\n%s", err, buf.Bytes())
			}
			whole, err := json.Marshal(stateFile{Version: stateFileVersion, SavedAt: savedAt, Services: tt.services, EndpointSlices: tt.slices})
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
			if err := SaveState(path, State{Services: tt.services, EndpointSlices: tt.slices, SavedAt: savedAt}); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(path); err != nil {
				t.Fatal(err)
			}
			loaded, err := LoadState(path)
			if err != nil {
				t.Fatal(err)
			}
			if !loaded.SavedAt.Equal(savedAt) {
				t.Errorf("saved at %v, loaded as saved at %v", savedAt, loaded.SavedAt)
			}
			gotSvcs, gotSls := loaded.Services, loaded.EndpointSlices
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

// TestLoadFreshState checks that a restart refuses a state file saved
// longer ago than the limit, whose endpoints may name pod IPs given to
// other pods since, and one dated too far ahead (the clock was set back);
// that a file written before it held its time is dated by its
// modification time; and that a zero limit serves a state of any age.
func TestLoadFreshState(t *testing.T) {
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	svc, sls := trimmedCopy(filledService(1), filledSlices(1))
	// write saves a state at path: saved at savedAt, or, when without,
	// the way files were before they held the time, modified at mtime.
	write := func(t *testing.T, path string, savedAt, mtime time.Time, without bool) {
		t.Helper()
		if !without {
			if err := SaveState(path, State{Services: []*v1.Service{svc}, EndpointSlices: sls, SavedAt: savedAt}); err != nil {
				t.Fatal(err)
			}
			return
		}
		b, err := json.Marshal(map[string]any{"version": stateFileVersion, "services": []*v1.Service{svc}, "endpointSlices": sls})
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(path, mtime, mtime); err != nil {
			t.Fatal(err)
		}
	}
	type outcome struct {
		Services int
		SavedAt  time.Time
		Stale    *StaleStateError
	}
	for _, tc := range []struct {
		name    string
		savedAt time.Time // or, without savedAt, the file's modification time
		without bool      // a file of the format before savedAt
		maxAge  time.Duration
		missing bool
		want    outcome
	}{
		{name: "recent", savedAt: now.Add(-5 * time.Minute), maxAge: 10 * time.Minute,
			want: outcome{Services: 1, SavedAt: now.Add(-5 * time.Minute)}},
		{name: "older than the limit", savedAt: now.Add(-11 * time.Minute), maxAge: 10 * time.Minute,
			want: outcome{Stale: &StaleStateError{SavedAt: now.Add(-11 * time.Minute), Age: 11 * time.Minute, MaxAge: 10 * time.Minute}}},
		{name: "days old, no limit", savedAt: now.Add(-72 * time.Hour),
			want: outcome{Services: 1, SavedAt: now.Add(-72 * time.Hour)}},
		{name: "ahead of the clock, within the limit", savedAt: now.Add(time.Minute), maxAge: 10 * time.Minute,
			want: outcome{Services: 1, SavedAt: now.Add(time.Minute)}},
		{name: "ahead of the clock, past the limit", savedAt: now.Add(time.Hour), maxAge: 10 * time.Minute,
			want: outcome{Stale: &StaleStateError{SavedAt: now.Add(time.Hour), Age: -time.Hour, MaxAge: 10 * time.Minute}}},
		{name: "without savedAt, modified recently", savedAt: now.Add(-time.Minute), without: true, maxAge: 10 * time.Minute,
			want: outcome{Services: 1, SavedAt: now.Add(-time.Minute)}},
		{name: "without savedAt, modified long ago", savedAt: now.Add(-2 * time.Hour), without: true, maxAge: 10 * time.Minute,
			want: outcome{Stale: &StaleStateError{SavedAt: now.Add(-2 * time.Hour), Age: 2 * time.Hour, MaxAge: 10 * time.Minute}}},
		{name: "no file", missing: true, maxAge: 10 * time.Minute, want: outcome{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "state.json")
			if !tc.missing {
				write(t, path, tc.savedAt, tc.savedAt, tc.without)
			}
			if tc.want.Stale != nil {
				tc.want.Stale.Path = path
			}
			st, err := LoadFreshState(path, tc.maxAge, now)
			var got outcome
			if !errors.As(err, &got.Stale) && err != nil {
				t.Fatal(err)
			}
			got.Services, got.SavedAt = len(st.Services), st.SavedAt
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
			if err != nil {
				t.Logf("refused: %v", err)
			}
		})
	}
}
