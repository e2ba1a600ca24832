package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"
	"golang.org/x/time/rate"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/internal/httplimit"
	"github.com/uproxy/uproxy/internal/kubeevents"
	"github.com/uproxy/uproxy/internal/upgrade"
	"github.com/uproxy/uproxy/proxy"
	"github.com/uproxy/uproxy/proxy/healthcheck"
	"github.com/uproxy/uproxy/redirect"
)

// runOptions are the flags of `uproxy run`. Names follow kube-proxy's
// where the concept is the same.
type runOptions struct {
	config             string // --manifests, a manifest file or folder
	kubeconfig         string
	master             string
	hostnameOverride   string
	clusterCIDR        string
	nodePortAddresses  []string
	healthzBindAddress string
	metricsBindAddress string
	debugBindAddress   string
	profiling          bool
	mode               string
	listener           string
	portRange          string
	balancer           string
	syncPeriod         time.Duration
	minSyncPeriod      time.Duration
	drainTimeout       time.Duration
	tcpIdleTimeout     time.Duration
	ioURing            bool
	eventLoops         int
	dialTimeout        time.Duration
	dialAttempts       int
	udpTimeout         time.Duration
	udpMaxFlows        int
	iptablesWait       time.Duration
	cleanupAndExit     bool
	upgradeSocket      string
	stateFile          string
	upgradeReadyTime   time.Duration
	lingerAfterUpgrade bool
	kubeProxy          kubeProxyOptions // kube-proxy's other flags and --config

	// Parsed by validate.
	ports         proxy.PortRange
	balancerKind  balancer.Kind
	clusterCIDRs  []netip.Prefix
	nodePortCIDRs []netip.Prefix
	nodeName      string
}

func (o *runOptions) register(fs *pflag.FlagSet) {
	fs.StringVar(&o.config, "manifests", "", "Serve the Services and EndpointSlices in this manifest file or folder (YAML or JSON, multi-document) instead of an API server. Reloaded when it changes. At startup it must hold at least one Service or EndpointSlice.")
	o.kubeProxy.register(fs)
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "Path to a kubeconfig file. Without it, and without --master, uproxy uses the in-cluster configuration.")
	fs.StringVar(&o.master, "master", "", "The address of the Kubernetes API server (overrides the kubeconfig's).")
	fs.StringVar(&o.hostnameOverride, "hostname-override", "", "This node's name, as endpoints' nodeName and the Node object give it. Empty means the hostname.")
	fs.StringVar(&o.clusterCIDR, "cluster-cidr", "", "The pod network(s), comma-separated for dual-stack. Pods reaching a service's external address are sent to all its endpoints even under externalTrafficPolicy: Local, as kube-proxy does.")
	fs.StringSliceVar(&o.nodePortAddresses, "nodeport-addresses", nil, "CIDRs of the node addresses that accept NodePort traffic (and serve health-check node ports), comma-separated, and kube-proxy's keywords: primary (the Node's IPs, or --bind-address), localhost (127.0.0.0/8 and ::1/128), all (0.0.0.0/0 and ::/0). A family without a CIDR accepts node ports on all its addresses, as in kube-proxy. Empty means all, or primary with --proxy-mode nftables, as in kube-proxy.")
	fs.StringVar(&o.healthzBindAddress, "healthz-bind-address", "0.0.0.0:10256", "Address of the /healthz and /livez server. Empty disables it.")
	fs.StringVar(&o.metricsBindAddress, "metrics-bind-address", "127.0.0.1:10249", "Address of the /metrics server. Empty disables it.")
	fs.StringVar(&o.debugBindAddress, "debug-bind-address", defaultDebugAddress, "Address of the server that answers `uproxy status` (/status) and `uproxy explain` (/explain), and /debug/pprof with --profiling. It has no authentication: keep it on loopback. Empty disables it.")
	fs.BoolVar(&o.profiling, "profiling", false, "Serve Go's profiles at /debug/pprof on --debug-bind-address.")
	fs.StringVar(&o.mode, "mode", "redirect", "How traffic reaches the listeners: redirect (iptables REDIRECT in the nat table; backends see the node's address) or tproxy (TPROXY in the mangle table with policy routing; listeners on loopback, and services that ask for it are dialled from the client's own address).")
	fs.StringVar(&o.listener, "listener", "per-service", "How service ports map to listeners: per-service (a listener and a kernel rule per service port and family) or shared (one listener per family and protocol, every service address in a kernel set behind one rule per protocol, so the rule count stays constant as services grow; under REDIRECT the TCP listener has 16 consecutive ports, so that connections from one client port to different services get different tuples, and a UDP flow's service, which REDIRECT hides, is looked up in conntrack).")
	fs.StringVar(&o.portRange, "proxy-port-range", "", "Local ports for the listeners: begin-end, begin+offset or a single port. Empty means the kernel's range for bind(0) (net.ipv4.ip_local_port_range, less ip_local_reserved_ports).")
	fs.StringVar(&o.balancer, "balancer", string(balancer.RoundRobin), fmt.Sprintf("Default balancer for services without the %s annotation: one of %v.", proxy.AnnotationBalancer, balancer.Kinds))
	fs.DurationVar(&o.syncPeriod, "iptables-sync-period", 30*time.Second, "The longest time between two full syncs: rules deleted or changed by someone else are repaired within this period.")
	fs.DurationVar(&o.minSyncPeriod, "iptables-min-sync-period", time.Second, "The shortest time between two syncs: changes arriving faster are applied together.")
	fs.DurationVar(&o.drainTimeout, "drain-timeout", 25*time.Second, "On SIGTERM or SIGINT, how long established connections may take to finish before they are closed.")
	fs.DurationVar(&o.tcpIdleTimeout, "tcp-idle-timeout", time.Hour, "Close a proxied TCP connection after it has been idle in both directions for this long (detected within twice the period). 0 disables.")
	fs.IntVar(&o.eventLoops, "event-loops", 0, "Event loops carrying TCP connections and UDP flows: each accepts on the TCP listeners, dials backends and moves bytes for its connections with epoll, splicing bulk transfers, and reads some of the UDP listeners, forwarding their datagrams and relaying their flows' replies. 0 means one less than the CPUs the process may use (GOMAXPROCS), at least one; -1 means none: each TCP connection is carried by goroutines of its own, which costs a goroutine stack per direction of an idle connection, each UDP listener by a goroutine, and each UDP flow by a goroutine.")
	fs.BoolVar(&o.ioURing, "io-uring", false, "Make each event loop wait in an io_uring and carry its TCP connections' small messages through it: one system call per turn of the loop submits every receive and send and waits for the next, where epoll takes one per read, write and wait. Bulk transfers still splice. Needs Linux 5.19; without it the loops use epoll, and say so.")
	fs.DurationVar(&o.dialTimeout, "endpoint-dial-timeout", time.Second, "How long one connection attempt to an endpoint may take before the next endpoint is tried.")
	fs.IntVar(&o.dialAttempts, "endpoint-dial-attempts", 3, "How many endpoints a new connection tries before it is refused.")
	fs.DurationVar(&o.udpTimeout, "udp-timeout", 30*time.Second, "How long a UDP flow (a client's association with an endpoint) lives without traffic in either direction; 30s is conntrack's timeout for UDP streams.")
	fs.IntVar(&o.udpMaxFlows, "udp-max-flows", 0, "The most UDP flows kept at once, across all services; past it the least recently used flow ends. Each flow holds a socket. 0 means 65,536, or half the open-files limit if that is lower, so that flows cannot take the descriptors the TCP connections need.")
	fs.DurationVar(&o.iptablesWait, "iptables-wait", 5*time.Second, "How long iptables commands wait for the xtables lock.")
	fs.BoolVar(&o.cleanupAndExit, "cleanup", false, "Remove uproxy's rules and exit (the same as `uproxy cleanup`, named as in kube-proxy).")
	fs.StringVar(&o.upgradeSocket, "upgrade-socket", "/run/uproxy/upgrade.sock", "Unix socket for hitless upgrades: a starting uproxy that finds a running one here takes its listening sockets over, and the old one drains and exits. Empty disables.")
	fs.StringVar(&o.stateFile, "state-file", "/run/uproxy/state.json", "Where the Services and EndpointSlices of the last successful sync are saved (API server source only). A uproxy restarted while the API server is unreachable serves them, on the listener ports its predecessor's rules still name, until the initial lists arrive; it writes no rule before them. Empty disables.")
	fs.DurationVar(&o.upgradeReadyTime, "upgrade-ready-timeout", upgrade.DefaultReadyTimeout, "How long a running uproxy that handed its sockets to a new one waits for the new one's first sync, with its own sync loop paused. Past it the old process takes the handover back and syncs again, and the new one exits with an error.")
	fs.BoolVar(&o.lingerAfterUpgrade, "linger-after-upgrade", os.Getpid() == 1, "After handing the sockets to a new uproxy and draining, wait for SIGTERM instead of exiting. Defaults to true when uproxy is PID 1, a container's entrypoint: its exit would restart the container, and the restarted old version would take the sockets back.")
}

// validate checks the options once and parses what needs parsing.
func (o *runOptions) validate() error {
	if o.cleanupAndExit {
		return nil
	}
	var errs []error
	if o.config != "" && (o.kubeconfig != "" || o.master != "") {
		errs = append(errs, errors.New("--manifests and --kubeconfig/--master are exclusive: serve manifests or an API server, not both"))
	}
	if o.mode != "redirect" && o.mode != "tproxy" {
		errs = append(errs, fmt.Errorf("--mode: %q is not supported (want redirect or tproxy)", o.mode))
	}
	if o.listener != "per-service" && o.listener != "shared" {
		errs = append(errs, fmt.Errorf("--listener: %q is not supported (want per-service or shared)", o.listener))
	}
	var err error
	if o.ports, err = proxy.ParsePortRange(o.portRange); err != nil {
		errs = append(errs, fmt.Errorf("--proxy-port-range: %w", err))
	}
	if o.balancerKind, err = balancer.ParseKind(o.balancer); err != nil {
		errs = append(errs, fmt.Errorf("--balancer: %w", err))
	}
	if o.clusterCIDRs, err = parseCIDRs(strings.Split(o.clusterCIDR, ",")); err != nil {
		errs = append(errs, fmt.Errorf("--cluster-cidr: %w", err))
	}
	// Without the Node's IPs yet: resolveNodeAddresses completes
	// 'primary' once the API client exists.
	if o.nodePortCIDRs, err = nodePortPrefixes(o.nodePortAddresses, withBindAddress(nil, o.kubeProxy.bindAddress)); err != nil {
		errs = append(errs, fmt.Errorf("--nodeport-addresses: %w", err))
	}
	for _, a := range []struct{ flag, v string }{{"--healthz-bind-address", o.healthzBindAddress}, {"--metrics-bind-address", o.metricsBindAddress}, {"--debug-bind-address", o.debugBindAddress}} {
		if a.v == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(a.v); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", a.flag, err))
		}
	}
	for _, d := range []struct {
		name string
		v    time.Duration
		zero bool // zero allowed
	}{
		{"--iptables-sync-period", o.syncPeriod, false},
		{"--iptables-min-sync-period", o.minSyncPeriod, true},
		{"--drain-timeout", o.drainTimeout, true},
		{"--upgrade-ready-timeout", o.upgradeReadyTime, false},
		{"--tcp-idle-timeout", o.tcpIdleTimeout, true},
		{"--endpoint-dial-timeout", o.dialTimeout, false},
		{"--iptables-wait", o.iptablesWait, false},
		{"--udp-timeout", o.udpTimeout, false},
	} {
		if d.v < 0 || (d.v == 0 && !d.zero) {
			errs = append(errs, fmt.Errorf("%s: %v must be positive", d.name, d.v))
		}
	}
	if o.udpMaxFlows < 0 {
		errs = append(errs, fmt.Errorf("--udp-max-flows: %d must be positive, or 0 for the default", o.udpMaxFlows))
	}
	if o.eventLoops < -1 {
		errs = append(errs, fmt.Errorf("--event-loops: %d is neither a count nor -1 (none)", o.eventLoops))
	}
	if o.minSyncPeriod > o.syncPeriod && o.syncPeriod > 0 {
		errs = append(errs, fmt.Errorf("--iptables-min-sync-period (%v) is longer than --iptables-sync-period (%v)", o.minSyncPeriod, o.syncPeriod))
	}
	if o.dialAttempts < 1 {
		errs = append(errs, fmt.Errorf("--endpoint-dial-attempts: %d must be at least 1", o.dialAttempts))
	}
	o.nodeName = strings.ToLower(strings.TrimSpace(o.hostnameOverride))
	if o.nodeName == "" {
		h, err := os.Hostname()
		if err != nil {
			errs = append(errs, fmt.Errorf("--hostname-override is empty and the hostname is unknown: %w", err))
		}
		o.nodeName = strings.ToLower(h)
	}
	return errors.Join(errs...)
}

func parseCIDRs(raw []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, r := range raw {
		r = strings.TrimSpace(r)
		if r == "" {
			continue
		}
		p, err := netip.ParsePrefix(r)
		if err != nil {
			return nil, fmt.Errorf("%q is not a CIDR", r)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

func newRunCommand(lf *logFlags) *cobra.Command {
	var o runOptions
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Proxy the Services of an API server, or of manifest files",
		Long: `run installs iptables REDIRECT rules for every Service port's cluster IPs, node ports,
external IPs and load-balancer IPs, and serves each Service port on its own local listener,
balancing new connections over the endpoints of its EndpointSlices as kube-proxy would.

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
				log.Info("--init-only: uproxy needs no privileged setup before it runs; exiting")
				return nil
			}
			if o.cleanupAndExit {
				return cleanup(context.Background())
			}
			applyOOMScoreAdj(oomScoreAdjPath, o.kubeProxy.oomScoreAdj, log)
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			return run(ctx, &o, log)
		},
	}
	o.register(cmd.Flags())
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
		// sockets off it, so that the listeners can hold it (#30).
		if n, err := proxy.ExposedPorts(o.ports); err != nil {
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
	metrics := proxy.NewMetrics(reg)
	ruleCommands := newRuleCommands(reg)
	// The rules of both families, synced side by side. NewFamilies, which
	// checks the iptables tools, runs below, once the manifests have
	// loaded.
	rulesCfg := redirect.FamiliesConfig{
		IPv4:     redirect.Config{Wait: o.iptablesWait},
		IPv6:     redirect.Config{Wait: o.iptablesWait},
		Services: redirect.ServiceOptions{NodePortAddresses: o.nodePortCIDRs, Shared: shared},
		Commands: func(name string) { ruleCommands.WithLabelValues(name).Inc() },
		Logger:   log.Named("rules"),
	}
	if tproxy {
		rulesCfg.Services.TProxy = &redirect.TProxy{Routing: redirect.DefaultRouting}
	}
	var rules *redirect.Families // set below, before the sync loop starts
	synced := make(chan struct{})
	restoreGC := startupGC()
	firstSync := sync.OnceFunc(func() { restoreGC(); close(synced) })
	previous := previousPorts(ctx, tproxy, log.Named("proxy"))
	stateFile := o.stateFile
	if o.config != "" {
		stateFile = "" // the manifests are read before the first sync
	}
	servePrevious := stateFile != "" && previous != nil && !up.TookOver()
	p := proxy.NewProxier(proxy.Config{
		Metrics: metrics,
		Rules: proxy.RuleSyncerFunc(func(ctx context.Context, in []proxy.Intercept, full bool) (proxy.RuleStats, error) {
			return syncRules(ctx, rules, in, full)
		}),
		OriginalDst:     originalDst,
		Transparent:     tproxy,
		SharedListeners: sharedProtocols,
		UDPOriginalDst:  udpOriginalDst,
		PortRange:       o.ports,
		Defaults:        proxy.ServiceDefaults{Balancer: o.balancerKind},
		Sync:            proxy.RunnerConfig{MinInterval: o.minSyncPeriod, MaxInterval: o.syncPeriod},
		OwnMark:         redirect.OwnMark,
		ServerAddrs:     serverAddrs(o.healthzBindAddress, o.metricsBindAddress),
		DialTimeout:     o.dialTimeout,
		DialAttempts:    o.dialAttempts,
		IdleTimeout:     o.tcpIdleTimeout,
		EventLoops:      o.eventLoops,
		IOURing:         o.ioURing,
		UDPTimeout:      o.udpTimeout,
		UDPMaxFlows:     udpMaxFlows(o.udpMaxFlows, noFile),
		NodeName:        o.nodeName,
		ClusterCIDRs:    o.clusterCIDRs,
		ServiceHealth:   svcHealth,
		OnSync:          func() { health.Updated(); firstSync() },
		OnChange:        health.QueuedUpdate,
		OnReject:        events.Rejected(),
		Inherited:       up.Inherited(),
		PreviousPort:    previous,
		StateFile:       stateFile,
		Logger:          log.Named("proxy"),
	})
	// runSource runs the source until ctx is done: the folder's watch
	// (after its first load), or the informers.
	var runSource func(context.Context) error
	if o.config != "" {
		fs := &proxy.FileSource{Path: o.config, Tracker: p.Tracker(), Logger: log.Named("manifests")}
		if err := fs.Load(); err != nil {
			return fmt.Errorf("loading manifests: %w", err)
		}
		runSource = fs.Watch
	} else {
		ks := &proxy.KubeSource{
			Client:   client,
			Tracker:  p.Tracker(),
			NodeName: o.nodeName,
			Resync:   o.kubeProxy.configSyncPeriod,
			OnNode: func(n *v1.Node) {
				health.SyncNode(n)
				if n != nil {
					p.SetZone(n.Labels[v1.LabelTopologyZone])
				}
			},
			Logger: log.Named("kube"),
		}
		runSource = ks.Run
	}
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
	if servePrevious {
		// The previous instance's rules still send its Services here:
		// serve them until the API server answers (#30).
		services, slices, err := proxy.LoadState(stateFile)
		switch {
		case err != nil:
			log.Warn("cannot serve the previous instance's Services before the initial lists", zap.Error(err))
		case len(services) > 0:
			p.ServePrevious(services, slices)
		}
	}
	if tproxy {
		warnBridgeNetfilter(log)
	}

	// Goroutines owned here: the sync loop, the source, the two servers
	// and the upgrade server. All return when ctx is done; wg waits for
	// them before the drain. A server that cannot listen stops uproxy: a
	// health check that silently does not exist is worse than a clear
	// failure.
	signals := ctx
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
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
		if err := serveHTTP(ctx, o.metricsBindAddress, metricsHandler(reg), up.Listen("metrics")); err != nil {
			cancel(fmt.Errorf("metrics server: %w", err))
		}
	})
	wg.Go(func() {
		debug := debugHandler(p, explainHandler(p, tproxy), explainBucket(), o.profiling)
		if err := serveHTTP(ctx, o.debugBindAddress, debug, up.Listen("debug")); err != nil {
			cancel(fmt.Errorf("debug server: %w", err))
		}
	})
	source := o.config
	if source == "" {
		source = "API server"
	}
	events.Starting()
	log.Info("uproxy started", zap.String("source", source), zap.String("node", o.nodeName), zap.String("mode", o.mode), zap.String("listener", o.listener), zap.Int("pid", os.Getpid()))
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

// metricsHandler serves the Prometheus metrics of reg, and nothing else:
// the metrics address is often opened to a scraper on the node's network
// (#30).
func metricsHandler(reg *prometheus.Registry) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	return mux
}

// debugHandler serves p's /status and explain at /explain (for `uproxy
// status` and `uproxy explain`), the latter one at a time and within
// bucket, and pprof when profiling is set.
func debugHandler(p interface{ Status() proxy.Status }, explain http.Handler, bucket *rate.Limiter, profiling bool) http.Handler {
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

// serveHTTP serves h on addr until ctx is done. An empty addr disables
// it.
func serveHTTP(ctx context.Context, addr string, h http.Handler, listen healthcheck.ListenFunc) error {
	if addr == "" {
		return nil
	}
	ln, err := listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { <-ctx.Done(); srv.Close() }() // ends when ctx is done
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// warnBridgeNetfilter warns when br_netfilter hands bridged frames to
// iptables: TPROXY's socket assignment made during that bridge-level
// PREROUTING pass is dropped by ip_rcv, and br_netfilter keeps PREROUTING
// from running again, so clients attached through a Linux bridge are not
// intercepted in tproxy mode (openwrt/packages#18850).
func warnBridgeNetfilter(log *zap.Logger) {
	for _, f := range []string{"/proc/sys/net/bridge/bridge-nf-call-iptables", "/proc/sys/net/bridge/bridge-nf-call-ip6tables"} {
		if b, err := os.ReadFile(f); err == nil && strings.TrimSpace(string(b)) == "1" {
			log.Warn("tproxy mode: clients behind a Linux bridge will not be intercepted while br_netfilter passes bridged frames to iptables; set it to 0 (routed CNIs are unaffected)",
				zap.String("sysctl", strings.TrimPrefix(f, "/proc/sys/")))
		}
	}
}
