package main

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/uproxy/uproxy/proxy/listeners"

	"github.com/spf13/pflag"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/internal/upgrade"
	"github.com/uproxy/uproxy/proxy/service"
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
	ioURing            ioURingMode
	eventLoops         int
	dialTimeout        time.Duration
	dialAttempts       int
	udpTimeout         time.Duration
	udpCheckEveryFlow  bool
	udpMaxFlows        int
	udpPoolSize        int
	udpPoolMax         int
	maxListeners       int
	maxConnections     int
	maxConnsPerPort    int
	maxPerService      int
	maxPerNamespace    int
	udpQueryTimeout    time.Duration
	iptablesWait       time.Duration
	cleanupAndExit     bool
	upgradeSocket      string
	stateFile          string
	stateFileMaxAge    time.Duration
	upgradeReadyTime   time.Duration
	lingerAfterUpgrade bool
	endpointDenyCIDRs  string
	nodePortRange      string
	nodeEndpointPorts  string
	kubeProxy          kubeProxyOptions // kube-proxy's other flags and --config

	// Parsed by validate.
	ports         listeners.PortRange
	balancerKind  balancer.Kind
	clusterCIDRs  []netip.Prefix
	nodePortCIDRs []netip.Prefix
	nodeName      string
	node          nodeWatch // what resolveNodeAddresses read of the Node
	deniedEPs     []netip.Prefix
	podNetworks   []netip.Prefix // --cluster-cidr, kept when NodeCIDR replaces clusterCIDRs
	nodePorts     service.PortRange
	nodeEPPorts   service.PortRanges
}

func (o *runOptions) register(fs *pflag.FlagSet) {
	fs.StringVar(&o.config, "manifests", "", "Serve the Services and EndpointSlices in this manifest file or folder instead of an API server, reloading it when it changes.")
	o.kubeProxy.register(fs)
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "Path to a kubeconfig file; without it and --master, uproxy uses the in-cluster configuration.")
	fs.StringVar(&o.master, "master", "", "The address of the Kubernetes API server (overrides the kubeconfig's).")
	fs.StringVar(&o.hostnameOverride, "hostname-override", "", "This node's name, as endpoints' nodeName and the Node object give it; empty means the hostname.")
	fs.StringVar(&o.clusterCIDR, "cluster-cidr", "", "The pod networks, comma-separated; pods reaching a service's external address get all its endpoints, as in kube-proxy.")
	fs.StringSliceVar(&o.nodePortAddresses, "nodeport-addresses", nil, "CIDRs of the node addresses that accept node ports, comma-separated, or kube-proxy's keywords primary, localhost and all; empty means all (primary with --proxy-mode nftables).")
	fs.StringVar(&o.healthzBindAddress, "healthz-bind-address", "0.0.0.0:10256", "The `host:port` of the /healthz and /livez server; empty disables it.")
	fs.StringVar(&o.metricsBindAddress, "metrics-bind-address", "127.0.0.1:10249", "The `host:port` of the /metrics server; empty disables it.")
	fs.StringVar(&o.debugBindAddress, "debug-bind-address", defaultDebugAddress, "The `host:port` of the unauthenticated /status, /explain and, with --profiling, /debug/pprof server; keep it on loopback, or empty to disable.")
	fs.BoolVar(&o.profiling, "profiling", false, "Serve Go's profiles at /debug/pprof on --debug-bind-address.")
	fs.StringVar(&o.mode, "mode", "redirect", "How traffic reaches the listeners: redirect (iptables REDIRECT; backends see the node's address) or tproxy (TPROXY and policy routing).")
	fs.StringVar(&o.listener, "listener", "per-service", "How service ports map to listeners: per-service (one per service port and family) or shared (one per family and protocol, with a constant rule count).")
	fs.StringVar(&o.portRange, "proxy-port-range", "", "Local ports for the listeners (begin-end, begin+offset or one port); empty means the ports bind(0) would use.")
	fs.StringVar(&o.balancer, "balancer", string(balancer.RoundRobin), fmt.Sprintf("Default balancer for services without the %s annotation: one of %v.", service.AnnotationBalancer, balancer.Kinds))
	fs.DurationVar(&o.syncPeriod, "iptables-sync-period", 30*time.Second, "The longest time between two full syncs: rules deleted or changed by someone else are repaired within this period.")
	fs.DurationVar(&o.minSyncPeriod, "iptables-min-sync-period", time.Second, "The shortest time between two syncs: changes arriving faster are applied together.")
	fs.DurationVar(&o.drainTimeout, "drain-timeout", 25*time.Second, "On SIGTERM or SIGINT, how long established connections may take to finish before they are closed.")
	fs.DurationVar(&o.tcpIdleTimeout, "tcp-idle-timeout", time.Hour, "Close a proxied TCP connection after it has been idle in both directions for this long (detected within twice the period). 0 disables.")
	fs.IntVar(&o.eventLoops, "event-loops", 0, "Event loops carrying TCP connections and UDP flows: 0 means one less than GOMAXPROCS (at least one).")
	o.ioURing = ioURingAuto
	fs.Var(&o.ioURing, "io-uring", "Whether the event loops wait in an io_uring that carries small TCP messages: auto where the kernel allows it, true to ask for it (warning on fallback), false for epoll.")
	fs.Lookup("io-uring").NoOptDefVal = string(ioURingOn)
	fs.DurationVar(&o.dialTimeout, "endpoint-dial-timeout", time.Second, "How long one connection attempt to an endpoint may take before the next endpoint is tried.")
	fs.IntVar(&o.dialAttempts, "endpoint-dial-attempts", 3, "How many endpoints a new connection tries before it is refused.")
	fs.DurationVar(&o.udpTimeout, "udp-timeout", 30*time.Second, "How long a UDP flow (a client's association with an endpoint) lives without traffic in either direction; 30s is conntrack's timeout for UDP streams.")
	fs.BoolVar(&o.udpCheckEveryFlow, "udp-check-every-flow", false, "In redirect mode, ask conntrack whether every new UDP flow was redirected to its listener, even while the kernel's listener guard holds the port.")
	fs.IntVar(&o.maxListeners, "max-listeners", 0, "The most listening sockets uproxy holds, past which a service port is not intercepted: 0 means the open-files limit less an eighth, -1 no bound.")
	fs.IntVar(&o.maxConnsPerPort, "max-connections-per-service-port", 0, "The most TCP connections proxied at once for one service port without the uproxy.io/max-connections annotation: 0 means a quarter of --max-connections, -1 no bound.")
	fs.IntVar(&o.maxConnections, "max-connections", 0, "The most TCP connections proxied at once across every service, past which a new one is reset: 0 means as many as the open-files limit less an eighth holds at two descriptors each, -1 no bound.")
	fs.IntVar(&o.maxPerService, "max-listeners-per-service", 0, "The most listening sockets one Service's ports may hold, in all families: 0 means a 64th of the listener budget (at least 16, or half a smaller budget), -1 no bound.")
	fs.IntVar(&o.maxPerNamespace, "max-listeners-per-namespace", 0, "The most listening sockets the Services of one namespace may hold: 0 means the listener budget less an eighth, kept for the other namespaces; -1 means no bound.")
	fs.IntVar(&o.udpMaxFlows, "udp-max-flows", 0, "The most UDP flows kept at once, shared fairly among Service ports: a full table ends the least recently used flow of the port with the most; 0 means 65,536, or half the open-files limit if lower.")
	fs.IntVar(&o.udpPoolSize, "udp-pool-size", 0, "The most sockets each event loop keeps per endpoint for UDP request-reply queries: 0 means 256, -1 turns pooling off.")
	fs.IntVar(&o.udpPoolMax, "udp-pool-max", 0, "The most pooled UDP sockets across all endpoints and event loops, shared fairly among Service ports: 0 means 4,096, or a quarter of the open-files limit if that is lower.")
	fs.DurationVar(&o.udpQueryTimeout, "udp-query-timeout", 5*time.Second, "How long a pooled UDP socket waits for the reply to its query before it is closed; 5s is a stub resolver's default timeout.")
	fs.DurationVar(&o.iptablesWait, "iptables-wait", 5*time.Second, "How long iptables commands wait for the xtables lock.")
	fs.BoolVar(&o.cleanupAndExit, "cleanup", false, "Remove uproxy's rules and kube-proxy's leftover state (iptables, IPVS and nftables modes') and exit, as kube-proxy --cleanup does.")
	fs.StringVar(&o.upgradeSocket, "upgrade-socket", "/run/uproxy/upgrade.sock", "Unix socket for hitless upgrades, where a starting uproxy takes a running one's listening sockets over; empty disables.")
	fs.StringVar(&o.stateFile, "state-file", "/run/uproxy/state.json", "Where each sync's Services and EndpointSlices are saved, for a restart to serve before the API server answers (API server source only); empty disables.")
	fs.DurationVar(&o.stateFileMaxAge, "state-file-max-age", 10*time.Minute, "How old a --state-file may be for a restart to serve it: an older one's endpoints may be other pods' by now; 0 serves any age.")
	fs.DurationVar(&o.upgradeReadyTime, "upgrade-ready-timeout", upgrade.DefaultReadyTimeout, "How long the old process of an upgrade waits, its syncs paused, for the new one's first sync before it takes the handover back.")
	fs.StringVar(&o.endpointDenyCIDRs, "endpoint-deny-cidrs", prefixList(service.DefaultDeniedEndpoints),
		"Networks (CIDRs or addresses, comma-separated) no endpoint may be in; the default holds the clouds' metadata services that are not link-local, and empty denies none.")
	fs.StringVar(&o.nodePortRange, "service-node-port-range", "30000-32767",
		"The API server's node-port range: no endpoint outside --cluster-cidr, or on this node, may be at one of its ports, which another node would intercept and could send back.")
	fs.StringVar(&o.nodeEndpointPorts, "node-endpoint-ports", "",
		"Ports and ranges (6443,9100-9110) on which an endpoint may be an address of this node, a host-network pod; empty allows only the Service default/kubernetes.")
	fs.BoolVar(&o.lingerAfterUpgrade, "linger-after-upgrade", os.Getpid() == 1, "After handing over and draining, wait for SIGTERM instead of exiting (default true when uproxy is PID 1, so a container restart does not take the sockets back).")
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
	if o.ports, err = listeners.ParsePortRange(o.portRange); err != nil {
		errs = append(errs, fmt.Errorf("--proxy-port-range: %w", err))
	}
	if o.balancerKind, err = balancer.ParseKind(o.balancer); err != nil {
		errs = append(errs, fmt.Errorf("--balancer: %w", err))
	}
	if o.deniedEPs, err = service.ParsePrefixes(o.endpointDenyCIDRs); err != nil {
		errs = append(errs, fmt.Errorf("--endpoint-deny-cidrs: %w", err))
	}
	if r, err := service.ParsePortRanges(o.nodePortRange); err != nil || len(r) != 1 || r[0].First == r[0].Last {
		errs = append(errs, fmt.Errorf("--service-node-port-range: %q is not a range of ports (30000-32767)", o.nodePortRange))
	} else {
		o.nodePorts = r[0]
	}
	if o.nodeEPPorts, err = service.ParsePortRanges(o.nodeEndpointPorts); err != nil {
		errs = append(errs, fmt.Errorf("--node-endpoint-ports: %w", err))
	}
	if o.clusterCIDRs, err = parseCIDRs(strings.Split(o.clusterCIDR, ",")); err != nil {
		errs = append(errs, fmt.Errorf("--cluster-cidr: %w", err))
	}
	o.podNetworks = append([]netip.Prefix{}, o.clusterCIDRs...)
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
		{"--state-file-max-age", o.stateFileMaxAge, true},
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
	if o.udpPoolSize < -1 {
		errs = append(errs, fmt.Errorf("--udp-pool-size: %d is neither a count, 0 for the default, nor -1 (no pooling)", o.udpPoolSize))
	}
	if o.maxListeners < -1 {
		errs = append(errs, fmt.Errorf("--max-listeners: %d is neither a count, 0 for the default, nor -1 (no bound)", o.maxListeners))
	}
	if o.maxConnsPerPort < -1 {
		errs = append(errs, fmt.Errorf("--max-connections-per-service-port: %d is neither a count, 0 for the default, nor -1 (no bound)", o.maxConnsPerPort))
	}
	if o.maxConnections < -1 {
		errs = append(errs, fmt.Errorf("--max-connections: %d is neither a count, 0 for the default, nor -1 (no bound)", o.maxConnections))
	}
	for _, q := range []struct {
		flag string
		v    int
	}{{"--max-listeners-per-service", o.maxPerService}, {"--max-listeners-per-namespace", o.maxPerNamespace}} {
		if q.v < -1 {
			errs = append(errs, fmt.Errorf("%s: %d is neither a count, 0 for the default, nor -1 (no bound)", q.flag, q.v))
		}
	}
	if o.udpPoolMax < 0 {
		errs = append(errs, fmt.Errorf("--udp-pool-max: %d must be positive, or 0 for the default", o.udpPoolMax))
	}
	if o.udpQueryTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--udp-query-timeout: %v must be positive", o.udpQueryTimeout))
	}
	if o.eventLoops < 0 {
		errs = append(errs, fmt.Errorf("--event-loops: %d is not a count (0 means one less than GOMAXPROCS)", o.eventLoops))
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

// prefixList formats networks as --endpoint-deny-cidrs takes them.
func prefixList(ps []netip.Prefix) string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.String()
	}
	return strings.Join(out, ",")
}
