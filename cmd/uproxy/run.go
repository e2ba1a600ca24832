package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/uproxy/uproxy/proxy/routing"

	"github.com/uproxy/uproxy/proxy/listeners"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/clock"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/httplimit"
	"github.com/uproxy/uproxy/internal/kubeevents"
	"github.com/uproxy/uproxy/internal/upgrade"
	"github.com/uproxy/uproxy/proxy"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/healthcheck"
	"github.com/uproxy/uproxy/proxy/service"
	"github.com/uproxy/uproxy/proxy/source"
	"github.com/uproxy/uproxy/redirect"
)

func newRunCommand(lf *logFlags) *cobra.Command {
	var o runOptions
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Proxy the Services of an API server, or of manifest files",
		Long: `run installs rules that send every Service port's cluster IPs, node ports, external IPs
and load-balancer IPs to local listeners (--mode: iptables REDIRECT, or TPROXY; --listener:
one listener per Service port, or one shared per family and protocol), and balances new
connections over the endpoints of its EndpointSlices as kube-proxy would.

The Services come from the API server (--kubeconfig, --master, or the in-cluster
configuration), or from manifests (--manifests).

On SIGTERM or SIGINT it stops accepting, lets established connections finish for up to
--drain-timeout, and leaves the rules in place for the next instance to adopt
(remove them with 'uproxy cleanup').`,
		Example: `  uproxy run --kubeconfig /etc/kubernetes/uproxy.conf --cluster-cidr 10.244.0.0/16
  uproxy run --manifests deploy/examples/
  uproxy run --manifests services.yaml --balancer least-conn --proxy-port-range 40000-40999`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if printVersion(cmd.Flags()) {
				fmt.Fprintln(cmd.OutOrStdout(), "uproxy", buildVersion())
				return nil
			}
			if err := o.kubeProxy.complete(cmd.Flags(), &o, lf); err != nil {
				return err
			}
			if err := o.validate(); err != nil {
				return err
			}
			log, err := lf.logger()
			if err != nil {
				return err
			}
			defer log.Sync()
			for _, n := range o.kubeProxy.notes {
				logNote(log, n)
			}
			if path := o.kubeProxy.writeConfigTo; path != "" {
				log.Info("--write-config-to: writing the configuration and exiting", zap.String("file", path))
				return o.writeConfig(path, lf)
			}
			if o.kubeProxy.initOnly {
				applyConntrack(o.kubeProxy.conntrack, log.Named("conntrack"))
				log.Info("--init-only: conntrack's parameters are set; exiting")
				return nil
			}
			if o.cleanupAndExit {
				// kube-proxy --cleanup, which runbooks call with whatever
				// image the DaemonSet has: uproxy's state and kube-proxy's.
				n, kerr := cleanupKubeProxy(context.Background(), redirect.OSExec{}, procIPVS)
				if kerr == nil {
					log.Info("removed kube-proxy's rules", zap.Int("removed", n))
				}
				return errors.Join(cleanup(context.Background()), kerr)
			}
			applyOOMScoreAdj(oomScoreAdjPath, o.kubeProxy.oomScoreAdj, log)
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			return run(ctx, &o, log)
		},
	}
	o.register(cmd.Flags())
	groupIgnoredFlags(cmd)
	return cmd
}

// run wires the proxier to its source, the kernel and the health servers,
// and runs until ctx is done; then it drains.
func run(ctx context.Context, o *runOptions, log *zap.Logger) error {
	noFile := logNoFile(log)
	// Check the manifests or the API server's configuration before touching
	// the kernel: a typo must stop us with the cause named.
	var client kubernetes.Interface
	if o.config == "" {
		cfg, err := clientcmd.BuildConfigFromFlags(o.master, o.kubeconfig)
		if err != nil {
			return fmt.Errorf("API server configuration (--kubeconfig, --master or in-cluster): %w", err)
		}
		cfg.UserAgent = "uproxy"
		cfg.QPS, cfg.Burst, cfg.ContentType = o.kubeProxy.apiQPS, int(o.kubeProxy.apiBurst), o.kubeProxy.apiContentType
		cfg.AcceptContentTypes = o.kubeProxy.apiAcceptContentTypes
		if client, err = kubernetes.NewForConfig(cfg); err != nil {
			return fmt.Errorf("API client: %w", err)
		}
		// The nodeport keyword 'primary' and detect-local mode NodeCIDR
		// need this node's Node object (validate resolved the rest).
		if err := o.resolveNodeAddresses(ctx, client, log.Named("node")); err != nil {
			return err
		}
	}
	var events *kubeevents.Recorder // nil without an API server
	if client != nil {
		events = kubeevents.New(ctx, client, o.nodeName)
		defer events.Stop()
	}
	if o.ports.Size > 0 {
		// The rules refuse what reaches a listener port that uproxy does
		// not hold; reserving the range keeps other processes' ephemeral
		// sockets off it, so that the listeners can hold it.
		if n, err := listeners.ExposedPorts(o.ports); err != nil {
			log.Warn("cannot check that --proxy-port-range is reserved", zap.Error(err))
		} else if n > 0 {
			log.Warn("ports of --proxy-port-range are in the kernel's ephemeral range and not reserved: another process's connection may take a listener's port; add the range to net.ipv4.ip_local_reserved_ports (deploy/README.md)",
				zap.Stringer("range", o.ports), zap.Int("ports", n))
		}
	}
	// Take the sockets over from a running uproxy (hitless upgrade; see
	// internal/upgrade), or get ready to hand ours over later.
	up := upgrade.New(upgrade.Config{
		Path:         o.upgradeSocket,
		Mode:         o.mode,
		ReadyTimeout: o.upgradeReadyTime,
		Logger:       log.Named("upgrade"),
	})
	if err := up.Start(); err != nil {
		return err
	}
	defer up.Close()

	// A registry of our own: the Go runtime's and the process's collectors
	// and the proxier's, nothing that a library registered globally. The
	// Go collector exports every runtime/metrics series, as component-base
	// registers it for kube-proxy, so that kube-proxy's go_* families are
	// all here.
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(collectors.MetricsAll)),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	health := healthcheck.NewProxyHealth(healthcheck.ProxyHealthConfig{
		Addr:          o.healthzBindAddress,
		HealthTimeout: 2 * o.syncPeriod,
		WaitForNode:   client != nil,
		Registerer:    reg,
		Logger:        log.Named("healthz"),
		Listen:        up.Listen("healthz"),
	})
	svcHealth := healthcheck.NewServiceHealth(healthcheck.ServiceHealthConfig{
		Addresses:   o.nodePortCIDRs,
		Logger:      log.Named("healthcheck"),
		ProxyHealth: health,
		Listen:      up.Listen("healthcheck"),
	})
	defer svcHealth.Close()
	tproxy := o.mode == "tproxy"
	shared := o.listener == "shared"
	var (
		sharedProtocols []v1.Protocol
		udpOriginalDst  func(client, local netip.AddrPort) (netip.AddrPort, error)
	)
	if shared {
		sharedProtocols = []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP}
	}
	if !tproxy {
		// REDIRECT rewrites a datagram's destination: a UDP listener asks
		// conntrack for each new flow's, a shared one to route the flow,
		// one of a service port's own to check that uproxy's rules sent
		// it there, and not someone straight to the listener's port.
		ct, err := redirect.NewConntrackLookup()
		if err != nil {
			return fmt.Errorf("redirect mode needs conntrack's netlink interface to find UDP flows' original destinations: %w", err)
		}
		defer ct.Close()
		udpOriginalDst = func(client, local netip.AddrPort) (netip.AddrPort, error) {
			return ct.OriginalDst(redirect.UDP, client, local)
		}
	}
	originalDst := redirect.OriginalDst
	if tproxy {
		originalDst = redirect.TProxyDst
	}
	metrics := introspect.NewMetrics(reg)
	ruleCommands := newRuleCommands(reg)
	conntrackDeleted := newConntrackDeleted(reg)
	// The rules of both families, synced side by side. NewFamilies, which
	// checks the iptables tools, runs below, once the manifests have
	// loaded.
	rulesCfg := redirect.FamiliesConfig{
		IPv4:     redirect.Config{Wait: o.iptablesWait},
		IPv6:     redirect.Config{Wait: o.iptablesWait},
		Services: redirect.ServiceOptions{NodePortAddresses: o.nodePortCIDRs, LocalhostNodePorts: o.kubeProxy.localhostNodePortsOn(o.nodePortAddresses), Shared: shared},
		Commands: func(name string) { ruleCommands.WithLabelValues(name).Inc() },
		Logger:   log.Named("rules"),
	}
	// Both modes dial backends from a client's own address where
	// kube-proxy would keep it, so both need the policy routing that
	// brings the replies back, and with br_netfilter the rules that take
	// them off a bridge.
	bridged := brNetfilterLoaded()
	if tproxy {
		rulesCfg.Services.TProxy = &redirect.TProxy{Routing: redirect.DefaultRouting, NoBridged: !bridged}
	} else {
		rulesCfg.Services.Replies = &redirect.Replies{Routing: redirect.DefaultRouting, NoBridged: !bridged}
	}
	if !bridged {
		log.Info("br_netfilter is not loaded: no rules for clients behind a Linux bridge, whose match would load it, so a backend on its client's bridge sees the node's address, not the client's (counted in uproxy_source_ip_fallbacks_total); restart uproxy after loading it")
	}
	var rules *redirect.Families // set below, before the sync loop starts
	// The stale UDP conntrack entries are deleted after each sync that
	// may have made some (syncRules), on a goroutine of their own (below).
	var stale *redirect.StaleConntrack
	if table, err := redirect.NewNetlinkConntrack(); err != nil {
		log.Warn("conntrack's netlink interface is not available: stale UDP conntrack entries, which keep a flow from uproxy's rules, will not be deleted", zap.Error(err))
	} else {
		defer table.Close() // after the goroutines, which wg.Wait waits for
		if stale, err = redirect.NewStaleConntrack(redirect.StaleConntrackConfig{
			Table:             table,
			NodePortAddresses: o.nodePortCIDRs,
			Deleted:           func(n int) { conntrackDeleted.Add(float64(n)) },
			Logger:            log.Named("conntrack"),
		}); err != nil {
			return err
		}
	}
	synced := make(chan struct{})
	restoreGC := startupGC(debug.FreeOSMemory)
	firstSync := sync.OnceFunc(func() { restoreGC(); close(synced) })
	previous := previousPorts(ctx, tproxy, log.Named("proxy"))
	stateFile := o.stateFile
	if o.config != "" {
		stateFile = "" // the manifests are read before the first sync
	}
	servePrevious := stateFile != "" && previous != nil && !up.TookOver()
	useRing, noRing := chooseIOURing(o.ioURing, datapath.IOURingSupported)
	switch {
	case noRing != nil && o.ioURing == ioURingOn:
		log.Warn("--io-uring: io_uring is not available for the event loops; they use epoll only", zap.Error(noRing))
	case noRing != nil:
		log.Info("io_uring is not available for the event loops; they use epoll", zap.Error(noRing))
	}
	p := proxy.NewProxier(proxy.Config{
		Config: datapath.Config{
			OriginalDst:     originalDst,
			Transparent:     tproxy,
			MasqueradeAll:   o.kubeProxy.masqueradeAll,
			BridgedReplies:  bridged,
			UDPOriginalDst:  udpOriginalDst,
			OwnMark:         redirect.OwnMark,
			DialTimeout:     o.dialTimeout,
			DialAttempts:    o.dialAttempts,
			IdleTimeout:     o.tcpIdleTimeout,
			MaxConnections:  maxConnections(o.maxConnections, noFile),
			EventLoops:      o.eventLoops,
			IOURing:         useRing,
			UDPTimeout:      o.udpTimeout,
			UDPMaxFlows:     udpMaxFlows(o.udpMaxFlows, noFile),
			UDPPoolSize:     o.udpPoolSize,
			UDPPoolMax:      udpPoolMax(o.udpPoolMax, noFile),
			UDPQueryTimeout: o.udpQueryTimeout,
			Logger:          log.Named("proxy"),
		},
		Metrics: metrics,
		Rules: proxy.RuleSyncerFunc(func(ctx context.Context, in []routing.Intercept, full bool) (proxy.RuleStats, error) {
			return syncRules(ctx, rules, stale, in, full)
		}),
		SharedListeners:          sharedProtocols,
		MaxListeners:             maxListeners(o.maxListeners, noFile),
		MaxListenersPerService:   o.maxPerService,
		MaxListenersPerNamespace: o.maxPerNamespace,
		UDPCheckEveryFlow:        o.udpCheckEveryFlow,
		PortRange:                o.ports,
		Defaults: service.Defaults{Balancer: o.balancerKind, NoExternalIPs: o.kubeProxy.noExternalIPs,
			MaxConnections: maxConnectionsPerPort(o.maxConnsPerPort, maxConnections(o.maxConnections, noFile))},
		Sync:              changes.RunnerConfig{MinInterval: o.minSyncPeriod, MaxInterval: o.syncPeriod},
		ServerAddrs:       serverAddrs(o.healthzBindAddress, o.metricsBindAddress),
		DeniedEndpoints:   o.deniedEPs,
		NodeEndpointPorts: o.nodeEPPorts,
		NodePortRange:     o.nodePorts,
		NodeName:          o.nodeName,
		ClusterCIDRs:      o.clusterCIDRs,
		PodNetworks:       o.podNetworks,
		ServiceHealth:     svcHealth,
		OnSync:            func() { health.Updated(); firstSync() },
		OnChange:          health.QueuedUpdate,
		OnReject:          events.Rejected(),
		OnRefuse:          events.Refused(),
		Inherited:         up.Inherited(),
		PreviousPort:      previous,
		StateFile:         stateFile,
	})
	// runSource runs the source until ctx is done: the folder's watch
	// (after its first load), or the informers.
	var runSource func(context.Context) error
	// nodeChanged stops uproxy when the Node's IPs or podCIDRs that it
	// uses change (nodeWatch); set once the run's context can carry why.
	var nodeChanged atomic.Pointer[func(error)]
	if o.config != "" {
		fs := &source.FileSource{Path: o.config, Tracker: p.Tracker(), Logger: log.Named("manifests")}
		if err := fs.Load(); err != nil {
			return fmt.Errorf("loading manifests: %w", err)
		}
		runSource = fs.Watch
	} else {
		ks := &source.KubeSource{
			Client:   client,
			Tracker:  p.Tracker(),
			NodeName: o.nodeName,
			Resync:   o.kubeProxy.configSyncPeriod,
			OnNode: func(n *v1.Node) {
				health.SyncNode(n)
				if n != nil {
					p.SetZone(n.Labels[v1.LabelTopologyZone])
				}
				if err := o.node.changed(n); err != nil {
					if stop := nodeChanged.Load(); stop != nil {
						(*stop)(err)
					}
				}
			},
			Logger: log.Named("kube"),
		}
		runSource = ks.Run
	}
	// kube-proxy sets these at start too: the manifests or the API
	// server's configuration have been checked by now.
	applyConntrack(o.kubeProxy.conntrack, log.Named("conntrack"))
	rules, err := redirect.NewFamilies(rulesCfg)
	if err != nil {
		return err
	}
	health.SetIPFamilies(ipFamilies(rules)...)
	metrics.SetIPFamilies(ipFamilies(rules)...)
	if host, _, err := net.SplitHostPort(o.debugBindAddress); err == nil {
		if ip, err := netip.ParseAddr(host); (err != nil && host != "localhost") || (err == nil && !ip.IsLoopback()) {
			log.Warn("--debug-bind-address is not a loopback address: /status and /explain (and pprof with --profiling) have no authentication, and show every Service's endpoints to whoever reaches it",
				zap.String("address", o.debugBindAddress))
		}
	}
	if len(o.podNetworks) == 0 {
		log.Warn("without --cluster-cidr, uproxy cannot tell another node's address from a pod's: an endpoint at another node's node port is not refused, and a loop between nodes ends only at --max-connections-per-service-port")
	}
	if stateFile != "" && o.stateFileMaxAge > 0 && o.stateFileMaxAge < o.syncPeriod+proxy.StateRefreshInterval {
		log.Warn("--state-file-max-age is shorter than the state file's refresh, which follows the syncs: a restart may refuse the state of a cluster where nothing changed",
			zap.Duration("maxAge", o.stateFileMaxAge), zap.Duration("refresh", proxy.StateRefreshInterval), zap.Duration("syncPeriod", o.syncPeriod))
	}
	if servePrevious {
		// The previous instance's rules still send its Services here:
		// serve them until the API server answers.
		if st := loadPreviousState(stateFile, o.stateFileMaxAge, clock.RealClock{}, log); len(st.Services) > 0 {
			p.ServePrevious(st.Services, st.EndpointSlices)
			health.ServingPrevious()
		}
	}

	// Goroutines owned here: the sync loop, the source, the two servers,
	// the upgrade server and the stale conntrack entries' cleaner. All
	// return when ctx is done; wg waits for them before the drain. A
	// server that cannot listen stops uproxy: a health check that
	// silently does not exist is worse than a clear failure.
	signals := ctx
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stopForNode := func(err error) {
		log.Warn("stopping: this node's Node changed", zap.Error(err))
		cancel(err)
	}
	nodeChanged.Store(&stopForNode)
	var wg sync.WaitGroup
	if o.healthzBindAddress != "" {
		up.Expect("healthz")
	}
	if o.metricsBindAddress != "" {
		up.Expect("metrics")
	}
	if o.debugBindAddress != "" {
		up.Expect("debug")
	}
	syncLoop := upgrade.NewSyncLoop(p)
	wg.Go(func() { syncLoop.Run(ctx) })
	if stale != nil {
		wg.Go(func() { stale.Run(ctx) })
	}
	var handedOver *upgrade.Handover // set when a successor has taken the sockets over
	wg.Go(func() {
		if h := up.Serve(ctx, synced, upgrade.Hooks{Sync: syncLoop, Export: p.ExportListeners, Abort: cancel}); h != nil {
			handedOver = h
			cancel(upgrade.ErrHandedOver)
		}
	})
	wg.Go(func() {
		if err := runSource(ctx); err != nil {
			cancel(fmt.Errorf("source: %w", err))
		}
	})
	wg.Go(func() {
		if err := health.Run(ctx); err != nil {
			cancel(fmt.Errorf("healthz server: %w", err))
		}
	})
	wg.Go(func() {
		if err := serveHTTP(ctx, o.metricsBindAddress, metricsHandler(reg, o.mode), up.Listen("metrics"), httplimit.ServerConfig{}); err != nil {
			cancel(fmt.Errorf("metrics server: %w", err))
		}
	})
	wg.Go(func() {
		debug := debugHandler(p, explainHandler(p, tproxy), explainBucket(), o.profiling)
		if err := serveHTTP(ctx, o.debugBindAddress, debug, up.Listen("debug"), httplimit.ServerConfig{}); err != nil {
			cancel(fmt.Errorf("debug server: %w", err))
		}
	})
	source := o.config
	if source == "" {
		source = "API server"
	}
	events.Starting()
	st := p.Status()
	log.Info("uproxy started", zap.String("source", source), zap.String("node", o.nodeName), zap.String("mode", o.mode), zap.String("listener", o.listener),
		zap.Int("eventLoops", st.EventLoops), zap.String("io", st.IO), zap.Int("pid", os.Getpid()))
	<-ctx.Done()
	wg.Wait()
	failure := context.Cause(ctx)
	if errors.Is(failure, context.Canceled) {
		failure = nil // a signal, not a failure
	}
	if handedOver != nil {
		return drainHandedOver(signals, o, p, svcHealth, handedOver, log)
	}

	log.Info("stopping: draining connections", zap.Int("active", p.ActiveConnections()), zap.Duration("timeout", o.drainTimeout))
	dctx, dcancel := context.WithTimeout(context.Background(), o.drainTimeout)
	defer dcancel()
	if err := p.Shutdown(dctx); err != nil {
		log.Warn("drain incomplete", zap.Error(err))
	}
	log.Info("stopped; rules left in place for the next instance")
	return failure
}

// loadPreviousState reads the state file at path for ServePrevious. A
// state saved more than maxAge before clk's time (0: no limit) is refused
// and logged, with its path, age and the limit: its endpoints may name
// pod IPs that other pods, of other tenants, have been given since, and
// serving nothing until the initial lists arrive is the safer outage. It
// returns the zero State when there is nothing to serve.
func loadPreviousState(path string, maxAge time.Duration, clk clock.PassiveClock, log *zap.Logger) source.State {
	st, err := source.LoadFreshState(path, maxAge, clk.Now())
	var stale *source.StaleStateError
	switch {
	case errors.As(err, &stale):
		log.Warn("refusing the previous instance's state file, older than --state-file-max-age (its endpoints may be other pods' by now): serving nothing until the initial lists arrive",
			zap.String("path", stale.Path), zap.Duration("age", stale.Age), zap.Duration("maxAge", stale.MaxAge), zap.Time("savedAt", stale.SavedAt))
	case err != nil:
		log.Warn("cannot serve the previous instance's Services before the initial lists", zap.Error(err))
	default:
		return st
	}
	return source.State{}
}

// brNetfilterLoaded reports whether br_netfilter is loaded, which shows
// in its sysctls under /proc/sys/net/bridge. Without it no bridged frame
// meets iptables, and tproxy mode leaves out the rules for bridged
// clients (redirect.TProxy.NoBridged), whose physdev match would load it.
func brNetfilterLoaded() bool {
	_, err := os.Stat("/proc/sys/net/bridge/bridge-nf-call-iptables")
	return err == nil
}
