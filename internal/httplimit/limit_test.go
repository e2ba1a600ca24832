package httplimit

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"golang.org/x/time/rate"
)

// TestOneAtATime checks that the handler runs one request at a time and
// a bounded number in all, answering 429 with Retry-After past either.
func TestOneAtATime(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	slow := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		select {
		case entered <- struct{}{}:
			<-release
		case <-time.After(time.Second):
			// A request that the test expects to be refused, run anyway:
			// answer, so that the test fails instead of hanging.
		}
	})
	h := OneAtATime("explain", slow, rate.NewLimiter(rate.Every(time.Hour), 2))
	get := func() *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/explain?dst=10.96.0.10:80", nil))
		return rec
	}
	first := make(chan int)
	go func() { first <- get().Code }() // ends once released
	<-entered
	if rec := get(); rec.Code != http.StatusTooManyRequests || rec.Header().Get("Retry-After") == "" || rec.Body.String() != "another explain is running; retry later\n" {
		t.Errorf("a second request while one runs: %d %q (Retry-After %q), want 429 with Retry-After", rec.Code, rec.Body, rec.Header().Get("Retry-After"))
	}
	release <- struct{}{}
	if code := <-first; code != 200 {
		t.Errorf("the first request: %d", code)
	}
	go func() { <-entered; release <- struct{}{} }()
	if code := get().Code; code != 200 {
		t.Errorf("the second request, within the bucket: %d", code)
	}
	if rec := get(); rec.Code != http.StatusTooManyRequests || rec.Header().Get("Retry-After") == "" || rec.Body.String() != "too many explain requests; retry later\n" {
		t.Errorf("the third request, past the bucket: %d %q (Retry-After %q), want 429 with Retry-After", rec.Code, rec.Body, rec.Header().Get("Retry-After"))
	}
}
