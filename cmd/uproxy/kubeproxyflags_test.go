package main

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/spf13/pflag"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/uproxy/uproxy/internal/testkube"
)

// kubeProxySource is kube-proxy v1.37.2's flag definitions in the module
// cache of bench/tools, which pins k8s.io/kubernetes.
func kubeProxySource(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMODCACHE").Output()
	if err != nil {
		t.Skipf("go env GOMODCACHE: %v", err)
	}
	return filepath.Join(strings.TrimSpace(string(out)), "k8s.io", "kubernetes@v1.37.2", "cmd", "kube-proxy", "app", "options.go")
}

// sampleValues are a value of each type kube-proxy's --help names, to
// parse every flag with kube-proxy's type. A flag without a type is a
// bool.
var sampleValues = map[string]string{
	"duration": "2s", "float32": "7.5", "int32": "3", "ip": "192.0.2.1", "ipport": "192.0.2.1:10256",
	"mapStringBool": "SomeGate=true,OtherGate=false", "string": "x", "strings": "10.96.0.0/16,2001:db8::/64",
	"quantity": "1Ki", "Level": "2", "LocalMode": "ClusterCIDR", "ProxyMode": "iptables",
	"pattern=N,...": "proxier*=3", "version[=true]": "true",
}

// TestKubeProxyFlagsAccepted checks that `uproxy run` accepts every flag
// of the real kube-proxy v1.37.2 (its --help, and the deprecated hidden
// flags of its options.go), each with a value of kube-proxy's type.
func TestKubeProxyFlagsAccepted(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping: needs kube-proxy, built by bench/tools/build.sh")
	}
	_, kubeProxy, err := testkube.Binaries("../..")
	if err != nil {
		if kubeUnavailable(err) {
			t.Skipf("skipping: %v", err)
		}
		t.Fatal(err)
	}
	help, err := exec.Command(kubeProxy, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("kube-proxy --help: %v\n%s", err, help)
	}
	flag := regexp.MustCompile(`(?m)^\s+(?:-\w, )?--([a-z0-9-]+)(?: (\S+))?`)
	types := map[string]string{}
	for _, m := range flag.FindAllStringSubmatch(string(help), -1) {
		types[m[1]] = m[2]
	}
	if len(types) < 50 {
		t.Fatalf("found %d flags in kube-proxy --help, want kube-proxy's 60 or so:\n%s", len(types), help)
	}
	// Hidden (deprecated) flags are in the source only.
	src, err := os.ReadFile(kubeProxySource(t))
	if err != nil {
		t.Fatalf("kube-proxy's options.go (cd bench/tools && GOWORK=off go mod download k8s.io/kubernetes): %v", err)
	}
	for _, m := range regexp.MustCompile(`MarkDeprecated\("([a-z-]+)"`).FindAllStringSubmatch(string(src), -1) {
		types[m[1]] = "int32"
	}
	var missing, rejected []string
	for name, typ := range types {
		if name == "help" {
			continue
		}
		root := newRootCommand()
		run, _, err := root.Find([]string{"run"})
		if err != nil {
			t.Fatal(err)
		}
		arg := "--" + name
		if v, ok := sampleValues[typ]; ok {
			arg += "=" + v
		}
		if err := run.ParseFlags([]string{arg}); err != nil {
			if strings.Contains(err.Error(), "unknown flag") {
				missing = append(missing, name)
			} else {
				rejected = append(rejected, arg+": "+err.Error())
			}
		}
	}
	slices.Sort(missing)
	slices.Sort(rejected)
	if diff := cmp.Diff([]string(nil), missing); diff != "" {
		t.Errorf("kube-proxy flags that uproxy run does not define (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string(nil), rejected); diff != "" {
		t.Errorf("kube-proxy flags that uproxy run rejects with a value of kube-proxy's type (-want +got):\n%s", diff)
	}
}

// completed is what a command line resolves to, for the tests.
type completed struct {
	Mode, Kubeconfig, Hostname, ClusterCIDR, Healthz, Metrics string
	NodePorts                                                 []string
	Sync, MinSync, ConfigSync                                 time.Duration
	OOM                                                       int32
	LogFormat                                                 string
	Verbosity                                                 int
	QPS                                                       float32
	Burst                                                     int32
	Accept                                                    string
	MasqueradeAll                                             bool
	LocalhostNodePorts                                        bool // effective
	NoExternalIPs                                             bool
	Conntrack                                                 conntrackOptions
	Notes                                                     []string
}

// completeArgs parses args as `uproxy run`'s flags and completes them.
func completeArgs(t *testing.T, args ...string) (completed, error) {
	t.Helper()
	c, _, _, err := completeOptions(t, args...)
	return c, err
}

// completeOptions is completeArgs, with the options themselves.
func completeOptions(t *testing.T, args ...string) (completed, *runOptions, *logFlags, error) {
	t.Helper()
	var o runOptions
	var lf logFlags
	fs := pflag.NewFlagSet("run", pflag.ContinueOnError)
	o.register(fs)
	lf.register(fs)
	if err := fs.Parse(args); err != nil {
		return completed{}, nil, nil, err
	}
	if err := o.kubeProxy.complete(fs, &o, &lf); err != nil {
		return completed{}, nil, nil, err
	}
	o.hostnameOverride = strings.TrimSpace(o.hostnameOverride)
	if err := o.validate(); err != nil {
		return completed{}, nil, nil, err
	}
	core, logs := observer.New(zap.DebugLevel)
	for _, n := range o.kubeProxy.notes {
		logNote(zap.New(core), n)
	}
	var notes []string
	for _, e := range logs.All() {
		s := e.Message
		for _, k := range []string{"flag", "field", "gate", "proxyMode"} {
			if v, ok := e.ContextMap()[k]; ok {
				s += " " + k + "=" + v.(string)
			}
		}
		notes = append(notes, s)
	}
	return completed{
		Mode: o.mode, Kubeconfig: o.kubeconfig, Hostname: o.hostnameOverride, ClusterCIDR: o.clusterCIDR,
		Healthz: o.healthzBindAddress, Metrics: o.metricsBindAddress, NodePorts: o.nodePortAddresses,
		Sync: o.syncPeriod, MinSync: o.minSyncPeriod, ConfigSync: o.kubeProxy.configSyncPeriod,
		OOM: o.kubeProxy.oomScoreAdj, LogFormat: lf.format, Verbosity: lf.verbosity,
		QPS: o.kubeProxy.apiQPS, Burst: o.kubeProxy.apiBurst, Accept: o.kubeProxy.apiAcceptContentTypes,
		MasqueradeAll: o.kubeProxy.masqueradeAll, LocalhostNodePorts: o.kubeProxy.localhostNodePortsOn(o.nodePortAddresses), NoExternalIPs: o.kubeProxy.noExternalIPs, Conntrack: o.kubeProxy.conntrack, Notes: notes,
	}, &o, &lf, nil
}

// defaults is what `uproxy run` with no flag resolves to: kube-proxy's
// defaults where kube-proxy has the setting.
var defaults = completed{
	Mode: "redirect", Healthz: "0.0.0.0:10256", Metrics: "127.0.0.1:10249", NodePorts: []string{"all"},
	Sync: 30 * time.Second, MinSync: time.Second, ConfigSync: 15 * time.Minute, OOM: -999,
	LogFormat: "console", QPS: 5, Burst: 10, LocalhostNodePorts: true, Conntrack: defaultConntrackOptions,
}

func with(f func(*completed)) completed {
	c := defaults
	f(&c)
	return c
}

// TestKubeProxyCommandLine checks how kube-proxy's flags and
// configuration file resolve, against kube-proxy v1.37's rules
// (cmd/kube-proxy/app/options.go).
func TestKubeProxyCommandLine(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	full := write("full.conf", `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: 0.0.0.0
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 20
  burst: 40
  acceptContentTypes: application/json
clusterCIDR: 10.244.0.0/16,2001:db8:1::/56
configSyncPeriod: 5m
conntrack:
  maxPerCore: 0
  tcpBeLiberal: true
healthzBindAddress: 0.0.0.0
metricsBindAddress: 127.0.0.1:10300
hostnameOverride: From-File
iptables:
  syncPeriod: 10s
  minSyncPeriod: 2s
  masqueradeAll: false
ipvs:
  strictARP: true
logging:
  format: json
  verbosity: 3
mode: ipvs
nodePortAddresses: [primary, 192.0.2.0/24]
oomScoreAdj: -500
featureGates:
  ContextualLogging: true
`)
	empty := write("empty.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n")
	noLocalhost := write("nolocalhost.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables: {localhostNodePorts: false}\n")
	masq := write("masq.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables: {masqueradeAll: true}\nnftables: {masqueradeAll: false}\n")
	masqNFT := write("masq-nft.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\niptables: {masqueradeAll: false}\nnftables: {masqueradeAll: true}\n")
	conntrackFile := write("conntrack.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nconntrack: {maxPerCore: 0, min: 1000, tcpEstablishedTimeout: 0s, udpStreamTimeout: 5m}\n")
	nft := write("nft.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nnftables: {syncPeriod: 20s, minSyncPeriod: 3s}\nbindAddress: \"::\"\n")
	tests := []struct {
		name string
		args []string
		want completed
	}{
		{"no flags", nil, defaults},
		{"IP-only bind addresses take kube-proxy's ports", []string{"--healthz-bind-address", "0.0.0.0", "--metrics-bind-address", "127.0.0.1"}, defaults},
		{"IPv6 bind addresses", []string{"--healthz-bind-address", "::", "--metrics-bind-address", "[::1]:9999"},
			with(func(c *completed) { c.Healthz, c.Metrics = "[::]:10256", "[::1]:9999" })},
		{"deprecated ports", []string{"--healthz-port", "0", "--metrics-port", "10300"},
			with(func(c *completed) { c.Healthz, c.Metrics = "", "127.0.0.1:10300" })},
		{"proxy-mode iptables is redirect", []string{"--proxy-mode", "iptables"},
			with(func(c *completed) {
				c.Notes = []string{"kube-proxy's proxy mode is served by uproxy's redirect mode: iptables REDIRECT rules into uproxy's listeners proxyMode=iptables"}
			})},
		{"proxy-mode nftables defaults node ports to primary", []string{"--proxy-mode=nftables"},
			with(func(c *completed) {
				c.NodePorts, c.LocalhostNodePorts = []string{"primary"}, false
				c.Notes = []string{"kube-proxy's proxy mode is served by uproxy's redirect mode: iptables REDIRECT rules into uproxy's listeners proxyMode=nftables"}
			})},
		{"proxy-mode tproxy", []string{"--proxy-mode", "tproxy"}, with(func(c *completed) { c.Mode = "tproxy" })},
		{"--mode wins over a kube-proxy mode", []string{"--proxy-mode", "ipvs", "--mode", "tproxy"}, with(func(c *completed) { c.Mode, c.LocalhostNodePorts = "tproxy", false })},
		{"k3s's flags", []string{"--proxy-mode=iptables", "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0s", "--kube-api-qps=50", "--cluster-cidr=10.42.0.0/16", "--nodeport-addresses=primary,localhost"},
			with(func(c *completed) {
				c.QPS, c.ClusterCIDR, c.NodePorts = 50, "10.42.0.0/16", []string{"primary", "localhost"}
				c.Conntrack.MaxPerCore, c.Conntrack.TCPEstablishedTimeout = 0, 0
				c.Notes = []string{
					"kube-proxy's proxy mode is served by uproxy's redirect mode: iptables REDIRECT rules into uproxy's listeners proxyMode=iptables",
				}
			})},
		{"logging flags", []string{"--logging-format=json", "--v=4", "--vmodule=proxier=5"},
			with(func(c *completed) {
				c.LogFormat, c.Verbosity = "json", 4
				c.Notes = []string{"kube-proxy flag ignored: uproxy's verbosity is global (-v) flag=--vmodule"}
			})},
		{"feature gates", []string{"--feature-gates=NativeHistograms=true,AllowServiceExternalIPs=false"},
			with(func(c *completed) {
				c.NoExternalIPs = true
				c.Notes = []string{"kube-proxy feature gate has no effect on uproxy gate=NativeHistograms"}
			})},
		{"kube-proxy's nftables mode serves localhost node ports behind its gate, where the list names them",
			[]string{"--proxy-mode=nftables", "--feature-gates=KubeProxyNFTablesLocalhostNodePorts=true", "--nodeport-addresses=primary,localhost"},
			with(func(c *completed) {
				c.NodePorts = []string{"primary", "localhost"}
				c.Notes = []string{"kube-proxy's proxy mode is served by uproxy's redirect mode: iptables REDIRECT rules into uproxy's listeners proxyMode=nftables"}
			})},
		{"an empty file takes kube-proxy's defaults", []string{"--config", empty}, defaults},
		{"--masquerade-all", []string{"--masquerade-all"}, with(func(c *completed) { c.MasqueradeAll = true })},
		{"--iptables-localhost-nodeports=false", []string{"--iptables-localhost-nodeports=false"}, with(func(c *completed) { c.LocalhostNodePorts = false })},
		{"localhostNodePorts: false of the iptables section", []string{"--config", noLocalhost}, with(func(c *completed) { c.LocalhostNodePorts = false })},
		{"no localhost node ports in kube-proxy's ipvs mode", []string{"--proxy-mode", "ipvs"},
			with(func(c *completed) {
				c.LocalhostNodePorts = false
				c.Notes = []string{"kube-proxy's proxy mode is served by uproxy's redirect mode: iptables REDIRECT rules into uproxy's listeners proxyMode=ipvs"}
			})},
		{"every conntrack flag", []string{"--conntrack-max-per-core=65536", "--conntrack-min=0", "--conntrack-tcp-timeout-established=2h",
			"--conntrack-tcp-timeout-close-wait=0", "--conntrack-tcp-be-liberal", "--conntrack-udp-timeout=10s", "--conntrack-udp-timeout-stream=2m"},
			with(func(c *completed) {
				c.Conntrack = conntrackOptions{MaxPerCore: 65536, TCPEstablishedTimeout: 2 * time.Hour, TCPBeLiberal: true,
					UDPTimeout: 10 * time.Second, UDPStreamTimeout: 2 * time.Minute}
			})},
		{"the file's conntrack section", []string{"--config", conntrackFile, "--conntrack-min=1"},
			with(func(c *completed) {
				c.Conntrack = conntrackOptions{MaxPerCore: 0, Min: 1000, TCPEstablishedTimeout: 0, TCPCloseWaitTimeout: time.Hour,
					UDPStreamTimeout: 5 * time.Minute}
				c.Notes = []string{"flag ignored: --config is given, and kube-proxy takes this setting from the file flag=--conntrack-min"}
			})},
		{"masqueradeAll of the iptables section", []string{"--config", masq}, with(func(c *completed) { c.MasqueradeAll = true })},
		{"masqueradeAll of the nftables section, in nftables mode", []string{"--config", masqNFT},
			with(func(c *completed) {
				c.MasqueradeAll, c.NodePorts, c.LocalhostNodePorts = true, []string{"primary"}, false
				c.Notes = []string{"kube-proxy's proxy mode is served by uproxy's redirect mode: iptables REDIRECT rules into uproxy's listeners proxyMode=nftables"}
			})},
		{"an IPv6 bind address makes IPv6 default addresses; nftables' sync periods", []string{"--config", nft},
			with(func(c *completed) {
				c.Healthz, c.Metrics, c.NodePorts, c.Sync, c.MinSync = "[::]:10256", "[::1]:10249", []string{"primary"}, 20*time.Second, 3*time.Second
				c.LocalhostNodePorts = false
				c.Notes = []string{"kube-proxy's proxy mode is served by uproxy's redirect mode: iptables REDIRECT rules into uproxy's listeners proxyMode=nftables"}
			})},
		{"every honoured field of the file, and the flags kube-proxy lets override it",
			[]string{"--config", full, "--hostname-override", "node-a", "--v", "1", "--proxy-mode", "iptables", "--iptables-sync-period", "1m", "--masquerade-all"},
			completed{
				Mode: "redirect", Kubeconfig: "/var/lib/kube-proxy/kubeconfig.conf", Hostname: "node-a", ClusterCIDR: "10.244.0.0/16,2001:db8:1::/56",
				Healthz: "0.0.0.0:10256", Metrics: "127.0.0.1:10300", NodePorts: []string{"primary", "192.0.2.0/24"},
				// mode ipvs: the ipvs section's periods, unset, so kube-proxy's defaults.
				Sync: 30 * time.Second, MinSync: time.Second, ConfigSync: 5 * time.Minute, OOM: -500,
				LogFormat: "json", Verbosity: 1, QPS: 20, Burst: 40, Accept: "application/json",
				Conntrack: conntrackOptions{Min: defaultConntrackMin, TCPEstablishedTimeout: defaultConntrackTCPEstablished,
					TCPCloseWaitTimeout: defaultConntrackTCPCloseWait, TCPBeLiberal: true},
				Notes: []string{
					"flag ignored: --config is given, and kube-proxy takes this setting from the file flag=--proxy-mode",
					"flag ignored: --config is given, and kube-proxy takes this setting from the file flag=--iptables-sync-period",
					"flag ignored: --config is given, and kube-proxy takes this setting from the file flag=--masquerade-all",
					"KubeProxyConfiguration field ignored: it has no meaning for uproxy field=ipvs.strictARP",
					"kube-proxy's proxy mode is served by uproxy's redirect mode: iptables REDIRECT rules into uproxy's listeners proxyMode=ipvs",
					"kube-proxy feature gate has no effect on uproxy gate=ContextualLogging",
				},
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := completeArgs(t, tt.args...)
			if err != nil {
				t.Fatalf("completing %q: %v", tt.args, err)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("%q (-want +got):\n%s", tt.args, diff)
			}
		})
	}
}

// TestKubeProxyCommandLineErrors checks that what kube-proxy rejects,
// uproxy rejects, with the setting named.
func TestKubeProxyCommandLineErrors(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	typo := write("typo.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCidr: 10.244.0.0/16\n")
	svc := write("svc.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: web}\n")
	negativeConntrack := write("negative.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nconntrack: {udpTimeout: -1s}\n")
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{"a field the file's kind lacks", []string{"--config", typo}, typo + `: strict decoding error: unknown field "clusterCidr"`},
		{"a Service manifest", []string{"--config", svc}, `--config ` + svc + `: apiVersion "v1", kind "Service" is not a KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1); Service and EndpointSlice manifests go to --manifests`},
		{"a missing file", []string{"--config", filepath.Join(dir, "missing")}, "no such file"},
		{"--config and --manifests", []string{"--config", typo, "--manifests", dir}, "--config (a KubeProxyConfiguration) and --manifests are exclusive"},
		{"unknown proxy mode", []string{"--proxy-mode", "kernelspace"}, `proxy mode "kernelspace" is not supported`},
		{"modes disagree", []string{"--proxy-mode", "redirect", "--mode", "tproxy"}, "--mode tproxy and proxy mode redirect disagree"},
		{"OOM score out of range", []string{"--oom-score-adj", "-1001"}, "oom score adjustment -1001 is not in [-1000, 1000]"},
		{"bad bind address", []string{"--healthz-bind-address", "localhost"}, `healthz bind address: "localhost" is neither IP:port nor an IP address`},
		{"bad nodeport keyword", []string{"--nodeport-addresses", "primary,everything"}, `--nodeport-addresses: "everything" is not a CIDR nor one of primary, localhost, all`},
		{"bad logging format", []string{"--logging-format", "yaml"}, `--logging-format: "yaml" is not text or json`},
		{"bad detect-local mode", []string{"--detect-local-mode", "Magic"}, `detect-local mode "Magic" is not`},
		{"no event loops", []string{"--event-loops", "-1"}, "--event-loops: -1 is not a count"},
		{"an unknown feature gate", []string{"--feature-gates=NoSuchGate=true"}, "--feature-gates: unrecognized feature gate: NoSuchGate"},
		{"a locked feature gate", []string{"--feature-gates=PreferSameTrafficDistribution=false"}, "--feature-gates: cannot set feature gate PreferSameTrafficDistribution to false, feature is locked to true"},
		{"a negative state file age", []string{"--state-file-max-age", "-1m"}, "--state-file-max-age: -1m0s must be positive"},
		{"a Service quota below -1", []string{"--max-listeners-per-service", "-2"}, "--max-listeners-per-service: -2 is neither a count, 0 for the default, nor -1 (no bound)"},
		{"a namespace quota below -1", []string{"--max-listeners-per-namespace", "-5"}, "--max-listeners-per-namespace: -5 is neither a count"},
		{"a negative conntrack minimum", []string{"--conntrack-min=-1"}, "--conntrack-min (or the file's conntrack section): must be greater than or equal to 0"},
		{"a negative conntrack timeout in the file", []string{"--config", negativeConntrack}, "--conntrack-udp-timeout (or the file's conntrack section): must be greater than or equal to 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := completeArgs(t, tt.args...)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("%q: error %v, want one containing %q", tt.args, err, tt.wantErr)
			}
		})
	}
}

// TestNodePortPrefixes checks the expansion of --nodeport-addresses
// against kube-proxy's expandNodePortAddressKeywords and
// NewNodePortAddresses.
func TestNodePortPrefixes(t *testing.T) {
	v4, v6 := netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("2001:db8::10")
	tests := []struct {
		name    string
		entries []string
		nodeIPs []netip.Addr
		want    []string
	}{
		{"all", []string{"all"}, nil, []string{"0.0.0.0/0", "::/0"}},
		{"localhost", []string{"localhost"}, nil, []string{"127.0.0.0/8", "::1/128"}},
		{"primary, dual-stack", []string{"primary"}, []netip.Addr{v4, v6}, []string{"192.0.2.10/32", "2001:db8::10/128"}},
		{"primary, IPv4 only: IPv6 takes every address", []string{"primary"}, []netip.Addr{v4}, []string{"192.0.2.10/32", "::/0"}},
		{"primary without a node IP: every address", []string{"primary"}, nil, []string{"0.0.0.0/0", "::/0"}},
		{"primary on loopback is skipped", []string{"primary"}, []netip.Addr{netip.MustParseAddr("127.0.0.1")}, []string{"0.0.0.0/0", "::/0"}},
		{"CIDRs, masked", []string{"192.0.2.7/24", "2001:db8::1/64"}, nil, []string{"192.0.2.0/24", "2001:db8::/64"}},
		{"keyword and CIDR", []string{"primary", " 10.0.0.0/8 "}, []netip.Addr{v4}, []string{"192.0.2.10/32", "10.0.0.0/8", "::/0"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ps, err := nodePortPrefixes(tt.entries, tt.nodeIPs)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, p := range ps {
				got = append(got, p.String())
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("nodePortPrefixes(%q, %v) (-want +got):\n%s", tt.entries, tt.nodeIPs, diff)
			}
		})
	}
	if got := withBindAddress([]netip.Addr{v4, v6}, "192.0.2.99"); !slices.Equal(got, []netip.Addr{netip.MustParseAddr("192.0.2.99"), v6}) {
		t.Errorf("withBindAddress = %v, want the bind address in place of the IPv4 node IP", got)
	}
	if got := withBindAddress([]netip.Addr{v4}, "0.0.0.0"); !slices.Equal(got, []netip.Addr{v4}) {
		t.Errorf("withBindAddress(0.0.0.0) = %v, want the node IPs", got)
	}
}

// TestKubeProxyArgs checks when the binary is `uproxy run`: run as
// kube-proxy, or given flags without a subcommand.
func TestKubeProxyArgs(t *testing.T) {
	subs := []string{"run", "cleanup", "status", "explain", "version", "help", "completion"}
	tests := []struct {
		argv0 string
		args  []string
		want  []string
	}{
		{"/usr/local/bin/kube-proxy", []string{"--config=/var/lib/kube-proxy/config.conf", "--hostname-override=node-a"}, []string{"run", "--config=/var/lib/kube-proxy/config.conf", "--hostname-override=node-a"}},
		{"kube-proxy", nil, []string{"run"}},
		{"kube-proxy", []string{"--help"}, []string{"run", "--help"}},
		{"kube-proxy", []string{"status"}, []string{"status"}},
		{"uproxy", []string{"--config", "c.conf"}, []string{"run", "--config", "c.conf"}},
		{"uproxy", []string{"--proxy-mode=iptables"}, []string{"run", "--proxy-mode=iptables"}},
		{"uproxy", []string{"run", "--manifests", "d"}, []string{"run", "--manifests", "d"}},
		{"uproxy", []string{"-v", "2", "status"}, []string{"-v", "2", "status"}},
		{"uproxy", []string{"--help"}, []string{"--help"}},
		{"uproxy", nil, nil},
		{"/usr/bin/uproxy", []string{"version"}, []string{"version"}},
	}
	for _, tt := range tests {
		if diff := cmp.Diff(tt.want, kubeProxyArgs(tt.argv0, tt.args, subs)); diff != "" {
			t.Errorf("kubeProxyArgs(%q, %q) (-want +got):\n%s", tt.argv0, tt.args, diff)
		}
	}
	names := subcommandNames(newRootCommand())
	slices.Sort(names)
	slices.Sort(subs)
	if diff := cmp.Diff(subs, names); diff != "" {
		t.Errorf("the root command's subcommands changed (-want +got):\n%s", diff)
	}
}

// TestWriteConfigTo checks that --write-config-to writes a
// KubeProxyConfiguration that --config reads back to the same settings.
func TestWriteConfigTo(t *testing.T) {
	for _, args := range [][]string{
		nil,
		{"--proxy-mode=nftables", "--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", "--iptables-sync-period=1m"},
		{"--proxy-mode=ipvs", "--ipvs-sync-period=20s", "--kube-api-qps=50", "--kube-api-burst=80", "--oom-score-adj=-500"},
		{"--mode=tproxy", "--nodeport-addresses=primary,192.0.2.0/24", "--bind-address=192.0.2.10", "--healthz-bind-address=127.0.0.1", "--metrics-bind-address=0.0.0.0:9100", "--config-sync-period=1h"},
		{"--logging-format=json", "-v=3", "--kubeconfig=/etc/kube-proxy.conf", "--detect-local-mode=NodeCIDR", "--feature-gates=ContextualLogging=true"},
		{"--conntrack-max-per-core=0", "--conntrack-min=7", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-be-liberal", "--conntrack-udp-timeout-stream=3m"},
	} {
		want, o, lf, err := completeOptions(t, args...)
		if err != nil {
			t.Fatalf("%q: %v", args, err)
		}
		path := filepath.Join(t.TempDir(), "config.conf")
		if err := o.writeConfig(path, lf); err != nil {
			t.Fatal(err)
		}
		got, err := completeArgs(t, "--config", path)
		if err != nil {
			b, _ := os.ReadFile(path)
			t.Fatalf("%q: reading the written configuration back: %v\n%s", args, err, b)
		}
		want.Notes, got.Notes = nil, nil
		if diff := cmp.Diff(want, got); diff != "" {
			b, _ := os.ReadFile(path)
			t.Errorf("%q, written and read back (-flags +file):\n%s\n%s", args, diff, b)
		}
	}
}
