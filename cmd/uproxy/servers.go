package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"strconv"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/time/rate"

	"github.com/uproxy/uproxy/internal/httplimit"
	"github.com/uproxy/uproxy/proxy/healthcheck"
)

// serverAddrs returns the addresses of uproxy's own servers that no
// endpoint may be (proxy.Config.ServerAddrs): those of addrs that are
// set, an empty or unparsable host standing for every address.
func serverAddrs(addrs ...string) []netip.AddrPort {
	var out []netip.AddrPort
	for _, a := range addrs {
		host, port, err := net.SplitHostPort(a)
		if err != nil {
			continue // empty: disabled; validate rejects the rest
		}
		n, err := strconv.ParseUint(port, 10, 16)
		if err != nil {
			continue
		}
		ip, err := netip.ParseAddr(host)
		if err != nil {
			ip = netip.IPv4Unspecified() // a name or empty: every address
		}
		out = append(out, netip.AddrPortFrom(ip.Unmap(), uint16(n)))
	}
	return out
}

// defaultDebugAddress is where the debug server listens by default:
// loopback only, and a port no Kubernetes component takes (kubelet's are
// 10248, 10250 and 10255, kube-proxy's 10249 and 10256, the controller
// managers' 10257 and 10258, the scheduler's 10259).
const defaultDebugAddress = "127.0.0.1:10262"

// metricsHandler serves the Prometheus metrics of reg, and /proxyMode as
// kube-proxy's metrics server does (the mode, as plain text), which
// Kubernetes' e2e suite and tools that read a node's proxy mode ask for.
// Nothing else: the metrics address is often opened to a scraper on the
// node's network.
func metricsHandler(reg *prometheus.Registry, mode string) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/proxyMode", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		io.WriteString(w, mode)
	})
	return mux
}

// debugHandler serves p's /status and explain at /explain (for `uproxy
// status` and `uproxy explain`), the latter one at a time and within
// bucket, and pprof when profiling is set.
func debugHandler(p interface{ Status() introspect.Status }, explain http.Handler, bucket *rate.Limiter, profiling bool) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(p.Status())
	})
	mux.Handle("GET /explain", httplimit.OneAtATime("explain", explain, bucket))
	if profiling {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	return mux
}

// explainBucket bounds the /explain requests, each of which runs up to a
// dozen iptables-save, ipset and ip processes: bursts of 5, then one a
// second (and httplimit.OneAtATime runs one at a time).
func explainBucket() *rate.Limiter { return rate.NewLimiter(rate.Every(time.Second), 5) }

// serveHTTP serves h on addr until ctx is done, within limits: idle and
// slow clients are closed, and past its bound of connections the longest
// idle one. An empty addr disables it. The pprof handlers that sample for
// ?seconds= extend their own write deadline past limits' WriteTimeout.
func serveHTTP(ctx context.Context, addr string, h http.Handler, listen healthcheck.ListenFunc, limits httplimit.ServerConfig) error {
	if addr == "" {
		return nil
	}
	ln, err := listen("tcp", addr)
	if err != nil {
		return err
	}
	lim := limits.Limiter()
	srv := limits.Server(h, lim, nil)
	go func() { <-ctx.Done(); srv.Close() }() // ends when ctx is done
	if err := srv.Serve(lim.Listener(ln)); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
