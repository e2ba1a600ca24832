package healthcheck

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	"k8s.io/utils/clock"
)

const (
	// DefaultHealthTimeout is the health timeout used when
	// ProxyHealthConfig.HealthTimeout is zero: kube-proxy passes
	// 2 × --iptables-sync-period, whose default is 30s.
	DefaultHealthTimeout = 60 * time.Second

	// ToBeDeletedTaint is the taint the Cluster Autoscaler puts on a node
	// it is about to delete. A node with it is not eligible for load
	// balancer traffic: /healthz answers 503.
	ToBeDeletedTaint = "ToBeDeletedByClusterAutoscaler"

	// readHeaderTimeout bounds how long a health-check client may take to
	// send its request headers, so that idle or slow clients cannot pin
	// connections (and their goroutines) forever.
	readHeaderTimeout = 10 * time.Second
)

// ListenFunc opens a listening socket, with net.Listen's contract. It is
// called from SyncServices and Run; the caller owns the returned listener.
type ListenFunc func(network, addr string) (net.Listener, error)

// ProxyHealthConfig configures a ProxyHealth.
type ProxyHealthConfig struct {
	// Addr is the address /healthz and /livez are served on, like
	// kube-proxy's --healthz-bind-address (its default is "0.0.0.0:10256").
	// Empty disables serving: Run returns at once, and the tracking methods
	// and Handler still work.
	Addr string
	// HealthTimeout is how long a queued update may stay unapplied before
	// the proxy counts as unhealthy. kube-proxy uses 2 × the sync period;
	// callers should do the same. Zero means DefaultHealthTimeout.
	HealthTimeout time.Duration
	// IPFamilies are the families the proxy programs. Each is reported
	// under "status" in the JSON bodies, as kube-proxy reports each of its
	// per-family proxiers; uproxy syncs all families at once, so they share
	// one state. Empty means IPv4 only (a single-stack kube-proxy).
	IPFamilies []v1.IPFamily
	// Clock is the time source; nil means the real clock.
	Clock clock.PassiveClock
	// Logger receives serving errors; nil discards them.
	Logger *zap.Logger
	// Listen opens the listening socket; nil means net.Listen.
	Listen ListenFunc
}

// ProxyHealth tracks whether the proxy's rules are up to date, and serves
// /healthz and /livez on one address like kube-proxy's healthz server.
//
// The proxy is healthy unless an update was queued (QueuedUpdate) more than
// HealthTimeout ago and no sync has completed (Updated) since: the same
// "oldest pending queued update" rule as kube-proxy. /livez reports exactly
// that; /healthz additionally answers 503 while the node is not eligible
// for load balancer traffic (see SyncNode).
//
// All methods are safe for concurrent use.
type ProxyHealth struct {
	addr     string
	timeout  time.Duration
	families []v1.IPFamily
	clock    clock.PassiveClock
	log      *zap.Logger
	listen   ListenFunc

	mu sync.RWMutex
	// lastUpdated holds, per family, when the last sync completed; a
	// family is absent until the first Updated.
	lastUpdated map[v1.IPFamily]time.Time
	// oldestPending holds, per family, when the oldest update not yet
	// applied was queued; absent when nothing is pending.
	oldestPending map[v1.IPFamily]time.Time
	nodeEligible  bool
}

// NewProxyHealth returns a ProxyHealth that is healthy and whose node is
// eligible. It does not serve until Run is called.
func NewProxyHealth(cfg ProxyHealthConfig) *ProxyHealth {
	h := &ProxyHealth{
		addr:          cfg.Addr,
		timeout:       cfg.HealthTimeout,
		families:      cfg.IPFamilies,
		clock:         cfg.Clock,
		log:           cfg.Logger,
		listen:        cfg.Listen,
		lastUpdated:   make(map[v1.IPFamily]time.Time),
		oldestPending: make(map[v1.IPFamily]time.Time),
		// Like kube-proxy before its first Node event (and uproxy may
		// have no Node source at all), the node counts as eligible.
		nodeEligible: true,
	}
	if h.timeout <= 0 {
		h.timeout = DefaultHealthTimeout
	}
	if len(h.families) == 0 {
		h.families = []v1.IPFamily{v1.IPv4Protocol}
	}
	if h.clock == nil {
		h.clock = clock.RealClock{}
	}
	if h.log == nil {
		h.log = zap.NewNop()
	}
	if h.listen == nil {
		h.listen = net.Listen
	}
	return h
}

// QueuedUpdate records that a change was received and a sync is pending.
// Only the oldest pending change counts: if no sync completes within
// HealthTimeout of it, the proxy becomes unhealthy.
func (h *ProxyHealth) QueuedUpdate() {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.clock.Now()
	for _, f := range h.families {
		if _, pending := h.oldestPending[f]; !pending {
			h.oldestPending[f] = now
		}
	}
}

// Updated records that a sync completed successfully: nothing is pending
// any more. Like kube-proxy's SyncLoop, the caller should also call it
// once when its sync loop starts; until the first Updated the proxy is
// healthy whatever is queued, and "status" is absent from the bodies.
func (h *ProxyHealth) Updated() {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.clock.Now()
	for _, f := range h.families {
		delete(h.oldestPending, f)
		h.lastUpdated[f] = now
	}
}

// SyncNode records the state of this node. The node is eligible for load
// balancer traffic unless it is being deleted (has a deletion timestamp)
// or is tainted ToBeDeletedByClusterAutoscaler. A nil node means the Node
// object is gone (or not yet seen): not eligible, as in kube-proxy.
// Eligibility only affects /healthz, never /livez, Health, or the
// per-service health checks.
func (h *ProxyHealth) SyncNode(node *v1.Node) {
	eligible := nodeEligible(node)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.nodeEligible = eligible
}

func nodeEligible(node *v1.Node) bool {
	if node == nil || !node.DeletionTimestamp.IsZero() {
		return false
	}
	for _, t := range node.Spec.Taints {
		if t.Key == ToBeDeletedTaint {
			return false
		}
	}
	return true
}

// NodeEligible reports whether the node is eligible for load balancer
// traffic, as last recorded by SyncNode.
func (h *ProxyHealth) NodeEligible() bool {
	h.mu.RLock()
	defer h.mu.RUnlock()
	return h.nodeEligible
}

// Health reports whether the proxy is healthy (ignoring node eligibility,
// like /livez) and when a sync last completed (zero before the first
// Updated).
func (h *ProxyHealth) Health() (healthy bool, lastUpdated time.Time) {
	r := h.health()
	return r.Healthy, r.LastUpdated
}

// healthy is Health without the time, for ServiceHealth. A nil
// ProxyHealth is healthy.
func (h *ProxyHealth) healthy() bool {
	if h == nil {
		return true
	}
	ok, _ := h.Health()
	return ok
}

// healthResponse is the JSON body of /healthz and /livez: kube-proxy's
// ProxyHealth struct (v1.37.2 pkg/proxy/healthcheck/proxy_health.go), with
// its field order and tags, marshalled by encoding/json.
type healthResponse struct {
	LastUpdated  time.Time                      `json:"lastUpdated"`
	CurrentTime  time.Time                      `json:"currentTime"`
	NodeEligible *bool                          `json:"nodeEligible,omitempty"`
	Healthy      bool                           `json:"healthy"`
	Status       map[v1.IPFamily]familyResponse `json:"status,omitempty"`
}

// familyResponse is kube-proxy's ProxierHealth: one IP family's state.
type familyResponse struct {
	LastUpdated time.Time `json:"lastUpdated"`
	Healthy     bool      `json:"healthy"`
}

// health computes the state the way kube-proxy's ProxyHealthServer.Health
// does: a family counts only once it has been Updated, and is unhealthy
// when its oldest pending update is at least HealthTimeout old.
func (h *ProxyHealth) health() healthResponse {
	h.mu.RLock()
	defer h.mu.RUnlock()
	now := h.clock.Now()
	r := healthResponse{
		CurrentTime: now,
		Healthy:     true,
		Status:      make(map[v1.IPFamily]familyResponse, len(h.lastUpdated)),
	}
	for f, last := range h.lastUpdated {
		if last.After(r.LastUpdated) {
			r.LastUpdated = last
		}
		ok := true
		if queued, pending := h.oldestPending[f]; pending && now.Sub(queued) >= h.timeout {
			ok = false
			r.Healthy = false
		}
		r.Status[f] = familyResponse{LastUpdated: last, Healthy: ok}
	}
	return r
}

// Handler returns the handler of /healthz and /livez; other paths get 404.
// Run serves it; tests and other servers may mount it too.
func (h *ProxyHealth) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", h.serveHealthz)
	mux.HandleFunc("/livez", h.serveLivez)
	return mux
}

// serveHealthz answers 200 when the proxy is healthy and the node is
// eligible, 503 otherwise; the body always carries "nodeEligible".
func (h *ProxyHealth) serveHealthz(w http.ResponseWriter, _ *http.Request) {
	r := h.health()
	eligible := h.NodeEligible()
	r.NodeEligible = &eligible
	h.write(w, r, r.Healthy && eligible)
}

// serveLivez answers 200 when the proxy is healthy, whatever the node.
func (h *ProxyHealth) serveLivez(w http.ResponseWriter, _ *http.Request) {
	r := h.health()
	h.write(w, r, r.Healthy)
}

func (h *ProxyHealth) write(w http.ResponseWriter, r healthResponse, ok bool) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if ok {
		// kube-proxy compatibility: older releases reported the last run
		// of the sync loop, so a healthy proxy reports "now".
		r.LastUpdated = h.clock.Now()
		w.WriteHeader(http.StatusOK)
	} else {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	body, err := json.Marshal(r)
	if err != nil { // cannot happen: only times, bools and strings
		h.log.Error("encoding health response", zap.Error(err))
		return
	}
	_, _ = w.Write(body)
}

// Run serves Handler on Addr until ctx is done, then closes the server and
// returns nil. It returns an error if Addr cannot be bound or serving
// fails; the caller may call Run again later (kube-proxy retries every 5s).
// With an empty Addr it returns nil at once.
//
// Run owns one goroutine, the server's accept loop, and returns only after
// it has exited; http.Server's per-connection goroutines end when Run
// closes their connections.
func (h *ProxyHealth) Run(ctx context.Context) error {
	if h.addr == "" {
		return nil
	}
	ln, err := h.listen("tcp", h.addr)
	if err != nil {
		return fmt.Errorf("proxy health: listening on %s: %w", h.addr, err)
	}
	srv := &http.Server{
		Handler:           h.Handler(),
		ReadHeaderTimeout: readHeaderTimeout,
		ErrorLog:          zap.NewStdLog(h.log),
	}
	h.log.Info("serving proxy health", zap.Stringer("address", ln.Addr()))
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		_ = srv.Close()
		return fmt.Errorf("proxy health: serving on %s: %w", ln.Addr(), err)
	case <-ctx.Done():
	}
	if err := srv.Close(); err != nil {
		h.log.Warn("closing proxy health server", zap.Error(err))
	}
	<-served // http.ErrServerClosed
	return nil
}
