package main

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/uring"
)

// dataPath is one way for the client's traffic to reach the backends.
type dataPath struct {
	Subject
	// setup builds the path in t and returns how to use it, or an
	// *naError when it cannot be measured here.
	setup func(ctx context.Context, e *env, t *topo, k *kubeEnv) (*pathRun, error)
	// baseline, set for uproxy's paths, sets the path up as setup does but
	// with the baseline binary (--baseline); see baselineTwin.
	baseline func(ctx context.Context, e *env, t *topo, k *kubeEnv) (*pathRun, error)
}

// pathRun is a data path set up in one lab.
type pathRun struct {
	// Targets of the TCP request/response, bulk and UDP workloads.
	rr, bulk, udp []string
	// udpNA says why there is no UDP figure, when udp is empty.
	udpNA string
	// proc is the proxy process (or kube-proxy, which only programs the
	// kernel); nil when the harness programs the kernel itself.
	proc *testlab.Proc
	// userspace is true when proc carries the connections.
	userspace bool
	// comm is the proxy's process name, for perf; empty for kernel paths.
	comm string
	// pprof is true when the proxy serves /debug/pprof on
	// 127.0.0.1:10262 in the node namespace (uproxy, with --profiling).
	pprof bool
	// binary is the proxy's executable, for pprof's symbols.
	binary string
	// exitNA, if set, tells from the output of a proc that exited at once
	// that the path cannot be measured (an *naError), or returns nil.
	exitNA func(output string) error
}

// waitReady waits until the service answers from the client pod, failing
// early if the proxy process exits.
func waitReady(ctx context.Context, e *env, t *topo, r *pathRun, timeout time.Duration) error {
	pr, err := t.lab.Start(t.client.NS, "probe-ready", e.loadBin, "load", "probe", "--target", r.rr[0], "--timeout", timeout.String())
	if err != nil {
		return err
	}
	defer stopProc(pr, time.Second)
	for {
		if r.proc != nil && r.proc.Exited() {
			out := r.proc.Output()
			if r.exitNA != nil {
				if err := r.exitNA(out); err != nil {
					return err
				}
			}
			return fmt.Errorf("%s exited (%v):\n%s", r.proc.Name, r.proc.Wait(time.Second), tail(out, 10))
		}
		if pr.Exited() {
			var res ProbeResult
			if err := decodeLine(pr.Output(), &res); err != nil || !res.OK {
				msg := fmt.Sprintf("the service does not answer: %s", tail(pr.Output(), 2))
				if r.proc != nil {
					msg += "\n" + r.proc.Name + " output:\n" + tail(r.proc.Output(), 10)
				}
				return errors.New(msg)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

var dataPaths = []dataPath{
	{Subject{"direct", "direct to the pod", "The client connects to the backend pods' own addresses (round-robin over them); no service address, no NAT. The ceiling."}, setupDirect, nil},
	{Subject{"dnat", "kernel DNAT (iptables rules)", "The harness installs kube-proxy's iptables-mode rule shapes in the node: KUBE-SERVICES → KUBE-SVC (statistic random) → KUBE-SEP (DNAT). The baseline of every ratio."}, setupDNAT, nil},
	{Subject{"kp-iptables", "kube-proxy iptables", "The real kube-proxy (--proxy-mode iptables, defaults otherwise) against the real API server; the Service and EndpointSlice live there."}, setupKubeProxy("iptables"), nil},
	{Subject{"kp-nftables", "kube-proxy nftables", "The real kube-proxy (--proxy-mode nftables, defaults otherwise) against the real API server."}, setupKubeProxy("nftables"), nil},
	{Subject{"haproxy", "HAProxy", "HAProxy in the node (mode tcp, option splice-auto, balance roundrobin, maxpipes 16), reached through an iptables REDIRECT from the VIP to its port: the same rule shape as uproxy's."}, setupHAProxy, nil},
	{Subject{"nginx", "nginx stream", "nginx's stream module in the node (worker_processes auto, round-robin upstreams, proxy_half_close on; UDP with proxy_responses 1), reached through the same REDIRECT rules."}, setupNginx, nil},
	{Subject{"iocopy", "Go io.Copy proxy", "The reference Go proxy (bench iocopy, about 30 lines): accept, dial the next backend round-robin, one goroutine per direction with io.Copy, which Go carries with splice(2) between TCP sockets; reached through the same REDIRECT rules. What a Go proxy gets for free."}, setupIOCopy, nil},
	{Subject{"uring", "Go io_uring loop", "A yardstick (bench uring): one goroutine, locked to its thread, drives one io_uring. Accept (multishot), connect, recv, send, shutdown and close are ring operations, and one io_uring_enter per turn of the loop submits them all and waits. A receive takes a 16 KiB buffer from a provided-buffer ring when data arrives, and gives it back once sent on, so an idle connection holds none. No splice: bulk is copied through the buffers. What a Go data path on io_uring could carry; reached through the same REDIRECT rules."}, setupURing, nil},
	uproxyPath(Subject{"uproxy", "uproxy redirect", "uproxy run --manifests <manifests> (default flags: --mode redirect, --io-uring=auto), built from the working tree; it installs its own REDIRECT rules."}, "redirect"),
	uproxyPath(Subject{"uproxy-tproxy", "uproxy tproxy", "uproxy run --mode=tproxy --manifests <manifests>, when uproxy supports that mode."}, "tproxy"),
	uproxyPath(Subject{"uproxy-uring", "uproxy redirect, io_uring loops", "uproxy run --io-uring --manifests <manifests>: the event loops wait in an io_uring each and carry small messages on it; bulk transfers leave the ring for the epoll splice path."}, "redirect", "--io-uring"),
	uproxyPath(Subject{"uproxy-epoll", "uproxy redirect, epoll loops", "uproxy run --io-uring=false --manifests <manifests>: the event loops wait in epoll, with a system call per read, write and wait; what kernels without io_uring get."}, "redirect", "--io-uring=false"),
}

func pathByID(id string) *dataPath {
	for i := range dataPaths {
		if dataPaths[i].ID == id {
			return &dataPaths[i]
		}
	}
	return nil
}

func pathIDs() []string {
	var ids []string
	for _, p := range dataPaths {
		ids = append(ids, p.ID)
	}
	return ids
}

func backendTargets(t *topo, port uint16) []string {
	var out []string
	for _, p := range t.backends {
		out = append(out, addrPort(p.IP, port))
	}
	return out
}

func backendEndpoints(t *topo, port uint16) []netip.AddrPort {
	var out []netip.AddrPort
	for _, p := range t.backends {
		out = append(out, netip.AddrPortFrom(p.IP, port))
	}
	return out
}

// vipRun is the pathRun of a path that serves the benchmark service's VIP.
func vipRun() *pathRun {
	return &pathRun{rr: []string{vip(rrPort)}, bulk: []string{vip(bulkPort)}, udp: []string{vip(udpPort)}}
}

func setupDirect(_ context.Context, _ *env, t *topo, _ *kubeEnv) (*pathRun, error) {
	return &pathRun{
		rr:   backendTargets(t, rrTarget),
		bulk: backendTargets(t, bulkTarget)[:1],
		udp:  backendTargets(t, udpTarget),
	}, nil
}

// benchDNATPorts are the benchmark service's ports for the DNAT path.
func benchDNATPorts(t *topo) []dnatPort {
	v := netip.MustParseAddr(benchVIP)
	return []dnatPort{
		{Name: "default/bench:rr", ClusterIP: v, Port: rrPort, Protocol: "tcp", Endpoints: backendEndpoints(t, rrTarget)},
		{Name: "default/bench:bulk", ClusterIP: v, Port: bulkPort, Protocol: "tcp", Endpoints: backendEndpoints(t, bulkTarget)},
		{Name: "default/bench:udp", ClusterIP: v, Port: udpPort, Protocol: "udp", Endpoints: backendEndpoints(t, udpTarget)},
	}
}

func setupDNAT(ctx context.Context, _ *env, t *topo, _ *kubeEnv) (*pathRun, error) {
	if _, err := exec.LookPath("iptables-restore"); err != nil {
		return nil, na("iptables-restore is not installed (Debian package iptables)")
	}
	if err := restore(ctx, t.lab, t.lab.Node, renderDNAT(benchDNATPorts(t), clusterCIDR), false); err != nil {
		return nil, err
	}
	return vipRun(), nil
}

// redirectToLocal installs REDIRECT rules from the benchmark service's
// ports to local ports (tcp rr, tcp bulk, udp; udp 0 means none).
func redirectToLocal(ctx context.Context, t *topo, rr, bulk, udp uint16) error {
	v := netip.MustParseAddr(benchVIP)
	ports := []redirectPort{{v, rrPort, "tcp", rr}, {v, bulkPort, "tcp", bulk}}
	if udp != 0 {
		ports = append(ports, redirectPort{v, udpPort, "udp", udp})
	}
	return restore(ctx, t.lab, t.lab.Node, renderRedirect(ports), false)
}

// Local ports of HAProxy and nginx in the node namespace.
const (
	localRR   = 18080
	localBulk = 15001
	localUDP  = 10053
)

func setupHAProxy(ctx context.Context, e *env, t *topo, _ *kubeEnv) (*pathRun, error) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		return nil, na("haproxy is not installed (Debian package haproxy)")
	}
	dir := t.dir
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
`, (e.noFile-2*haproxyPipes-100)/2, haproxyPipes)
	for _, s := range []struct {
		name        string
		local, port uint16
	}{{"rr", localRR, rrTarget}, {"bulk", localBulk, bulkTarget}} {
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
func setupIOCopy(ctx context.Context, e *env, t *topo, _ *kubeEnv) (*pathRun, error) {
	args := append([]string{e.ioCopyBin, "iocopy"}, localRoutes(t)...)
	return startLocalProxy(ctx, t, "iocopy", "the reference Go proxy carries TCP only", args...)
}

// setupURing runs the io_uring yardstick (bench uring) in the node, behind
// the REDIRECT rules that HAProxy and nginx get. It carries no UDP.
func setupURing(ctx context.Context, e *env, t *topo, _ *kubeEnv) (*pathRun, error) {
	if err := uring.Available(); err != nil {
		return nil, na("io_uring is not available here (%v)", err)
	}
	args := append([]string{e.uringBin, "uring"}, localRoutes(t)...)
	return startLocalProxy(ctx, t, "uring", "the io_uring yardstick carries TCP only", args...)
}

// localRoutes are the --route flags of bench iocopy and bench uring: the
// local keep-alive and bulk ports, each to every backend's port.
func localRoutes(t *topo) []string {
	var args []string
	for _, s := range []struct{ local, port uint16 }{{localRR, rrTarget}, {localBulk, bulkTarget}} {
		args = append(args, "--route", fmt.Sprintf("0.0.0.0:%d=%s", s.local, strings.Join(backendTargets(t, s.port), ",")))
	}
	return args
}

// startLocalProxy starts a proxy of the node's own (args: its binary and
// arguments), listening on the local ports, and redirects the service's
// VIP to them. udpNA, when set, says why it carries no UDP; else it
// listens on localUDP too.
func startLocalProxy(ctx context.Context, t *topo, name, udpNA string, args ...string) (*pathRun, error) {
	p, err := t.lab.Start(t.lab.Node, name, args...)
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
		r.udp, r.udpNA = nil, udpNA
	}
	// The process name, for perf: the binary's, as the kernel records it.
	r.proc, r.userspace, r.comm, r.binary = p, true, filepath.Base(args[0]), args[0]
	return r, nil
}

// haproxyPipes is HAProxy's maxpipes.
const haproxyPipes = 16

// nginxStreamModule is Debian's stream module (libnginx-mod-stream).
const nginxStreamModule = "/usr/lib/nginx/modules/ngx_stream_module.so"

func setupNginx(ctx context.Context, e *env, t *topo, _ *kubeEnv) (*pathRun, error) {
	bin, err := exec.LookPath("nginx")
	if err != nil {
		return nil, na("nginx is not installed (Debian packages nginx-light and libnginx-mod-stream)")
	}
	if _, err := os.Stat(nginxStreamModule); err != nil {
		return nil, na("nginx's stream module is not installed (Debian package libnginx-mod-stream)")
	}
	dir := t.dir
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
`, nginxStreamModule, e.noFile, dir, dir, e.noFile-100)
	for _, s := range []struct {
		name        string
		local, port uint16
		udp         bool
	}{{"rr", localRR, rrTarget, false}, {"bulk", localBulk, bulkTarget, false}, {"udp", localUDP, udpTarget, true}} {
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
func benchManifests(t *topo) string {
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
`, benchVIP, rrPort, rrTarget, bulkPort, bulkTarget, udpPort, udpTarget, rrTarget, bulkTarget, udpTarget)
	for _, p := range t.backends {
		fmt.Fprintf(&b, "- addresses: [%q]\n  conditions: {ready: true}\n", p.IP)
	}
	return b.String()
}

// uproxyPath is a data path through uproxy run with the given mode and
// flags: by the binary built from the working tree, or by the baseline.
func uproxyPath(s Subject, mode string, extra ...string) dataPath {
	return dataPath{Subject: s, setup: setupUproxy(currentUproxy, mode, extra...), baseline: setupUproxy(baselineUproxy, mode, extra...)}
}

// currentUproxy returns the uproxy built from the working tree.
func currentUproxy(e *env) (string, error) {
	if e.uproxyErr != nil {
		return "", fmt.Errorf("uproxy does not build: %w", e.uproxyErr)
	}
	return e.uproxyBin, nil
}

// baselineUproxy returns the baseline uproxy (--baseline).
func baselineUproxy(e *env) (string, error) {
	if e.baseline == nil {
		return "", errors.New("no baseline binary (--baseline or --baseline-rev)")
	}
	return e.baseline.path, nil
}

// setupUproxy runs uproxy (the binary that bin returns) in the given mode
// over manifests of the benchmark service. A mode that uproxy does not
// support is "n/a: not implemented", so that the row fills in by itself
// once it is.
func setupUproxy(bin func(*env) (string, error), mode string, extra ...string) func(ctx context.Context, e *env, t *topo, _ *kubeEnv) (*pathRun, error) {
	return func(ctx context.Context, e *env, t *topo, _ *kubeEnv) (*pathRun, error) {
		uproxyBin, err := bin(e)
		if err != nil {
			return nil, err
		}
		dir := t.dir
		if err := os.WriteFile(filepath.Join(dir, "bench.yaml"), []byte(benchManifests(t)), 0o644); err != nil {
			return nil, err
		}
		// The socket is the lab's own, not the host's default.
		args := []string{uproxyBin, "run", "--manifests", dir, "--upgrade-socket", filepath.Join(dir, "upgrade.sock"), "--profiling"}
		if mode != "redirect" {
			args = append(args, "--mode="+mode)
		}
		args = append(args, extra...)
		p, err := t.lab.Start(t.lab.Node, "uproxy", args...)
		if err != nil {
			return nil, err
		}
		r := vipRun()
		r.proc, r.userspace, r.comm, r.pprof, r.binary = p, true, "uproxy", true, uproxyBin
		// A mode that uproxy does not know makes it exit at once, saying so.
		r.exitNA = func(out string) error {
			if strings.Contains(out, "is not supported") {
				return na("not implemented (`uproxy run --mode=%s`: %s)", mode, firstLine(lastMatching(out, "not supported")))
			}
			return nil
		}
		return r, nil
	}
}

// lastMatching returns the last line of s that contains sub.
func lastMatching(s, sub string) string {
	lines := strings.Split(s, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.Contains(lines[i], sub) {
			return lines[i]
		}
	}
	return ""
}

// waitProc waits for p to end, up to timeout or until ctx is done, and
// returns its error.
func waitProc(ctx context.Context, p *testlab.Proc, timeout time.Duration) error {
	if err := waitProgrammed(ctx, p, nil, timeout); err != nil {
		return fmt.Errorf("%s: %w", p.Name, err)
	}
	return p.Wait(time.Second) // it has ended: this returns at once
}

// stopProc stops a proxy we started (SIGTERM, then SIGKILL), by its pid.
func stopProc(p *testlab.Proc, grace time.Duration) {
	if p == nil || p.Exited() {
		return
	}
	_ = p.Signal(syscall.SIGTERM)
	if p.Wait(grace) != nil && !p.Exited() {
		_ = p.Cmd.Process.Kill()
		_ = p.Wait(5 * time.Second)
	}
}

// errNA returns the naError in err, if any.
func errNA(err error) (*naError, bool) {
	var n *naError
	ok := errors.As(err, &n)
	return n, ok
}
