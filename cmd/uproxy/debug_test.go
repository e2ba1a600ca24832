package main

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"
)

type fakeStatus struct{}

func (fakeStatus) Status() introspect.Status { return introspect.Status{Mode: "redirect"} }

// statusCodes asks h for each path and returns the status codes.
func statusCodes(h http.Handler, paths []string) map[string]int {
	got := map[string]int{}
	for _, path := range paths {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		got[path] = rec.Code
	}
	return got
}

// TestDebugEndpoints checks what each address serves: the metrics
// address only /metrics and /proxyMode, whatever --profiling says, and the debug
// address /status and /explain, and pprof only with --profiling.
func TestDebugEndpoints(t *testing.T) {
	paths := []string{"/metrics", "/proxyMode", "/status", "/explain?dst=10.96.0.10:80", "/debug/pprof/", "/debug/pprof/cmdline"}
	explain := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("{}")) })
	for _, tc := range []struct {
		name string
		h    http.Handler
		want map[string]int
	}{
		{"metrics", metricsHandler(prometheus.NewRegistry(), "redirect"), map[string]int{
			"/metrics": 200, "/proxyMode": 200, "/status": 404, "/explain?dst=10.96.0.10:80": 404, "/debug/pprof/": 404, "/debug/pprof/cmdline": 404}},
		{"debug", debugHandler(fakeStatus{}, explain, explainBucket(), false), map[string]int{
			"/metrics": 404, "/proxyMode": 404, "/status": 200, "/explain?dst=10.96.0.10:80": 200, "/debug/pprof/": 404, "/debug/pprof/cmdline": 404}},
		{"debug with --profiling", debugHandler(fakeStatus{}, explain, explainBucket(), true), map[string]int{
			"/metrics": 404, "/proxyMode": 404, "/status": 200, "/explain?dst=10.96.0.10:80": 200, "/debug/pprof/": 200, "/debug/pprof/cmdline": 200}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if diff := cmp.Diff(tc.want, statusCodes(tc.h, paths)); diff != "" {
				t.Errorf("status codes (-want +got):\n%s", diff)
			}
		})
	}
}

// TestExplainRateLimit checks that the debug server's /explain runs one
// request at a time, and that /status is not held up by it
// (internal/httplimit tests the limit itself).
func TestExplainRateLimit(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	slow := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		entered <- struct{}{}
		<-release
	})
	h := debugHandler(fakeStatus{}, slow, rate.NewLimiter(rate.Every(time.Hour), 2), false)
	get := func() *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/explain?dst=10.96.0.10:80", nil))
		return rec
	}
	first := make(chan int)
	go func() { first <- get().Code }() // ends once released
	<-entered
	if rec := get(); rec.Code != http.StatusTooManyRequests || rec.Header().Get("Retry-After") == "" {
		t.Errorf("a second explain while one runs: %d (Retry-After %q), want 429 with Retry-After", rec.Code, rec.Header().Get("Retry-After"))
	}
	if rec := statusCodes(h, []string{"/status"}); rec["/status"] != 200 {
		t.Errorf("/status while an explain runs: %d, want 200", rec["/status"])
	}
	release <- struct{}{}
	if code := <-first; code != 200 {
		t.Errorf("the first explain: %d", code)
	}
}

// TestProxyMode checks that /proxyMode answers as kube-proxy's does: the
// mode alone, as plain text.
func TestProxyMode(t *testing.T) {
	for _, mode := range []string{"redirect", "tproxy"} {
		rec := httptest.NewRecorder()
		metricsHandler(prometheus.NewRegistry(), mode).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/proxyMode", nil))
		got := struct {
			Code       int
			Type, Body string
		}{rec.Code, rec.Header().Get("Content-Type"), rec.Body.String()}
		want := struct {
			Code       int
			Type, Body string
		}{200, "text/plain; charset=utf-8", mode}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("/proxyMode in %s mode (-want +got):\n%s", mode, diff)
		}
	}
}
