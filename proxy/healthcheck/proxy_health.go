package healthcheck

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	"k8s.io/utils/clock"

	"github.com/uproxy/uproxy/internal/httplimit"
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
	// SetIPFamilies changes them once the families in use are known.
	IPFamilies []v1.IPFamily
	// WaitForNode, when true, makes the node ineligible (/healthz 503)
	// until SyncNode first reports this node's Node object: the proxy has
	// a Node source (an API server). False, with no Node source (the
	// manifests), means eligible unless SyncNode says otherwise.
	WaitForNode bool
	// Registerer receives kube-proxy's kubeproxy_proxy_healthz_total and
	// kubeproxy_proxy_livez_total, the answers of /healthz and /livez by
	// HTTP status code; nil means they are counted but not registered.
	Registerer prometheus.Registerer
	// Clock is the time source; nil means the real clock.
	Clock clock.PassiveClock
	// Logger receives serving errors; nil discards them.
	Logger *zap.Logger
	// Listen opens the listening socket; nil means net.Listen.
	Listen ListenFunc
	// Server bounds the time-outs and open connections of the server
	// (idle and slow clients are closed, the longest idle first at the
	// bound); the zero value means httplimit's defaults.
	Server httplimit.ServerConfig
}

// ProxyHealth tracks whether the proxy's rules are up to date, and serves
// /healthz and /livez on one address like kube-proxy's healthz server.
//
// The proxy is unhealthy until its first sync completes (Updated), which
// happens only once the initial lists of Services and EndpointSlices have
// arrived: kube-proxy does not serve health at all until the API server
// has answered, so a proxy that cannot reach it must not look ready.
// After that it is healthy unless an update was queued
// (QueuedUpdate) more than HealthTimeout ago and no sync has completed
// since: the same "oldest pending queued update" rule as kube-proxy.
// /livez reports exactly that; /healthz additionally answers 503 while
// the node is not eligible for load balancer traffic (see SyncNode).
//
// All methods are safe for concurrent use.
type ProxyHealth struct {
	addr     string
	timeout  time.Duration
	families []v1.IPFamily
	clock    clock.PassiveClock
	log      *zap.Logger
	listen   ListenFunc
	server   httplimit.ServerConfig

	mu sync.RWMutex
	// previous: the proxy serves its predecessor's saved state
	// (ServingPrevious).
	previous bool
	// lastUpdated holds, per family, when the last sync completed; a
	// family is absent until the first Updated.
	lastUpdated map[v1.IPFamily]time.Time
	// oldestPending holds, per family, when the oldest update not yet
	// applied was queued; absent when nothing is pending.
	oldestPending map[v1.IPFamily]time.Time
	nodeEligible  bool

	healthzTotal, livezTotal *prometheus.CounterVec // by code
}

// NewProxyHealth returns a ProxyHealth that is unhealthy until its first
// Updated, and whose node is eligible unless cfg.WaitForNode is set. It
// does not serve until Run is called.
func NewProxyHealth(cfg ProxyHealthConfig) *ProxyHealth {
	h := &ProxyHealth{
		addr:          cfg.Addr,
		timeout:       cfg.HealthTimeout,
		families:      cfg.IPFamilies,
		clock:         cfg.Clock,
		log:           cfg.Logger,
		listen:        cfg.Listen,
		server:        cfg.Server,
		lastUpdated:   make(map[v1.IPFamily]time.Time),
		oldestPending: make(map[v1.IPFamily]time.Time),
		// Without a Node source (the manifests) the node counts as
		// eligible; with one, not until its Node object has arrived, as
		// kube-proxy's NodeManager reports a Node it has not seen.
		nodeEligible: !cfg.WaitForNode,
		healthzTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Subsystem: "kubeproxy",
			Name:      "proxy_healthz_total",
			Help:      "Cumulative proxy healthz HTTP status",
		}, []string{"code"}),
		livezTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Subsystem: "kubeproxy",
			Name:      "proxy_livez_total",
			Help:      "Cumulative proxy livez HTTP status",
		}, []string{"code"}),
	}
	if cfg.Registerer != nil {
		cfg.Registerer.MustRegister(h.healthzTotal, h.livezTotal)
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

// SetIPFamilies sets the families reported, replacing
// ProxyHealthConfig.IPFamilies: call it once the families in use are
// known, before the first Updated. Empty means IPv4 only.
func (h *ProxyHealth) SetIPFamilies(families ...v1.IPFamily) {
	if len(families) == 0 {
		families = []v1.IPFamily{v1.IPv4Protocol}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.families = slices.Clone(families)
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
// any more. Until the first Updated the proxy is unhealthy, and each
// family's status says so with a zero lastUpdated. Unlike kube-proxy's
// SyncLoop, the caller must not call it before its first sync: uproxy
// serves health before the API server has answered, and must not look
// ready then.
func (h *ProxyHealth) Updated() {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.clock.Now()
	for _, f := range h.families {
		delete(h.oldestPending, f)
		h.lastUpdated[f] = now
	}
}

// ServingPrevious records that the proxy serves its predecessor's saved
// Services (a restart while the API server is unreachable, see
// proxy.Proxier.ServePrevious). Until its first sync completes, /livez
// then answers 200: the process is doing its work, and a liveness probe
// that restarted it would take the node's Services away for the length
// of the outage. /healthz keeps kube-proxy's meaning and answers 503
// until the first sync.
func (h *ProxyHealth) ServingPrevious() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.previous = true
}

// SyncNode records the state of this node. The node is eligible for load
// balancer traffic unless it is being deleted (has a deletion timestamp)
// or is tainted ToBeDeletedByClusterAutoscaler, as kube-proxy's
// NodeEligible computes it. A nil node means the Node object is gone (or
// not yet seen): not eligible, as in kube-proxy.
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
// does, a family being unhealthy when its oldest pending update is at
// least HealthTimeout old; and, unlike kube-proxy, a family never Updated
// (no sync has completed yet) is unhealthy too.
func (h *ProxyHealth) health() healthResponse {
	h.mu.RLock()
	defer h.mu.RUnlock()
	now := h.clock.Now()
	r := healthResponse{
		CurrentTime: now,
		Healthy:     true,
		Status:      make(map[v1.IPFamily]familyResponse, len(h.families)),
	}
	for _, f := range h.families {
		if _, ok := h.lastUpdated[f]; !ok {
			r.Healthy = false
			r.Status[f] = familyResponse{}
		}
	}
	for f, last := range h.lastUpdated {
		if !slices.Contains(h.families, f) {
			continue // no longer in use (SetIPFamilies)
		}
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
	h.write(w, h.healthzTotal, r, r.Healthy && eligible)
}

// serveLivez answers 200 when the proxy is healthy, whatever the node,
// or serves its predecessor's state before its first sync
// (ServingPrevious).
func (h *ProxyHealth) serveLivez(w http.ResponseWriter, _ *http.Request) {
	r := h.health()
	h.mu.RLock()
	if h.previous && len(h.lastUpdated) == 0 {
		r.Healthy = true // serving the saved state, before the first sync
	}
	h.mu.RUnlock()
	h.write(w, h.livezTotal, r, r.Healthy)
}

// write answers with r, and counts the answer's code in total.
func (h *ProxyHealth) write(w http.ResponseWriter, total *prometheus.CounterVec, r healthResponse, ok bool) {
	code := http.StatusServiceUnavailable
	if ok {
		code = http.StatusOK
	}
	total.WithLabelValues(strconv.Itoa(code)).Inc()
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
	lim := h.server.Limiter()
	srv := h.server.Server(h.Handler(), lim, zap.NewStdLog(h.log))
	h.log.Info("serving proxy health", zap.Stringer("address", ln.Addr()))
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lim.Listener(ln)) }()
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
