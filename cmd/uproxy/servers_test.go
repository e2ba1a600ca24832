package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/uproxy/uproxy/internal/httplimit"
)

// startServeHTTP runs serveHTTP for h with limits on loopback until the
// test ends, and returns the address.
func startServeHTTP(t *testing.T, h http.Handler, limits httplimit.ServerConfig) string {
	t.Helper()
	bound := make(chan string, 1)
	listen := func(string, string) (net.Listener, error) {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err == nil {
			bound <- ln.Addr().String()
		}
		return ln, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serveHTTP(ctx, "127.0.0.1:0", h, listen, limits) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serveHTTP: %v", err)
		}
	})
	select {
	case addr := <-bound:
		return addr
	case err := <-done:
		t.Fatalf("serveHTTP returned early: %v", err)
		return ""
	}
}

// TestServeHTTPClosesIdleConnections checks that the metrics and debug
// servers close a kept-alive connection once it has been idle for the
// idle time-out, and one that never sends a request after the header
// time-out. Before, a kept-alive connection was held for ever.
func TestServeHTTPClosesIdleConnections(t *testing.T) {
	const d = 100 * time.Millisecond
	addr := startServeHTTP(t, metricsHandler(prometheus.NewRegistry(), "redirect"), httplimit.ServerConfig{ReadHeaderTimeout: d, IdleTimeout: d})
	for _, path := range []string{"", "/proxyMode"} {
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		r := bufio.NewReader(c)
		if path != "" {
			c.SetDeadline(time.Now().Add(5 * time.Second))
			fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", path)
			resp, err := http.ReadResponse(r, nil)
			if err != nil {
				t.Fatalf("GET %s: %v", path, err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := r.ReadByte(); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("a connection idle after %q is still open: %v", path, err)
		}
	}
}

// TestDebugProfileOutlastsWriteTimeout checks that a pprof handler that
// samples for longer than the debug server's WriteTimeout answers in
// full: net/http/pprof extends its write deadline by its ?seconds=.
func TestDebugProfileOutlastsWriteTimeout(t *testing.T) {
	explain := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {})
	addr := startServeHTTP(t, debugHandler(fakeStatus{}, explain, explainBucket(), true), httplimit.ServerConfig{WriteTimeout: 50 * time.Millisecond})
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get("http://" + addr + "/debug/pprof/trace?seconds=0.3")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK || len(body) == 0 {
		t.Errorf("trace longer than the write time-out: %d, %d bytes, %v; want 200 with the whole trace", resp.StatusCode, len(body), err)
	}
}
