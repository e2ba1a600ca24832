package paths

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/uproxy/uproxy/bench/internal/harness"

	"github.com/uproxy/uproxy/bench/internal/results"

	"github.com/uproxy/uproxy/internal/uring"
)

// dataPath is one way for the client's traffic to reach the backends.
type dataPath struct {
	results.Subject
	// setup builds the path in t and returns how to use it, or an
	// *results.NAError when it cannot be measured here.
	setup func(ctx context.Context, e *harness.Env, t *harness.Topo, k *harness.KubeEnv) (*harness.PathRun, error)
	// baseline, set for uproxy's paths, sets the path up as setup does but
	// with the baseline binary (--baseline); see baselineTwin.
	baseline func(ctx context.Context, e *harness.Env, t *harness.Topo, k *harness.KubeEnv) (*harness.PathRun, error)
}

var All = []dataPath{
	{results.Subject{ID: "direct", Title: "direct to the pod", How: "The client connects to the backend pods' own addresses (round-robin over them); no service address, no NAT. The ceiling."}, setupDirect, nil},
	{results.Subject{ID: "dnat", Title: "kernel DNAT (iptables rules)", How: "The harness installs kube-proxy's iptables-mode rule shapes in the node: KUBE-SERVICES → KUBE-SVC (statistic random) → KUBE-SEP (DNAT). The baseline of every ratio."}, setupDNAT, nil},
	{results.Subject{ID: "kp-iptables", Title: "kube-proxy iptables", How: "The real kube-proxy (--proxy-mode iptables, defaults otherwise) against the real API server; the Service and EndpointSlice live there."}, setupKubeProxy("iptables"), nil},
	{results.Subject{ID: "kp-nftables", Title: "kube-proxy nftables", How: "The real kube-proxy (--proxy-mode nftables, defaults otherwise) against the real API server."}, setupKubeProxy("nftables"), nil},
	{results.Subject{ID: "haproxy", Title: "HAProxy", How: "HAProxy in the node (mode tcp, option splice-auto, balance roundrobin, maxpipes 16), reached through an iptables REDIRECT from the VIP to its port: the same rule shape as uproxy's."}, setupHAProxy, nil},
	{results.Subject{ID: "nginx", Title: "nginx stream", How: "nginx's stream module in the node (worker_processes auto, round-robin upstreams, proxy_half_close on; UDP with proxy_responses 1), reached through the same REDIRECT rules."}, setupNginx, nil},
	{results.Subject{ID: "iocopy", Title: "Go io.Copy proxy", How: "The reference Go proxy (bench iocopy, about 30 lines): accept, dial the next backend round-robin, one goroutine per direction with io.Copy, which Go carries with splice(2) between TCP sockets; reached through the same REDIRECT rules. What a Go proxy gets for free."}, setupIOCopy, nil},
	{results.Subject{ID: "uring", Title: "Go io_uring loop", How: "A yardstick (bench uring): one goroutine, locked to its thread, drives one io_uring. Accept (multishot), connect, recv, send, shutdown and close are ring operations, and one io_uring_enter per turn of the loop submits them all and waits. A receive takes a 16 KiB buffer from a provided-buffer ring when data arrives, and gives it back once sent on, so an idle connection holds none. No splice: bulk is copied through the buffers. What a Go data path on io_uring could carry; reached through the same REDIRECT rules."}, setupURing, nil},
	uproxyPath(results.Subject{ID: "uproxy", Title: "uproxy redirect", How: "uproxy run --manifests <manifests> --cluster-cidr 10.244.0.0/16 (default flags otherwise: --mode redirect, --io-uring=auto), built from the working tree; it installs its own REDIRECT rules. The client pod keeps its address to the backends."}, "redirect"),
	uproxyPath(results.Subject{ID: "uproxy-tproxy", Title: "uproxy tproxy", How: "uproxy run --mode=tproxy --manifests <manifests>, when uproxy supports that mode."}, "tproxy"),
	uproxyPath(results.Subject{ID: "uproxy-uring", Title: "uproxy redirect, io_uring loops", How: "uproxy run --io-uring --manifests <manifests>: the event loops wait in an io_uring each and carry small messages on it; bulk transfers leave the ring for the epoll splice path."}, "redirect", "--io-uring"),
	uproxyPath(results.Subject{ID: "uproxy-epoll", Title: "uproxy redirect, epoll loops", How: "uproxy run --io-uring=false --manifests <manifests>: the event loops wait in epoll, with a system call per read, write and wait; what kernels without io_uring get."}, "redirect", "--io-uring=false"),
}

func pathByID(id string) *dataPath {
	for i := range All {
		if All[i].ID == id {
			return &All[i]
		}
	}
	return nil
}

func IDs() []string {
	var ids []string
	for _, p := range All {
		ids = append(ids, p.ID)
	}
	return ids
}

func backendTargets(t *harness.Topo, port uint16) []string {
	var out []string
	for _, p := range t.Backends {
		out = append(out, harness.AddrPort(p.IP, port))
	}
	return out
}

func backendEndpoints(t *harness.Topo, port uint16) []netip.AddrPort {
	var out []netip.AddrPort
	for _, p := range t.Backends {
		out = append(out, netip.AddrPortFrom(p.IP, port))
	}
	return out
}

// vipRun is the PathRun of a path that serves the benchmark service's VIP.
func vipRun() *harness.PathRun {
	return &harness.PathRun{RR: []string{harness.VIP(harness.RRPort)}, Bulk: []string{harness.VIP(harness.BulkPort)}, UDP: []string{harness.VIP(harness.UDPPort)}}
}

func setupDirect(_ context.Context, _ *harness.Env, t *harness.Topo, _ *harness.KubeEnv) (*harness.PathRun, error) {
	return &harness.PathRun{
		RR:   backendTargets(t, harness.RRTarget),
		Bulk: backendTargets(t, harness.BulkTarget)[:1],
		UDP:  backendTargets(t, harness.UDPTarget),
	}, nil
}

// benchDNATPorts are the benchmark service's ports for the DNAT path.
func benchDNATPorts(t *harness.Topo) []harness.DNATPort {
	v := netip.MustParseAddr(harness.BenchVIP)
	return []harness.DNATPort{
		{Name: "default/bench:rr", ClusterIP: v, Port: harness.RRPort, Protocol: "tcp", Endpoints: backendEndpoints(t, harness.RRTarget)},
		{Name: "default/bench:bulk", ClusterIP: v, Port: harness.BulkPort, Protocol: "tcp", Endpoints: backendEndpoints(t, harness.BulkTarget)},
		{Name: "default/bench:udp", ClusterIP: v, Port: harness.UDPPort, Protocol: "udp", Endpoints: backendEndpoints(t, harness.UDPTarget)},
	}
}

func setupDNAT(ctx context.Context, _ *harness.Env, t *harness.Topo, _ *harness.KubeEnv) (*harness.PathRun, error) {
	if _, err := exec.LookPath("iptables-restore"); err != nil {
		return nil, results.NA("iptables-restore is not installed (Debian package iptables)")
	}
	if err := harness.Restore(ctx, t.Lab, t.Lab.Node, harness.RenderDNAT(benchDNATPorts(t), harness.ClusterCIDR), false); err != nil {
		return nil, err
	}
	return vipRun(), nil
}

// redirectToLocal installs REDIRECT rules from the benchmark service's
// ports to local ports (tcp rr, tcp bulk, udp; udp 0 means none).
func redirectToLocal(ctx context.Context, t *harness.Topo, rr, bulk, udp uint16) error {
	v := netip.MustParseAddr(harness.BenchVIP)
	ports := []harness.RedirectPort{{VIP: v, Port: harness.RRPort, Protocol: "tcp", To: rr}, {VIP: v, Port: harness.BulkPort, Protocol: "tcp", To: bulk}}
	if udp != 0 {
		ports = append(ports, harness.RedirectPort{VIP: v, Port: harness.UDPPort, Protocol: "udp", To: udp})
	}
	return harness.Restore(ctx, t.Lab, t.Lab.Node, harness.RenderRedirect(ports), false)
}

// Local ports of HAProxy and nginx in the node namespace.
const (
	localRR   = 18080
	localBulk = 15001
	localUDP  = 10053
)

func setupHAProxy(ctx context.Context, e *harness.Env, t *harness.Topo, _ *harness.KubeEnv) (*harness.PathRun, error) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		return nil, results.NA("haproxy is not installed (Debian package haproxy)")
	}
	dir := t.Dir
	var b strings.Builder
	// HAProxy reserves two descriptors per connection and two per pipe:
	// few pipes (splice needs them only while a transfer is under way),
	// and as many connections as the open-files limit then allows.
	fmt.Fprintf(&b, `global
    maxconn %d
    maxpipes %d
defaults
    mode tcp
    option splice-auto
    balance roundrobin
    timeout connect 2s
    timeout client 10m
    timeout server 10m
`, (e.NoFile-2*haproxyPipes-100)/2, haproxyPipes)
	for _, s := range []struct {
		name        string
		local, port uint16
	}{{"rr", localRR, harness.RRTarget}, {"bulk", localBulk, harness.BulkTarget}} {
		fmt.Fprintf(&b, "frontend %s\n    bind 0.0.0.0:%d\n    default_backend %s-pods\nbackend %s-pods\n", s.name, s.local, s.name, s.name)
		for i, ep := range backendTargets(t, s.port) {
			fmt.Fprintf(&b, "    server be%d %s\n", i, ep)
		}
	}
	cfg := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(cfg, []byte(b.String()), 0o644); err != nil {
		return nil, err
	}
	// -db: stay in the foreground, as one process (its threads use every core).
	return startLocalProxy(ctx, t, "haproxy", "HAProxy does not proxy UDP", bin, "-db", "-f", cfg)
}

// setupIOCopy runs the reference Go proxy (bench iocopy) in the node,
// behind the REDIRECT rules that HAProxy and nginx get. It carries no UDP.
func setupIOCopy(ctx context.Context, e *harness.Env, t *harness.Topo, _ *harness.KubeEnv) (*harness.PathRun, error) {
	args := append([]string{e.IOCopyBin, "iocopy"}, localRoutes(t)...)
	return startLocalProxy(ctx, t, "iocopy", "the reference Go proxy carries TCP only", args...)
}

// setupURing runs the io_uring yardstick (bench uring) in the node, behind
// the REDIRECT rules that HAProxy and nginx get. It carries no UDP.
func setupURing(ctx context.Context, e *harness.Env, t *harness.Topo, _ *harness.KubeEnv) (*harness.PathRun, error) {
	if err := uring.Available(); err != nil {
		return nil, results.NA("io_uring is not available here (%v)", err)
	}
	args := append([]string{e.URingBin, "uring"}, localRoutes(t)...)
	return startLocalProxy(ctx, t, "uring", "the io_uring yardstick carries TCP only", args...)
}

// localRoutes are the --route flags of bench iocopy and bench uring: the
// local keep-alive and bulk ports, each to every backend's port.
func localRoutes(t *harness.Topo) []string {
	var args []string
	for _, s := range []struct{ local, port uint16 }{{localRR, harness.RRTarget}, {localBulk, harness.BulkTarget}} {
		args = append(args, "--route", fmt.Sprintf("0.0.0.0:%d=%s", s.local, strings.Join(backendTargets(t, s.port), ",")))
	}
	return args
}

// startLocalProxy starts a proxy of the node's own (args: its binary and
// arguments), listening on the local ports, and redirects the service's
// VIP to them. udpNA, when set, says why it carries no UDP; else it
// listens on localUDP too.
func startLocalProxy(ctx context.Context, t *harness.Topo, name, udpNA string, args ...string) (*harness.PathRun, error) {
	p, err := t.Lab.Start(t.Lab.Node, name, args...)
	if err != nil {
		return nil, err
	}
	udp := uint16(localUDP)
	if udpNA != "" {
		udp = 0
	}
	if err := redirectToLocal(ctx, t, localRR, localBulk, udp); err != nil {
		return nil, err
	}
	r := vipRun()
	if udpNA != "" {
		r.UDP, r.UDPNA = nil, udpNA
	}
	// The process name, for perf: the binary's, as the kernel records it.
	r.Proc, r.Userspace, r.Comm, r.Binary = p, true, filepath.Base(args[0]), args[0]
	return r, nil
}

// haproxyPipes is HAProxy's maxpipes.
const haproxyPipes = 16

// nginxStreamModule is Debian's stream module (libnginx-mod-stream).
const nginxStreamModule = "/usr/lib/nginx/modules/ngx_stream_module.so"

func setupNginx(ctx context.Context, e *harness.Env, t *harness.Topo, _ *harness.KubeEnv) (*harness.PathRun, error) {
	bin, err := exec.LookPath("nginx")
	if err != nil {
		return nil, results.NA("nginx is not installed (Debian packages nginx-light and libnginx-mod-stream)")
	}
	if _, err := os.Stat(nginxStreamModule); err != nil {
		return nil, results.NA("nginx's stream module is not installed (Debian package libnginx-mod-stream)")
	}
	dir := t.Dir
	var b strings.Builder
	fmt.Fprintf(&b, `load_module %s;
daemon off;
master_process on;
worker_processes auto;
worker_rlimit_nofile %d;
user root;
pid %s/nginx.pid;
error_log %s/error.log warn;
events { worker_connections %d; }
stream {
`, nginxStreamModule, e.NoFile, dir, dir, e.NoFile-100)
	for _, s := range []struct {
		name        string
		local, port uint16
		udp         bool
	}{{"rr", localRR, harness.RRTarget, false}, {"bulk", localBulk, harness.BulkTarget, false}, {"udp", localUDP, harness.UDPTarget, true}} {
		fmt.Fprintf(&b, "    upstream %s {\n", s.name)
		for _, ep := range backendTargets(t, s.port) {
			fmt.Fprintf(&b, "        server %s;\n", ep)
		}
		b.WriteString("    }\n")
		if s.udp {
			fmt.Fprintf(&b, "    server { listen %d udp; proxy_pass %s; proxy_responses 1; proxy_timeout 2s; }\n", s.local, s.name)
		} else {
			fmt.Fprintf(&b, "    server { listen %d; proxy_pass %s; proxy_connect_timeout 2s; proxy_timeout 10m; proxy_half_close on; }\n", s.local, s.name)
		}
	}
	b.WriteString("}\n")
	cfg := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(cfg, []byte(b.String()), 0o644); err != nil {
		return nil, err
	}
	return startLocalProxy(ctx, t, "nginx", "", bin, "-c", cfg, "-p", dir, "-e", filepath.Join(dir, "error.log"))
}

// benchManifests is the benchmark service as uproxy's manifests.
func benchManifests(t *harness.Topo) string {
	var b strings.Builder
	fmt.Fprintf(&b, `apiVersion: v1
kind: Service
metadata:
  name: bench
  namespace: default
spec:
  clusterIP: %s
  ports:
  - {name: rr, port: %d, targetPort: %d, protocol: TCP}
  - {name: bulk, port: %d, targetPort: %d, protocol: TCP}
  - {name: udp, port: %d, targetPort: %d, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: bench-1
  namespace: default
  labels:
    kubernetes.io/service-name: bench
addressType: IPv4
ports:
- {name: rr, port: %d, protocol: TCP}
- {name: bulk, port: %d, protocol: TCP}
- {name: udp, port: %d, protocol: UDP}
endpoints:
`, harness.BenchVIP, harness.RRPort, harness.RRTarget, harness.BulkPort, harness.BulkTarget, harness.UDPPort, harness.UDPTarget, harness.RRTarget, harness.BulkTarget, harness.UDPTarget)
	for _, p := range t.Backends {
		fmt.Fprintf(&b, "- addresses: [%q]\n  conditions: {ready: true}\n", p.IP)
	}
	return b.String()
}

// uproxyPath is a data path through uproxy run with the given mode and
// flags: by the binary built from the working tree, or by the baseline.
func uproxyPath(s results.Subject, mode string, extra ...string) dataPath {
	return dataPath{Subject: s, setup: setupUproxy(currentUproxy, mode, extra...), baseline: setupUproxy(baselineUproxy, mode, extra...)}
}

// currentUproxy returns the uproxy built from the working tree.
func currentUproxy(e *harness.Env) (string, error) {
	if e.UproxyErr != nil {
		return "", fmt.Errorf("uproxy does not build: %w", e.UproxyErr)
	}
	return e.UproxyBin, nil
}

// baselineUproxy returns the baseline uproxy (--baseline).
func baselineUproxy(e *harness.Env) (string, error) {
	if e.Baseline == nil {
		return "", errors.New("no baseline binary (--baseline or --baseline-rev)")
	}
	return e.Baseline.Path, nil
}

// setupUproxy runs uproxy (the binary that bin returns) in the given mode
// over manifests of the benchmark service. A mode that uproxy does not
// support is "n/a: not implemented", so that the row fills in by itself
// once it is.
func setupUproxy(bin func(*harness.Env) (string, error), mode string, extra ...string) func(ctx context.Context, e *harness.Env, t *harness.Topo, _ *harness.KubeEnv) (*harness.PathRun, error) {
	return func(ctx context.Context, e *harness.Env, t *harness.Topo, _ *harness.KubeEnv) (*harness.PathRun, error) {
		uproxyBin, err := bin(e)
		if err != nil {
			return nil, err
		}
		dir := t.Dir
		if err := os.WriteFile(filepath.Join(dir, "bench.yaml"), []byte(benchManifests(t)), 0o644); err != nil {
			return nil, err
		}
		// The socket is the lab's own, not the host's default.
		// The pod network, as a cluster's DaemonSet gives it: the
		// client pod keeps its own address to the service.
		args := []string{uproxyBin, "run", "--manifests", dir, "--upgrade-socket", filepath.Join(dir, "upgrade.sock"), "--profiling", "--cluster-cidr", harness.ClusterCIDR}
		if mode != "redirect" {
			args = append(args, "--mode="+mode)
		}
		args = append(args, extra...)
		p, err := t.Lab.Start(t.Lab.Node, "uproxy", args...)
		if err != nil {
			return nil, err
		}
		r := vipRun()
		r.Proc, r.Userspace, r.Comm, r.Pprof, r.Binary = p, true, "uproxy", true, uproxyBin
		// A mode that uproxy does not know makes it exit at once, saying so.
		r.ExitNA = func(out string) error {
			if strings.Contains(out, "is not supported") {
				return results.NA("not implemented (`uproxy run --mode=%s`: %s)", mode, results.FirstLine(harness.LastMatching(out, "not supported")))
			}
			return nil
		}
		return r, nil
	}
}
