package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/internal/testkube"
	"github.com/uproxy/uproxy/internal/testlab"
)

// kubeEnv is a real etcd and kube-apiserver in a lab of their own, which
// the labs of the kube-proxy (and uproxy) runs reach through a relay.
type kubeEnv struct {
	lab       *testlab.Lab
	cp        *testkube.ControlPlane
	kubeProxy string
	// err says why there is no control plane (an *naError when it cannot
	// run here); the other fields are then unset.
	err error

	benchOnce sync.Once
	benchErr  error
}

// startKube starts a control plane, or returns a kubeEnv whose err says
// why it cannot. It registers the Node the proxies run as.
func startKube(ctx context.Context, e *env) *kubeEnv {
	k := &kubeEnv{}
	if _, err := os.Stat(testkube.EtcdPath); err != nil {
		k.err = na("etcd is not installed (Debian package etcd-server)")
		return k
	}
	if _, err := exec.LookPath("socat"); err != nil {
		k.err = na("socat is not installed (Debian package socat)")
		return k
	}
	start := time.Now()
	_, kp, err := testkube.Binaries(e.cfg.Root)
	if err != nil {
		k.err = fmt.Errorf("building kube-apiserver and kube-proxy: %w", err)
		return k
	}
	k.kubeProxy = kp
	if k.lab, err = testlab.New(testlab.Options{Logf: e.labLogf()}); err != nil {
		k.err = err
		return k
	}
	sctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	if k.cp, err = testkube.Start(sctx, testkube.Options{Lab: k.lab, Root: e.cfg.Root, Logf: e.labLogf()}); err != nil {
		k.close()
		k.err = err
		return k
	}
	if err := k.cp.CreateNode(ctx, benchNode, "10.244.0.1"); err != nil {
		k.close()
		k.err = err
		return k
	}
	e.logf("control plane (etcd, kube-apiserver %s) ready in %v", kubeVersion(k.kubeProxy), time.Since(start).Round(100*time.Millisecond))
	return k
}

func (k *kubeEnv) close() {
	if k.cp != nil {
		k.cp.Close()
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

// connect makes the API server reachable at testkube.Server (127.0.0.1:6443)
// inside l's node namespace, where the proxies run: a socat there relays
// to the control plane's unix socket.
func (k *kubeEnv) connect(ctx context.Context, l *testlab.Lab) error {
	if _, err := l.Start(l.Node, "apiserver-relay", "socat",
		fmt.Sprintf("TCP-LISTEN:%d,bind=127.0.0.1,fork,reuseaddr,nodelay", testkube.APIServerPort), "UNIX-CONNECT:"+k.cp.Socket); err != nil {
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

// ensureBenchService creates the benchmark service (benchVIP) and its
// EndpointSlice over the topology's backends, once. Every topology has the
// same backend addresses.
func (k *kubeEnv) ensureBenchService(ctx context.Context, t *topo) error {
	k.benchOnce.Do(func() {
		c := k.cp.Client
		_, err := c.CoreV1().Services("default").Create(ctx, &v1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "bench"},
			Spec: v1.ServiceSpec{
				ClusterIP: benchVIP,
				Selector:  map[string]string{"app": "bench"},
				Ports: []v1.ServicePort{
					{Name: "rr", Port: rrPort, TargetPort: intstr.FromInt32(rrTarget), Protocol: v1.ProtocolTCP},
					{Name: "bulk", Port: bulkPort, TargetPort: intstr.FromInt32(bulkTarget), Protocol: v1.ProtocolTCP},
					{Name: "udp", Port: udpPort, TargetPort: intstr.FromInt32(udpTarget), Protocol: v1.ProtocolUDP},
				},
			},
		}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			k.benchErr = fmt.Errorf("creating the bench Service: %w", err)
			return
		}
		var eps []discovery.Endpoint
		for _, p := range t.backends {
			eps = append(eps, discovery.Endpoint{Addresses: []string{p.IP.String()}, Conditions: discovery.EndpointConditions{Ready: ptr.To(true)}})
		}
		_, err = c.DiscoveryV1().EndpointSlices("default").Create(ctx, &discovery.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: "bench-1", Labels: map[string]string{discovery.LabelServiceName: "bench"}},
			AddressType: discovery.AddressTypeIPv4,
			Ports: []discovery.EndpointPort{
				{Name: ptr.To("rr"), Port: ptr.To[int32](rrTarget), Protocol: ptr.To(v1.ProtocolTCP)},
				{Name: ptr.To("bulk"), Port: ptr.To[int32](bulkTarget), Protocol: ptr.To(v1.ProtocolTCP)},
				{Name: ptr.To("udp"), Port: ptr.To[int32](udpTarget), Protocol: ptr.To(v1.ProtocolUDP)},
			},
			Endpoints: eps,
		}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			k.benchErr = fmt.Errorf("creating the bench EndpointSlice: %w", err)
		}
	})
	return k.benchErr
}

// deleteBenchService deletes what ensureBenchService created, so that the
// control-plane part's proxies see only the services it creates.
func (k *kubeEnv) deleteBenchService(ctx context.Context) error {
	if k.cp == nil {
		return nil
	}
	c := k.cp.Client
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

// kubeProxyArgs is kube-proxy's command line: the given mode and the
// defaults, except that it must leave the machine-wide conntrack settings
// alone (the conntrack table size is shared by every namespace) and keep
// its OOM score.
func kubeProxyArgs(bin, kubeconfig, mode string) []string {
	return []string{bin,
		"--kubeconfig=" + kubeconfig,
		"--hostname-override=" + benchNode,
		"--cluster-cidr=" + clusterCIDR,
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

// kubeProxyNA says why kube-proxy in mode cannot run here, or nil.
func kubeProxyNA(k *kubeEnv, mode string) error {
	if k == nil {
		return errors.New("no control plane was started")
	}
	if k.err != nil {
		if n, ok := errNA(k.err); ok {
			return n
		}
		return fmt.Errorf("control plane: %w", k.err)
	}
	tool := "iptables-restore"
	pkg := "iptables"
	if mode == "nftables" {
		tool, pkg = "nft", "nftables"
	}
	if _, err := exec.LookPath(tool); err != nil {
		return na("%s is not installed (Debian package %s), which kube-proxy's %s mode needs", tool, pkg, mode)
	}
	return nil
}

func setupKubeProxy(mode string) func(ctx context.Context, e *env, t *topo, k *kubeEnv) (*pathRun, error) {
	return func(ctx context.Context, e *env, t *topo, k *kubeEnv) (*pathRun, error) {
		if err := kubeProxyNA(k, mode); err != nil {
			return nil, err
		}
		if err := k.ensureBenchService(ctx, t); err != nil {
			return nil, err
		}
		if err := k.connect(ctx, t.lab); err != nil {
			return nil, err
		}
		p, err := t.lab.Start(t.lab.Node, "kube-proxy", kubeProxyArgs(k.kubeProxy, k.cp.Kubeconfig, mode)...)
		if err != nil {
			return nil, err
		}
		r := vipRun()
		r.proc, r.comm, r.binary = p, "kube-proxy", k.kubeProxy
		return r, nil
	}
}
