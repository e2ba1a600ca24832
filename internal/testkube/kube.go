// Package testkube owns the real control plane (etcd and kube-apiserver)
// that uproxy's tests and benchmarks run inside a lab's node namespace.
//
// The control plane's processes live in the node namespace and listen on
// its loopback (and, for the apiserver, on its bridge address too), so
// nothing is reachable from, or touches, the root namespace's network.
// The test process itself stays in the root namespace: it reaches the
// apiserver through a unix socket (a filesystem object, visible across
// network namespaces) that socat, running in the node namespace, forwards
// to 127.0.0.1:6443. RESTConfig dials that socket; Kubeconfig is for
// processes started inside the node namespace (uproxy, kube-proxy).
//
// The kube-apiserver and kube-proxy binaries come from bench/tools (a
// separate module pinning k8s.io/kubernetes); Binaries builds them on first
// use. etcd is Debian's etcd-server, and socat Debian's socat.
package testkube

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/internal/testlab"
)

const (
	// APIServerPort is kube-apiserver's secure port in the node namespace.
	APIServerPort = 6443
	// Server is kube-apiserver's URL from inside the node namespace.
	Server = "https://127.0.0.1:6443"
	// AdvertiseAddress is the address kube-apiserver advertises: the node
	// namespace's bridge address (see testlab.New). It listens there too.
	AdvertiseAddress = "10.244.0.1"
	// DefaultServiceCIDR is the service range when Options.ServiceCIDR is
	// empty.
	DefaultServiceCIDR = "10.96.0.0/16"
	// AdminUser is the token-authenticated user of Kubeconfig and
	// RESTConfig, a member of system:masters.
	AdminUser = "uproxy-admin"
	// EtcdPath is Debian's etcd binary (package etcd-server).
	EtcdPath = "/usr/bin/etcd"
	// ReadyTimeout bounds Start's wait for /readyz when its context has no
	// deadline.
	ReadyTimeout = 3 * time.Minute
)

// ModuleRoot returns the uproxy module root: the nearest directory, from
// the working directory up, that holds bench/tools/build.sh.
func ModuleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("finding the module root: %w", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "bench", "tools", "build.sh")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("finding the module root: no bench/tools/build.sh above the working directory")
		}
		dir = parent
	}
}

// Binaries returns the paths of kube-apiserver and kube-proxy, building
// them with bench/tools/build.sh if they are missing or older than
// bench/tools/go.mod or go.sum (the first build takes minutes). root is
// the uproxy module root. It returns a clear error if etcd is not
// installed, since nothing here runs without it.
func Binaries(root string) (apiserver, kubeProxy string, err error) {
	if _, err := os.Stat(EtcdPath); err != nil {
		return "", "", fmt.Errorf("etcd is not installed (install the Debian package etcd-server): %w", err)
	}
	tools := filepath.Join(root, "bench", "tools")
	bin := filepath.Join(root, "bench", ".cache", "bin")
	apiserver, kubeProxy = filepath.Join(bin, "kube-apiserver"), filepath.Join(bin, "kube-proxy")
	if upToDate([]string{apiserver, kubeProxy}, []string{filepath.Join(tools, "go.mod"), filepath.Join(tools, "go.sum")}) {
		return apiserver, kubeProxy, nil
	}
	script := filepath.Join(tools, "build.sh")
	out, err := exec.Command("bash", script, bin).CombinedOutput()
	if err != nil {
		return "", "", fmt.Errorf("building kube-apiserver and kube-proxy with %s: %w:\n%s", script, err, tail(string(out), 30))
	}
	return apiserver, kubeProxy, nil
}

// upToDate reports whether every target exists and is newer than every
// source.
func upToDate(targets, sources []string) bool {
	var newest time.Time
	for _, s := range sources {
		fi, err := os.Stat(s)
		if err != nil {
			return false
		}
		if fi.ModTime().After(newest) {
			newest = fi.ModTime()
		}
	}
	for _, t := range targets {
		fi, err := os.Stat(t)
		if err != nil || !fi.ModTime().After(newest) {
			return false
		}
	}
	return true
}

// Options configures Start.
type Options struct {
	// Lab is required: etcd and kube-apiserver run in Lab.Node.
	Lab *testlab.Lab
	// Root is the uproxy module root, for Binaries; empty means
	// ModuleRoot().
	Root string
	// ServiceCIDR is the service range (--service-cluster-ip-range);
	// empty means DefaultServiceCIDR.
	ServiceCIDR string
	// Dir holds the certificates, tokens, kubeconfigs, the socket and
	// etcd's data. Empty means a new temporary directory (on /dev/shm when
	// there is one, so that etcd's fsyncs are cheap) that Close removes.
	Dir string
	// APIServerArgs are extra kube-apiserver flags, appended to the
	// defaults (a later flag wins).
	APIServerArgs []string
	// Logf receives progress lines; nil means none.
	Logf func(format string, args ...any)
}

// ControlPlane is a running etcd and kube-apiserver in a lab's node
// namespace. Its processes are the Lab's: Lab.Close stops them too, but
// only Close removes an automatically created Dir.
type ControlPlane struct {
	// Kubeconfig is an admin kubeconfig (token auth, system:masters) for
	// processes inside the node namespace: its server is Server.
	Kubeconfig string
	// Server is the apiserver's URL inside the node namespace.
	Server string
	// CAFile is the CA that verifies the apiserver's serving certificate,
	// which is valid for 127.0.0.1, AdvertiseAddress, the kubernetes
	// Service's ClusterIP and the usual kubernetes.default names.
	CAFile string
	// Socket is the unix socket, in Dir, that leads to the apiserver.
	Socket string
	// RESTConfig is an admin config for the calling (root namespace)
	// process: it dials Socket.
	RESTConfig *rest.Config
	// Client is built from RESTConfig.
	Client kubernetes.Interface
	// Dir holds certificates, tokens, kubeconfigs, Socket and etcd's data.
	Dir string

	logf                   func(format string, args ...any)
	ownDir                 bool
	caPEM                  []byte
	etcd, apiserver, socat *testlab.Proc
	closeOnce              sync.Once

	lab           *testlab.Lab
	apiserverArgv []string // to restart it
}

// Start runs etcd (on 127.0.0.1:2379, peer 127.0.0.1:2380) and
// kube-apiserver (on 0.0.0.0:6443, advertising AdvertiseAddress) inside
// opts.Lab.Node, plus the socat that serves Socket, and waits until
// /readyz is ok and the default and kube-system namespaces exist. If
// ctx has no deadline, the wait is bounded by ReadyTimeout. On failure it
// stops what it started and the error includes the processes' log tails.
func Start(ctx context.Context, opts Options) (_ *ControlPlane, err error) {
	if opts.Lab == nil {
		return nil, errors.New("testkube.Start: Options.Lab is required")
	}
	if _, err := exec.LookPath("socat"); err != nil {
		return nil, fmt.Errorf("testkube.Start: socat is not installed (install the Debian package socat): %w", err)
	}
	logf := opts.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	root := opts.Root
	if root == "" {
		if root, err = ModuleRoot(); err != nil {
			return nil, fmt.Errorf("testkube.Start: %w", err)
		}
	}
	cidr := opts.ServiceCIDR
	if cidr == "" {
		cidr = DefaultServiceCIDR
	}
	svcRange, err := netip.ParsePrefix(cidr)
	if err != nil {
		return nil, fmt.Errorf("testkube.Start: service CIDR: %w", err)
	}
	kubernetesIP := svcRange.Masked().Addr().Next() // the kubernetes Service's ClusterIP

	apiserverBin, _, err := Binaries(root)
	if err != nil {
		return nil, fmt.Errorf("testkube.Start: %w", err)
	}

	cp := &ControlPlane{Server: Server, Dir: opts.Dir, logf: logf}
	if cp.Dir == "" {
		base := ""
		if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
			base = "/dev/shm"
		}
		if cp.Dir, err = os.MkdirTemp(base, "uproxy-kube-"); err != nil {
			return nil, fmt.Errorf("testkube.Start: %w", err)
		}
		cp.ownDir = true
	}
	defer func() {
		if err != nil {
			cp.Close()
		}
	}()

	pk, err := writePKI(cp.Dir,
		[]net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback, net.ParseIP(AdvertiseAddress), net.ParseIP("2001:db8:244::1"), kubernetesIP.AsSlice()},
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"})
	if err != nil {
		return nil, fmt.Errorf("testkube.Start: %w", err)
	}
	cp.CAFile, cp.caPEM = pk.caFile, pk.caPEM
	token := randomToken()
	tokens := filepath.Join(cp.Dir, "tokens.csv")
	if err := os.WriteFile(tokens, fmt.Appendf(nil, "%s,%s,%s,\"system:masters\"\n", token, AdminUser, AdminUser), 0o600); err != nil {
		return nil, fmt.Errorf("testkube.Start: writing the token file: %w", err)
	}

	node := opts.Lab.Node
	cp.etcd, err = opts.Lab.Start(node, "etcd", etcdArgs(filepath.Join(cp.Dir, "etcd"))...)
	if err != nil {
		return nil, fmt.Errorf("testkube.Start: %w", err)
	}
	args := append([]string{apiserverBin}, apiserverArgs(pk, tokens, cidr)...)
	cp.lab, cp.apiserverArgv = opts.Lab, append(args, opts.APIServerArgs...)
	cp.apiserver, err = opts.Lab.Start(node, "kube-apiserver", cp.apiserverArgv...)
	if err != nil {
		return nil, fmt.Errorf("testkube.Start: %w", err)
	}
	cp.Socket = filepath.Join(cp.Dir, "apiserver.sock")
	cp.socat, err = opts.Lab.Start(node, "apiserver-socket", "socat",
		"UNIX-LISTEN:"+cp.Socket+",fork,unlink-early,mode=600,backlog=256",
		fmt.Sprintf("TCP:127.0.0.1:%d,nodelay", APIServerPort))
	if err != nil {
		return nil, fmt.Errorf("testkube.Start: %w", err)
	}

	cp.RESTConfig = &rest.Config{
		Host:            Server,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: pk.caPEM},
		Dial:            cp.dial,
		QPS:             100,
		Burst:           200,
	}
	client, err := kubernetes.NewForConfig(cp.RESTConfig)
	if err != nil {
		return nil, fmt.Errorf("testkube.Start: building the client: %w", err)
	}
	cp.Client = client
	if cp.Kubeconfig, err = cp.TokenKubeconfig(AdminUser, token); err != nil {
		return nil, fmt.Errorf("testkube.Start: %w", err)
	}

	start := time.Now()
	logf("waiting for kube-apiserver in %s to become ready", node)
	if err := cp.waitReady(ctx); err != nil {
		return nil, fmt.Errorf("testkube.Start: %w", err)
	}
	logf("kube-apiserver ready after %v (kubeconfig %s)", time.Since(start).Round(time.Millisecond), cp.Kubeconfig)
	return cp, nil
}

// etcdArgs returns the etcd command line Start uses: a single member on the
// namespace's loopback, with its data in dataDir.
func etcdArgs(dataDir string) []string {
	return []string{
		EtcdPath,
		"--name=uproxy-lab",
		"--data-dir=" + dataDir,
		"--listen-client-urls=http://127.0.0.1:2379",
		"--advertise-client-urls=http://127.0.0.1:2379",
		"--listen-peer-urls=http://127.0.0.1:2380",
		"--initial-advertise-peer-urls=http://127.0.0.1:2380",
		"--initial-cluster=uproxy-lab=http://127.0.0.1:2380",
		"--initial-cluster-state=new",
		"--logger=zap",
		"--log-outputs=stderr",
	}
}

// apiserverArgs returns the kube-apiserver flags Start uses (without the
// binary and without Options.APIServerArgs).
func apiserverArgs(pk *pki, tokenFile, serviceCIDR string) []string {
	return []string{
		"--etcd-servers=http://127.0.0.1:2379",
		"--bind-address=0.0.0.0",
		fmt.Sprintf("--secure-port=%d", APIServerPort),
		"--advertise-address=" + AdvertiseAddress,
		"--endpoint-reconciler-type=none",
		"--tls-cert-file=" + pk.certFile,
		"--tls-private-key-file=" + pk.keyFile,
		"--token-auth-file=" + tokenFile,
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + pk.saPubFile,
		"--service-account-signing-key-file=" + pk.saKeyFile,
		"--service-cluster-ip-range=" + serviceCIDR,
		"--enable-priority-and-fairness=false",
		"--profiling=false",
	}
}

// dial connects to the apiserver through Socket, whatever the address.
func (cp *ControlPlane) dial(ctx context.Context, _, _ string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "unix", cp.Socket)
}

// waitReady polls /readyz until it is ok and the namespaces that the
// bootstrap controller creates exist, failing early if a process exits.
func (cp *ControlPlane) waitReady(ctx context.Context) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, ReadyTimeout)
		defer cancel()
	}
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		for _, p := range []*testlab.Proc{cp.etcd, cp.apiserver, cp.socat} {
			if p.Exited() {
				return fmt.Errorf("%s exited (%v) before kube-apiserver was ready\n%s", p.Name, p.Wait(time.Second), cp.logTails())
			}
		}
		if last = cp.ready(ctx); last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kube-apiserver not ready: %w (last check: %v)\n%s", ctx.Err(), last, cp.logTails())
		case <-tick.C:
		}
	}
}

// ready checks /readyz and the bootstrap namespaces once.
func (cp *ControlPlane) ready(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	body, err := cp.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
	if err != nil {
		return fmt.Errorf("/readyz: %w: %s", err, strings.TrimSpace(string(body)))
	}
	for _, ns := range []string{metav1.NamespaceDefault, metav1.NamespaceSystem} {
		if _, err := cp.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); err != nil {
			return fmt.Errorf("namespace %s: %w", ns, err)
		}
	}
	return nil
}

// logTails returns the last lines of each process's output.
func (cp *ControlPlane) logTails() string {
	var b strings.Builder
	for _, p := range []struct {
		proc  *testlab.Proc
		lines int
	}{{cp.apiserver, 40}, {cp.etcd, 10}, {cp.socat, 10}} {
		if p.proc != nil {
			fmt.Fprintf(&b, "--- %s log tail:\n%s\n", p.proc.Name, tail(p.proc.Output(), p.lines))
		}
	}
	return b.String()
}

// Logs returns the last lines of the output of kube-apiserver, etcd and
// socat, for a failing test's report.
func (cp *ControlPlane) Logs() string { return cp.logTails() }

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Close stops kube-apiserver, socat and etcd (SIGTERM, then SIGKILL after
// a grace period) and removes Dir if Start created it. It is idempotent,
// and safe to call before or after the Lab's Close.
func (cp *ControlPlane) Close() {
	cp.closeOnce.Do(func() {
		// The apiserver first: socat's per-connection children, which hold
		// its output pipe, exit when the apiserver closes their connections.
		for _, p := range []*testlab.Proc{cp.apiserver, cp.socat, cp.etcd} {
			if p != nil {
				start := time.Now()
				stop(p)
				cp.logf("stopped %s in %v", p.Name, time.Since(start).Round(time.Millisecond))
			}
		}
		if cp.ownDir {
			_ = os.RemoveAll(cp.Dir)
		}
	})
}

// StopAPIServer stops kube-apiserver, leaving etcd running, so a test can
// see how clients behave while the API is down.
func (cp *ControlPlane) StopAPIServer() {
	stop(cp.apiserver)
	cp.logf("stopped kube-apiserver")
}

// StartAPIServer starts kube-apiserver again, with the same flags, after
// StopAPIServer, and waits until it is ready.
func (cp *ControlPlane) StartAPIServer(ctx context.Context) error {
	if !cp.apiserver.Exited() {
		return errors.New("kube-apiserver is still running")
	}
	p, err := cp.lab.Start(cp.lab.Node, "kube-apiserver", cp.apiserverArgv...)
	if err != nil {
		return err
	}
	cp.apiserver = p
	if err := cp.waitReady(ctx); err != nil {
		return fmt.Errorf("restarting kube-apiserver: %w", err)
	}
	return nil
}

// stop ends p, which the Lab started for us, by its pid.
func stop(p *testlab.Proc) {
	if p == nil || p.Exited() {
		return
	}
	_ = p.Signal(syscall.SIGTERM)
	if p.Wait(10*time.Second) != nil && !p.Exited() {
		_ = p.Cmd.Process.Kill()
		_ = p.Wait(5 * time.Second)
	}
}

// TokenKubeconfig writes, into Dir, a kubeconfig for processes inside the
// node namespace that authenticates with the bearer token as user name,
// and returns its path.
func (cp *ControlPlane) TokenKubeconfig(name, token string) (string, error) {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["lab"] = &clientcmdapi.Cluster{Server: cp.Server, CertificateAuthorityData: cp.caPEM}
	cfg.AuthInfos[name] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["lab"] = &clientcmdapi.Context{Cluster: "lab", AuthInfo: name}
	cfg.CurrentContext = "lab"
	path := filepath.Join(cp.Dir, strings.NewReplacer("/", "-", ":", "-").Replace(name)+".kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return "", fmt.Errorf("writing kubeconfig for %s: %w", name, err)
	}
	return path, nil
}

// ServiceAccountKubeconfig creates the namespace and the ServiceAccount if
// they do not exist, gets a token for it with the TokenRequest API, and
// writes a kubeconfig with that token (see TokenKubeconfig). The account
// has no permissions beyond the defaults until RBAC objects grant them.
func (cp *ControlPlane) ServiceAccountKubeconfig(ctx context.Context, namespace, name string) (string, error) {
	_, err := cp.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("creating namespace %s: %w", namespace, err)
	}
	sa := &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name}}
	_, err = cp.Client.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("creating service account %s/%s: %w", namespace, name, err)
	}
	tr := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](24 * 3600)}}
	tr, err = cp.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, tr, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("requesting a token for service account %s/%s: %w", namespace, name, err)
	}
	return cp.TokenKubeconfig("system:serviceaccount:"+namespace+":"+name, tr.Status.Token)
}

// RESTConfigFor loads a kubeconfig written by TokenKubeconfig or
// ServiceAccountKubeconfig and returns a config for it that the calling
// (root namespace) process can use: it dials Socket.
func (cp *ControlPlane) RESTConfigFor(kubeconfig string) (*rest.Config, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("loading %s: %w", kubeconfig, err)
	}
	cfg.Dial = cp.dial
	return cfg, nil
}

// CreateNode creates a Node named name, with the given InternalIP
// addresses, a Hostname address, the usual hostname/os labels and a Ready
// condition, as a kubelet would register it (kube-proxy waits for its
// Node).
func (cp *ControlPlane) CreateNode(ctx context.Context, name string, addrs ...string) error {
	now := metav1.Now()
	status := v1.NodeStatus{
		Conditions: []v1.NodeCondition{{
			Type:               v1.NodeReady,
			Status:             v1.ConditionTrue,
			Reason:             "KubeletReady",
			Message:            "uproxy lab node",
			LastHeartbeatTime:  now,
			LastTransitionTime: now,
		}},
	}
	for _, a := range addrs {
		ip, err := netip.ParseAddr(a)
		if err != nil {
			return fmt.Errorf("creating node %s: address %q: %w", name, a, err)
		}
		status.Addresses = append(status.Addresses, v1.NodeAddress{Type: v1.NodeInternalIP, Address: ip.String()})
	}
	status.Addresses = append(status.Addresses, v1.NodeAddress{Type: v1.NodeHostName, Address: name})
	node := &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
			"kubernetes.io/hostname": name,
			"kubernetes.io/os":       "linux",
		}},
		Status: status,
	}
	created, err := cp.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("creating node %s: %w", name, err)
	}
	if len(created.Status.Conditions) == 0 || len(created.Status.Addresses) != len(status.Addresses) {
		// Should the apiserver ever drop status on create, set it explicitly.
		created.Status = status
		if _, err := cp.Client.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("setting node %s's status: %w", name, err)
		}
	}
	return nil
}
