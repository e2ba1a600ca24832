package main

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/uproxy/uproxy/proxy/source"
)

// TestLoadPreviousState checks what a restart serves of its predecessor's
// state file: a state older than --state-file-max-age is refused, and the
// log names the file, its age and the limit, since its endpoints may be
// other tenants' pods by now; a recent one, or any with no limit, is
// served.
func TestLoadPreviousState(t *testing.T) {
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	type logged struct {
		Message string
		Fields  map[string]any
	}
	type outcome struct {
		Services int
		Logs     []logged
	}
	for _, tc := range []struct {
		name    string
		savedAt time.Time // zero: no file
		maxAge  time.Duration
		want    func(path string) outcome
	}{
		{"recent", now.Add(-9 * time.Minute), 10 * time.Minute, func(string) outcome { return outcome{Services: 1} }},
		{"older than the limit", now.Add(-3 * time.Hour), 10 * time.Minute, func(path string) outcome {
			return outcome{Logs: []logged{{
				Message: "refusing the previous instance's state file, older than --state-file-max-age (its endpoints may be other pods' by now): serving nothing until the initial lists arrive",
				Fields:  map[string]any{"path": path, "age": 3 * time.Hour, "maxAge": 10 * time.Minute, "savedAt": now.Add(-3 * time.Hour)},
			}}}
		}},
		{"days old, no limit", now.Add(-72 * time.Hour), 0, func(string) outcome { return outcome{Services: 1} }},
		{"no file", time.Time{}, 10 * time.Minute, func(string) outcome { return outcome{} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "state.json")
			if !tc.savedAt.IsZero() {
				svc := &v1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web"},
					Spec: v1.ServiceSpec{ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10"}}}
				if err := source.SaveState(path, source.State{Services: []*v1.Service{svc}, SavedAt: tc.savedAt}); err != nil {
					t.Fatal(err)
				}
			}
			core, logs := observer.New(zapcore.InfoLevel)
			st := loadPreviousState(path, tc.maxAge, clocktesting.NewFakePassiveClock(now), zap.New(core))
			got := outcome{Services: len(st.Services)}
			for _, e := range logs.All() {
				got.Logs = append(got.Logs, logged{Message: e.Message, Fields: e.ContextMap()})
			}
			if diff := cmp.Diff(tc.want(path), got, cmp.Comparer(func(a, b time.Time) bool { return a.Equal(b) })); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}
