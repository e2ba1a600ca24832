package main

import (
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"
	cliflag "k8s.io/component-base/cli/flag"
)

// kubeProxyOptions are the parts of kube-proxy v1.37's command line that
// uproxy's own flags (runOptions) lack, so that kube-proxy's DaemonSets
// (kubeadm's, k3s's) can run uproxy with their command lines unchanged.
// Flags kube-proxy shares with uproxy (--kubeconfig, --master,
// --hostname-override, --cluster-cidr, --nodeport-addresses,
// --healthz-bind-address, --metrics-bind-address, --iptables-sync-period,
// --iptables-min-sync-period, --cleanup, -v) stay in runOptions.
//
// The zero value means what kube-proxy's flag defaults mean.
type kubeProxyOptions struct {
	// configFile is --config, a KubeProxyConfiguration; empty means
	// none: the flags alone configure uproxy.
	configFile string
	// proxyMode is --proxy-mode or the file's mode: empty means uproxy's
	// default (redirect); see resolveMode.
	proxyMode string
	// bindAddress is kube-proxy's idea of the node's primary IP, which
	// the nodeport keyword "primary" expands to when set; empty or
	// unspecified means the Node object's addresses.
	bindAddress string
	// oomScoreAdj is written to /proc/self/oom_score_adj at startup.
	oomScoreAdj int32
	// configSyncPeriod is the informers' resync period.
	configSyncPeriod time.Duration
	// featureGates are kube-proxy's --feature-gates, validated as
	// kube-proxy does (featureGateSet).
	featureGates map[string]bool
	// noExternalIPs: AllowServiceExternalIPs is off, and spec.externalIPs
	// are ignored (service.Defaults.NoExternalIPs).
	noExternalIPs bool
	// nftLocalhostNodePorts: KubeProxyNFTablesLocalhostNodePorts is on.
	nftLocalhostNodePorts bool
	// apiQPS, apiBurst, apiContentType and apiAcceptContentTypes (the
	// file's only) configure the API client.
	apiQPS                float32
	apiBurst              int32
	apiContentType        string
	apiAcceptContentTypes string
	// detectLocalMode says how kube-proxy tells pod traffic from other
	// traffic; uproxy tells it by source address (ClusterCIDR, or the
	// Node's podCIDRs with NodeCIDR).
	detectLocalMode string
	// masqueradeAll is --masquerade-all: every backend is dialled from
	// the node's address (datapath.Config.MasqueradeAll).
	masqueradeAll bool
	// localhostNodePorts is --iptables-localhost-nodeports: IPv4 node
	// ports are served on 127.0.0.0/8 too (see localhostNodePortsOn).
	localhostNodePorts bool
	// healthzPort and metricsPort are kube-proxy's deprecated port
	// flags: 0 disables the server, another port replaces the address's.
	healthzPort, metricsPort int32
	// loggingFormat is kube-proxy's --logging-format: text or json.
	loggingFormat string
	// version is --version: non-empty and not "false" prints the version
	// and exits.
	version string
	// initOnly is --init-only: set conntrack's parameters (the
	// privileged setup kube-proxy's init container does) and exit.
	initOnly bool
	// conntrack are the --conntrack-* flags, or the file's conntrack
	// section, applied to the node's sysctls at start.
	conntrack conntrackOptions
	// writeConfigTo is --write-config-to: write the configuration the
	// command line resolves to there, as a KubeProxyConfiguration, and
	// exit.
	writeConfigTo string

	// notes are what complete has to say once the logger exists: the
	// flags and file fields ignored, and the mode mapping.
	notes []note
}

// note is a log line that complete could not log yet.
type note struct {
	warn   bool
	msg    string
	fields []zap.Field
}

// logNote logs n, once the logger exists.
func logNote(log *zap.Logger, n note) {
	log = log.WithOptions(zap.AddCallerSkip(1))
	if n.warn {
		log.Warn(n.msg, n.fields...)
	} else {
		log.Info(n.msg, n.fields...)
	}
}

// kube-proxy's defaults (k8s.io/kubernetes pkg/proxy/apis/config/v1alpha1
// SetDefaults_KubeProxyConfiguration, pkg/cluster/ports, pkg/kubelet/qos).
const (
	defaultHealthzPort      = 10256
	defaultMetricsPort      = 10249
	defaultOOMScoreAdj      = -999
	defaultConfigSyncPeriod = 15 * time.Minute
	defaultAPIQPS           = 5
	defaultAPIBurst         = 10
	defaultAPIContentType   = "application/vnd.kubernetes.protobuf"
)

// ignoredKubeProxyFlags are kube-proxy v1.37's flags that have no meaning
// for uproxy, with the reason logged when one is given. They are parsed
// with kube-proxy's types, so that a command line kube-proxy accepts is
// accepted, and one it rejects is rejected.
var ignoredKubeProxyFlags = []struct {
	name, typ, why string
}{
	{"bind-address-hard-fail", "bool", "uproxy always exits when it cannot bind a server"},
	{"iptables-masquerade-bit", "int32", "uproxy marks nothing for SNAT: it dials a backend from the node's address where kube-proxy would masquerade"},
	{"ipvs-exclude-cidrs", "strings", "uproxy has no IPVS mode"},
	{"ipvs-min-sync-period", "duration", "uproxy has no IPVS mode; see --iptables-min-sync-period"},
	{"ipvs-scheduler", "string", "uproxy has no IPVS mode; see --balancer"},
	{"ipvs-strict-arp", "bool", "uproxy has no IPVS mode"},
	{"ipvs-sync-period", "duration", "uproxy has no IPVS mode; see --iptables-sync-period"},
	{"ipvs-tcp-timeout", "duration", "uproxy has no IPVS mode"},
	{"ipvs-tcpfin-timeout", "duration", "uproxy has no IPVS mode"},
	{"ipvs-udp-timeout", "duration", "uproxy has no IPVS mode"},
	{"log-flush-frequency", "duration", "uproxy's logger writes each line at once"},
	{"log-json-info-buffer-size", "string", "uproxy's logger does not buffer"},
	{"log-json-split-stream", "bool", "uproxy logs to one stream"},
	{"log-text-info-buffer-size", "string", "uproxy's logger does not buffer"},
	{"log-text-split-stream", "bool", "uproxy logs to one stream"},
	{"vmodule", "string", "uproxy's verbosity is global (-v)"},
	{"pod-bridge-interface", "string", "uproxy tells pod traffic by source address, not by interface"},
	{"pod-interface-name-prefix", "string", "uproxy tells pod traffic by source address, not by interface"},
	{"show-hidden-metrics-for-version", "string", "uproxy hides no metrics"},
}

// register adds kube-proxy's flags to fs, the run command's.
func (k *kubeProxyOptions) register(fs *pflag.FlagSet) {
	fs.StringVar(&k.configFile, "config", "", "kube-proxy's KubeProxyConfiguration file, which replaces the kube-proxy flags given with it (docs/operations.md, Running as kube-proxy).")
	fs.StringVar(&k.proxyMode, "proxy-mode", "", "kube-proxy's proxy mode: iptables, nftables and ipvs mean uproxy's redirect mode (with a warning), redirect and tproxy select uproxy's modes (see --mode).")
	fs.StringVar(&k.bindAddress, "bind-address", "", "kube-proxy's node primary IP, which --nodeport-addresses' keyword primary means; empty or 0.0.0.0 takes the Node object's addresses.")
	fs.Int32Var(&k.oomScoreAdj, "oom-score-adj", defaultOOMScoreAdj, "The oom_score_adj of the uproxy process, in [-1000, 1000], as kube-proxy's.")
	fs.DurationVar(&k.configSyncPeriod, "config-sync-period", defaultConfigSyncPeriod, "How often the informers replay every Service and EndpointSlice (kube-proxy's resync period), greater than 0.")
	fs.Var(cliflag.NewMapStringBool(&k.featureGates), "feature-gates", "kube-proxy's feature gates (key=value pairs), checked as kube-proxy checks them; uproxy honours AllowServiceExternalIPs and KubeProxyNFTablesLocalhostNodePorts.")
	fs.Float32Var(&k.apiQPS, "kube-api-qps", defaultAPIQPS, "Queries per second to the API server.")
	fs.Int32Var(&k.apiBurst, "kube-api-burst", defaultAPIBurst, "Burst of queries to the API server.")
	fs.StringVar(&k.apiContentType, "kube-api-content-type", defaultAPIContentType, "Content type of requests sent to the API server.")
	fs.StringVar(&k.detectLocalMode, "detect-local-mode", "", "How pod traffic is told apart: ClusterCIDR (source in --cluster-cidr, the default) or NodeCIDR (in the Node's podCIDRs); the interface modes fall back to ClusterCIDR.")
	fs.BoolVar(&k.localhostNodePorts, "iptables-localhost-nodeports", true, "Serve IPv4 node ports on 127.0.0.0/8 too, where --nodeport-addresses admits it, as kube-proxy's iptables mode; never with --proxy-mode nftables or ipvs, nor for IPv6.")
	fs.BoolVar(&k.masqueradeAll, "masquerade-all", false, "Dial every backend from the node's address, as kube-proxy SNATs all service traffic with it; a Service annotated uproxy.io/preserve-source-ip: \"true\" still keeps its clients' addresses.")
	fs.Int32Var(&k.healthzPort, "healthz-port", defaultHealthzPort, "The port of the health server; 0 disables it.")
	_ = fs.MarkDeprecated("healthz-port", "use --healthz-bind-address instead")
	fs.Int32Var(&k.metricsPort, "metrics-port", defaultMetricsPort, "The port of the metrics server; 0 disables it.")
	_ = fs.MarkDeprecated("metrics-port", "use --metrics-bind-address instead")
	fs.StringVar(&k.loggingFormat, "logging-format", "", "kube-proxy's log format, text (uproxy's console format) or json, which overrides --log-format.")
	fs.StringVar(&k.version, "version", "", "Print the version and exit, as kube-proxy's --version.")
	fs.Lookup("version").NoOptDefVal = "true"
	fs.BoolVar(&k.initOnly, "init-only", false, "Set conntrack's parameters (the --conntrack-* flags), the privileged setup kube-proxy's init container does, and exit.")
	fs.Int32Var(&k.conntrack.MaxPerCore, "conntrack-max-per-core", defaultConntrackMaxPerCore, "Raise nf_conntrack_max to this many entries per CPU, at least --conntrack-min (0 leaves it as is and ignores --conntrack-min).")
	fs.Int32Var(&k.conntrack.Min, "conntrack-min", defaultConntrackMin, "The least nf_conntrack_max that --conntrack-max-per-core raises to.")
	fs.DurationVar(&k.conntrack.TCPEstablishedTimeout, "conntrack-tcp-timeout-established", defaultConntrackTCPEstablished, "Set conntrack's idle timeout of established TCP connections (0 leaves it as is).")
	fs.DurationVar(&k.conntrack.TCPCloseWaitTimeout, "conntrack-tcp-timeout-close-wait", defaultConntrackTCPCloseWait, "Set conntrack's timeout of TCP connections in CLOSE_WAIT (0 leaves it as is).")
	fs.BoolVar(&k.conntrack.TCPBeLiberal, "conntrack-tcp-be-liberal", false, "Set nf_conntrack_tcp_be_liberal to 1, so that out-of-window TCP packets are not marked INVALID.")
	fs.DurationVar(&k.conntrack.UDPTimeout, "conntrack-udp-timeout", 0, "Set conntrack's idle timeout of UDP flows without replies (0 leaves it as is).")
	fs.DurationVar(&k.conntrack.UDPStreamTimeout, "conntrack-udp-timeout-stream", 0, "Set conntrack's idle timeout of UDP flows with replies (0 leaves it as is).")
	fs.StringVar(&k.writeConfigTo, "write-config-to", "", "Write the configuration this command line resolves to into this file, as a KubeProxyConfiguration that --config reads back, and exit.")
	for _, f := range ignoredKubeProxyFlags {
		usage := "kube-proxy's flag, ignored: " + f.why + "."
		switch f.typ {
		case "bool":
			fs.Bool(f.name, false, usage)
		case "int32":
			fs.Int32(f.name, 0, usage)
		case "duration":
			fs.Duration(f.name, 0, usage)
		case "string":
			fs.String(f.name, "", usage)
		case "strings":
			fs.StringSlice(f.name, nil, usage)
		default:
			panic("ignoredKubeProxyFlags: unknown type " + f.typ)
		}
		_ = fs.SetAnnotation(f.name, ignoredFlagAnnotation, []string{"true"})
	}
}

// ignoredFlagAnnotation marks the kube-proxy flags uproxy accepts and
// ignores, which its help lists apart (groupIgnoredFlags).
const ignoredFlagAnnotation = "uproxy.io/kube-proxy-ignored"

// groupIgnoredFlags makes cmd's help list the kube-proxy flags it accepts
// and ignores in a section of their own, after uproxy's flags, so that
// the flags that do something are not lost among them.
func groupIgnoredFlags(cmd *cobra.Command) {
	split := func(fs *pflag.FlagSet, ignored bool) string {
		part := pflag.NewFlagSet("", pflag.ContinueOnError)
		fs.VisitAll(func(f *pflag.Flag) {
			if _, ok := f.Annotations[ignoredFlagAnnotation]; ok == ignored {
				part.AddFlag(f)
			}
		})
		return part.FlagUsages()
	}
	cobra.AddTemplateFunc("ownFlagUsages", func(fs *pflag.FlagSet) string { return split(fs, false) })
	cobra.AddTemplateFunc("ignoredFlagUsages", func(fs *pflag.FlagSet) string { return split(fs, true) })
	const flags = "{{.LocalFlags.FlagUsages | trimTrailingWhitespaces}}"
	tmpl := cmd.UsageTemplate()
	if !strings.Contains(tmpl, flags) {
		return // another cobra's template: one list, as before
	}
	cmd.SetUsageTemplate(strings.Replace(tmpl, flags,
		"{{ownFlagUsages .LocalFlags | trimTrailingWhitespaces}}\n\nkube-proxy's flags, accepted and ignored (each is logged when given):\n{{ignoredFlagUsages .LocalFlags | trimTrailingWhitespaces}}", 1))
}

// complete merges the kube-proxy command line and configuration file into
// o and lf the way kube-proxy v1.37 does (cmd/kube-proxy/app/options.go,
// Complete): without --config the flags apply; with it, the file replaces
// every kube-proxy flag except --hostname-override, --master and the
// logging flags, and each such flag given is logged as ignored. It runs
// before the logger exists, so it records what to log in k.notes.
func (k *kubeProxyOptions) complete(fs *pflag.FlagSet, o *runOptions, lf *logFlags) error {
	for _, f := range ignoredKubeProxyFlags {
		if fl := fs.Lookup(f.name); fl != nil && fl.Changed {
			k.notef(false, "kube-proxy flag ignored: "+f.why, zap.String("flag", "--"+f.name), zap.String("value", fl.Value.String()))
		}
	}
	if k.configFile != "" {
		if o.config != "" {
			return fmt.Errorf("--config (a KubeProxyConfiguration) and --manifests are exclusive: the configuration file serves an API server's Services")
		}
		cfg, err := loadKubeProxyConfig(k.configFile)
		if err != nil {
			return err
		}
		for _, name := range kubeProxyFlagsReplacedByConfig {
			if fl := fs.Lookup(name); fl != nil && fl.Changed {
				k.notef(true, "flag ignored: --config is given, and kube-proxy takes this setting from the file", zap.String("flag", "--"+name), zap.String("file", k.configFile))
			}
		}
		if err := k.applyConfig(cfg, fs, o, lf); err != nil {
			return fmt.Errorf("--config %s: %w", k.configFile, err)
		}
	} else {
		// kube-proxy's deprecated port flags (addressFromDeprecatedFlags).
		var err error
		if o.healthzBindAddress, err = portFromDeprecatedFlag(o.healthzBindAddress, k.healthzPort, fs.Changed("healthz-port")); err != nil {
			return fmt.Errorf("--healthz-port: %w", err)
		}
		if o.metricsBindAddress, err = portFromDeprecatedFlag(o.metricsBindAddress, k.metricsPort, fs.Changed("metrics-port")); err != nil {
			return fmt.Errorf("--metrics-port: %w", err)
		}
	}
	if k.loggingFormat != "" {
		switch k.loggingFormat {
		case "text":
			lf.format = "console"
		case "json":
			lf.format = "json"
		default:
			return fmt.Errorf("--logging-format: %q is not text or json", k.loggingFormat)
		}
	}
	var err error
	if o.healthzBindAddress, err = withDefaultPort(o.healthzBindAddress, defaultHealthzPort); err != nil {
		return fmt.Errorf("healthz bind address: %w", err)
	}
	if o.metricsBindAddress, err = withDefaultPort(o.metricsBindAddress, defaultMetricsPort); err != nil {
		return fmt.Errorf("metrics bind address: %w", err)
	}
	if k.oomScoreAdj < -1000 || k.oomScoreAdj > 1000 {
		return fmt.Errorf("oom score adjustment %d is not in [-1000, 1000]", k.oomScoreAdj)
	}
	if k.configSyncPeriod <= 0 {
		return fmt.Errorf("config sync period %v must be greater than 0", k.configSyncPeriod)
	}
	if err := k.conntrack.validate(); err != nil {
		return err
	}
	if k.bindAddress != "" {
		if _, err := netip.ParseAddr(k.bindAddress); err != nil {
			return fmt.Errorf("bind address %q is not an IP address", k.bindAddress)
		}
	}
	if o.mode, err = k.resolveMode(o.mode, fs.Changed("mode")); err != nil {
		return err
	}
	if err := k.resolveDetectLocal(); err != nil {
		return err
	}
	if len(o.nodePortAddresses) == 0 {
		// kube-proxy's default: 'primary' in nftables mode, else every
		// address (platformApplyDefaults and NewNodePortAddresses).
		o.nodePortAddresses = []string{nodePortAll}
		if k.proxyMode == "nftables" {
			o.nodePortAddresses = []string{nodePortPrimary}
		}
	}
	gates, err := k.featureGateSet()
	if err != nil {
		return err
	}
	k.noExternalIPs = !gates.Enabled(gateExternalIPs)
	k.nftLocalhostNodePorts = gates.Enabled(gateNFTablesLocalhostNodePorts)
	return nil
}

func (k *kubeProxyOptions) notef(warn bool, msg string, fields ...zap.Field) {
	k.notes = append(k.notes, note{warn: warn, msg: msg, fields: fields})
}

// kubeProxyFlagsReplacedByConfig are the flags whose setting kube-proxy
// takes from --config when both are given ("This parameter is ignored if
// a config file is specified by --config"): every flag that maps into
// KubeProxyConfiguration except --hostname-override and the logging
// flags, which kube-proxy lets override the file.
var kubeProxyFlagsReplacedByConfig = []string{
	"kubeconfig", "kube-api-content-type", "kube-api-burst", "kube-api-qps",
	"bind-address", "healthz-bind-address", "metrics-bind-address", "proxy-mode",
	"iptables-sync-period", "iptables-min-sync-period", "detect-local-mode", "cluster-cidr", "masquerade-all",
	"nodeport-addresses", "oom-score-adj", "config-sync-period", "feature-gates",
	"healthz-port", "metrics-port",
	"conntrack-max-per-core", "conntrack-min", "conntrack-tcp-timeout-established", "conntrack-tcp-timeout-close-wait",
	"conntrack-tcp-be-liberal", "conntrack-udp-timeout", "conntrack-udp-timeout-stream",
}

// resolveMode maps kube-proxy's proxy mode onto uproxy's --mode. An
// explicit --mode (modeSet) wins over kube-proxy's iptables, nftables and
// ipvs, but not over a conflicting redirect or tproxy.
func (k *kubeProxyOptions) resolveMode(mode string, modeSet bool) (string, error) {
	switch k.proxyMode {
	case "":
		return mode, nil
	case "iptables", "nftables", "ipvs":
		if !modeSet {
			k.notef(true, "kube-proxy's proxy mode is served by uproxy's redirect mode: iptables REDIRECT rules into uproxy's listeners", zap.String("proxyMode", k.proxyMode))
			return "redirect", nil
		}
		return mode, nil
	case "redirect", "tproxy":
		if modeSet && mode != k.proxyMode {
			return "", fmt.Errorf("--mode %s and proxy mode %s disagree", mode, k.proxyMode)
		}
		return k.proxyMode, nil
	}
	return "", fmt.Errorf("proxy mode %q is not supported (want iptables, nftables, ipvs, redirect, tproxy or empty)", k.proxyMode)
}

// resolveDetectLocal checks kube-proxy's detect-local mode.
func (k *kubeProxyOptions) resolveDetectLocal() error {
	switch k.detectLocalMode {
	case "", "ClusterCIDR", "NodeCIDR":
		return nil
	case "BridgeInterface", "InterfaceNamePrefix":
		k.notef(true, "detect-local mode not supported: uproxy tells pod traffic by source address, so it uses --cluster-cidr", zap.String("detectLocalMode", k.detectLocalMode))
		return nil
	}
	return fmt.Errorf("detect-local mode %q is not ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix", k.detectLocalMode)
}

// withDefaultPort completes a bind address given as an IP alone with
// port, as kube-proxy does (proxyutil.AppendPortIfNeeded): "0.0.0.0"
// means 0.0.0.0:port. Empty stays empty (the server is disabled).
func withDefaultPort(addr string, port int) (string, error) {
	if addr == "" {
		return "", nil
	}
	if _, _, err := net.SplitHostPort(addr); err == nil {
		return addr, nil
	}
	ip, err := netip.ParseAddr(strings.Trim(addr, "[]"))
	if err != nil {
		return "", fmt.Errorf("%q is neither IP:port nor an IP address", addr)
	}
	return net.JoinHostPort(ip.String(), fmt.Sprint(port)), nil
}

// portFromDeprecatedFlag applies kube-proxy's --healthz-port or
// --metrics-port to addr: 0 disables the server, another port replaces
// addr's.
func portFromDeprecatedFlag(addr string, port int32, changed bool) (string, error) {
	if !changed {
		return addr, nil
	}
	if port == 0 {
		return "", nil
	}
	if port < 0 || port > 65535 {
		return "", fmt.Errorf("%d is not a port", port)
	}
	host := addr
	if h, _, err := net.SplitHostPort(addr); err == nil {
		host = h
	}
	if host == "" {
		host = "0.0.0.0"
	}
	return net.JoinHostPort(strings.Trim(host, "[]"), fmt.Sprint(port)), nil
}

// kubeProxyArgs returns the arguments for the root command when the binary
// is run as kube-proxy (argv0 kube-proxy) or without a subcommand but with
// flags (uproxy --config ...): both are `uproxy run`. subcommands are the
// root command's.
func kubeProxyArgs(argv0 string, args []string, subcommands []string) []string {
	isSub := func(a string) bool { return slices.Contains(subcommands, a) }
	if filepath.Base(argv0) == "kube-proxy" {
		if len(args) > 0 && isSub(args[0]) {
			return args
		}
		return append([]string{"run"}, args...)
	}
	if len(args) == 0 || !strings.HasPrefix(args[0], "-") || args[0] == "-h" || args[0] == "--help" {
		return args
	}
	// Root flags may precede a subcommand (uproxy -v 2 status).
	if slices.ContainsFunc(args, isSub) {
		return args
	}
	return append([]string{"run"}, args...)
}

// subcommandNames returns the names and aliases of root's subcommands.
func subcommandNames(root *cobra.Command) []string {
	var out []string
	for _, c := range root.Commands() {
		out = append(out, c.Name())
		out = append(out, c.Aliases...)
	}
	return append(out, "help", "completion")
}

// printVersion prints the version line of `uproxy version`, for
// kube-proxy's --version.
func printVersion(fs *pflag.FlagSet) bool {
	v := fs.Lookup("version")
	return v != nil && v.Changed && v.Value.String() != "false"
}

// localhostNodePortsOn reports whether IPv4 node ports are served on
// loopback addresses (redirect.Rules.LocalhostNodePorts), given the
// --nodeport-addresses entries: with --iptables-localhost-nodeports,
// kube-proxy's iptables-mode default; never in kube-proxy's ipvs mode;
// in its nftables mode only with KubeProxyNFTablesLocalhostNodePorts and
// a loopback entry.
func (k *kubeProxyOptions) localhostNodePortsOn(nodePortAddresses []string) bool {
	switch k.proxyMode {
	case "nftables":
		// Behind its gate, kube-proxy's nftables mode serves them where
		// the list names loopback.
		return k.nftLocalhostNodePorts && slices.ContainsFunc(nodePortAddresses, func(a string) bool {
			if a == nodePortLocalhost {
				return true
			}
			p, err := netip.ParsePrefix(strings.TrimSpace(a))
			return err == nil && p.Addr().Is4() && p.Overlaps(netip.MustParsePrefix("127.0.0.0/8"))
		})
	case "ipvs":
		return false
	}
	return k.localhostNodePorts
}
