package healthcheck

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	testingclock "k8s.io/utils/clock/testing"
)

// The expected bodies below are kube-proxy's, from k8s.io/kubernetes
// v1.37.2 pkg/proxy/healthcheck/proxy_health.go: healthzHandler and
// livezHandler json.Marshal a ProxyHealth{lastUpdated, currentTime,
// nodeEligible (healthz only), healthy, status (per family, omitted until
// the first Updated)}, with Content-Type: application/json and
// X-Content-Type-Options: nosniff; a healthy answer reports lastUpdated as
// the current time. Before the first Updated, where kube-proxy does not
// serve yet, uproxy answers 503 with each family's status unhealthy. They were also checked against that package running
// side by side (same call sequence, timestamps normalised).

var t0 = time.Date(2026, 5, 4, 3, 2, 0, 0, time.UTC)

// jsonHeaders are the headers of every /healthz and /livez answer.
var jsonHeaders = map[string]string{"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}

// serve calls h's handler for path in-process.
func serve(h http.Handler, path string) response {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return toResponse(rec.Code, rec.Header(), rec.Body.String())
}

func TestProxyHealthTransitions(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	h := NewProxyHealth(ProxyHealthConfig{
		HealthTimeout: 10 * time.Second,
		IPFamilies:    []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol},
		Clock:         clk,
	})
	handler := h.Handler()

	// Steps run in order on the same ProxyHealth and clock.
	steps := []struct {
		name        string
		do          func()
		wantHealthz response
		wantLivez   response
		wantHealthy bool
		wantLast    time.Time
	}{{
		name:        "fresh: unhealthy until the first sync",
		do:          func() {},
		wantHealthz: response{503, jsonHeaders, `{"lastUpdated":"0001-01-01T00:00:00Z","currentTime":"2026-05-04T03:02:00Z","nodeEligible":true,"healthy":false,"status":{"IPv4":{"lastUpdated":"0001-01-01T00:00:00Z","healthy":false},"IPv6":{"lastUpdated":"0001-01-01T00:00:00Z","healthy":false}}}`},
		wantLivez:   response{503, jsonHeaders, `{"lastUpdated":"0001-01-01T00:00:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":false,"status":{"IPv4":{"lastUpdated":"0001-01-01T00:00:00Z","healthy":false},"IPv6":{"lastUpdated":"0001-01-01T00:00:00Z","healthy":false}}}`},
		wantHealthy: false,
	}, {
		name:        "queued long ago but never updated: still unhealthy",
		do:          func() { h.QueuedUpdate(); clk.Step(30 * time.Second) },
		wantHealthz: response{503, jsonHeaders, `{"lastUpdated":"0001-01-01T00:00:00Z","currentTime":"2026-05-04T03:02:30Z","nodeEligible":true,"healthy":false,"status":{"IPv4":{"lastUpdated":"0001-01-01T00:00:00Z","healthy":false},"IPv6":{"lastUpdated":"0001-01-01T00:00:00Z","healthy":false}}}`},
		wantLivez:   response{503, jsonHeaders, `{"lastUpdated":"0001-01-01T00:00:00Z","currentTime":"2026-05-04T03:02:30Z","healthy":false,"status":{"IPv4":{"lastUpdated":"0001-01-01T00:00:00Z","healthy":false},"IPv6":{"lastUpdated":"0001-01-01T00:00:00Z","healthy":false}}}`},
		wantHealthy: false,
	}, {
		name:        "first update: status per family",
		do:          func() { h.Updated() },
		wantHealthz: response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:30Z","currentTime":"2026-05-04T03:02:30Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true},"IPv6":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true}}}`},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:30Z","currentTime":"2026-05-04T03:02:30Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true},"IPv6":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true}}}`},
		wantHealthy: true,
		wantLast:    t0.Add(30 * time.Second),
	}, {
		name:        "idle with nothing queued stays healthy; top lastUpdated is now",
		do:          func() { clk.Step(25 * time.Second) },
		wantHealthz: response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:55Z","currentTime":"2026-05-04T03:02:55Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true},"IPv6":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true}}}`},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:55Z","currentTime":"2026-05-04T03:02:55Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true},"IPv6":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true}}}`},
		wantHealthy: true,
		wantLast:    t0.Add(30 * time.Second),
	}, {
		name:        "queued 9s ago: not late yet",
		do:          func() { h.QueuedUpdate(); clk.Step(9 * time.Second) },
		wantHealthz: response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:03:04Z","currentTime":"2026-05-04T03:03:04Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true},"IPv6":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true}}}`},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:03:04Z","currentTime":"2026-05-04T03:03:04Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true},"IPv6":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":true}}}`},
		wantHealthy: true,
		wantLast:    t0.Add(30 * time.Second),
	}, {
		name:        "queued 10s (the timeout) ago: unhealthy, real lastUpdated",
		do:          func() { clk.Step(time.Second) },
		wantHealthz: response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:30Z","currentTime":"2026-05-04T03:03:05Z","nodeEligible":true,"healthy":false,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":false},"IPv6":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":false}}}`},
		wantLivez:   response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:30Z","currentTime":"2026-05-04T03:03:05Z","healthy":false,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":false},"IPv6":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":false}}}`},
		wantHealthy: false,
		wantLast:    t0.Add(30 * time.Second),
	}, {
		name:        "a newer queued update does not reset the oldest",
		do:          func() { h.QueuedUpdate(); clk.Step(time.Second) },
		wantHealthz: response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:30Z","currentTime":"2026-05-04T03:03:06Z","nodeEligible":true,"healthy":false,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":false},"IPv6":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":false}}}`},
		wantLivez:   response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:30Z","currentTime":"2026-05-04T03:03:06Z","healthy":false,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":false},"IPv6":{"lastUpdated":"2026-05-04T03:02:30Z","healthy":false}}}`},
		wantHealthy: false,
		wantLast:    t0.Add(30 * time.Second),
	}, {
		name:        "a sync completes: healthy again",
		do:          func() { h.Updated() },
		wantHealthz: response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:03:06Z","currentTime":"2026-05-04T03:03:06Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:03:06Z","healthy":true},"IPv6":{"lastUpdated":"2026-05-04T03:03:06Z","healthy":true}}}`},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:03:06Z","currentTime":"2026-05-04T03:03:06Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:03:06Z","healthy":true},"IPv6":{"lastUpdated":"2026-05-04T03:03:06Z","healthy":true}}}`},
		wantHealthy: true,
		wantLast:    t0.Add(66 * time.Second),
	}, {
		name:        "the next queued update counts from its own time",
		do:          func() { h.QueuedUpdate(); clk.Step(9 * time.Second) },
		wantHealthz: response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:03:15Z","currentTime":"2026-05-04T03:03:15Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:03:06Z","healthy":true},"IPv6":{"lastUpdated":"2026-05-04T03:03:06Z","healthy":true}}}`},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:03:15Z","currentTime":"2026-05-04T03:03:15Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:03:06Z","healthy":true},"IPv6":{"lastUpdated":"2026-05-04T03:03:06Z","healthy":true}}}`},
		wantHealthy: true,
		wantLast:    t0.Add(66 * time.Second),
	}}
	for _, s := range steps {
		s.do()
		if diff := cmp.Diff(s.wantHealthz, serve(handler, "/healthz")); diff != "" {
			t.Errorf("%s: /healthz (-want +got):\n%s", s.name, diff)
		}
		if diff := cmp.Diff(s.wantLivez, serve(handler, "/livez")); diff != "" {
			t.Errorf("%s: /livez (-want +got):\n%s", s.name, diff)
		}
		healthy, last := h.Health()
		if healthy != s.wantHealthy || !last.Equal(s.wantLast) {
			t.Errorf("%s: Health() = %v, %v; want %v, %v", s.name, healthy, last, s.wantHealthy, s.wantLast)
		}
	}
}

func TestProxyHealthFamilies(t *testing.T) {
	tests := []struct {
		name     string
		families []v1.IPFamily
		set      []v1.IPFamily // passed to SetIPFamilies when not nil
		want     string        // /livez after one Updated
	}{
		{"default is IPv4 only", nil, nil, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:00Z","healthy":true}}}`},
		{"IPv6 only", []v1.IPFamily{v1.IPv6Protocol}, nil, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,"status":{"IPv6":{"lastUpdated":"2026-05-04T03:02:00Z","healthy":true}}}`},
		{"set to the one family in use", []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}, []v1.IPFamily{v1.IPv4Protocol}, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:00Z","healthy":true}}}`},
		{"dual-stack, keys sorted", []v1.IPFamily{v1.IPv6Protocol, v1.IPv4Protocol}, nil, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:00Z","healthy":true},"IPv6":{"lastUpdated":"2026-05-04T03:02:00Z","healthy":true}}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := NewProxyHealth(ProxyHealthConfig{IPFamilies: tt.families, Clock: testingclock.NewFakeClock(t0)})
			if tt.set != nil {
				h.SetIPFamilies(tt.set...)
			}
			h.Updated()
			if diff := cmp.Diff(response{200, jsonHeaders, tt.want}, serve(h.Handler(), "/livez")); diff != "" {
				t.Errorf("/livez (-want +got):\n%s", diff)
			}
		})
	}
}

func TestProxyHealthDefaultTimeout(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	h := NewProxyHealth(ProxyHealthConfig{Clock: clk}) // HealthTimeout zero: 60s
	h.Updated()
	h.QueuedUpdate()
	clk.Step(DefaultHealthTimeout - time.Nanosecond)
	if ok, _ := h.Health(); !ok {
		t.Errorf("unhealthy %v after the queued update, want healthy until %v", DefaultHealthTimeout-time.Nanosecond, DefaultHealthTimeout)
	}
	clk.Step(time.Nanosecond)
	if ok, _ := h.Health(); ok {
		t.Errorf("healthy %v after the queued update, want unhealthy", DefaultHealthTimeout)
	}
}

func TestProxyHealthNodeEligible(t *testing.T) {
	deleting := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", DeletionTimestamp: &metav1.Time{Time: t0}}}
	toBeDeleted := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n"}, Spec: v1.NodeSpec{Taints: []v1.Taint{
		{Key: "other", Effect: v1.TaintEffectNoSchedule},
		{Key: ToBeDeletedTaint, Value: "1700000000", Effect: v1.TaintEffectNoSchedule},
	}}}
	otherTaint := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n"}, Spec: v1.NodeSpec{Taints: []v1.Taint{{Key: "other", Effect: v1.TaintEffectNoSchedule}}}}
	plain := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n"}}

	const (
		okStatus   = `"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:00Z","healthy":true}}}`
		lateStatus = `"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:00Z","healthy":false}}}`
	)
	tests := []struct {
		name        string
		nodes       []*v1.Node // passed to SyncNode in order; none means never synced
		waitForNode bool
		late        bool // an update queued HealthTimeout ago
		wantHealthz response
		wantLivez   response
	}{{
		name:        "never synced, no Node source: eligible",
		wantHealthz: response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","nodeEligible":true,"healthy":true,` + okStatus},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,` + okStatus},
	}, {
		name:        "never synced, waiting for the Node: /healthz 503, /livez 200",
		waitForNode: true,
		wantHealthz: response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","nodeEligible":false,"healthy":true,` + okStatus},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,` + okStatus},
	}, {
		name:        "waiting for the Node, which arrives",
		waitForNode: true,
		nodes:       []*v1.Node{plain},
		wantHealthz: response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","nodeEligible":true,"healthy":true,` + okStatus},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,` + okStatus},
	}, {
		name:        "plain node",
		nodes:       []*v1.Node{plain},
		wantHealthz: response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","nodeEligible":true,"healthy":true,` + okStatus},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,` + okStatus},
	}, {
		name:        "other taints do not matter",
		nodes:       []*v1.Node{otherTaint},
		wantHealthz: response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","nodeEligible":true,"healthy":true,` + okStatus},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,` + okStatus},
	}, {
		name:        "ToBeDeletedByClusterAutoscaler: /healthz 503, /livez 200",
		nodes:       []*v1.Node{toBeDeleted},
		wantHealthz: response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","nodeEligible":false,"healthy":true,` + okStatus},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,` + okStatus},
	}, {
		name:        "being deleted: /healthz 503, /livez 200",
		nodes:       []*v1.Node{deleting},
		wantHealthz: response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","nodeEligible":false,"healthy":true,` + okStatus},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,` + okStatus},
	}, {
		name:        "gone (nil): /healthz 503, /livez 200",
		nodes:       []*v1.Node{plain, nil},
		wantHealthz: response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","nodeEligible":false,"healthy":true,` + okStatus},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,` + okStatus},
	}, {
		name:        "taint removed again",
		nodes:       []*v1.Node{toBeDeleted, plain},
		wantHealthz: response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","nodeEligible":true,"healthy":true,` + okStatus},
		wantLivez:   response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,` + okStatus},
	}, {
		name:        "eligible but late",
		nodes:       []*v1.Node{plain},
		late:        true,
		wantHealthz: response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:03:00Z","nodeEligible":true,"healthy":false,` + lateStatus},
		wantLivez:   response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:03:00Z","healthy":false,` + lateStatus},
	}, {
		name:        "ineligible and late",
		nodes:       []*v1.Node{deleting},
		late:        true,
		wantHealthz: response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:03:00Z","nodeEligible":false,"healthy":false,` + lateStatus},
		wantLivez:   response{503, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:03:00Z","healthy":false,` + lateStatus},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := testingclock.NewFakeClock(t0)
			h := NewProxyHealth(ProxyHealthConfig{Clock: clk, WaitForNode: tt.waitForNode})
			h.Updated()
			for _, n := range tt.nodes {
				h.SyncNode(n)
			}
			if tt.late {
				h.QueuedUpdate()
				clk.Step(DefaultHealthTimeout)
			}
			if diff := cmp.Diff(tt.wantHealthz, serve(h.Handler(), "/healthz")); diff != "" {
				t.Errorf("/healthz (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.wantLivez, serve(h.Handler(), "/livez")); diff != "" {
				t.Errorf("/livez (-want +got):\n%s", diff)
			}
			// Health, like /livez, ignores the node.
			if ok, _ := h.Health(); ok == tt.late {
				t.Errorf("Health() = %v, want %v", ok, !tt.late)
			}
		})
	}
}

func TestProxyHealthRun(t *testing.T) {
	checkNoLeaks(t)
	type listenCall struct{ Network, Addr string }
	var calls []listenCall
	bound := make(chan string, 1)
	h := NewProxyHealth(ProxyHealthConfig{
		Addr:  "0.0.0.0:10256",
		Clock: testingclock.NewFakeClock(t0),
		Listen: func(network, addr string) (net.Listener, error) {
			calls = append(calls, listenCall{network, addr})
			ln, err := net.Listen("tcp4", "127.0.0.1:0")
			if err == nil {
				bound <- ln.Addr().String()
			}
			return ln, err
		},
	})
	h.Updated()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.Run(ctx) }()
	var addr string
	select {
	case addr = <-bound:
	case err := <-done:
		t.Fatalf("Run returned early: %v", err)
	}

	for _, tc := range []struct {
		path string
		want response
	}{
		{"/healthz", response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:00Z","healthy":true}}}`}},
		{"/livez", response{200, jsonHeaders, `{"lastUpdated":"2026-05-04T03:02:00Z","currentTime":"2026-05-04T03:02:00Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2026-05-04T03:02:00Z","healthy":true}}}`}},
		{"/metrics", response{404, map[string]string{"Content-Type": "text/plain; charset=utf-8", "X-Content-Type-Options": "nosniff"}, "404 page not found\n"}},
	} {
		if diff := cmp.Diff(tc.want, mustGet(t, addr, tc.path)); diff != "" {
			t.Errorf("GET %s (-want +got):\n%s", tc.path, diff)
		}
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run after cancel = %v, want nil", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	if !refused(addr) {
		t.Errorf("%s still accepts connections after Run returned", addr)
	}
	if diff := cmp.Diff([]listenCall{{"tcp", "0.0.0.0:10256"}}, calls); diff != "" {
		t.Errorf("Listen calls (-want +got):\n%s", diff)
	}
}

func TestProxyHealthRunListenError(t *testing.T) {
	checkNoLeaks(t)
	h := NewProxyHealth(ProxyHealthConfig{
		Addr: "0.0.0.0:10256",
		Listen: func(network, addr string) (net.Listener, error) {
			return nil, &net.OpError{Op: "listen", Net: network, Err: syscall.EADDRINUSE}
		},
	})
	err := h.Run(context.Background())
	if !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("Run = %v, want EADDRINUSE", err)
	}
	errContains(t, err, "0.0.0.0:10256")
}

func TestProxyHealthRunDisabled(t *testing.T) {
	h := NewProxyHealth(ProxyHealthConfig{Listen: func(string, string) (net.Listener, error) {
		t.Error("Listen called with an empty Addr")
		return nil, errors.New("unexpected")
	}})
	if err := h.Run(context.Background()); err != nil {
		t.Errorf("Run with empty Addr = %v, want nil", err)
	}
	// Tracking still works.
	h.Updated()
	if ok, last := h.Health(); !ok || last.IsZero() {
		t.Errorf("Health() = %v, %v; want healthy with a time", ok, last)
	}
}

// TestProxyHealthCounters checks kube-proxy's proxy_healthz_total and
// proxy_livez_total: every answer counted under its status code.
func TestProxyHealthCounters(t *testing.T) {
	reg := prometheus.NewRegistry()
	h := NewProxyHealth(ProxyHealthConfig{Clock: testingclock.NewFakeClock(t0), WaitForNode: true, Registerer: reg})
	handler := h.Handler()
	serve(handler, "/healthz") // 503: no sync yet
	serve(handler, "/livez")   // 503
	h.Updated()
	serve(handler, "/healthz") // 503: no Node yet
	serve(handler, "/livez")   // 200
	h.SyncNode(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n"}})
	serve(handler, "/healthz") // 200
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			got[mf.GetName()+"/"+m.GetLabel()[0].GetName()+"="+m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
		}
	}
	want := map[string]float64{
		"kubeproxy_proxy_healthz_total/code=503": 2,
		"kubeproxy_proxy_healthz_total/code=200": 1,
		"kubeproxy_proxy_livez_total/code=503":   1,
		"kubeproxy_proxy_livez_total/code=200":   1,
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("counters (-want +got):\n%s", diff)
	}
}

// TestProxyHealthServingPrevious checks that a proxy serving its
// predecessor's saved state answers /livez 200 until its first sync, so
// that a liveness probe does not restart it through an API server
// outage, while /healthz answers 503 as before; after the first sync,
// /livez follows the usual rule again.
func TestProxyHealthServingPrevious(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	h := NewProxyHealth(ProxyHealthConfig{HealthTimeout: 10 * time.Second, IPFamilies: []v1.IPFamily{v1.IPv4Protocol}, Clock: clk})
	handler := h.Handler()
	codes := func() [2]int { return [2]int{serve(handler, "/healthz").Code, serve(handler, "/livez").Code} }
	if got := codes(); got != [2]int{503, 503} {
		t.Errorf("fresh: /healthz, /livez = %v, want 503, 503", got)
	}
	h.ServingPrevious()
	h.QueuedUpdate()
	clk.Step(5 * time.Minute)
	if got := codes(); got != [2]int{503, 200} {
		t.Errorf("serving the saved state, minutes into an outage: /healthz, /livez = %v, want 503, 200", got)
	}
	h.Updated()
	h.QueuedUpdate()
	clk.Step(time.Minute)
	if got := codes(); got != [2]int{503, 503} {
		t.Errorf("synced, then a change not synced for a minute: /healthz, /livez = %v, want 503, 503", got)
	}
}
