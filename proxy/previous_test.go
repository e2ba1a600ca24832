package proxy

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"path/filepath"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/service"
	"github.com/uproxy/uproxy/proxy/source"
)

// TestListenersRebindPreviousPorts checks that a listener binds the port
// the previous instance's rules name (so those rules work before the first
// sync), and falls back to another port when that one is taken.
func TestListenersRebindPreviousPorts(t *testing.T) {
	be := nameBackend(t, "a")
	// A port nobody holds now, below the ephemeral range (which other
	// tests' connections take at any moment).
	free := func() int {
		for range 50 {
			port := 30000 + rand.IntN(2000)
			if l, err := net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port)); err == nil {
				l.Close()
				return port
			}
		}
		t.Fatal("no free port")
		return 0
	}
	wantA := free()
	busy, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	wantB := busy.Addr().(*net.TCPAddr).Port
	previous := map[string]uint16{"default/a:http": uint16(wantA), "default/b:http": uint16(wantB)}
	p, rules := startProxier(t, Config{PreviousPort: func(name service.PortName, network string) uint16 {
		if network != "tcp4" {
			return 0
		}
		return previous[name.String()]
	}})
	p.Tracker().Replace([]*v1.Service{svc("a", "10.96.0.10", "http:80"), svc("b", "10.96.0.11", "http:80")},
		append(slicesFor("a", "http", be), slicesFor("b", "http", be)...))
	if got := rules.port(t, "default/a:http"); got != wantA {
		t.Errorf("service a listens on %d, want its previous port %d", got, wantA)
	}
	if got := rules.port(t, "default/b:http"); got == wantB || got == 0 {
		t.Errorf("service b listens on %d, want another port than its previous, busy %d", got, wantB)
	}
	if name, err := get(t, wantA); err != nil || name != "a" {
		t.Errorf("service a on its previous port: %q, %v", name, err)
	}
}

// TestServePreviousState checks that a proxier restarted before its
// source's initial lists serves the Services its predecessor saved, on
// the ports the predecessor's rules name, without writing a rule, and
// that the initial lists then replace them: a Service they lack is
// dropped.
func TestServePreviousState(t *testing.T) {
	a, b := nameBackend(t, "a"), nameBackend(t, "b")
	state := filepath.Join(t.TempDir(), "state.json")
	services := []*v1.Service{svc("a", "10.96.0.10", "http:80"), svc("b", "10.96.0.11", "http:80")}
	slices := append(slicesFor("a", "http", a), slicesFor("b", "http", b)...)

	// The previous instance syncs once and is killed: its rules stay.
	rules := &recordingRules{}
	prev := NewProxier(Config{Rules: rules, StateFile: state, Sync: changes.RunnerConfig{MinInterval: 10 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { prev.Run(ctx); close(done) }() // ends with cancel
	prev.Tracker().Replace(services, slices)
	ports := map[string]uint16{
		"default/a:http": uint16(rules.port(t, "default/a:http")),
		"default/b:http": uint16(rules.port(t, "default/b:http")),
	}
	testwait.Until(t, 5*time.Second, "the state file to hold both services", func() bool {
		saved, _ := source.LoadState(state)
		return len(saved.Services) >= 2
	})
	cancel()
	<-done
	if err := prev.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	saved, err := source.LoadState(state)
	savedServices, savedSlices := saved.Services, saved.EndpointSlices
	if err != nil || len(savedServices) != 2 || len(savedSlices) != 2 {
		t.Fatalf("the saved state: %d services, %d slices, %v", len(savedServices), len(savedSlices), err)
	}

	// The new instance: no source has listed yet.
	p, newRules := startProxier(t, Config{StateFile: state, PreviousPort: func(name service.PortName, network string) uint16 {
		if network != "tcp4" {
			return 0
		}
		return ports[name.String()]
	}})
	p.ServePrevious(savedServices, savedSlices)
	for name, want := range map[string]string{"default/a:http": "a", "default/b:http": "b"} {
		testwait.UntilOK(t, 5*time.Second, fmt.Sprintf("%s served on its previous port %d before the initial lists", name, ports[name]), func() (bool, string) {
			got, err := get(t, int(ports[name]))
			return err == nil && got == want, fmt.Sprintf("%q, %v; want %q", got, err, want)
		})
	}
	newRules.mu.Lock()
	calls := newRules.calls
	newRules.mu.Unlock()
	if calls != 0 {
		t.Errorf("%d rule syncs before the initial lists, want none", calls)
	}

	// The initial lists arrive, as a watch delivers them: b only.
	p.Tracker().OnServiceUpsert(services[1])
	for _, s := range slicesFor("b", "http", b) {
		p.Tracker().OnSliceUpsert(s)
	}
	p.Tracker().SetServicesSynced()
	p.Tracker().SetSlicesSynced()
	if got := newRules.port(t, "default/b:http"); got != int(ports["default/b:http"]) {
		t.Errorf("b's rule names port %d, want its listener's %d", got, ports["default/b:http"])
	}
	if newRules.has("default/a:http") {
		t.Error("a, which the initial lists lack, still has a rule")
	}
	if _, err := get(t, int(ports["default/a:http"])); err == nil {
		t.Error("a, which the initial lists lack, is still served")
	}
	if got, err := get(t, int(ports["default/b:http"])); got != "b" {
		t.Errorf("b after the initial lists: %q, %v", got, err)
	}
}

// TestStateFileRefreshedWhileUnchanged checks that the state file's time
// follows the syncs even when nothing changes, so that a restart's age
// limit (source.LoadFreshState) tells how long ago a uproxy last synced,
// not how long ago a quiet cluster last changed; and that writes stay
// spaced, changed or not.
func TestStateFileRefreshedWhileUnchanged(t *testing.T) {
	start := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	clk := clocktesting.NewFakeClock(start)
	state := filepath.Join(t.TempDir(), "state.json")
	p := NewProxier(Config{Config: datapath.Config{Clock: clk}, StateFile: state})
	t.Cleanup(func() { p.Shutdown(context.Background()) })
	p.Tracker().Replace([]*v1.Service{svc("a", "10.96.0.10", "http:80")}, nil)
	// Each step: time passes, then a sync that changed something or not;
	// want is the file's time after it.
	for _, step := range []struct {
		after   time.Duration
		changed bool
		want    time.Duration // since start
	}{
		{0, false, 0}, // the first sync writes, changed or not
		{5 * time.Second, true, 0},
		{10 * time.Second, false, 15 * time.Second}, // the change left above
		{30 * time.Second, false, 15 * time.Second},
		{40 * time.Second, false, 85 * time.Second}, // a minute since the last write
		{10 * time.Second, false, 85 * time.Second},
		{StateRefreshInterval, false, 85*time.Second + 10*time.Second + StateRefreshInterval},
	} {
		clk.Step(step.after)
		p.saveStateAfterSync(step.changed)
		saved, err := source.LoadState(state)
		if err != nil {
			t.Fatal(err)
		}
		if got := saved.SavedAt.Sub(start); got != step.want || len(saved.Services) != 1 {
			t.Fatalf("at %v: the file holds %d services, saved at %v; want 1, at %v",
				clk.Now().Sub(start), len(saved.Services), got, step.want)
		}
	}
}
