package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/kubernetes"
	logsapi "k8s.io/component-base/logs/api/v1"
	kpconfig "k8s.io/kube-proxy/config/v1alpha1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
)

// loadKubeProxyConfig decodes path as a KubeProxyConfiguration, strictly:
// an unknown or duplicate field is an error naming it, so a typo cannot
// silently leave a default in place.
func loadKubeProxyConfig(path string) (*kpconfig.KubeProxyConfiguration, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--config: %w", err)
	}
	scheme := runtime.NewScheme()
	if err := kpconfig.AddToScheme(scheme); err != nil {
		return nil, err
	}
	codecs := serializer.NewCodecFactory(scheme, serializer.EnableStrict)
	obj, _, err := codecs.UniversalDeserializer().Decode(data, nil, nil)
	if runtime.IsNotRegisteredError(err) || runtime.IsMissingKind(err) || runtime.IsMissingVersion(err) {
		var tm metav1.TypeMeta
		_ = yaml.Unmarshal(data, &tm)
		hint := ""
		if tm.Kind == "Service" || tm.Kind == "EndpointSlice" || tm.Kind == "List" {
			hint = "; Service and EndpointSlice manifests go to --manifests"
		}
		return nil, fmt.Errorf("--config %s: apiVersion %q, kind %q is not a KubeProxyConfiguration (%s)%s", path, tm.APIVersion, tm.Kind, kpconfig.SchemeGroupVersion, hint)
	}
	if err != nil {
		return nil, fmt.Errorf("--config %s: %w", path, err)
	}
	cfg, ok := obj.(*kpconfig.KubeProxyConfiguration)
	if !ok {
		return nil, fmt.Errorf("--config %s: %T is not a KubeProxyConfiguration", path, obj)
	}
	return cfg, nil
}

// honouredConfigFields are the KubeProxyConfiguration fields (JSON paths)
// that uproxy applies; every other field set in the file is logged as
// ignored. A prefix ending in "." covers the fields below it.
var honouredConfigFields = []string{
	"apiVersion", "kind",
	"clientConnection.kubeconfig", "clientConnection.qps", "clientConnection.burst", "clientConnection.acceptContentTypes", "clientConnection.contentType",
	"hostnameOverride", "clusterCIDR", "bindAddress", "healthzBindAddress", "metricsBindAddress",
	"nodePortAddresses", "oomScoreAdj", "logging.format", "logging.verbosity",
	"detectLocalMode", "configSyncPeriod", "featureGates.", "mode",
	"iptables.syncPeriod", "iptables.minSyncPeriod", "iptables.masqueradeAll", "iptables.localhostNodePorts",
	"nftables.syncPeriod", "nftables.minSyncPeriod", "nftables.masqueradeAll",
	"ipvs.syncPeriod", "ipvs.minSyncPeriod",
	"conntrack.",
}

// applyConfig sets o, lf and k from cfg, with kube-proxy's defaults for
// what cfg leaves unset, and notes each field it ignores.
func (k *kubeProxyOptions) applyConfig(cfg *kpconfig.KubeProxyConfiguration, fs *pflag.FlagSet, o *runOptions, lf *logFlags) error {
	o.kubeconfig = cfg.ClientConnection.Kubeconfig
	k.apiQPS = cmp.Or(cfg.ClientConnection.QPS, defaultAPIQPS)
	k.apiBurst = cmp.Or(cfg.ClientConnection.Burst, defaultAPIBurst)
	k.apiContentType = cmp.Or(cfg.ClientConnection.ContentType, defaultAPIContentType)
	k.apiAcceptContentTypes = cfg.ClientConnection.AcceptContentTypes
	if !fs.Changed("hostname-override") {
		o.hostnameOverride = cfg.HostnameOverride
	}
	o.clusterCIDR = cfg.ClusterCIDR
	k.bindAddress = cfg.BindAddress
	// kube-proxy's default addresses follow the bind address's family
	// (getDefaultAddresses).
	healthzHost, metricsHost := "0.0.0.0", "127.0.0.1"
	if ip, err := netip.ParseAddr(cfg.BindAddress); err == nil && ip.Is6() && !ip.Is4In6() {
		healthzHost, metricsHost = "::", "::1"
	}
	o.healthzBindAddress = cmp.Or(cfg.HealthzBindAddress, healthzHost)
	o.metricsBindAddress = cmp.Or(cfg.MetricsBindAddress, metricsHost)
	o.nodePortAddresses = cfg.NodePortAddresses
	k.oomScoreAdj = defaultOOMScoreAdj
	if cfg.OOMScoreAdj != nil {
		k.oomScoreAdj = *cfg.OOMScoreAdj
	}
	k.detectLocalMode = string(cfg.DetectLocalMode)
	k.conntrack = conntrackFromConfig(cfg.Conntrack)
	k.configSyncPeriod = cmp.Or(cfg.ConfigSyncPeriod.Duration, defaultConfigSyncPeriod)
	k.featureGates = cfg.FeatureGates
	k.proxyMode = string(cfg.Mode)
	// The sync periods of the mode kube-proxy would run (the internal
	// configuration's are converted from the mode's section).
	sync, minSync := cfg.IPTables.SyncPeriod.Duration, cfg.IPTables.MinSyncPeriod.Duration
	switch cfg.Mode {
	case "nftables":
		sync, minSync = cfg.NFTables.SyncPeriod.Duration, cfg.NFTables.MinSyncPeriod.Duration
	case "ipvs":
		sync, minSync = cfg.IPVS.SyncPeriod.Duration, cfg.IPVS.MinSyncPeriod.Duration
	}
	// kube-proxy reads masqueradeAll from the mode's section too
	// (v1alpha1's conversion).
	k.masqueradeAll = cfg.IPTables.MasqueradeAll
	if cfg.Mode == "nftables" {
		k.masqueradeAll = cfg.NFTables.MasqueradeAll
	}
	k.localhostNodePorts = cfg.IPTables.LocalhostNodePorts == nil || *cfg.IPTables.LocalhostNodePorts
	o.syncPeriod = cmp.Or(sync, 30*time.Second)
	o.minSyncPeriod = cmp.Or(minSync, time.Second)
	// Logging flags override the file, as in kube-proxy (copyLogsFromFlags).
	if f := cfg.Logging.Format; f != "" && !fs.Changed("logging-format") && !fs.Changed("log-format") {
		k.loggingFormat = f
	}
	if !fs.Changed("v") {
		lf.verbosity = int(cfg.Logging.Verbosity)
	}
	ignored, err := ignoredConfigFields(cfg)
	if err != nil {
		return err
	}
	for _, f := range ignored {
		k.notef(false, "KubeProxyConfiguration field ignored: it has no meaning for uproxy", zap.String("field", f.path), zap.String("value", f.value), zap.String("file", k.configFile))
	}
	return nil
}

// conntrackFromConfig returns the conntrack options of a
// KubeProxyConfiguration's section, with kube-proxy's defaults for the
// fields it leaves out (SetDefaults_KubeProxyConfiguration defaults the
// pointer fields only).
func conntrackFromConfig(c kpconfig.KubeProxyConntrackConfiguration) conntrackOptions {
	out := conntrackOptions{
		MaxPerCore:   ptr.Deref(c.MaxPerCore, defaultConntrackMaxPerCore),
		Min:          ptr.Deref(c.Min, defaultConntrackMin),
		TCPBeLiberal: c.TCPBeLiberal, UDPTimeout: c.UDPTimeout.Duration, UDPStreamTimeout: c.UDPStreamTimeout.Duration,
		TCPEstablishedTimeout: defaultConntrackTCPEstablished, TCPCloseWaitTimeout: defaultConntrackTCPCloseWait,
	}
	if c.TCPEstablishedTimeout != nil {
		out.TCPEstablishedTimeout = c.TCPEstablishedTimeout.Duration
	}
	if c.TCPCloseWaitTimeout != nil {
		out.TCPCloseWaitTimeout = c.TCPCloseWaitTimeout.Duration
	}
	return out
}

type configField struct{ path, value string }

// ignoredConfigFields returns the fields of cfg set to something other
// than their zero value that uproxy does not apply, sorted by path.
func ignoredConfigFields(cfg *kpconfig.KubeProxyConfiguration) ([]configField, error) {
	b, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	var tree map[string]any
	if err := json.Unmarshal(b, &tree); err != nil {
		return nil, err
	}
	var out []configField
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch t := v.(type) {
		case map[string]any:
			for key, child := range t {
				p := key
				if path != "" {
					p = path + "." + key
				}
				walk(p, child)
			}
			return
		case nil:
			return
		case []any:
			if len(t) == 0 {
				return
			}
		}
		if v == false || v == "" || v == float64(0) {
			return
		}
		for _, h := range honouredConfigFields {
			if path == h || (strings.HasSuffix(h, ".") && strings.HasPrefix(path, h)) {
				return
			}
		}
		// Durations and quantities marshal as strings: "0s" and "0" are
		// unset.
		if s, ok := v.(string); ok && (s == "0s" || s == "0") {
			return
		}
		val, _ := json.Marshal(v)
		out = append(out, configField{path, string(val)})
	}
	walk("", tree)
	sort.Slice(out, func(i, j int) bool { return out[i].path < out[j].path })
	return out, nil
}

// The keywords of --nodeport-addresses, as kube-proxy's.
const (
	nodePortPrimary   = "primary"
	nodePortLocalhost = "localhost"
	nodePortAll       = "all"
)

// nodePortPrefixes expands kube-proxy's --nodeport-addresses (CIDRs and
// keywords) into prefixes, as kube-proxy's expandNodePortAddressKeywords
// and NewNodePortAddresses do: 'primary' is the node IP of each family
// unless it is loopback, 'localhost' is 127.0.0.0/8 and ::1/128, 'all' is
// 0.0.0.0/0 and ::/0; and a family left without a prefix accepts node
// ports on every address.
func nodePortPrefixes(entries []string, nodeIPs []netip.Addr) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, e := range entries {
		e = strings.TrimSpace(e)
		switch e {
		case "":
		case nodePortPrimary:
			for _, ip := range nodeIPs {
				if !ip.IsLoopback() {
					out = append(out, netip.PrefixFrom(ip, ip.BitLen()))
				}
			}
		case nodePortLocalhost:
			out = append(out, netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128"))
		case nodePortAll:
			out = append(out, netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0"))
		default:
			p, err := netip.ParsePrefix(e)
			if err != nil {
				return nil, fmt.Errorf("%q is not a CIDR nor one of %s, %s, %s", e, nodePortPrimary, nodePortLocalhost, nodePortAll)
			}
			out = append(out, p.Masked())
		}
	}
	if !slices.ContainsFunc(out, func(p netip.Prefix) bool { return p.Addr().Unmap().Is4() }) {
		out = append(out, netip.MustParsePrefix("0.0.0.0/0"))
	}
	if !slices.ContainsFunc(out, func(p netip.Prefix) bool { return !p.Addr().Unmap().Is4() }) {
		out = append(out, netip.MustParsePrefix("::/0"))
	}
	return slices.Compact(out), nil
}

// nodeInfo waits up to timeout for this node's Node object and returns
// its IPs (one per family, InternalIP before ExternalIP, as kube-proxy's
// NodeManager picks them) and podCIDRs. A node that does not appear in
// time yields none, as in kube-proxy, which then assumes loopback.
func nodeInfo(ctx context.Context, client kubernetes.Interface, name string, timeout, poll time.Duration, log *zap.Logger) (ips []netip.Addr, podCIDRs []netip.Prefix) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		// A list by name, not a get: the RBAC of kube-proxy and of
		// deploy/ grant list and watch on nodes.
		var n *v1.Node
		l, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + name})
		if err == nil {
			for i := range l.Items {
				if l.Items[i].Name == name {
					n = &l.Items[i]
				}
			}
			if n == nil {
				err = apierrors.NewNotFound(v1.Resource("nodes"), name)
			}
		}
		if err == nil {
			ips = nodeIPs(n)
			if len(ips) > 0 {
				for _, c := range n.Spec.PodCIDRs {
					if p, err := netip.ParsePrefix(c); err == nil {
						podCIDRs = append(podCIDRs, p.Masked())
					}
				}
				return ips, podCIDRs
			}
		} else if !apierrors.IsNotFound(err) && !errors.Is(err, context.DeadlineExceeded) {
			log.Info("reading this node's Node object", zap.String("node", name), zap.Error(err))
		}
		select {
		case <-ctx.Done():
			log.Warn("this node's Node object has no address; assuming loopback, as kube-proxy does: set --bind-address", zap.String("node", name), zap.Duration("waited", timeout))
			return nil, nil
		case <-time.After(poll):
		}
	}
}

// nodeIPs returns a Node's addresses, one per family, the first family
// first, InternalIP before ExternalIP (k8s.io/component-helpers
// node/util.GetNodeHostIPs).
func nodeIPs(n *v1.Node) []netip.Addr {
	var out []netip.Addr
	for _, t := range []v1.NodeAddressType{v1.NodeInternalIP, v1.NodeExternalIP} {
		for _, a := range n.Status.Addresses {
			if a.Type != t {
				continue
			}
			ip, err := netip.ParseAddr(a.Address)
			if err != nil {
				continue
			}
			ip = ip.Unmap()
			if !slices.ContainsFunc(out, func(o netip.Addr) bool { return o.Is4() == ip.Is4() }) {
				out = append(out, ip)
			}
		}
	}
	return out
}

// withBindAddress puts kube-proxy's --bind-address in place of the node
// IP of its family (detectNodeIPs): an unspecified address changes
// nothing.
func withBindAddress(ips []netip.Addr, bind string) []netip.Addr {
	b, err := netip.ParseAddr(bind)
	if err != nil || b.IsUnspecified() {
		return ips
	}
	b = b.Unmap()
	out := []netip.Addr{b}
	for _, ip := range ips {
		if ip.Is4() != b.Is4() {
			out = append(out, ip)
		}
	}
	return out
}

// resolveNodeAddresses completes o's node-port prefixes and, with
// detect-local mode NodeCIDR, its cluster CIDRs, which may need this
// node's Node object: for the nodeport keyword 'primary', and for the
// Node's podCIDRs. client is nil when uproxy serves manifests.
func (o *runOptions) resolveNodeAddresses(ctx context.Context, client kubernetes.Interface, log *zap.Logger) error {
	k := &o.kubeProxy
	var ips []netip.Addr
	var podCIDRs []netip.Prefix
	// kube-proxy reads the Node's IPs even with a --bind-address, which
	// replaces only its own family's.
	needNode := slices.Contains(o.nodePortAddresses, nodePortPrimary) || k.detectLocalMode == "NodeCIDR"
	if needNode && client != nil {
		ips, podCIDRs = nodeInfo(ctx, client, o.nodeName, 30*time.Second, time.Second, log)
		o.node = nodeWatch{
			ips: ips, watchIPs: slices.Contains(o.nodePortAddresses, nodePortPrimary),
			podCIDRs: podCIDRs, watchPodCIDRs: k.detectLocalMode == "NodeCIDR",
		}
	}
	ips = withBindAddress(ips, k.bindAddress)
	var err error
	if o.nodePortCIDRs, err = nodePortPrefixes(o.nodePortAddresses, ips); err != nil {
		return fmt.Errorf("--nodeport-addresses: %w", err)
	}
	log.Info("node ports accepted on", zap.Stringers("prefixes", o.nodePortCIDRs), zap.Strings("nodePortAddresses", o.nodePortAddresses))
	if k.detectLocalMode == "NodeCIDR" {
		if len(podCIDRs) == 0 {
			log.Warn("detect-local mode NodeCIDR: this node's Node object has no podCIDRs; using --cluster-cidr", zap.String("node", o.nodeName))
		} else {
			o.clusterCIDRs = podCIDRs
		}
	}
	return nil
}

// effectiveConfig returns the KubeProxyConfiguration that o and lf
// resolve to, for --write-config-to: --config reads it back to the same
// settings.
func (o *runOptions) effectiveConfig(lf *logFlags) *kpconfig.KubeProxyConfiguration {
	k := &o.kubeProxy
	cfg := &kpconfig.KubeProxyConfiguration{
		TypeMeta:           metav1.TypeMeta{APIVersion: kpconfig.SchemeGroupVersion.String(), Kind: "KubeProxyConfiguration"},
		FeatureGates:       k.featureGates,
		HostnameOverride:   o.hostnameOverride,
		BindAddress:        k.bindAddress,
		HealthzBindAddress: o.healthzBindAddress,
		MetricsBindAddress: o.metricsBindAddress,
		Mode:               kpconfig.ProxyMode(k.proxyMode),
		DetectLocalMode:    kpconfig.LocalMode(k.detectLocalMode),
		ClusterCIDR:        o.clusterCIDR,
		NodePortAddresses:  o.nodePortAddresses,
		OOMScoreAdj:        ptr.To(k.oomScoreAdj),
		ConfigSyncPeriod:   metav1.Duration{Duration: k.configSyncPeriod},
	}
	if o.mode == "tproxy" {
		// uproxy's --mode, which no kube-proxy mode maps to.
		cfg.Mode = "tproxy"
	}
	cfg.ClientConnection.Kubeconfig = o.kubeconfig
	cfg.ClientConnection.QPS = k.apiQPS
	cfg.ClientConnection.Burst = k.apiBurst
	cfg.ClientConnection.ContentType = k.apiContentType
	cfg.ClientConnection.AcceptContentTypes = k.apiAcceptContentTypes
	sync := kpconfig.KubeProxyIPTablesConfiguration{SyncPeriod: metav1.Duration{Duration: o.syncPeriod}, MinSyncPeriod: metav1.Duration{Duration: o.minSyncPeriod}}
	switch k.proxyMode {
	case "nftables":
		cfg.NFTables.SyncPeriod, cfg.NFTables.MinSyncPeriod = sync.SyncPeriod, sync.MinSyncPeriod
		cfg.NFTables.MasqueradeAll = k.masqueradeAll
	case "ipvs":
		cfg.IPVS.SyncPeriod, cfg.IPVS.MinSyncPeriod = sync.SyncPeriod, sync.MinSyncPeriod
		cfg.IPTables.MasqueradeAll = k.masqueradeAll
	default:
		cfg.IPTables = sync
		cfg.IPTables.MasqueradeAll = k.masqueradeAll
		cfg.IPTables.LocalhostNodePorts = ptr.To(k.localhostNodePorts)
	}
	ct := k.conntrack
	cfg.Conntrack = kpconfig.KubeProxyConntrackConfiguration{
		MaxPerCore: ptr.To(ct.MaxPerCore), Min: ptr.To(ct.Min),
		TCPEstablishedTimeout: &metav1.Duration{Duration: ct.TCPEstablishedTimeout},
		TCPCloseWaitTimeout:   &metav1.Duration{Duration: ct.TCPCloseWaitTimeout},
		TCPBeLiberal:          ct.TCPBeLiberal,
		UDPTimeout:            metav1.Duration{Duration: ct.UDPTimeout},
		UDPStreamTimeout:      metav1.Duration{Duration: ct.UDPStreamTimeout},
	}
	cfg.Logging.Format = "text"
	if lf.format == "json" {
		cfg.Logging.Format = "json"
	}
	cfg.Logging.Verbosity = logsapi.VerbosityLevel(max(lf.verbosity, 0))
	return cfg
}

// writeConfig writes o's configuration to path as YAML.
func (o *runOptions) writeConfig(path string, lf *logFlags) error {
	b, err := yaml.Marshal(o.effectiveConfig(lf))
	if err != nil {
		return fmt.Errorf("--write-config-to: %w", err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("--write-config-to: %w", err)
	}
	return nil
}
