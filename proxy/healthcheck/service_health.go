package healthcheck

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"sync"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/internal/httplimit"
)

// ServiceHealthConfig configures a ServiceHealth.
type ServiceHealthConfig struct {
	// Addresses restricts the health-check servers to the node addresses
	// in these prefixes, like kube-proxy's --nodeport-addresses. Empty
	// means every address of both families (one "tcp" socket on
	// 0.0.0.0). A zero-length prefix (0.0.0.0/0 or ::/0) means every
	// address of its family (one wildcard socket). See ServiceHealth for
	// how this differs from kube-proxy.
	Addresses []netip.Prefix
	// Listen opens each listening socket; nil means net.Listen.
	Listen ListenFunc
	// Logger receives opening, closing and serving events; nil discards
	// them.
	Logger *zap.Logger
	// Server bounds the time-outs of every health-check server, and the
	// connections open to all of them together (idle and slow clients
	// are closed, the longest idle first at the bound), so that the
	// descriptors they hold do not grow with the number of services; the
	// zero value means httplimit's defaults.
	Server httplimit.ServerConfig
	// ProxyHealth, if not nil, gates every answer: as in kube-proxy, a
	// service is healthy on this node only while the proxy itself is
	// (ProxyHealth.Health, which ignores node eligibility). The body
	// reports it as "serviceProxyHealthy". Nil counts as healthy.
	ProxyHealth *ProxyHealth
}

// ServiceHealth serves, for each service with externalTrafficPolicy: Local,
// an HTTP server on its healthCheckNodePort that answers 200 when this node
// has local endpoints for it and the proxy is healthy, and 503 otherwise.
// Any path and method get the same answer. The body is kube-proxy's JSON
// and the X-Load-Balancing-Endpoint-Weight header carries the local
// endpoint count, so load balancers send external traffic only to (and,
// if they weigh, in proportion to) nodes with local endpoints.
//
// Differences from kube-proxy v1.37.2, all deliberate:
//   - a port that fails to bind is returned as an error from SyncServices
//     (naming the service and port) rather than as a Kubernetes event;
//     the service is retried on the next SyncServices and the others are
//     unaffected, as in kube-proxy;
//   - one ServiceHealth covers both IP families. With Addresses set, only
//     the families that have a prefix are served (kube-proxy runs one
//     server per family and serves all of a family that has no prefix);
//     IPv6 link-local addresses are skipped (they cannot be bound without
//     a zone); and if no node address matches, opening fails with an
//     error instead of silently listening nowhere;
//   - a request that races with the removal of its service gets 503 with
//     "localEndpoints": 0 instead of an empty 200.
//
// Concurrency: SyncServices, SyncEndpoints and Close may be called from
// any goroutine; SyncServices and Close are serialised with each other.
// Ownership: each listening socket has one goroutine running
// http.Server.Serve on it, owned by the service's entry; it exits when
// SyncServices removes (or re-ports) the service or Close is called, and
// both wait for it. http.Server's per-connection goroutines end when those
// calls close their connections.
type ServiceHealth struct {
	prefixes []netip.Prefix
	listen   ListenFunc
	log      *zap.Logger
	proxy    *ProxyHealth
	server   httplimit.ServerConfig
	conns    *httplimit.ConnLimiter // shared by every server
	// interfaceAddrs lists the node's addresses; tests replace it.
	interfaceAddrs func() ([]net.Addr, error)

	// syncMu serialises SyncServices and Close: it guards opening and
	// closing sockets, which happen outside mu.
	syncMu sync.Mutex
	closed bool // guarded by syncMu

	// mu guards services and every entry's endpoints; handlers read them.
	mu       sync.RWMutex
	services map[types.NamespacedName]*hcInstance
}

// hcInstance is one service's health check: its servers, one per
// listening address, and its local endpoint count.
type hcInstance struct {
	nsn       types.NamespacedName
	port      uint16
	servers   []*http.Server
	serving   sync.WaitGroup // the Serve goroutines
	endpoints int            // guarded by ServiceHealth.mu
}

// NewServiceHealth returns a ServiceHealth serving nothing yet. Invalid
// prefixes in cfg.Addresses are logged and ignored.
func NewServiceHealth(cfg ServiceHealthConfig) *ServiceHealth {
	s := &ServiceHealth{
		listen:         cfg.Listen,
		log:            cfg.Logger,
		proxy:          cfg.ProxyHealth,
		server:         cfg.Server,
		conns:          cfg.Server.Limiter(),
		interfaceAddrs: net.InterfaceAddrs,
		services:       make(map[types.NamespacedName]*hcInstance),
	}
	if s.listen == nil {
		s.listen = net.Listen
	}
	if s.log == nil {
		s.log = zap.NewNop()
	}
	for _, p := range cfg.Addresses {
		if !p.IsValid() {
			s.log.Warn("ignoring invalid health check address prefix", zap.Stringer("prefix", p))
			continue
		}
		if p.Addr().Is4In6() && p.Bits() >= 96 {
			// ::ffff:a.b.c.d/n (n ≥ 96) is the IPv4 prefix a.b.c.d/(n-96).
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		s.prefixes = append(s.prefixes, p.Masked())
	}
	return s
}

// SyncServices makes ports the set of served health checks: the value is
// each service's healthCheckNodePort. Services that are gone, or whose
// port changed, are closed first (so a port can move between services);
// then new ones are opened; unchanged ones are left alone, with their
// endpoint counts. A new service starts with zero local endpoints.
//
// A service whose port cannot be bound is skipped, and retried on the
// next call; the others are opened regardless. The returned error joins
// one error per failed service, each naming the service and port.
func (s *ServiceHealth) SyncServices(ports map[types.NamespacedName]uint16) error {
	s.syncMu.Lock()
	defer s.syncMu.Unlock()
	if s.closed {
		return errors.New("service health: SyncServices after Close")
	}

	var stale []*hcInstance
	s.mu.Lock()
	for nsn, inst := range s.services {
		if port, ok := ports[nsn]; !ok || port != inst.port {
			inst.endpoints = 0
			delete(s.services, nsn)
			stale = append(stale, inst)
		}
	}
	s.mu.Unlock()
	for _, inst := range stale {
		s.log.Info("closing service health check", zap.Stringer("service", inst.nsn), zap.Uint16("port", inst.port))
		s.closeInstance(inst)
	}

	var added []types.NamespacedName
	s.mu.RLock()
	for nsn := range ports {
		if s.services[nsn] == nil {
			added = append(added, nsn)
		}
	}
	s.mu.RUnlock()
	if len(added) == 0 {
		return nil
	}
	slices.SortFunc(added, func(a, b types.NamespacedName) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})

	var errs []error
	addrs, err := s.bindAddresses()
	if err != nil {
		for _, nsn := range added {
			errs = append(errs, fmt.Errorf("service %s health check port %d: %w", nsn, ports[nsn], err))
		}
		s.log.Error("not opening service health checks", zap.Int("services", len(added)), zap.Error(err))
		return errors.Join(errs...)
	}
	for _, nsn := range added {
		port := ports[nsn]
		inst, err := s.open(nsn, port, addrs)
		if err != nil {
			err = fmt.Errorf("service %s health check port %d: %w", nsn, port, err)
			s.log.Error("failed to open service health check", zap.Stringer("service", nsn), zap.Uint16("port", port), zap.Error(err))
			errs = append(errs, err)
			continue
		}
		s.log.Info("opened service health check", zap.Stringer("service", nsn), zap.Uint16("port", port))
		s.mu.Lock()
		s.services[nsn] = inst
		s.mu.Unlock()
	}
	return errors.Join(errs...)
}

// SyncEndpoints sets each served service's number of local ready
// endpoints. Services not in counts get zero; counts for services not
// served are dropped. It never fails; the error is for symmetry with
// kube-proxy's ServiceHealthServer.
func (s *ServiceHealth) SyncEndpoints(counts map[types.NamespacedName]int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for nsn, inst := range s.services {
		inst.endpoints = max(counts[nsn], 0)
	}
	return nil
}

// Close closes every health check and waits for their goroutines. Later
// SyncServices calls fail; Close may be called more than once.
func (s *ServiceHealth) Close() {
	s.syncMu.Lock()
	defer s.syncMu.Unlock()
	s.closed = true
	s.mu.Lock()
	all := make([]*hcInstance, 0, len(s.services))
	for nsn, inst := range s.services {
		inst.endpoints = 0
		all = append(all, inst)
		delete(s.services, nsn)
	}
	s.mu.Unlock()
	for _, inst := range all {
		s.closeInstance(inst)
	}
}

// bindAddr is one socket to open for each service: network is "tcp",
// "tcp4" or "tcp6"; host an address literal.
type bindAddr struct{ network, host string }

// bindAddresses returns where each health check listens, from the
// configured prefixes and the node's current addresses.
func (s *ServiceHealth) bindAddresses() ([]bindAddr, error) {
	if len(s.prefixes) == 0 {
		// As kube-proxy: Go binds "0.0.0.0" on "tcp" as a dual-stack
		// wildcard socket.
		return []bindAddr{{"tcp", "0.0.0.0"}}, nil
	}
	var all4, all6, want4, want6 bool
	for _, p := range s.prefixes {
		is4 := p.Addr().Is4()
		all4 = all4 || (is4 && p.Bits() == 0)
		all6 = all6 || (!is4 && p.Bits() == 0)
		want4 = want4 || is4
		want6 = want6 || !is4
	}
	if all4 && all6 {
		return []bindAddr{{"tcp", "0.0.0.0"}}, nil
	}
	var out []bindAddr
	if all4 {
		out = append(out, bindAddr{"tcp4", "0.0.0.0"})
	}
	if all6 {
		out = append(out, bindAddr{"tcp6", "::"})
	}
	if (want4 && !all4) || (want6 && !all6) {
		ifAddrs, err := s.interfaceAddrs()
		if err != nil {
			return nil, fmt.Errorf("listing node addresses: %w", err)
		}
		seen := make(map[netip.Addr]bool)
		for _, ia := range ifAddrs {
			var ip net.IP
			switch v := ia.(type) {
			case *net.IPNet:
				ip = v.IP
			case *net.IPAddr:
				ip = v.IP
			default:
				continue
			}
			a, ok := netip.AddrFromSlice(ip)
			if !ok {
				continue
			}
			a = a.Unmap()
			if seen[a] || (a.Is4() && all4) || (a.Is6() && all6) || (a.Is6() && a.IsLinkLocalUnicast()) {
				continue
			}
			if slices.ContainsFunc(s.prefixes, func(p netip.Prefix) bool { return p.Contains(a) }) {
				seen[a] = true
				network := "tcp4"
				if a.Is6() {
					network = "tcp6"
				}
				out = append(out, bindAddr{network, a.String()})
			}
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no node address in %v", s.prefixes)
	}
	slices.SortFunc(out, func(a, b bindAddr) int {
		return cmp.Or(cmp.Compare(a.network, b.network), cmp.Compare(a.host, b.host))
	})
	return out, nil
}

// open listens on port at every address and starts serving; on any
// failure it closes what it opened.
func (s *ServiceHealth) open(nsn types.NamespacedName, port uint16, addrs []bindAddr) (*hcInstance, error) {
	inst := &hcInstance{nsn: nsn, port: port}
	handler := serviceHandler{s: s, inst: inst}
	for _, a := range addrs {
		ln, err := s.listen(a.network, net.JoinHostPort(a.host, strconv.Itoa(int(port))))
		if err != nil {
			s.closeInstance(inst)
			return nil, err
		}
		srv := s.server.Server(handler, s.conns, zap.NewStdLog(s.log))
		inst.servers = append(inst.servers, srv)
		inst.serving.Go(func() {
			if err := srv.Serve(s.conns.Listener(ln)); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.log.Error("service health check stopped serving", zap.Stringer("service", nsn), zap.Stringer("address", ln.Addr()), zap.Error(err))
			}
		})
	}
	return inst, nil
}

// closeInstance closes inst's servers (listeners and connections) and
// waits for its Serve goroutines.
func (s *ServiceHealth) closeInstance(inst *hcInstance) {
	for _, srv := range inst.servers {
		if err := srv.Close(); err != nil {
			s.log.Warn("closing service health check", zap.Stringer("service", inst.nsn), zap.Error(err))
		}
	}
	inst.serving.Wait()
}

// serviceHandler answers one service's health checks.
type serviceHandler struct {
	s    *ServiceHealth
	inst *hcInstance
}

// ServeHTTP writes kube-proxy's answer (v1.37.2 service_health.go,
// hcHandler.ServeHTTP): 200 if the service has local endpoints and the
// proxy is healthy, else 503, with the endpoint count as the weight.
func (h serviceHandler) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	h.s.mu.RLock()
	count := h.inst.endpoints
	h.s.mu.RUnlock()
	proxyHealthy := h.s.proxy.healthy()

	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("X-Load-Balancing-Endpoint-Weight", strconv.Itoa(count))
	if count != 0 && proxyHealthy {
		w.WriteHeader(http.StatusOK)
	} else {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_, _ = fmt.Fprint(w, serviceBody(h.inst.nsn, count, proxyHealthy))
}

// serviceBody is kube-proxy's body: its dedented, newline-trimmed
// template, tab-indented, with no trailing newline. Names are quoted with
// %q, as kube-proxy does.
func serviceBody(nsn types.NamespacedName, count int, proxyHealthy bool) string {
	return fmt.Sprintf("{\n\t\"service\": {\n\t\t\"namespace\": %q,\n\t\t\"name\": %q\n\t},\n\t\"localEndpoints\": %d,\n\t\"serviceProxyHealthy\": %v\n}",
		nsn.Namespace, nsn.Name, count, proxyHealthy)
}
