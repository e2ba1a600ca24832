package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"github.com/uproxy/uproxy/balancer"
)

// Config configures a Proxier. The zero value of each field is documented;
// only what the command line sets needs setting.
type Config struct {
	// Rules programs the kernel's intercept rules. Nil means none are
	// programmed (tests that connect to listeners directly).
	Rules RuleSyncer
	// OriginalDst recovers the destination a client connected to before the
	// kernel redirected it (SO_ORIGINAL_DST in redirect mode), from the
	// accepted socket c, which it may only read through c.Control; v6 is
	// the family of the socket's listener. The connection is dropped
	// unless it equals the listener's service VIP and port, so the
	// listener cannot be used to reach a service it does not serve. Nil
	// means no check.
	OriginalDst func(c syscall.RawConn, v6 bool) (netip.AddrPort, error)
	// Transparent selects tproxy mode. The kernel's TPROXY rules hand
	// connections and datagrams to listeners bound to the loopback address
	// with IP_TRANSPARENT, destination unchanged: the original destination
	// is a connection's local address, or a datagram's IP_RECVORIGDSTADDR;
	// UDP replies leave from transparent sockets bound to it; and services
	// that ask for it are dialled from the client's own address. Listeners
	// on loopback cannot be reached from outside the node. False is
	// redirect mode: listeners on every address, destinations rewritten by
	// REDIRECT.
	Transparent bool
	// Listen opens a listener; nil means net.ListenConfig.Listen.
	Listen func(ctx context.Context, network, address string) (net.Listener, error)
	// ListenUDP opens a UDP listener; nil means net.ListenConfig.ListenPacket.
	ListenUDP func(ctx context.Context, network, address string) (*net.UDPConn, error)
	// Inherited holds the listening sockets handed over by the process
	// this one replaces (see handoff.go): a listener adopts the socket of
	// its key instead of binding a new one. Nil means every listener is
	// bound anew.
	Inherited *Inherited
	// PreviousPort returns the listener port that the rules a previous
	// instance left in the kernel send a service port's traffic to (for a
	// network: "tcp4", "udp6", …), or 0. A listener binds that port again
	// where it can, so that after a crash the rules left behind work as
	// soon as the listener is open, before the first sync rewrites them.
	// Nil means none.
	PreviousPort func(name ServicePortName, network string) uint16
	// StateFile is where each successful sync's Services and
	// EndpointSlices are saved (state.go), for ServePrevious after a
	// restart. Empty means none is saved.
	StateFile string
	// OwnMark is the mark (SO_MARK) put on every socket the proxy dials a
	// backend from, by its own dialers (not Dial's): the kernel rules
	// let packets that carry it past every interception
	// (redirect.OwnMark), so the proxy's connections reach the backend
	// they were dialled to even when its address and port are a
	// Service's, instead of coming back to the proxy (#30). Setting it
	// takes CAP_NET_ADMIN. Zero means the sockets are not marked.
	OwnMark uint32
	// Dial connects to a backend; nil means net.Dialer.DialContext.
	Dial func(ctx context.Context, network, address string) (net.Conn, error)
	// UDPTimeout is how long a UDP flow lives without traffic in either
	// direction (kube-proxy's --udp-timeout); zero means 30s, conntrack's
	// default for UDP streams.
	UDPTimeout time.Duration
	// UDPMaxFlows bounds the UDP flow table, across all services: past it
	// the least recently used flow is dropped. Zero means 65536.
	UDPMaxFlows int
	// UDPPoolSize bounds, on each event loop, the sockets connected to one
	// endpoint that carry request–reply queries, one query at a time each
	// (udppool.go): a new client's first datagram goes out on one, and a
	// query that finds them all awaiting replies is dropped. Zero means
	// 256; negative means no pooling: every client is a flow of its own.
	UDPPoolSize int
	// UDPPoolMax bounds the pooled sockets across every endpoint and
	// loop. Zero means 4096.
	UDPPoolMax int
	// UDPQueryTimeout is how long a pooled socket waits for the reply to
	// its query; past it the socket is closed. Zero means 5s, a stub
	// resolver's default timeout (resolv.conf(5)).
	UDPQueryTimeout time.Duration
	// UDPReadBatch is the most datagrams a UDP listener reads with one
	// recvmmsg(2) when datagrams queue up; zero means 8, one reads them
	// one at a time. BenchmarkUDPRequestResponse measures the difference.
	UDPReadBatch int
	// SharedListeners lists the protocols whose service ports share one
	// listener per family (--listener=shared; see shared.go): the
	// listener finds each connection's service from its original
	// destination, OriginalDst for TCP (which must then be set), and for
	// UDP a datagram's destination in tproxy mode or UDPOriginalDst in
	// redirect mode; without either, UDP service ports keep their own
	// listeners. Empty means a listener per service port and family.
	SharedListeners []v1.Protocol
	// UDPOriginalDst returns where a datagram that the kernel redirected
	// from client to the local address local was originally sent (in
	// redirect mode, conntrack's entry for the flow). It is asked once per
	// new UDP flow in redirect mode: a shared listener routes the flow by
	// it, and a service port's own listener drops a flow whose original
	// destination is unknown or not the service's, which no rule of
	// uproxy's sent there. Nil means UDP is shared only in tproxy mode,
	// and a service port's own UDP listener forwards whatever reaches its
	// port (tests that send to listeners directly).
	UDPOriginalDst func(client, local netip.AddrPort) (netip.AddrPort, error)
	// PortRange limits listener ports; zero means the ports the kernel
	// assigns to bind(0), chosen by uproxy (portAllocator).
	PortRange PortRange
	// Defaults are the settings a Service can override by annotation.
	Defaults ServiceDefaults
	// Sync sets the sync frequency bounds.
	Sync RunnerConfig
	// DialTimeout bounds one connection attempt to a backend; zero means 1s.
	DialTimeout time.Duration
	// DialAttempts is how many backends a connection tries before it is
	// refused; zero means 3.
	DialAttempts int
	// EventLoops is the number of event loops that carry TCP connections
	// and relay UDP flows' replies (loop.go). Zero means one less than
	// GOMAXPROCS, at least one; negative means none: each TCP connection is
	// carried by goroutines of its own, one per direction, and each UDP
	// flow by one goroutine (the data path before event loops, kept for
	// comparison).
	EventLoops int
	// IOURing makes each event loop wait in an io_uring, and carry its TCP
	// connections' small messages through it, receiving into buffers the
	// kernel picks only when data comes (loopring.go). False means epoll
	// only. Where the kernel lacks what the loops need (Linux 5.19), the
	// proxier logs why and uses epoll.
	IOURing bool
	// IOURingBuffers is how many receive buffers each event loop's
	// io_uring provides the kernel, a power of two up to 32768; a loop
	// holds a buffer only while its bytes wait to be sent on. Zero means
	// 256. A count the ring refuses leaves the loops on epoll, as any ring
	// that cannot be set up does (logged).
	IOURingBuffers int
	// BackendKeepAliveEvery is how often an event loop turns TCP
	// keep-alive on for the backend sockets it connected without it
	// (eventLoop.armKeepAlive): a connection that lasts gets keep-alive
	// within that time. Zero means 15s.
	BackendKeepAliveEvery time.Duration
	// IdleTimeout closes a TCP connection after neither side has sent or
	// received anything for about that long (between one and two periods).
	// Zero means no idle timeout.
	IdleTimeout time.Duration
	// EjectBase is how long a backend that refused or timed out a
	// connection is skipped by the balancers; it doubles with each
	// consecutive failure up to EjectMax. Zeros mean 1s and 30s.
	EjectBase, EjectMax time.Duration
	// NodeName is this node's name, as endpoints' nodeName gives it: it
	// decides which endpoints are local. Empty means none is.
	NodeName string
	// ClusterCIDRs are the pod networks (--cluster-cidr). Like kube-proxy,
	// uproxy sends pods that reach a service's external address to the
	// cluster endpoints even under externalTrafficPolicy Local. Nil means
	// only the node's own addresses count as internal clients.
	ClusterCIDRs []netip.Prefix
	// LocalAddrs lists the node's own addresses; clients using them count
	// as internal (kube-proxy's "addrtype LOCAL" short circuit). Nil means
	// the addresses of net.InterfaceAddrs, read at every sync.
	LocalAddrs func() ([]netip.Addr, error)
	// ServerAddrs are the addresses of the proxy's own TCP servers
	// (metrics, health checks), where an unspecified address stands for
	// every address of the node. No endpoint may be one of them on an
	// address of the node (#30). Nil means none.
	ServerAddrs []netip.AddrPort
	// LoopbackEndpoints lets endpoints on loopback addresses through,
	// for tests whose backends listen there. False refuses them, as a
	// pod could otherwise reach the node's own local services through a
	// Service (see endpointAddrRefusal).
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
	// Metrics receives the proxier's Prometheus metrics (see NewMetrics);
	// nil means none are kept.
	Metrics *Metrics
	// Logger receives the proxier's logs; nil means none.
	Logger *zap.Logger
	// SourceHashBytes bounds the memory of the source-hash balancers'
	// Maglev tables, across all services. Past it, a balancer whose table
	// does not fit uses rendezvous hashing, which needs none (see
	// hashTables), and the service is logged. Zero means
	// DefaultSourceHashBytes.
	SourceHashBytes int64
	// Clock is the time source for sync and ejection timing; nil means the
	// real clock. Socket deadlines always use the real clock.
	Clock clock.WithTickerAndDelayedExecution
	// stats, if set, counts what the data path carried and how, for the
	// tests that must tell the data paths apart although traffic flows
	// the same on each. Nil means nothing is counted.
	stats *loopStats
}

func (c *Config) ioURingBuffers() int {
	if c.IOURingBuffers == 0 {
		return defaultRingBufs
	}
	return c.IOURingBuffers
}

func (c *Config) backendKeepAliveEvery() time.Duration {
	if c.BackendKeepAliveEvery <= 0 {
		return defaultKeepAliveEvery
	}
	return c.BackendKeepAliveEvery
}

func (c *Config) dialTimeout() time.Duration {
	if c.DialTimeout <= 0 {
		return time.Second
	}
	return c.DialTimeout
}

func (c *Config) dialAttempts() int {
	if c.DialAttempts <= 0 {
		return 3
	}
	return c.DialAttempts
}

func (c *Config) clock() clock.WithTickerAndDelayedExecution {
	if c.Clock == nil {
		return clock.RealClock{}
	}
	return c.Clock
}

func (c *Config) udpReadBatch() int {
	if c.UDPReadBatch <= 0 {
		return 8
	}
	return min(c.UDPReadBatch, maxReadBatch)
}

func (c *Config) logger() *zap.Logger {
	if c.Logger == nil {
		return zap.NewNop()
	}
	return c.Logger
}

// Proxier turns the tracked Services and EndpointSlices into listeners,
// balancers and intercept rules, and carries the connections.
//
// Run owns the sync goroutine; each listener owns an accept goroutine that
// exits when the listener is closed; each connection owns one goroutine
// (plus one for its second copy direction) that exits when both directions
// have ended. Shutdown stops them all.
type Proxier struct {
	cfg     Config
	tracker *Tracker
	runner  *Runner
	log     *zap.Logger
	connLog *zap.Logger // sampled: per-connection errors
	health  *health

	// Owned by the sync goroutine.
	ports      portAllocator
	services   map[types.NamespacedName]map[portKey]*listener
	shared     map[portKey]*listener // the shared listeners, by family and protocol
	endpoints  int                   // the endpoints of every listener (counts)
	rulesDirty bool
	// retired are the listeners that applied services no longer want,
	// closed once the rules no longer send anything to them
	// (closeRetired).
	retired []*listener
	// requeued: a service of this sync failed and waits for a retry.
	requeued bool
	slots    map[ServicePortName]*connSlots       // per service port, shared by its listeners
	hash     hashTables                           // the source-hash balancers' tables
	warned   map[types.NamespacedName]*v1.Service // the version whose ignored annotations were logged
	// hcPorts and hcLocal are what the ServiceHealth server was last
	// given (or is to be given when hcDirty): each health-checked
	// service's port and number of ready local endpoints. Kept per
	// applied service, so that a sync hands them on only when they change.
	hcPorts map[types.NamespacedName]uint16
	hcLocal map[types.NamespacedName]int
	hcDirty bool
	// stateDirty: changes applied since the state file was last saved,
	// at stateSaved.
	stateDirty bool
	stateSaved time.Time

	lastSync    atomic.Int64 // unix nanos of the last successful sync
	zone        atomic.Pointer[string]
	forceFull   atomic.Bool
	localAddrs  atomic.Pointer[[]netip.Addr] // sorted; refreshed every sync
	statusPorts sync.Map                     // types.NamespacedName → []statusPort, replaced per applied service

	flows flowTable // UDP flows, created with the first UDP listener
	// poolOpen counts the pooled UDP sockets of every event loop, against
	// Config.UDPPoolMax.
	poolOpen atomic.Int64

	loops    loopGroup // the TCP data path's event loops, started on first use
	sessMu   sync.Mutex
	sessions map[*session]struct{}
	closing  bool
	wg       sync.WaitGroup // accept and read goroutines, and sessions
}

// NewProxier returns a Proxier with an empty Tracker. Feed the tracker
// from one or more sources, then call Run.
func NewProxier(cfg Config) *Proxier {
	p := &Proxier{
		cfg:      cfg,
		log:      cfg.logger(),
		services: map[types.NamespacedName]map[portKey]*listener{},
		hcPorts:  map[types.NamespacedName]uint16{},
		hcLocal:  map[types.NamespacedName]int{},
		sessions: map[*session]struct{}{},
		ports:    portAllocator{r: cfg.PortRange},
		loops: loopGroup{n: cfg.eventLoops(), opts: loopOptions{
			idle: cfg.IdleTimeout, dialTimeout: cfg.dialTimeout(),
			keepAliveEvery: cfg.backendKeepAliveEvery(), ringBufs: cfg.ioURingBuffers(),
			stats: cfg.stats,
		}},
	}
	if cfg.IOURing && p.loops.n > 0 {
		if err := IOURingSupported(); err != nil {
			p.log.Warn("io_uring is not available for the event loops; they use epoll only", zap.Error(err))
		} else {
			p.loops.opts.ring = true
			p.loops.noRing = func(err error) {
				p.log.Warn("an event loop could not set up its io_uring; it uses epoll only", zap.Error(err))
			}
			p.loops.opts.ringFailed = func(err error) {
				p.log.Error("an event loop's io_uring failed: the connections it carried were reset, and the loop uses epoll only from now on", zap.Error(err))
			}
		}
	}
	// At most 5 identical per-connection messages per second, then 1 in 100.
	p.connLog = p.log.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(c, time.Second, 5, 100)
	}))
	p.ports.warn = func(err error) {
		p.log.Warn("cannot read the kernel's local port range; listeners bind port 0, which is slower with thousands of them", zap.Error(err))
	}
	p.health = newHealth(cfg.clock(), cfg.EjectBase, cfg.EjectMax)
	cfg.Metrics.setSource(p.walkMetrics)
	p.runner = NewRunner(cfg.Sync, p.sync)
	p.tracker = NewTracker(p.log, func() {
		if cfg.OnChange != nil {
			cfg.OnChange()
		}
		cfg.Metrics.queued(cfg.clock().Now())
		p.runner.Run()
	})
	p.tracker.OnReject = cfg.OnReject
	cfg.Metrics.setPending(p.tracker.Pending)
	return p
}

// Tracker returns the tracker that sources feed.
func (p *Proxier) Tracker() *Tracker { return p.tracker }

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

// refreshLocalAddrs re-reads the node's addresses.
func (p *Proxier) refreshLocalAddrs() {
	var addrs []netip.Addr
	if p.cfg.LocalAddrs != nil {
		var err error
		if addrs, err = p.cfg.LocalAddrs(); err != nil {
			p.log.Warn("cannot list the node's addresses", zap.Error(err))
			return
		}
	} else {
		ifAddrs, err := net.InterfaceAddrs()
		if err != nil {
			p.log.Warn("cannot list the node's addresses", zap.Error(err))
			return
		}
		for _, a := range ifAddrs {
			if n, ok := a.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(n.IP); ok {
					addrs = append(addrs, ip.Unmap())
				}
			}
		}
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	p.localAddrs.Store(&addrs)
}

// internalClient reports whether a client is a pod or the node itself, which
// kube-proxy sends to the cluster endpoints even when they reach a service
// through an external address with externalTrafficPolicy Local.
func (p *Proxier) internalClient(ip netip.Addr) bool {
	if ip.IsLoopback() {
		return true
	}
	for _, c := range p.cfg.ClusterCIDRs {
		if c.Contains(ip) {
			return true
		}
	}
	return p.localAddr(ip)
}

// Run syncs until ctx is done. It does not close listeners: call Shutdown.
func (p *Proxier) Run(ctx context.Context) {
	// As kube-proxy's SyncLoop: the first sync is queued as the informers
	// start listing.
	p.cfg.Metrics.queued(p.cfg.clock().Now())
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

// portKey names one listener: a service port in one address family.
type portKey struct {
	name ServicePortName
	v6   bool
	// slot numbers the further sockets of a shared listener that listens
	// on a range of ports (sharedRedirectPorts): slot i listens on the
	// shared listener's port + i. Zero on every other listener.
	slot int
}

func (k portKey) network() string {
	n := "tcp"
	if k.name.Protocol == v1.ProtocolUDP {
		n = "udp"
	}
	if k.v6 {
		return n + "6"
	}
	return n + "4"
}

// sync applies the tracker's changes. It runs only on the runner's goroutine.
func (p *Proxier) sync(ctx context.Context, full bool) error {
	if !p.tracker.Synced() {
		if p.tracker.takeSeed() {
			p.applyPrevious(ctx)
		}
		p.log.Info("waiting for the initial lists of Services and EndpointSlices before syncing")
		return ErrSyncSkipped
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
	p.refreshLocalAddrs()
	var programmed []types.NamespacedName
	if reapply {
		for name := range p.services {
			programmed = append(programmed, name)
		}
	}
	ch := p.tracker.Take(reapply, programmed)
	p.cfg.Metrics.countChanges(ch.ServiceChanges, ch.SliceChanges)
	zone := p.currentZone()
	wants := make([]serviceWant, len(ch.Services))
	for i, st := range ch.Services {
		wants[i] = wantOf(st, p.cfg.Defaults)
	}
	opened := p.openListeners(ctx, wants)
	for _, w := range wants {
		p.applyService(ctx, w, zone, opened)
	}
	// The shared listeners' routes, like the rules, follow the intercepts:
	// they change only with them (rulesDirty).
	if reapply || p.rulesDirty {
		p.rebuildRoutes()
	}
	p.syncServiceHealth(full)
	var rules RuleStats
	synced := false
	if p.cfg.Rules != nil && (full || p.rulesDirty) {
		var err error
		if rules, err = p.cfg.Rules.SyncRules(ctx, p.Intercepts(), full); err != nil {
			p.rulesDirty = true
			p.log.Error("syncing rules failed; will retry with a full resync", zap.Error(err))
			return fmt.Errorf("syncing rules: %w", err)
		}
		synced = true
	}
	p.rulesDirty = false
	if p.closeRetired() && p.requeued {
		// The ports just freed may be what a failed listener lacked (a
		// full --proxy-port-range): retry now, not at the next full sync.
		p.runner.Run()
	}
	p.requeued = false
	end := p.cfg.clock().Now()
	p.lastSync.Store(end.UnixNano())
	p.cfg.Inherited.synced(p.log)
	p.saveStateAfterSync(len(ch.Services) > 0)
	p.cfg.Metrics.observeSync(start, end, full, ch.TriggerTimes)
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

// closeRetired closes the listeners that applied services let go. The
// sync calls it only once the rules that sent traffic to them are gone
// from the kernel: a listener closed first leaves its port free while a
// rule still redirects a Service's traffic there, for any local process
// to bind (#30). It reports whether it closed any. Called by the sync
// goroutine, or by Shutdown after it.
func (p *Proxier) closeRetired() bool {
	if len(p.retired) == 0 {
		return false // and writes nothing: most syncs retire nothing
	}
	for _, l := range p.retired {
		p.closeListener(l)
	}
	clear(p.retired)
	p.retired = p.retired[:0]
	return true
}

// walkMetrics yields the metrics of every service port's snapshots, as
// the status entries hold them. Safe for concurrent use.
func (p *Proxier) walkMetrics(yield func(*portMetrics) bool) {
	p.statusPorts.Range(func(_, ports any) bool {
		for _, sp := range ports.([]statusPort) {
			if !yield(sp.snap.metrics) {
				return false
			}
		}
		return true
	})
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
		n += len(l.snap.Load().endpoints)
	}
	return n
}

// serviceWant is a changed service and the listeners it wants: one per
// service port and family of its cluster IPs, in the service's order. A
// deleted service wants none.
type serviceWant struct {
	st    ServiceState
	ports []wantedPort
}

// wantedPort is a listener that a service wants, and the cluster IP it
// serves. A service has few, so a slice, searched by want, costs less
// than a map: a first sync holds the wants of every service at once.
type wantedPort struct {
	key portKey
	sp  *ServicePort
	vip netip.Addr
}

// wantOf returns the listeners st wants.
func wantOf(st ServiceState, defaults ServiceDefaults) serviceWant {
	w := serviceWant{st: st}
	if st.Service == nil {
		return w
	}
	for _, sp := range ServicePorts(st.Service, defaults) {
		for _, ip := range sp.ClusterIPs {
			wp := wantedPort{key: portKey{name: sp.Name, v6: ip.Is6()}, sp: sp, vip: ip}
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
func (w serviceWant) want(k portKey) bool {
	return slices.ContainsFunc(w.ports, func(wp wantedPort) bool { return wp.key == k })
}

// opening is a listener that openListeners bound ahead of applyService,
// or why it could not.
type opening struct {
	l   *listener
	err error
}

// openListeners opens the per-service listeners that the changed services
// want and do not have, before they are applied: every one of them on a
// first sync. This goroutine binds them one by one in the services' order,
// so each gets the port that opening them in applyService would give it (a
// --proxy-port-range is handed out in order). Meanwhile workers on the other
// CPUs finish the bound ones (startListener: socket options, the runtime's
// poller, the log line, starting to accept), which is more than half of a
// listener's cost, so a large first sync is shorter.
//
// applyService takes the listeners from the result. It is empty, and
// applyService opens them itself, with a single CPU, or with fewer than
// two listeners to open. The workers belong to this call and end with it.
func (p *Proxier) openListeners(ctx context.Context, wants []serviceWant) map[portKey]opening {
	var need []portKey
	for _, w := range wants {
		have := p.services[w.st.Name]
		for _, wp := range w.ports {
			if have[wp.key] == nil && !p.cfg.sharedFor(wp.key.name.Protocol) {
				need = append(need, wp.key)
			}
		}
	}
	workers := min(runtime.GOMAXPROCS(0)-1, len(need)-1)
	if workers < 1 {
		return nil
	}
	opened := make(map[portKey]opening, len(need))
	bound := make(chan *listener, 64)
	var (
		wg       sync.WaitGroup
		failedMu sync.Mutex
		failed   = map[*listener]error{}
	)
	for range workers {
		wg.Go(func() {
			for l := range bound {
				if err := p.startListener(l); err != nil {
					failedMu.Lock()
					failed[l] = err
					failedMu.Unlock()
				}
			}
		})
	}
	for _, k := range need {
		l, err := p.bindListener(ctx, k, 0)
		opened[k] = opening{l: l, err: err}
		if err == nil {
			bound <- l
		}
	}
	close(bound)
	wg.Wait()
	for l, err := range failed {
		p.unbindListener(l)
		opened[l.key] = opening{err: err}
	}
	return opened
}

// applyService makes the listeners of one service match its objects. The
// listeners it wants that are in opened are taken from there rather than
// opened.
func (p *Proxier) applyService(ctx context.Context, w serviceWant, zone string, opened map[portKey]opening) {
	st := w.st
	p.warnIgnored(st)
	// The snapshots built below take their metric counters in this round;
	// retainService then drops the ports and backends none of them took.
	p.cfg.Metrics.beginService()
	p.endpoints -= p.serviceEndpoints(st.Name)
	defer func() { p.endpoints += p.serviceEndpoints(st.Name) }()
	have := p.services[st.Name]
	for k, l := range have {
		if !w.want(k) {
			p.retired = append(p.retired, l)
			delete(have, k)
			p.rulesDirty = true
			if !w.want(portKey{name: k.name, v6: !k.v6}) {
				delete(p.slots, k.name) // the port is gone in both families
			}
		}
	}
	failed := false
	var noLocal noLocalCounts
	hashing := p.beginHashing(st.Name)
	defer p.endHashing(st.Name, hashing)
	for _, wp := range w.ports {
		k, sp := wp.key, wp.sp
		l := have[k]
		if l == nil {
			var err error
			switch o, ok := opened[k]; {
			case ok:
				l, err = o.l, o.err
			case p.cfg.sharedFor(k.name.Protocol):
				l, err = p.hostOn(ctx, k)
			default:
				l, err = p.openListener(ctx, k)
			}
			if err != nil {
				p.log.Error("cannot open listener; will retry", zap.Stringer("servicePort", sp.Name), zap.Error(err))
				failed = true
				continue
			}
			if have == nil {
				have = map[portKey]*listener{}
				p.services[st.Name] = have
			}
			have[k] = l
		}
		old := l.snap.Load()
		next := p.buildSnapshot(l, sp, wp.vip, st, zone, old, hashing)
		if old == nil || !slices.EqualFunc(l.intercepts(old), l.intercepts(next), interceptEqual) {
			p.rulesDirty = true
		}
		l.snap.Store(next)
		if internal, external := noLocalOf(sp, next.endpoints, next.sets); internal || external {
			f := familyIndex(familyOf(k.v6))
			noLocal[f][0] += b2i(internal)
			noLocal[f][1] += b2i(external)
		}
	}
	p.cfg.Metrics.setNoLocal(st.Name, noLocal)
	if len(have) == 0 {
		delete(p.services, st.Name)
	}
	p.cfg.Metrics.retainService(st.Name.String())
	p.updateStatus(st.Name)
	p.updateServiceHealth(st.Name)
	if failed {
		p.tracker.Requeue(st.Name)
		p.requeued = true
	}
}

// buildSnapshot builds a listener's next data-path state. Backends that
// survive keep their identity, so active counts and ejections carry over.
// Source-hash balancers take their tables from hashing.
func (p *Proxier) buildSnapshot(l *listener, sp *ServicePort, vip netip.Addr, st ServiceState, zone string, old *snapshot, hashing *serviceHashing) *snapshot {
	s := &snapshot{sp: sp, vip: netip.AddrPortFrom(vip, sp.Port), nodePort: sp.NodePort, slots: p.portSlots(sp.Name)}
	for _, ip := range slices.Concat(sp.ExternalIPs, sp.LoadBalancerIPs) {
		if ip.Is6() == l.key.v6 {
			s.external = append(s.external, ip)
		}
	}
	eps, refused := portEndpoints(sp, st.Slices, func(ap netip.AddrPort) string { return p.endpointRefusal(sp, ap) })
	for _, r := range refused {
		if r.addr.Addr().Is6() == l.key.v6 { // once, by the listener of its family
			p.log.Warn("refusing an endpoint; the service's other endpoints are used",
				zap.String("kind", "EndpointSlice"), zap.String("object", r.slice), zap.String("field", r.field),
				zap.Stringer("endpoint", r.addr), zap.Stringer("servicePort", sp.Name), zap.String("reason", r.reason))
		}
	}
	otherFamily := func(e Endpoint) bool { return e.Addr.Addr().Is6() != l.key.v6 }
	if !slices.ContainsFunc(eps, otherFamily) {
		s.endpoints = eps // all of the listener's family: no copy (snapshots are immutable)
	} else {
		s.endpoints = slices.DeleteFunc(eps, otherFamily) // eps is this call's own
	}
	s.sets = CategorizeEndpoints(s.endpoints, sp, p.cfg.NodeName, zone)

	// One Backend per endpoint address, shared by both sets, found by a
	// scan of s.backends while there are few (smallSet).
	var byAddr map[netip.AddrPort]*balancer.Backend
	if len(s.endpoints) > smallSet {
		byAddr = make(map[netip.AddrPort]*balancer.Backend, len(s.endpoints))
	}
	find := func(a netip.AddrPort) *balancer.Backend {
		if byAddr == nil {
			return s.backend(a)
		}
		return byAddr[a]
	}
	backendsOf := func(eps []Endpoint) []*balancer.Backend {
		out := make([]*balancer.Backend, 0, len(eps))
		for _, e := range eps {
			b := find(e.Addr)
			if b == nil {
				w := sp.Weights[e.Addr.Addr()]
				if old != nil {
					if ob := old.backend(e.Addr); ob != nil && ob.Weight == w {
						b = ob
					}
				}
				if b == nil {
					b = balancer.NewBackend(e.Addr, w)
				}
				if byAddr != nil {
					byAddr[e.Addr] = b
				}
				s.backends = append(s.backends, b)
			}
			out = append(out, b)
		}
		return out
	}
	cluster, local := backendsOf(s.sets.Cluster), backendsOf(s.sets.Local)
	if old != nil {
		for _, ob := range old.backends {
			if find(ob.Addr) != ob {
				p.health.forget(ob)
			}
		}
	}
	if sp.AffinityTimeout > 0 {
		if l.affinity == nil || l.affinityTimeout != sp.AffinityTimeout {
			l.affinity = balancer.NewAffinityTable(balancer.AffinityConfig{
				Timeout: sp.AffinityTimeout,
				Now:     p.cfg.clock().Now,
			})
			l.affinityTimeout = sp.AffinityTimeout
		}
	} else {
		l.affinity = nil
	}
	build := func(bs []*balancer.Backend) balancer.Balancer {
		var bal balancer.Balancer
		if sp.Balancer == balancer.SourceHash {
			bal = hashing.balancer(bs)
		} else {
			bal = balancer.New(sp.Balancer, bs)
		}
		if l.affinity != nil {
			bal = l.affinity.Wrap(bal, bs)
		}
		return bal
	}
	s.cluster, s.local = build(cluster), build(local)
	s.clusterBackends, s.localBackends = cluster, local
	s.affinity = l.affinity
	s.metrics = p.cfg.Metrics.forPort(sp, s.backends)
	return s
}

// endpointRefusal returns why sp must not send traffic to the endpoint
// ap, or "" when it may (see portEndpoints). Besides the addresses that
// no Service may use (endpointAddrRefusal), it refuses:
//   - an address and port that sp itself intercepts: the proxy's own
//     dial skips this node's rules (Config.OwnMark) but not another
//     node's, which would send it back, and so on (#30);
//   - on an address of this node, the proxy's own ports: sp's node
//     port, a listener port, or a server of ServerAddrs, which a pod
//     must not reach through a Service address.
//
// Called by the sync goroutine, which owns the port allocator.
func (p *Proxier) endpointRefusal(sp *ServicePort, ap netip.AddrPort) string {
	ip, port := ap.Addr(), ap.Port()
	if why := endpointAddrRefusal(ip, p.cfg.LoopbackEndpoints); why != "" {
		return why
	}
	if port == sp.Port && (slices.Contains(sp.ClusterIPs, ip) || slices.Contains(sp.ExternalIPs, ip) || slices.Contains(sp.LoadBalancerIPs, ip)) {
		return "the service port's own address and port: the proxy's connections to it would be intercepted again"
	}
	for _, s := range p.cfg.ServerAddrs {
		if sp.Name.Protocol == v1.ProtocolTCP && s.Port() == port && (s.Addr().Unmap() == ip || s.Addr().IsUnspecified() && p.localAddr(ip)) {
			return "an address of the proxy's own servers"
		}
	}
	if !p.localAddr(ip) {
		return ""
	}
	if sp.NodePort != 0 && port == sp.NodePort {
		return "the service port's own node port on an address of this node"
	}
	if p.ports.inUse(portKey{name: sp.Name, v6: ip.Is6()}.network(), port) {
		return "a listener port of the proxy on an address of this node"
	}
	return ""
}

// localAddr reports whether ip is one of the node's addresses, as the
// last sync read them.
func (p *Proxier) localAddr(ip netip.Addr) bool {
	if addrs := p.localAddrs.Load(); addrs != nil {
		_, found := slices.BinarySearchFunc(*addrs, ip, netip.Addr.Compare)
		return found
	}
	return false
}

// intercepts returns the addresses whose traffic the kernel must send to
// l, given its snapshot s.
func (l *listener) intercepts(s *snapshot) []Intercept {
	proto := s.sp.Name.Protocol
	base := Intercept{Service: s.sp.Name, Protocol: proto, Port: s.sp.Port, ListenPort: l.port, ListenPortEnd: l.portEnd}
	out := []Intercept{with(base, ClusterIP, s.vip.Addr())}
	for _, ip := range s.sp.ExternalIPs {
		if ip.Is6() == l.key.v6 {
			out = append(out, with(base, ExternalIP, ip))
		}
	}
	for _, ip := range s.sp.LoadBalancerIPs {
		if ip.Is6() == l.key.v6 {
			i := with(base, LoadBalancerIP, ip)
			i.SourceRanges = s.sp.SourceRanges
			out = append(out, i)
		}
	}
	if s.nodePort != 0 {
		any := netip.IPv4Unspecified()
		if l.key.v6 {
			any = netip.IPv6Unspecified()
		}
		i := with(base, NodePort, any)
		i.Port = s.nodePort
		out = append(out, i)
	}
	return out
}

func with(i Intercept, k InterceptKind, ip netip.Addr) Intercept {
	i.Kind, i.VIP = k, ip
	return i
}

func interceptEqual(a, b Intercept) bool {
	return a.Service == b.Service && a.Kind == b.Kind && a.Protocol == b.Protocol && a.VIP == b.VIP &&
		a.Port == b.Port && a.ListenPort == b.ListenPort && a.ListenPortEnd == b.ListenPortEnd &&
		slices.Equal(a.SourceRanges, b.SourceRanges)
}

// Intercepts returns the intercepts of every listener, sorted. It must be
// called from the sync goroutine (or before Run).
func (p *Proxier) Intercepts() []Intercept {
	var out []Intercept
	for _, ls := range p.services {
		for _, l := range ls {
			out = append(out, l.intercepts(l.snap.Load())...)
		}
	}
	slices.SortFunc(out, func(a, b Intercept) int {
		if c := a.VIP.Compare(b.VIP); c != 0 {
			return c
		}
		if a.Port != b.Port {
			return int(a.Port) - int(b.Port)
		}
		if a.Protocol != b.Protocol {
			return strings.Compare(string(a.Protocol), string(b.Protocol))
		}
		if a.Kind != b.Kind {
			return int(a.Kind) - int(b.Kind)
		}
		// Two services claiming one destination: the first wins in the
		// rules, and in a shared listener's routes (servicePortLess).
		return strings.Compare(a.Service.String(), b.Service.String())
	})
	return out
}

// updateServiceHealth records service name's health-check port and
// ready local endpoints, as its listeners now have them, and marks them
// for the ServiceHealth server if they changed. It looks at that one
// service, so that an endpoint change costs the same however many
// services there are.
func (p *Proxier) updateServiceHealth(name types.NamespacedName) {
	if p.cfg.ServiceHealth == nil {
		return
	}
	var (
		port  uint16
		local map[netip.Addr]bool
	)
	for _, l := range p.services[name] {
		s := l.snap.Load()
		if s.sp.HealthCheckNodePort == 0 {
			continue
		}
		port = s.sp.HealthCheckNodePort
		for _, e := range s.sets.Local {
			if e.Ready {
				if local == nil {
					local = map[netip.Addr]bool{}
				}
				local[e.Addr.Addr()] = true
			}
		}
	}
	oldPort, had := p.hcPorts[name]
	if port == 0 {
		if had {
			delete(p.hcPorts, name)
			delete(p.hcLocal, name)
			p.hcDirty = true
		}
		return
	}
	if !had || oldPort != port || p.hcLocal[name] != len(local) {
		p.hcPorts[name], p.hcLocal[name] = port, len(local)
		p.hcDirty = true
	}
}

// syncServiceHealth hands the health-check ports and local endpoint counts
// to the ServiceHealth server when they have changed, when its last
// SyncServices failed (it retries the ports it could not bind), and on
// every full sync.
func (p *Proxier) syncServiceHealth(full bool) {
	if p.cfg.ServiceHealth == nil || !p.hcDirty && !full {
		return
	}
	p.hcDirty = false
	if err := p.cfg.ServiceHealth.SyncServices(p.hcPorts); err != nil {
		p.hcDirty = true
		p.log.Error("serving health-check node ports", zap.Error(err))
	}
	if err := p.cfg.ServiceHealth.SyncEndpoints(p.hcLocal); err != nil {
		p.hcDirty = true
		p.log.Error("updating health-check node ports", zap.Error(err))
	}
}

// snapshot is a listener's data-path state: immutable, replaced whole.
type snapshot struct {
	sp        *ServicePort
	vip       netip.AddrPort // the cluster IP and port of the listener's family
	external  []netip.Addr   // external and load-balancer IPs of the family, at sp.Port
	nodePort  uint16
	endpoints []Endpoint // all endpoints of the listener's family
	sets      EndpointSets
	backends  []*balancer.Backend // every backend of cluster and local
	// cluster and local balance the two endpoint sets; a balancer over an
	// empty set picks nothing.
	cluster, local                 balancer.Balancer
	clusterBackends, localBackends []*balancer.Backend
	// metrics are the metric children of the service port and of each
	// backend; nil when metrics are disabled.
	metrics *portMetrics
	// affinity is the ClientIP affinity table the balancers wrap; nil
	// without session affinity. Read by Explain (Lookup has no effects).
	affinity *balancer.AffinityTable
	// slots counts the service port's TCP connections against
	// sp.MaxConnections; shared with the port's other listener and with
	// the snapshots before and after this one.
	slots *connSlots
}

// route returns the balancer for a connection that was originally sent to
// dst by client, applying the traffic policies; nil when dst is not one of
// this service port's addresses. known is false when the original
// destination is unknown (no OriginalDst configured): the cluster IP is
// assumed.
func (s *snapshot) route(dst netip.AddrPort, known bool, client netip.Addr, internal func(netip.Addr) bool) balancer.Balancer {
	toClusterIP := !known || (dst.Addr().Unmap() == s.vip.Addr() && dst.Port() == s.vip.Port())
	if !toClusterIP {
		external := (s.nodePort != 0 && dst.Port() == s.nodePort) ||
			(dst.Port() == s.vip.Port() && slices.Contains(s.external, dst.Addr().Unmap()))
		if !external {
			return nil
		}
	}
	if policySet(s.sp, toClusterIP, client, internal).local() {
		return s.local
	}
	return s.cluster
}

// endpointSet is the traffic policies' choice of a service port's
// endpoints for one flow, with the reason for it.
type endpointSet uint8

const (
	// clusterSet: no Local policy applies to the flow.
	clusterSet endpointSet = iota
	// localInternal: internalTrafficPolicy Local, for traffic to the
	// cluster IP.
	localInternal
	// localExternal: externalTrafficPolicy Local, for external traffic
	// from a client outside the cluster.
	localExternal
	// clusterShortCircuit: externalTrafficPolicy Local, but the client is
	// a pod or the node, which kube-proxy sends to the cluster set so that
	// a pod can reach a service whose endpoints are all on other nodes.
	clusterShortCircuit
)

// local reports whether the choice is the local endpoint set.
func (e endpointSet) local() bool { return e == localInternal || e == localExternal }

// policySet applies sp's traffic policies to a flow from client, sent to
// the cluster IP (toClusterIP) or to one of the external addresses (an
// external or load-balancer IP, or a node port). internal reports whether
// a client is a pod or the node; it is called only under
// externalTrafficPolicy Local. The data path (snapshot.route) and Explain
// both decide with it, so that Explain reports what the data path does.
func policySet(sp *ServicePort, toClusterIP bool, client netip.Addr, internal func(netip.Addr) bool) endpointSet {
	switch {
	case toClusterIP && sp.InternalPolicyLocal:
		return localInternal
	case toClusterIP || !sp.ExternalPolicyLocal:
		return clusterSet
	case internal(client):
		return clusterShortCircuit
	}
	return localExternal
}

// serves reports whether b is one of the backends that balancer set picks
// from (the snapshot's cluster or local balancer).
func (s *snapshot) serves(set balancer.Balancer, b *balancer.Backend) bool {
	bs := s.clusterBackends
	if set == s.local {
		bs = s.localBackends
	}
	return slices.Contains(bs, b)
}

func (s *snapshot) backend(addr netip.AddrPort) *balancer.Backend {
	for _, b := range s.backends {
		if b.Addr == addr {
			return b
		}
	}
	return nil
}

// listener is one service port's socket in one family, or, in the shared
// layout, either a service port hosted by a shared listener (host set, no
// socket of its own) or a shared listener itself (routes set, no
// snapshot).
type listener struct {
	key  portKey
	ln   net.Listener // TCP
	pc   *net.UDPConn // UDP
	port uint16
	// portEnd, above port, is the last of the consecutive ports that a
	// shared listener listens on, itself on port and its siblings on the
	// rest; a hosted listener has its host's. Zero means port alone.
	portEnd uint16
	// siblings are a shared listener's further sockets, on port+1 to
	// portEnd (slots 1 and up), each accepted on as the listener is, with
	// the same route table.
	siblings []*listener
	// raw is the listening socket when the event loops accept on it
	// (accept.go); ln is then nil.
	raw  *loopListener
	snap atomic.Pointer[snapshot]
	// host is the shared listener that receives this service port's
	// traffic; nil when the listener has its own socket.
	host *listener
	// routes is a shared listener's route table; nil on every other
	// listener.
	routes atomic.Pointer[routeTable]

	// Owned by the sync goroutine.
	affinity        *balancer.AffinityTable
	affinityTimeout time.Duration
}

func (p *Proxier) listen(ctx context.Context, network, addr string) (net.Listener, error) {
	if p.cfg.Listen != nil {
		return p.cfg.Listen(ctx, network, addr)
	}
	lc := p.listenConfig()
	return lc.Listen(ctx, network, addr)
}

// openListener binds a listener for k on all addresses of its family (the
// kernel's REDIRECT rewrites the destination to a local address: 127.0.0.1
// or ::1 for OUTPUT, the incoming interface's address for PREROUTING) and
// starts accepting on it (startAccepting).
func (p *Proxier) openListener(ctx context.Context, k portKey) (*listener, error) {
	return p.openListenerAt(ctx, k, 0)
}

// openListenerAt is openListener on port exactly, or, when exact is zero,
// on the port that adoptOrAllocate finds.
func (p *Proxier) openListenerAt(ctx context.Context, k portKey, exact uint16) (*listener, error) {
	l, err := p.bindListener(ctx, k, exact)
	if err != nil {
		return nil, err
	}
	if err := p.startListener(l); err != nil {
		p.unbindListener(l)
		return nil, err
	}
	return l, nil
}

// claimListener makes a redirect-mode listener's socket transparent
// (IP_TRANSPARENT, which takes CAP_NET_ADMIN or CAP_NET_RAW): the kernel
// rules (UPROXY-LISTENERS) hand what they redirect only to a transparent
// socket, so a local process that binds a listener port the proxy has
// let go, or left behind when it died, receives none of a Service's
// traffic (#30). An inherited socket gets it too, as an older version
// did not set it. Tproxy-mode listeners are transparent already.
func (p *Proxier) claimListener(l *listener) {
	var rc syscall.RawConn
	switch {
	case l.ln != nil:
		rc = listenerRawConn(l.ln)
	case l.pc != nil:
		rc, _ = l.pc.SyscallConn()
	}
	if rc == nil {
		return
	}
	if err := setTransparent(l.key.network(), rc, false); err != nil {
		p.log.Warn("cannot make the listener transparent; the kernel rules refuse the connections redirected to it",
			zap.Stringer("servicePort", l.key.name), zap.Uint16("port", l.port), zap.Error(err))
	}
}

// unbindListener closes a listener that startListener could not start,
// and frees its port. It runs on the sync goroutine, which owns the port
// allocator.
func (p *Proxier) unbindListener(l *listener) {
	l.close()
	p.ports.release(l.key.network(), l.port)
}

// bindListener is the first half of openListenerAt: it binds (or adopts)
// l's socket. It runs on the sync goroutine, which owns the port
// allocator.
func (p *Proxier) bindListener(ctx context.Context, k portKey, exact uint16) (*listener, error) {
	host := "0.0.0.0"
	if k.v6 {
		host = "::"
	}
	if p.cfg.Transparent {
		// TPROXY --on-ip hands packets to the loopback listener whatever
		// their destination; nothing else can reach it.
		host = "127.0.0.1"
		if k.v6 {
			host = "::1"
		}
	}
	network := k.network()
	l := &listener{key: k}
	udp := k.name.Protocol == v1.ProtocolUDP
	port, err := p.adoptOrAllocate(l, host, exact, func(port uint16) (uint16, error) {
		addr := net.JoinHostPort(host, strconv.Itoa(int(port)))
		var local net.Addr
		if udp {
			pc, err := p.listenUDP(ctx, network, addr)
			if err != nil {
				return 0, err
			}
			l.pc, local = pc, pc.LocalAddr()
		} else {
			ln, err := p.listen(ctx, network, addr)
			if err != nil {
				return 0, err
			}
			l.ln, local = ln, ln.Addr()
		}
		ap, err := netip.ParseAddrPort(local.String())
		if err != nil {
			l.close()
			return 0, fmt.Errorf("listener address %s: %w", local, err)
		}
		return ap.Port(), nil
	})
	if err != nil {
		return nil, fmt.Errorf("listening for %s (%s): %w", k.name, network, err)
	}
	l.port = port
	return l, nil
}

// startListener is the second half of openListenerAt: it readies l's
// bound socket for accepting and starts its accept or read loop. It is
// safe to call for different listeners concurrently, and concurrently
// with bindListener. An error means that nothing accepts on l: the caller
// closes it (unbindListener), and the service port is reported and
// retried as one whose listener could not be opened.
func (p *Proxier) startListener(l *listener) error {
	k, network, port := l.key, l.key.network(), l.port
	if p.cfg.Rules != nil && !p.cfg.Transparent {
		p.claimListener(l)
	}
	if rc := listenerRawConn(l.ln); rc != nil {
		// Once the socket is bound, whether bound here or inherited, and
		// not on the attempts whose bind failed. Setting them before bind
		// and again for the event loops cost 4 more system calls per listener:
		// 40,000 for the first sync of 10,000 services.
		if err := setAcceptOptions(rc); err != nil {
			p.log.Warn("cannot set the listener's socket options; accepted connections go without keep-alive",
				zap.Stringer("servicePort", k.name), zap.Error(err))
		}
		if fd := p.rawListenerFD(rc); fd >= 0 {
			// The duplicate is the socket's only descriptor from now on.
			// Keeping both cost a second descriptor per listener (10,000
			// services then needed 20,000, a common hard limit) and a
			// registration in the runtime's poller, which woke for every
			// connection too. Closing the original leaves the socket
			// listening: it is closed with its last descriptor.
			l.ln.Close()
			l.ln, l.raw = nil, p.newLoopListener(l, fd)
		}
	}
	if l.pc != nil {
		if err := p.loopPacketListener(l); err != nil {
			return fmt.Errorf("listening for %s (%s): %w", k.name, network, err)
		}
	}
	adopted, err := p.startAdopted(l)
	if err == nil && !adopted {
		err = p.startAccepting(l)
	}
	if err != nil {
		return fmt.Errorf("listening for %s (%s): %w", k.name, network, err)
	}
	p.log.Info("listening", zap.Stringer("servicePort", k.name), zap.String("network", network), zap.Uint16("port", port))
	return nil
}

// startAccepting starts accepting on l, or reading from it: with the
// event loops (l.raw), which serve it from then on, or on a goroutine of
// its own, which ends when l is closed.
//
// Only the loops can fail it: when none can be started (no descriptor
// left for an epoll instance) or they are stopping.
func (p *Proxier) startAccepting(l *listener) error {
	if l.raw != nil {
		if err := p.loops.listen(l.raw); err != nil {
			return fmt.Errorf("no event loop to accept on it: %w", err)
		}
		return nil
	}
	p.wg.Add(1)
	if l.key.name.Protocol == v1.ProtocolUDP {
		go p.udpLoop(l)
	} else {
		go p.acceptLoop(l)
	}
	return nil
}

// close closes l's socket, which ends its accept or read loop.
func (l *listener) close() {
	if l.raw != nil {
		l.raw.close()
	}
	if l.ln != nil {
		l.ln.Close()
	}
	if l.pc != nil {
		l.pc.Close()
	}
}

// closeListener stops accepting for l. Its established connections go on.
// A hosted service port only leaves its shared listener: the next route
// table no longer has it, and its UDP flows end now, as a closed socket's
// would.
func (p *Proxier) closeListener(l *listener) {
	if l.host != nil {
		if l.key.name.Protocol == v1.ProtocolUDP {
			p.removeFlows(l)
		}
		p.log.Info("removed service port from the shared listener", zap.Stringer("servicePort", l.key.name), zap.Uint16("port", l.port))
		return
	}
	l.close()
	p.ports.release(l.key.network(), l.port)
	p.log.Info("closed listener", zap.Stringer("servicePort", l.key.name), zap.Uint16("port", l.port))
}

// acceptLoop accepts until l is closed. On temporary errors (EMFILE,
// ENFILE, ENOBUFS) it backs off from 5ms to 1s, as net/http's Server does,
// instead of spinning or exiting: the old userspace proxy died here.
func (p *Proxier) acceptLoop(l *listener) {
	defer p.wg.Done()
	var delay time.Duration
	for {
		c, err := l.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			delay = p.acceptBackoff(l, delay, err)
			continue
		}
		delay = 0
		tc, ok := c.(*net.TCPConn)
		if !ok {
			c.Close()
			continue
		}
		s := p.newSession(tc, -1)
		if s == nil {
			tc.Close()
			continue
		}
		go p.serveTCP(l, tc, s)
	}
}

// acceptBackoff logs a failed accept and sleeps before the next one: 5ms
// after the first failure in a row, twice as long after each next one, up
// to 1s. It returns the delay slept.
func (p *Proxier) acceptBackoff(l *listener, delay time.Duration, err error) time.Duration {
	delay = min(max(2*delay, acceptBackoffMin), acceptBackoffMax)
	p.connLog.Warn("accept failed; backing off", zap.Stringer("servicePort", l.key.name), zap.Duration("delay", delay), zap.Error(err))
	time.Sleep(delay)
	return delay
}

// listenerRawConn returns the RawConn of ln, a TCP listener's socket; nil
// for no listener (a UDP listener has none) or one that is no socket (from
// Config.Listen).
func listenerRawConn(ln net.Listener) syscall.RawConn {
	sc, ok := ln.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// rawListenerFD returns a duplicate of a listener's socket, rc, for
// the event loops to accept on or read; -1 without event loops, with a dialer of
// the caller's (Config.Dial, which needs the goroutine path), or if it
// cannot be duplicated. The caller then closes the listener, leaving the
// duplicate as the socket's only descriptor.
func (p *Proxier) rawListenerFD(rc syscall.RawConn) int {
	if p.loops.n <= 0 || p.cfg.Dial != nil {
		return -1
	}
	nfd, err := dupRaw(rc)
	if err != nil {
		return -1
	}
	return nfd
}

// newLoopListener returns the loopListener of l's socket fd: the event
// loops accept on it straight with accept4(2), and the accepted sockets
// inherit its options (keep-alive, TCP_NODELAY). An accepted socket never
// joins the runtime's poller, which would cost six system calls per
// connection for nothing: register it, read its local address, set
// TCP_NODELAY, then duplicate it, deregister it and close it when it moves
// to a loop.
func (p *Proxier) newLoopListener(l *listener, fd int) *loopListener {
	serve := func(el *eventLoop, fd int, client netip.AddrPort) {
		s := p.newSession(nil, fd)
		if s == nil {
			unix.Close(fd)
			return
		}
		p.startTCP(el, l, accepted{rc: fdConn(fd), client: client}, s)
	}
	failed := func(err error, delay time.Duration) {
		if delay == 0 {
			p.log.Error("cannot accept on the listener: registering it with an event loop failed", zap.Stringer("servicePort", l.key.name), zap.Error(err))
			return
		}
		p.connLog.Warn("accept failed; backing off", zap.Stringer("servicePort", l.key.name), zap.Duration("delay", delay),
			zap.Error(os.NewSyscallError("accept4", err)))
	}
	return newLoopListener(fd, serve, failed)
}

// Shutdown stops accepting on every listener, then waits for established
// connections to finish until ctx is done, and then closes the rest
// (Drain). Unlike StopListening it refuses, from the start, connections
// that were accepted but not yet proxied. It leaves the kernel rules in
// place for the next instance to adopt. Call it after Run has returned.
func (p *Proxier) Shutdown(ctx context.Context) error {
	p.sessMu.Lock()
	p.closing = true
	p.sessMu.Unlock()
	for _, ls := range p.services {
		for _, l := range ls {
			p.closeListener(l)
		}
	}
	p.closeRetired()
	p.closeShared()
	p.cfg.Inherited.stop(p.log)
	return p.Drain(ctx)
}

// ActiveConnections returns the number of proxied connections in progress.
func (p *Proxier) ActiveConnections() int {
	p.sessMu.Lock()
	defer p.sessMu.Unlock()
	return len(p.sessions)
}
