package harness

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/uproxy/uproxy/bench/internal/results"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/internal/testkube"
	"github.com/uproxy/uproxy/internal/testlab"
)

// KubeEnv is a real etcd and kube-apiserver in a lab of their own, which
// the labs of the kube-proxy (and uproxy) runs reach through a relay.
type KubeEnv struct {
	lab       *testlab.Lab
	CP        *testkube.ControlPlane
	KubeProxy string
	// Err says why there is no control plane (an *results.NAError when it cannot
	// run here); the other fields are then unset.
	Err error

	benchOnce sync.Once
	benchErr  error
}

// startKube starts a control plane, or returns a KubeEnv whose err says
// why it cannot. It registers the Node the proxies run as.
func startKube(ctx context.Context, e *Env) *KubeEnv {
	k := &KubeEnv{}
	if _, err := os.Stat(testkube.EtcdPath); err != nil {
		k.Err = results.NA("etcd is not installed (Debian package etcd-server)")
		return k
	}
	if _, err := exec.LookPath("socat"); err != nil {
		k.Err = results.NA("socat is not installed (Debian package socat)")
		return k
	}
	start := time.Now()
	_, kp, err := testkube.Binaries(e.Config.Root)
	if err != nil {
		k.Err = fmt.Errorf("building kube-apiserver and kube-proxy: %w", err)
		return k
	}
	k.KubeProxy = kp
	if k.lab, err = testlab.New(testlab.Options{Logf: e.labLogf()}); err != nil {
		k.Err = err
		return k
	}
	sctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	if k.CP, err = testkube.Start(sctx, testkube.Options{Lab: k.lab, Root: e.Config.Root, Logf: e.labLogf()}); err != nil {
		k.close()
		k.Err = err
		return k
	}
	if err := k.CP.CreateNode(ctx, BenchNode, "10.244.0.1"); err != nil {
		k.close()
		k.Err = err
		return k
	}
	e.Logf("control plane (etcd, kube-apiserver %s) ready in %v", kubeVersion(k.KubeProxy), time.Since(start).Round(100*time.Millisecond))
	return k
}

func (k *KubeEnv) close() {
	if k.CP != nil {
		k.CP.Close()
	}
	if k.lab != nil {
		k.lab.Close()
	}
}

func kubeVersion(bin string) string {
	out, err := exec.Command(bin, "--version").Output()
	if err != nil {
		return "(unknown version)"
	}
	return strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(string(out)), "Kubernetes "))
}

// Connect makes the API server reachable at testkube.Server (127.0.0.1:6443)
// inside l's node namespace, where the proxies run: a socat there relays
// to the control plane's unix socket.
func (k *KubeEnv) Connect(ctx context.Context, l *testlab.Lab) error {
	if _, err := l.Start(l.Node, "apiserver-relay", "socat",
		fmt.Sprintf("TCP-LISTEN:%d,bind=127.0.0.1,fork,reuseaddr,nodelay", testkube.APIServerPort), "UNIX-CONNECT:"+k.CP.Socket); err != nil {
		return err
	}
	var last error
	for range 100 {
		if _, last = l.Exec(ctx, l.Node, "curl", "-sk", "--max-time", "2", testkube.Server+"/livez"); last == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("the API server relay in %s does not answer: %w", l.Node, last)
}

// EnsureBenchService creates the benchmark service (benchVIP) and its
// EndpointSlice over the topology's backends, once. Every topology has the
// same backend addresses.
func (k *KubeEnv) EnsureBenchService(ctx context.Context, t *Topo) error {
	k.benchOnce.Do(func() {
		c := k.CP.Client
		_, err := c.CoreV1().Services("default").Create(ctx, &v1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "bench"},
			Spec: v1.ServiceSpec{
				ClusterIP: BenchVIP,
				Selector:  map[string]string{"app": "bench"},
				Ports: []v1.ServicePort{
					{Name: "rr", Port: RRPort, TargetPort: intstr.FromInt32(RRTarget), Protocol: v1.ProtocolTCP},
					{Name: "bulk", Port: BulkPort, TargetPort: intstr.FromInt32(BulkTarget), Protocol: v1.ProtocolTCP},
					{Name: "udp", Port: UDPPort, TargetPort: intstr.FromInt32(UDPTarget), Protocol: v1.ProtocolUDP},
				},
			},
		}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			k.benchErr = fmt.Errorf("creating the bench Service: %w", err)
			return
		}
		var eps []discovery.Endpoint
		for _, p := range t.Backends {
			eps = append(eps, discovery.Endpoint{Addresses: []string{p.IP.String()}, Conditions: discovery.EndpointConditions{Ready: ptr.To(true)}})
		}
		_, err = c.DiscoveryV1().EndpointSlices("default").Create(ctx, &discovery.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: "bench-1", Labels: map[string]string{discovery.LabelServiceName: "bench"}},
			AddressType: discovery.AddressTypeIPv4,
			Ports: []discovery.EndpointPort{
				{Name: ptr.To("rr"), Port: ptr.To[int32](RRTarget), Protocol: ptr.To(v1.ProtocolTCP)},
				{Name: ptr.To("bulk"), Port: ptr.To[int32](BulkTarget), Protocol: ptr.To(v1.ProtocolTCP)},
				{Name: ptr.To("udp"), Port: ptr.To[int32](UDPTarget), Protocol: ptr.To(v1.ProtocolUDP)},
			},
			Endpoints: eps,
		}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			k.benchErr = fmt.Errorf("creating the bench EndpointSlice: %w", err)
		}
	})
	return k.benchErr
}

// DeleteBenchService deletes what ensureBenchService created, so that the
// control-plane part's proxies see only the services it creates.
func (k *KubeEnv) DeleteBenchService(ctx context.Context) error {
	if k.CP == nil {
		return nil
	}
	c := k.CP.Client
	err := c.DiscoveryV1().EndpointSlices("default").Delete(ctx, "bench-1", metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting the bench EndpointSlice: %w", err)
	}
	if err := c.CoreV1().Services("default").Delete(ctx, "bench", metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting the bench Service: %w", err)
	}
	k.benchOnce = sync.Once{}
	return nil
}

// KubeProxyArgs is kube-proxy's command line: the given mode and the
// defaults, except that it must leave the machine-wide conntrack settings
// alone (the conntrack table size is shared by every namespace) and keep
// its OOM score.
func KubeProxyArgs(bin, kubeconfig, mode string) []string {
	return []string{bin,
		"--kubeconfig=" + kubeconfig,
		"--hostname-override=" + BenchNode,
		"--cluster-cidr=" + ClusterCIDR,
		"--proxy-mode=" + mode,
		"--conntrack-max-per-core=0",
		"--conntrack-min=0",
		"--conntrack-tcp-timeout-established=0",
		"--conntrack-tcp-timeout-close-wait=0",
		"--oom-score-adj=0",
		"--metrics-bind-address=127.0.0.1:10249",
		"--healthz-bind-address=127.0.0.1:10256",
	}
}

// KubeProxyNA says why kube-proxy in mode cannot run here, or nil.
func KubeProxyNA(k *KubeEnv, mode string) error {
	if k == nil {
		return errors.New("no control plane was started")
	}
	if k.Err != nil {
		if n, ok := ErrNA(k.Err); ok {
			return n
		}
		return fmt.Errorf("control plane: %w", k.Err)
	}
	tool := "iptables-restore"
	pkg := "iptables"
	if mode == "nftables" {
		tool, pkg = "nft", "nftables"
	}
	if _, err := exec.LookPath(tool); err != nil {
		return results.NA("%s is not installed (Debian package %s), which kube-proxy's %s mode needs", tool, pkg, mode)
	}
	return nil
}
