// Package httplimit bounds what clients can cost uproxy's HTTP servers:
// the time-outs and connection bound of every server (ServerConfig,
// ConnLimiter), and the admission of costly debug requests, one at a
// time, under a token bucket, and answered 429 with Retry-After past
// either (OneAtATime).
//
// The debug server's /explain runs several iptables-save, ipset and ip
// processes per request; OneAtATime bounds what a client looping on it
// can cost the node. Every idle connection to a server holds a
// descriptor; ServerConfig bounds how many and for how long.
package httplimit

import (
	"net/http"

	"golang.org/x/time/rate"
)

// OneAtATime returns a handler that runs next for one request at a time,
// and only while bucket allows it. A request that arrives while another
// runs, or past the bucket, is answered 429 Too Many Requests with
// Retry-After: 1 and a body that names the requests as what (e.g.
// "explain"), and next does not see it. The handler is safe for
// concurrent use; bucket is shared by every request it serves.
func OneAtATime(what string, next http.Handler, bucket *rate.Limiter) http.Handler {
	one := make(chan struct{}, 1) // holds a token while a request runs
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case one <- struct{}{}:
			defer func() { <-one }()
		default:
			w.Header().Set("Retry-After", "1")
			http.Error(w, "another "+what+" is running; retry later", http.StatusTooManyRequests)
			return
		}
		if !bucket.Allow() {
			w.Header().Set("Retry-After", "1")
			http.Error(w, "too many "+what+" requests; retry later", http.StatusTooManyRequests)
			return
		}
		next.ServeHTTP(w, r)
	})
}
