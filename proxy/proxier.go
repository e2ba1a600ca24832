package proxy

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/uproxy/uproxy/proxy/routing"

	"github.com/uproxy/uproxy/proxy/listeners"

	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/service"
)

// Config configures a Proxier. The zero value of each field is documented;
// only what the command line sets needs setting.
type Config struct {
	// Config holds the data path's knobs (datapath.Config), each
	// documented there; its Clock also times syncs, its Logger takes the
	// proxier's logs too.
	datapath.Config
	// Rules programs the kernel's intercept rules. Nil means none are
	// programmed (tests that connect to listeners directly).
	Rules RuleSyncer
	// Inherited holds the listening sockets handed over by the process
	// this one replaces (see listeners.Inherited): a listener adopts the socket of
	// its key instead of binding a new one. Nil means every listener is
	// bound anew.
	Inherited *listeners.Inherited
	// PreviousPort returns the listener port that the rules a previous
	// instance left in the kernel send a service port's traffic to (for a
	// network: "tcp4", "udp6", …), or 0. A listener binds that port again
	// where it can, so that after a crash the rules left behind work as
	// soon as the listener is open, before the first sync rewrites them.
	// Nil means none.
	PreviousPort func(name service.PortName, network string) uint16
	// StateFile is where each successful sync's Services and
	// EndpointSlices are saved (source.SaveState), with the sync's time,
	// for ServePrevious after a restart. Empty means none is saved.
	StateFile string
	// SharedListeners lists the protocols whose service ports share one
	// listener per family (--listener=shared; see package listeners): the
	// listener finds each connection's service from its original
	// destination, OriginalDst for TCP (which must then be set), and for
	// UDP a datagram's destination in tproxy mode or UDPOriginalDst in
	// redirect mode; without either, UDP service ports keep their own
	// listeners. Empty means a listener per service port and family.
	SharedListeners []v1.Protocol
	// UDPCheckEveryFlow keeps the conntrack check of every new UDP flow
	// of a listener of its own (datapath.Config.UDPOriginalDst) while the
	// kernel's listener guard holds its port: the listeners are never
	// marked Guarded. It guards against the guard's rules or set being
	// removed behind the proxier's back, which only the next full sync
	// notices. False trusts the guard after a rules write that succeeded.
	UDPCheckEveryFlow bool
	// MaxListeners bounds the listening sockets of the service ports'
	// own listeners, each a descriptor, counted with the shared
	// listeners' sockets (which it never refuses) and those adopted from
	// a predecessor (which it never refuses either). Past it, a service
	// port's listener is not opened: the port is counted in
	// uproxy_service_ports_without_listener and retried at each sync,
	// as any listener that cannot be opened is. It keeps the
	// descriptors that connections, flows and rules writes need: a rules
	// write runs iptables-restore, which cannot start once the process
	// is out of descriptors, and then no service is proxied at all.
	// Zero means no bound.
	MaxListeners int
	// MaxListenersPerService bounds the listening sockets of one
	// Service's own listeners (its ports in each family), and
	// MaxListenersPerNamespace those of the Services of one namespace, so
	// that neither can take the whole budget or port range and leave the
	// other Services none. Past them, a service port is refused as past
	// MaxListeners. Zero means listeners.DefaultServiceQuota and
	// listeners.DefaultNamespaceQuota of the budget: the smaller of
	// MaxListeners and the ports the listeners may take (the PortRange's
	// size, or half of the kernel's range); negative means no bound.
	MaxListenersPerService   int
	MaxListenersPerNamespace int
	// PortRange limits listener ports; zero means the ports the kernel
	// assigns to bind(0), chosen by uproxy (listeners.Config.PortRange).
	PortRange listeners.PortRange
	// Defaults are the settings a Service can override by annotation.
	Defaults service.Defaults
	// Sync sets the sync frequency bounds.
	Sync changes.RunnerConfig
	// NodeName is this node's name, as endpoints' nodeName gives it: it
	// decides which endpoints are local. Empty means none is.
	NodeName string
	// ClusterCIDRs are the pod networks (--cluster-cidr). Like kube-proxy,
	// uproxy sends pods that reach a service's external address to the
	// cluster endpoints even under externalTrafficPolicy Local, and dials
	// a backend from the client's own address where kube-proxy would not
	// masquerade (datapath.KeepClient): clients outside them reaching a
	// cluster IP are masqueraded. Nil means only the node's own addresses
	// count as internal clients, and no client of a cluster IP is
	// masqueraded, as kube-proxy without a local detector.
	ClusterCIDRs []netip.Prefix
	// PodNetworks are the pod networks of the whole cluster
	// (--cluster-cidr), which endpoint refusals tell pods by: an endpoint
	// in them at a port of NodePortRange is a pod's, not another node's
	// node port, and an external IP in them is a pod's own address. They
	// differ from ClusterCIDRs with detect-local mode NodeCIDR, where
	// ClusterCIDRs are this node's pod networks only. Nil means
	// ClusterCIDRs.
	PodNetworks []netip.Prefix
	// LocalAddrs lists the node's own addresses; clients using them count
	// as internal (kube-proxy's "addrtype LOCAL" short circuit). Nil means
	// the addresses of net.InterfaceAddrs, read at every sync.
	LocalAddrs func() ([]netip.Addr, error)
	// ServerAddrs are the addresses of the proxy's own TCP servers
	// (metrics, health checks), where an unspecified address stands for
	// every address of the node. No endpoint may be one of them on an
	// address of the node. Nil means none.
	ServerAddrs []netip.AddrPort
	// DeniedEndpoints are the networks no endpoint may be in
	// (--endpoint-deny-cidrs). Nil means service.DefaultDeniedEndpoints,
	// the clouds' metadata services; an empty, non-nil list denies none.
	DeniedEndpoints []netip.Prefix
	// NodeEndpointPorts are the ports on which an endpoint may be one of
	// this node's own addresses, a host-network pod of this node
	// (--node-endpoint-ports). The API server's own Service
	// (default/kubernetes), which only the API server writes, may always
	// be. Nil allows no other: the proxy would dial the node's own
	// services from the node's address on a pod's behalf, where
	// kube-proxy's DNAT leaves the pod the client.
	NodeEndpointPorts service.PortRanges
	// NodePortRange is the API server's --service-node-port-range: no
	// endpoint outside the pod networks (ClusterCIDRs), or on this node's
	// addresses, may be at one of its ports, where another node's proxy
	// would intercept the connection and could send it back, a loop
	// between nodes that no TTL ends, since each hop is a new connection.
	// The zero value means 30000-32767, the API server's default.
	NodePortRange service.PortRange
	// LoopbackEndpoints lets endpoints on loopback addresses through,
	// for tests whose backends listen there. False refuses them, as a
	// pod could otherwise reach the node's own local services through a
	// Service (see service.AddrRefusal).
	LoopbackEndpoints bool
	// ServiceHealth receives the health-check node ports and local
	// endpoint counts of externalTrafficPolicy Local services after every
	// sync; nil means they are not served.
	ServiceHealth ServiceHealthSyncer
	// OnSync is called after every successful sync, from the sync
	// goroutine; nil means nothing is. The health server uses it.
	OnSync func()
	// OnChange is called whenever a source records a change that a sync
	// will apply, from the source's goroutine; it must not block. Nil
	// means nothing is. The health server uses it to time pending syncs.
	OnChange func()
	// OnReject is called, from the source's goroutine, with each Service
	// or EndpointSlice the tracker rejects as invalid (after logging it)
	// and the reason; it must not block. Nil means nothing is. uproxy
	// reports it as a Warning event on the object.
	OnReject func(obj k8sruntime.Object, err error)
	// OnRefuse is called, from the sync goroutine, with each Service
	// part of which the proxier refuses while serving the rest (an
	// external address that is another Service's cluster IP), when the
	// refusal starts; it must not block. Nil means nothing is. uproxy
	// reports it as a Warning event on the Service.
	OnRefuse func(obj k8sruntime.Object, err error)
	// Metrics receives the proxier's Prometheus metrics (see NewMetrics);
	// nil means none are kept.
	Metrics *introspect.Metrics
	// SourceHashBytes bounds the memory of the source-hash balancers'
	// Maglev tables, across all services. Past it, a balancer whose table
	// does not fit uses rendezvous hashing, which needs none (see
	// balancer.MaglevBudget), and the service is logged. Zero means
	// DefaultSourceHashBytes.
	SourceHashBytes int64
	// MaxEndpointsPerPort bounds the endpoints of one service port, in
	// one family, that the proxy balances over. Past it, the port uses a
	// subset (service.SubsetEndpoints: this node's and the ready ones
	// first, and otherwise a different subset on each node), and each
	// change is logged with the count left out. Zero means
	// DefaultMaxEndpointsPerPort; negative means no bound.
	MaxEndpointsPerPort int
}

// DefaultMaxEndpointsPerPort is the bound on a service port's endpoints
// per family when Config.MaxEndpointsPerPort is zero. A change to a port
// rebuilds its backends and balancers on the sync goroutine, while every
// other Service's changes wait, at a cost that grows with the endpoints
// (Maglev tables and weighted schedules); the bound caps that wait. It is
// far above the replicas one Service is meant to spread over, and past it
// another endpoint adds little but cost: each node still spreads its
// connections over a subset that large, and the nodes together over all.
const DefaultMaxEndpointsPerPort = 10000

// maxEndpointsPerPort returns the bound on a service port's endpoints per
// family, or 0 for none.
func (c *Config) maxEndpointsPerPort() int {
	switch {
	case c.MaxEndpointsPerPort == 0:
		return DefaultMaxEndpointsPerPort
	case c.MaxEndpointsPerPort < 0:
		return 0
	}
	return c.MaxEndpointsPerPort
}

func (c *Config) clock() clock.WithTickerAndDelayedExecution {
	if c.Clock == nil {
		return clock.RealClock{}
	}
	return c.Clock
}

func (c *Config) logger() *zap.Logger {
	if c.Logger == nil {
		return zap.NewNop()
	}
	return c.Logger
}

// Proxier turns the tracked Services and EndpointSlices into listeners,
// balancers and intercept rules, and publishes each listener's routing to
// the data path (datapath.Engine), which carries the connections.
//
// Run owns the sync goroutine, which owns the listeners and builds their
// snapshots; the Engine owns the goroutines of the data path. Shutdown
// stops them all.
type Proxier struct {
	cfg     Config
	tracker *changes.Tracker
	runner  *changes.Runner
	log     *zap.Logger
	// dp carries the connections and datagrams of the listeners.
	dp *datapath.Engine
	// sockets opens and closes the listeners' sockets (sync goroutine).
	sockets *listeners.Manager
	// addrs are the node's addresses, refreshed by each sync.
	addrs *nodeAddrs
	// inspect answers Status and Explain from the entries each sync
	// stores (updateStatus).
	inspect *introspect.Inspector

	// Owned by the sync goroutine.
	services   map[types.NamespacedName]listenerSet
	endpoints  int // the endpoints of every listener (counts)
	rulesDirty bool
	// retired are the listeners that applied services no longer want,
	// closed once the rules no longer send anything to them
	// (closeRetired).
	retired []*listener
	// requeued: a service of this sync failed and waits for a retry.
	requeued bool
	// claims: who owns each cluster IP, who names each external address.
	claims addrClaims
	// reclaim: a service outside this sync must be re-applied because an
	// address it names changed owner (refuseTakenAddrs).
	reclaim bool
	// refused holds the listeners of this sync that a budget or quota
	// refused, for one log line per reason and sync.
	refused refusedListeners
	slots   connSlots    // per service port, shared by its listeners
	hash    hashTables   // the source-hash balancers' tables
	ignored ignoredParts // the Services whose ignored parts were logged
	// health holds what the ServiceHealth server was last given.
	health healthPorts
	// stateDirty: changes applied since the state file was last saved,
	// at stateSaved.
	stateDirty bool
	stateSaved time.Time

	lastSync  atomic.Int64 // unix nanos of the last successful sync
	zone      atomic.Pointer[string]
	forceFull atomic.Bool
}

// podNetworks returns PodNetworks, or ClusterCIDRs.
func (c *Config) podNetworks() []netip.Prefix {
	if c.PodNetworks == nil {
		return c.ClusterCIDRs
	}
	return c.PodNetworks
}

// nodePortRange returns NodePortRange, or its default.
func (c *Config) nodePortRange() service.PortRange {
	if c.NodePortRange == (service.PortRange{}) {
		return service.DefaultNodePortRange
	}
	return c.NodePortRange
}

// deniedEndpoints returns DeniedEndpoints, or its default.
func (c *Config) deniedEndpoints() []netip.Prefix {
	if c.DeniedEndpoints == nil {
		return service.DefaultDeniedEndpoints
	}
	return c.DeniedEndpoints
}

// NewProxier returns a Proxier with an empty Tracker. Feed the tracker
// from one or more sources, then call Run.
func NewProxier(cfg Config) *Proxier {
	p := &Proxier{
		cfg:      cfg,
		log:      cfg.logger(),
		services: map[types.NamespacedName]listenerSet{},
		slots:    connSlots{},
		health:   healthPorts{syncer: cfg.ServiceHealth, ports: map[types.NamespacedName]uint16{}, local: map[types.NamespacedName]int{}},
	}
	p.ignored.log = p.log
	p.health.log = p.log
	p.addrs = &nodeAddrs{list: cfg.LocalAddrs, clusterCIDRs: cfg.ClusterCIDRs, podNetworks: cfg.podNetworks(), log: p.log}
	p.dp = datapath.NewEngine(cfg.Config, p.addrs)
	p.inspect = &introspect.Inspector{
		Engine: p.dp, Transparent: cfg.Transparent, LastSync: p.LastSync,
		IsLocal: p.addrs.Node, Internal: p.addrs.internal,
		Clients: p.addrs, MasqueradeAll: cfg.MasqueradeAll,
	}
	p.sockets = listeners.NewManager(listeners.Config{
		Transparent:     cfg.Transparent,
		Redirected:      cfg.Rules != nil && !cfg.Transparent,
		MaxListeners:    cfg.MaxListeners,
		MaxPerService:   cfg.MaxListenersPerService,
		MaxPerNamespace: cfg.MaxListenersPerNamespace,
		PortRange:       cfg.PortRange,
		Inherited:       cfg.Inherited,
		PreviousPort:    cfg.PreviousPort,
		Logger:          p.log,
	}, p.dp)
	cfg.Metrics.SetSource(func(yield func(*datapath.PortMetrics) bool) {
		p.inspect.Range(func(e introspect.Entry) bool { return yield(e.Snap.Metrics) })
	})
	p.runner = changes.NewRunner(cfg.Sync, p.sync)
	p.tracker = changes.NewTracker(p.log, func() {
		if cfg.OnChange != nil {
			cfg.OnChange()
		}
		cfg.Metrics.Queued(cfg.clock().Now())
		p.runner.Run()
	})
	p.tracker.OnReject = cfg.OnReject
	cfg.Metrics.SetPending(p.tracker.Pending)
	cfg.Metrics.SetConnectionsOverMax(p.dp.ConnectionsOverMax)
	return p
}

// Tracker returns the tracker that sources feed.
func (p *Proxier) Tracker() *changes.Tracker { return p.tracker }

// SetZone records this node's topology zone (its topology.kubernetes.io/zone
// label). A change re-evaluates every service's topology hints with a full
// sync. Safe for concurrent use.
func (p *Proxier) SetZone(zone string) {
	if old := p.zone.Swap(&zone); old == nil || *old != zone {
		p.forceFull.Store(true)
		p.runner.Run()
	}
}

func (p *Proxier) currentZone() string {
	if z := p.zone.Load(); z != nil {
		return *z
	}
	return ""
}

// Run syncs until ctx is done. It does not close listeners: call Shutdown.
func (p *Proxier) Run(ctx context.Context) {
	// As kube-proxy's SyncLoop: the first sync is queued as the informers
	// start listing.
	p.cfg.Metrics.Queued(p.cfg.clock().Now())
	p.runner.Loop(ctx)
}

// LastSync returns when the last successful sync finished; zero if none.
func (p *Proxier) LastSync() time.Time {
	n := p.lastSync.Load()
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

// applyServices makes the listeners of the changed services match their
// objects, opening the new ones ahead (openListeners). Called by the sync
// goroutine, for a sync and for the previous instance's objects.
func (p *Proxier) applyServices(ctx context.Context, changed []changes.ServiceState) {
	zone := p.currentZone()
	wants := make([]serviceWant, len(changed))
	for i, st := range changed {
		wants[i] = wantOf(st, p.cfg.Defaults)
	}
	p.refuseTakenAddrs(wants)
	opened := p.openListeners(ctx, wants)
	for _, w := range wants {
		p.applyService(ctx, w, zone, opened)
	}
}

// sync applies the tracker's changes. It runs only on the runner's goroutine.
func (p *Proxier) sync(ctx context.Context, full bool) error {
	if !p.tracker.Synced() {
		if p.tracker.TakeSeed() {
			p.applyPrevious(ctx)
		}
		p.log.Info("waiting for the initial lists of Services and EndpointSlices before syncing")
		return changes.ErrSyncSkipped
	}
	start := p.cfg.clock().Now()
	// A forced sync (a zone change, a failed handover) re-applies every
	// service. Any other full sync (the periodic one, the retry of a failed
	// one) re-applies only the services that changed, as a partial sync
	// does, and verifies the rest of the state that others can change: the
	// kernel's rules and sets. The listeners and their snapshots belong to
	// this process, and nothing else changes them; a service whose apply
	// failed is requeued. Re-applying all of them would rebuild every
	// snapshot and balancer every --iptables-sync-period, reset every
	// round-robin position, and make an endpoint change that arrived
	// meanwhile wait.
	reapply := p.forceFull.Swap(false)
	full = reapply || full
	if reapply {
		// A handover or zone change re-applies everything; until the
		// rules are written again, trust no guard.
		p.setGuarded([2]bool{})
	}
	p.addrs.refresh()
	var programmed []types.NamespacedName
	if reapply {
		for name := range p.services {
			programmed = append(programmed, name)
		}
	}
	ch := p.tracker.Take(reapply, programmed)
	p.cfg.Metrics.CountChanges(ch.ServiceChanges, ch.SliceChanges)
	p.applyServices(ctx, ch.Services)
	p.refused.log(p.log, p.sockets.Sockets(), p.cfg.MaxListeners, p.cfg.PortRange.Size > 0)
	// The shared listeners' routes, like the rules, follow the intercepts:
	// they change only with them (rulesDirty).
	if reapply || p.rulesDirty {
		p.rebuildRoutes()
	}
	p.health.sync(full)
	var rules RuleStats
	synced := false
	if p.cfg.Rules != nil && (full || p.rulesDirty) {
		var err error
		if rules, err = p.cfg.Rules.SyncRules(ctx, p.Intercepts(), full); err != nil {
			p.rulesDirty = true
			p.setGuarded([2]bool{})
			p.log.Error("syncing rules failed; will retry with a full resync", zap.Error(err))
			return fmt.Errorf("syncing rules: %w", err)
		}
		synced = true
		p.setGuarded([2]bool{!rules.Unguarded[0], !rules.Unguarded[1]})
	}
	p.rulesDirty = false
	if p.closeRetired() && p.requeued {
		// The ports just freed may be what a failed listener lacked (a
		// full --proxy-port-range): retry now, not at the next full sync.
		p.runner.Run()
	}
	p.requeued = false
	if p.reclaim {
		p.reclaim = false
		p.runner.Run()
	}
	end := p.cfg.clock().Now()
	p.lastSync.Store(end.UnixNano())
	p.cfg.Inherited.Synced(p.log)
	p.saveStateAfterSync(len(ch.Services) > 0)
	p.cfg.Metrics.ObserveSync(start, end, full, ch.TriggerTimes)
	if p.cfg.OnSync != nil {
		p.cfg.OnSync()
	}
	nsvc, neps := p.counts()
	// Endpoint-only changes leave the rules alone: the line then says
	// rulesWritten 0 and ruleCommands 0 without claiming a rule count it
	// did not check.
	ruleFields := []zap.Field{zap.Skip(), zap.Int("rulesWritten", 0), zap.Int("ruleCommands", 0)}
	if synced {
		ruleFields = []zap.Field{zap.Int("rules", rules.Rules), zap.Int("rulesWritten", rules.Written), zap.Int("ruleCommands", rules.Commands)}
	}
	p.log.Info("synced",
		zap.Bool("full", full),
		zap.Int("servicesChanged", len(ch.Services)),
		zap.Int("services", nsvc),
		zap.Int("endpoints", neps),
		ruleFields[0], ruleFields[1], ruleFields[2],
		zap.Duration("duration", end.Sub(start)))
	return nil
}

// setGuarded marks, by family (index 0 IPv4, 1 IPv6), whether the
// kernel's listener guard holds the port of every listener the services
// have: set after a rules write that succeeded, which listed each of
// them (Intercepts), for the families it wrote; cleared when one failed,
// which may have left the guard out, or before a forced resync. A UDP
// listener that is not marked asks conntrack whether each new flow was
// redirected to it (datapath.Listener.Guarded). A listener opened since
// the last write is not marked until the next one. Called by the sync
// goroutine. With UDPCheckEveryFlow no listener is marked.
func (p *Proxier) setGuarded(on [2]bool) {
	for _, ls := range p.services {
		for _, l := range ls {
			l.Guarded.Store(on[introspect.FamilyIndex(l.Key.V6)] && !p.cfg.UDPCheckEveryFlow)
		}
	}
}

// closeRetired closes the listeners that applied services let go. The
// sync calls it only once the rules that sent traffic to them are gone
// from the kernel: a listener closed first leaves its port free while a
// rule still redirects a Service's traffic there, for any local process
// to bind. It reports whether it closed any. Called by the sync
// goroutine, or by Shutdown after it.
func (p *Proxier) closeRetired() bool {
	if len(p.retired) == 0 {
		return false // and writes nothing: most syncs retire nothing
	}
	for _, l := range p.retired {
		p.sockets.Close(l.Listener)
	}
	clear(p.retired)
	p.retired = p.retired[:0]
	return true
}

// counts returns the number of services and of their endpoints (in
// every listener). The endpoint count is kept up to date by applyService:
// counting afresh cost a walk of every listener for each sync's log line.
func (p *Proxier) counts() (services, endpoints int) {
	return len(p.services), p.endpoints
}

// serviceEndpoints counts the endpoints of service name's listeners.
func (p *Proxier) serviceEndpoints(name types.NamespacedName) int {
	n := 0
	for _, l := range p.services[name] {
		n += len(l.snap.Load().Endpoints)
	}
	return n
}

// serviceWant is a changed service and the listeners it wants: one per
// service port and family of its cluster IPs, in the service's order. A
// deleted service wants none.
type serviceWant struct {
	st    changes.ServiceState
	ports []wantedPort
}

// wantedPort is a listener that a service wants, and the cluster IP it
// serves. A service has few, so a slice, searched by want, costs less
// than a map: a first sync holds the wants of every service at once.
type wantedPort struct {
	key listeners.Key
	sp  *service.Port
	vip netip.Addr
}

// wantOf returns the listeners st wants.
func wantOf(st changes.ServiceState, defaults service.Defaults) serviceWant {
	w := serviceWant{st: st}
	if st.Service == nil {
		return w
	}
	for _, sp := range service.Ports(st.Service, defaults) {
		for _, ip := range sp.ClusterIPs {
			wp := wantedPort{key: listeners.Key{Name: sp.Name, V6: ip.Is6()}, sp: sp, vip: ip}
			// One listener per key: the last cluster IP of a family wins,
			// should a source hand over two.
			if i := slices.IndexFunc(w.ports, func(o wantedPort) bool { return o.key == wp.key }); i >= 0 {
				w.ports[i] = wp
				continue
			}
			w.ports = append(w.ports, wp)
		}
	}
	return w
}

// want reports whether w wants a listener for k.
func (w serviceWant) want(k listeners.Key) bool {
	return slices.ContainsFunc(w.ports, func(wp wantedPort) bool { return wp.key == k })
}

// opening is a listener that openListeners bound ahead of applyService,
// or why it could not.
type opening struct {
	l   *listeners.Listener
	err error
}

// pendingListener is a listener that openListeners opens, and its rank:
// how many listeners its Service holds or opens before it.
type pendingListener struct {
	key  listeners.Key
	rank int
}

// fairOrder returns the keys of pending in the order openListeners opens
// them: round by round, each namespace's next listener in turn, and
// within a namespace the Services' next ones by rank. When the budget,
// the ports or a quota runs out within a sync, the namespace and the
// Service that come first in name order would otherwise have taken all
// they want before the next one had any; in rounds, each namespace and
// each Service gets its first listeners before any gets more. Within a
// round, names give the order, so that the same objects get the same
// ports each time.
func fairOrder(pending []pendingListener) []listeners.Key {
	byNamespace := map[string][]pendingListener{}
	for _, pl := range pending {
		ns := pl.key.Name.Namespace
		byNamespace[ns] = append(byNamespace[ns], pl)
	}
	namespaces := slices.Sorted(maps.Keys(byNamespace))
	most := 0
	for _, ns := range namespaces {
		// Stable: a Service's listeners keep the order of its ports.
		slices.SortStableFunc(byNamespace[ns], func(a, b pendingListener) int {
			return cmp.Or(cmp.Compare(a.rank, b.rank), cmp.Compare(a.key.Name.Name, b.key.Name.Name))
		})
		most = max(most, len(byNamespace[ns]))
	}
	need := make([]listeners.Key, 0, len(pending))
	for round := range most {
		for _, ns := range namespaces {
			if l := byNamespace[ns]; round < len(l) {
				need = append(need, l[round].key)
			}
		}
	}
	return need
}

// openListeners opens the per-service listeners that the changed services
// want and do not have, before they are applied: every one of them on a
// first sync. This goroutine binds them one by one, in fairOrder, which
// decides who gets the budget, the ports and the quotas when they run out
// within the sync (a --proxy-port-range is handed out in that order).
// Meanwhile workers on the other CPUs finish the bound ones
// (listeners.Manager.Start: socket options, the runtime's poller, the log
// line, starting to accept), which is more than half of a listener's
// cost, so a large first sync is shorter; with a single CPU, or a single
// listener to open, this goroutine finishes each itself.
//
// applyService takes the listeners from the result. The workers belong to
// this call and end with it.
func (p *Proxier) openListeners(ctx context.Context, wants []serviceWant) map[listeners.Key]opening {
	var pending []pendingListener
	for _, w := range wants {
		have := p.services[w.st.Name]
		rank := len(have)
		for _, wp := range w.ports {
			if have.get(wp.key) == nil && !p.cfg.sharedFor(wp.key.Name.Protocol) {
				pending = append(pending, pendingListener{wp.key, rank})
				rank++
			}
		}
	}
	if len(pending) == 0 {
		return nil
	}
	need := fairOrder(pending)
	opened := make(map[listeners.Key]opening, len(need))
	workers := min(runtime.GOMAXPROCS(0)-1, len(need)-1)
	if workers < 1 {
		for _, k := range need {
			l, err := p.sockets.Open(ctx, k)
			opened[k] = opening{l: l, err: err}
		}
		return opened
	}
	bound := make(chan *listeners.Listener, 64)
	var (
		wg       sync.WaitGroup
		failedMu sync.Mutex
		failed   = map[*listeners.Listener]error{}
	)
	for range workers {
		wg.Go(func() {
			for l := range bound {
				if err := p.sockets.Start(l); err != nil {
					failedMu.Lock()
					failed[l] = err
					failedMu.Unlock()
				}
			}
		})
	}
	for _, k := range need {
		l, err := p.sockets.Bind(ctx, k, 0)
		opened[k] = opening{l: l, err: err}
		if err == nil {
			bound <- l
		}
	}
	close(bound)
	wg.Wait()
	for l, err := range failed {
		p.sockets.Unbind(l)
		opened[l.Key] = opening{err: err}
	}
	return opened
}

// applyService makes the listeners of one service match its objects. The
// listeners it wants that are in opened are taken from there rather than
// opened.
func (p *Proxier) applyService(ctx context.Context, w serviceWant, zone string, opened map[listeners.Key]opening) {
	st := w.st
	p.ignored.warn(st)
	// The snapshots built below take their metric counters in this round;
	// retainService then drops the ports and backends none of them took.
	p.cfg.Metrics.BeginService()
	p.endpoints -= p.serviceEndpoints(st.Name)
	defer func() { p.endpoints += p.serviceEndpoints(st.Name) }()
	have := slices.DeleteFunc(p.services[st.Name], func(l *listener) bool {
		k := l.Key
		if w.want(k) {
			return false
		}
		p.retired = append(p.retired, l)
		p.rulesDirty = true
		if !w.want(listeners.Key{Name: k.Name, V6: !k.V6}) {
			delete(p.slots, k.Name) // the port is gone in both families
		}
		return true
	})
	failed := false
	var noLocal introspect.NoLocalCounts
	var noListener [2]int // by family
	hashing := p.hash.begin(st.Name, p.cfg.SourceHashBytes)
	defer p.hash.end(st.Name, hashing, p.log)
	for _, wp := range w.ports {
		k, sp := wp.key, wp.sp
		l := have.get(k)
		if l == nil {
			var (
				sock *listeners.Listener
				err  error
			)
			switch o, ok := opened[k]; {
			case ok:
				sock, err = o.l, o.err
			case p.cfg.sharedFor(k.Name.Protocol):
				sock, err = p.sockets.HostOn(ctx, k)
			default:
				sock, err = p.sockets.Open(ctx, k)
			}
			if err != nil {
				if why, ok := refusalOf(err); ok {
					// Said once per sync (refused), not per port.
					p.log.Debug("cannot open listener; will retry", zap.Stringer("servicePort", sp.Name), zap.Error(err))
					p.refused.add(why, st.Name, err)
				} else {
					p.log.Error("cannot open listener; will retry", zap.Stringer("servicePort", sp.Name), zap.Error(err))
				}
				noListener[introspect.FamilyIndex(k.V6)]++
				failed = true
				continue
			}
			l = &listener{Listener: sock}
			have = append(have, l)
		}
		old := l.snap.Load()
		next := p.buildSnapshot(l, sp, wp.vip, st, zone, old, hashing)
		if old == nil || !slices.EqualFunc(l.intercepts(old), l.intercepts(next), routing.SameIntercept) {
			p.rulesDirty = true
		}
		l.snap.Store(next)
		l.Snap.Store(next.Snapshot)
		noLocal.Count(k.V6, sp, next.Endpoints, next.Sets)
	}
	p.cfg.Metrics.SetNoLocal(st.Name, noLocal)
	p.cfg.Metrics.SetNoListener(st.Name, noListener)
	if len(have) == 0 {
		delete(p.services, st.Name)
	} else {
		p.services[st.Name] = have
	}
	p.cfg.Metrics.RetainService(st.Name.String())
	updateStatus(&p.inspect.Table, st.Name, p.services[st.Name])
	p.health.update(st.Name, p.services[st.Name])
	if failed {
		p.tracker.Requeue(st.Name)
		p.requeued = true
	}
}

// Shutdown stops accepting on every listener, then waits for established
// connections to finish until ctx is done, and then closes the rest
// (Drain). Unlike StopListening it refuses, from the start, connections
// that were accepted but not yet proxied. It leaves the kernel rules in
// place for the next instance to adopt. Call it after Run has returned.
func (p *Proxier) Shutdown(ctx context.Context) error {
	p.dp.Refuse()
	for _, ls := range p.services {
		for _, l := range ls {
			p.sockets.Close(l.Listener)
		}
	}
	p.closeRetired()
	p.sockets.CloseShared()
	p.cfg.Inherited.Stop(p.log)
	return p.Drain(ctx)
}

// ActiveConnections returns the number of proxied connections in progress.
func (p *Proxier) ActiveConnections() int {
	return p.dp.ActiveConnections()
}
