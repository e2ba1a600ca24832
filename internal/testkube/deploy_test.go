package testkube

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
)

// kubectlBinary returns bench/.cache/bin/kubectl, building it with
// bench/tools/build.sh when it is missing or older than the tools module
// (Binaries only looks after kube-apiserver and kube-proxy). It skips t,
// or fails it under CI, when the build fails.
func kubectlBinary(t *testing.T, root string) string {
	t.Helper()
	tools := filepath.Join(root, "bench", "tools")
	bin := filepath.Join(root, "bench", ".cache", "bin")
	kubectl := filepath.Join(bin, "kubectl")
	if upToDate([]string{kubectl}, []string{filepath.Join(tools, "go.mod"), filepath.Join(tools, "go.sum")}) {
		return kubectl
	}
	start := time.Now()
	out, err := exec.Command("bash", filepath.Join(tools, "build.sh"), bin).CombinedOutput()
	if err != nil {
		err = fmt.Errorf("building kubectl with bench/tools/build.sh: %w:\n%s", err, tail(string(out), 30))
		if os.Getenv("CI") != "" {
			t.Fatalf("CI must be able to build kubectl: %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
	t.Logf("kubectl built in %v", time.Since(start).Round(time.Millisecond))
	return kubectl
}

// kubectl runs the kubectl binary inside the lab's node namespace, where
// the admin Kubeconfig's server (127.0.0.1:6443) is the control plane.
// Unlike lab.Exec it keeps stdout apart from stderr, so that warnings
// cannot corrupt output that is parsed.
type kubectl struct {
	t          *testing.T
	ns         string // network namespace
	bin        string
	kubeconfig string
	env        []string
}

func newKubectl(t *testing.T, ns, bin, kubeconfig string) *kubectl {
	// A private HOME: no user's kuberc or discovery cache, and nothing
	// left in root's.
	env := []string{"HOME=" + t.TempDir(), "KUBERC=off"}
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); k != "HOME" && k != "KUBECONFIG" && k != "KUBERC" {
			env = append(env, kv)
		}
	}
	return &kubectl{t: t, ns: ns, bin: bin, kubeconfig: kubeconfig, env: env}
}

// run runs kubectl with args and returns its stdout. Anything it wrote
// to stderr is logged.
func (k *kubectl) run(ctx context.Context, args ...string) (string, error) {
	full := append([]string{"netns", "exec", k.ns, k.bin, "--kubeconfig=" + k.kubeconfig}, args...)
	cmd := exec.CommandContext(ctx, "ip", full...)
	cmd.Env = k.env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if err != nil {
		return stdout.String(), fmt.Errorf("kubectl %s: %w:\n%s", strings.Join(args, " "), err, bytes.TrimSpace(stderr.Bytes()))
	}
	if s := bytes.TrimSpace(stderr.Bytes()); len(s) > 0 {
		k.t.Logf("kubectl %s: stderr:\n%s", strings.Join(args, " "), s)
	}
	return stdout.String(), nil
}

// decodeObjects decodes multi-document YAML (or JSON) into typed objects
// with client-go's scheme, unpacking v1 Lists (what kubectl prints for
// several objects with -o yaml).
func decodeObjects(data string) ([]runtime.Object, error) {
	decoder := scheme.Codecs.UniversalDeserializer()
	var objs []runtime.Object
	var add func(doc []byte) error
	add = func(doc []byte) error {
		obj, _, err := decoder.Decode(doc, nil, nil)
		if err != nil {
			return err
		}
		if list, ok := obj.(*v1.List); ok {
			for i, item := range list.Items {
				if err := add(item.Raw); err != nil {
					return fmt.Errorf("list item %d: %w", i, err)
				}
			}
			return nil
		}
		objs = append(objs, obj)
		return nil
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(strings.NewReader(data)))
	for n := 1; ; n++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", n, err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		if err := add(doc); err != nil {
			return nil, fmt.Errorf("document %d: %w", n, err)
		}
	}
}

// objectKeys names each object "Kind namespace/name", sorted.
func objectKeys(t *testing.T, objs []runtime.Object) []string {
	t.Helper()
	var keys []string
	for _, o := range objs {
		m, err := meta.Accessor(o)
		if err != nil {
			t.Fatalf("%T has no metadata: %v", o, err)
		}
		kind := strings.TrimPrefix(fmt.Sprintf("%T", o), "*")
		keys = append(keys, fmt.Sprintf("%s %s/%s", kind, m.GetNamespace(), m.GetName()))
	}
	slices.Sort(keys)
	return keys
}

// deployObjects are the objects of deploy/kustomization.yaml.
var deployObjects = []string{
	"v1.ClusterRole /uproxy",
	"v1.ClusterRoleBinding /uproxy",
	"v1.ConfigMap kube-system/uproxy",
	"v1.DaemonSet kube-system/uproxy",
	"v1.ServiceAccount kube-system/uproxy",
}

// daemonSet returns the one DaemonSet in objs.
func daemonSet(t *testing.T, objs []runtime.Object) *appsv1.DaemonSet {
	t.Helper()
	for _, o := range objs {
		if ds, ok := o.(*appsv1.DaemonSet); ok {
			return ds
		}
	}
	t.Fatal("no DaemonSet")
	return nil
}

// checkDaemonSet checks what matters for security and for running as the
// node's service proxy in the DaemonSet as the apiserver returned it (or
// as kubectl kustomize built it, when dnsPolicy is still empty).
func checkDaemonSet(t *testing.T, ds *appsv1.DaemonSet, objs []runtime.Object) {
	t.Helper()
	spec := ds.Spec.Template.Spec
	if len(spec.Containers) != 1 {
		t.Fatalf("DaemonSet has %d containers, want 1", len(spec.Containers))
	}
	c := spec.Containers[0]
	sc := c.SecurityContext
	if sc == nil || sc.Capabilities == nil {
		t.Fatalf("container %s has no securityContext capabilities: %+v", c.Name, sc)
	}
	if diff := cmp.Diff([]v1.Capability{"NET_ADMIN", "NET_RAW", "NET_BIND_SERVICE", "SETUID"}, sc.Capabilities.Add); diff != "" {
		t.Errorf("capabilities.add (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]v1.Capability{"ALL"}, sc.Capabilities.Drop); diff != "" {
		t.Errorf("capabilities.drop (-want +got):\n%s", diff)
	}
	if sc.Privileged != nil && *sc.Privileged {
		t.Error("the container is privileged")
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Errorf("allowPrivilegeEscalation = %v, want false", sc.AllowPrivilegeEscalation)
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Errorf("readOnlyRootFilesystem = %v, want true", sc.ReadOnlyRootFilesystem)
	}
	type summary struct {
		HostNetwork        bool
		DNSPolicy          v1.DNSPolicy
		ServiceAccountName string
		PriorityClassName  string
		NodeSelector       map[string]string
		Tolerations        []v1.Toleration
		PodLabels          map[string]string
		Selector           map[string]string
		Image              string
		Args               []string
		Grace              int64
	}
	got := summary{
		HostNetwork:        spec.HostNetwork,
		DNSPolicy:          spec.DNSPolicy,
		ServiceAccountName: spec.ServiceAccountName,
		PriorityClassName:  spec.PriorityClassName,
		NodeSelector:       spec.NodeSelector,
		Tolerations:        spec.Tolerations,
		PodLabels:          ds.Spec.Template.Labels,
		Image:              c.Image,
		Args:               c.Args,
	}
	if ds.Spec.Selector != nil {
		got.Selector = ds.Spec.Selector.MatchLabels
	}
	if spec.TerminationGracePeriodSeconds != nil {
		got.Grace = *spec.TerminationGracePeriodSeconds
	}
	want := summary{
		HostNetwork: true,
		// The default policy, as kube-proxy's: ClusterFirstWithHostNet
		// would resolve through the cluster DNS, a Service.
		DNSPolicy:          v1.DNSClusterFirst,
		ServiceAccountName: "uproxy",
		PriorityClassName:  "system-node-critical",
		NodeSelector:       map[string]string{"kubernetes.io/os": "linux"},
		Tolerations:        []v1.Toleration{{Operator: v1.TolerationOpExists}},
		// k8s-app: kube-proxy is what kube-proxy scrape configs select.
		PodLabels: map[string]string{"app.kubernetes.io/name": "uproxy", "k8s-app": "kube-proxy"},
		Selector:  map[string]string{"app.kubernetes.io/name": "uproxy"},
		Image:     "uproxy:latest",
		Args: []string{"run", "--kubeconfig=/var/lib/uproxy/kubeconfig.conf", "--hostname-override=$(NODE_NAME)",
			"--cluster-cidr=10.244.0.0/16", "--healthz-bind-address=0.0.0.0:10256",
			"--metrics-bind-address=127.0.0.1:10249", "--log-format=json", "--proxy-port-range=40000-49999",
			"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0"},
		Grace: 30,
	}
	if spec.DNSPolicy == "" {
		want.DNSPolicy = "" // not yet defaulted by the server
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("DaemonSet pod spec (-want +got):\n%s", diff)
	}
	checkKubeconfig(t, ds, objs)
}

// checkKubeconfig checks that the DaemonSet's --kubeconfig is a file of a
// ConfigMap among objs, mounted in the container, and that it reaches the
// API server at an address of its own with the pod's service account, as
// kubeadm's kube-proxy kubeconfig does: never through the kubernetes
// Service, which needs a service proxy on the node to work.
func checkKubeconfig(t *testing.T, ds *appsv1.DaemonSet, objs []runtime.Object) {
	t.Helper()
	spec := ds.Spec.Template.Spec
	c := spec.Containers[0]
	var path string
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(a, "--kubeconfig="); ok {
			path = v
		}
	}
	if path == "" {
		t.Fatalf("container %s has no --kubeconfig: it would use the kubernetes Service's ClusterIP", c.Name)
	}
	for _, e := range c.Env {
		if strings.HasPrefix(e.Name, "KUBERNETES_SERVICE_") {
			t.Errorf("container %s sets %s: the kubeconfig gives the API server's address", c.Name, e.Name)
		}
	}
	var volume string
	for _, m := range c.VolumeMounts {
		if strings.HasPrefix(path, strings.TrimSuffix(m.MountPath, "/")+"/") {
			volume = m.Name
		}
	}
	var cmName string
	for _, v := range spec.Volumes {
		if v.Name == volume && v.ConfigMap != nil {
			cmName = v.ConfigMap.Name
		}
	}
	if cmName == "" {
		t.Fatalf("--kubeconfig=%s is not in a ConfigMap volume (mount %q)", path, volume)
	}
	var data string
	for _, o := range objs {
		if cm, ok := o.(*v1.ConfigMap); ok && cm.Name == cmName && cm.Namespace == ds.Namespace {
			data = cm.Data[filepath.Base(path)]
		}
	}
	if data == "" {
		t.Fatalf("ConfigMap %s/%s has no key %s for --kubeconfig=%s", ds.Namespace, cmName, filepath.Base(path), path)
	}
	cfg, err := clientcmd.Load([]byte(data))
	if err != nil {
		t.Fatalf("ConfigMap %s/%s: %s: %v", ds.Namespace, cmName, filepath.Base(path), err)
	}
	kctx := cfg.Contexts[cfg.CurrentContext]
	if kctx == nil || cfg.Clusters[kctx.Cluster] == nil || cfg.AuthInfos[kctx.AuthInfo] == nil {
		t.Fatalf("ConfigMap %s/%s: %s: current context %q has no cluster or user", ds.Namespace, cmName, filepath.Base(path), cfg.CurrentContext)
	}
	cluster, user := cfg.Clusters[kctx.Cluster], cfg.AuthInfos[kctx.AuthInfo]
	u, err := url.Parse(cluster.Server)
	if err != nil || u.Scheme != "https" {
		t.Fatalf("kubeconfig server %q: want an https URL (%v)", cluster.Server, err)
	}
	if h := u.Hostname(); strings.HasPrefix(h, "kubernetes") {
		t.Errorf("kubeconfig server %q is the kubernetes Service's name", cluster.Server)
	} else if a, err := netip.ParseAddr(h); err == nil && netip.MustParsePrefix(DefaultServiceCIDR).Contains(a) {
		t.Errorf("kubeconfig server %q is in the service range %s", cluster.Server, DefaultServiceCIDR)
	}
	type credentials struct{ CAFile, TokenFile string }
	const sa = "/var/run/secrets/kubernetes.io/serviceaccount/"
	if diff := cmp.Diff(credentials{sa + "ca.crt", sa + "token"}, credentials{cluster.CertificateAuthority, user.TokenFile}); diff != "" {
		t.Errorf("kubeconfig credentials (-want +got):\n%s", diff)
	}
}

// TestDeploy validates deploy/ against a real kube-apiserver: the
// kustomization builds, every object passes the server's validation (a
// server-side dry run), and the RBAC objects grant uproxy's service
// account exactly what it needs.
func TestDeploy(t *testing.T) {
	l, cp := startControlPlane(t)
	root, err := ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	k := newKubectl(t, l.Node, kubectlBinary(t, root), cp.Kubeconfig)
	deploy := filepath.Join(root, "deploy")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// The kustomization builds, and holds each object.
	out, err := k.run(ctx, "kustomize", deploy)
	if err != nil {
		t.Fatal(err)
	}
	built, err := decodeObjects(out)
	if err != nil {
		t.Fatalf("decoding kubectl kustomize's output: %v\n%s", err, out)
	}
	if diff := cmp.Diff(deployObjects, objectKeys(t, built)); diff != "" {
		t.Errorf("kubectl kustomize deploy/ objects (-want +got):\n%s", diff)
	}
	checkDaemonSet(t, daemonSet(t, built), built)

	// The server validates and defaults every object, and creates none.
	out, err = k.run(ctx, "apply", "-k", deploy, "--server-side", "--field-manager=uproxy-test", "--dry-run=server", "-o", "yaml")
	if err != nil {
		t.Fatal(err)
	}
	applied, err := decodeObjects(out)
	if err != nil {
		t.Fatalf("decoding the dry run's output: %v\n%s", err, out)
	}
	if diff := cmp.Diff(deployObjects, objectKeys(t, applied)); diff != "" {
		t.Errorf("server-side dry run objects (-want +got):\n%s", diff)
	}
	checkDaemonSet(t, daemonSet(t, applied), applied)
	if _, err := cp.Client.AppsV1().DaemonSets("kube-system").Get(ctx, "uproxy", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("after the dry run, getting the DaemonSet: err = %v, want NotFound", err)
	}

	// The ServiceAccount and the RBAC objects, for real.
	if _, err := k.run(ctx, "apply", "--server-side", "--field-manager=uproxy-test",
		"-f", filepath.Join(deploy, "serviceaccount.yaml"), "-f", filepath.Join(deploy, "rbac.yaml")); err != nil {
		t.Fatal(err)
	}

	const user = "system:serviceaccount:kube-system:uproxy"
	type check struct {
		verb, group, resource, namespace string
	}
	allowed := func(c check) bool {
		t.Helper()
		sar, err := cp.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
			Spec: authorizationv1.SubjectAccessReviewSpec{
				User:   user,
				Groups: []string{"system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"},
				ResourceAttributes: &authorizationv1.ResourceAttributes{
					Verb: c.verb, Group: c.group, Resource: c.resource, Namespace: c.namespace,
				},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("SubjectAccessReview %+v: %v", c, err)
		}
		return sar.Status.Allowed
	}
	name := func(c check) string {
		r := c.resource
		if c.group != "" {
			r += "." + c.group
		}
		if c.namespace != "" {
			r += " in " + c.namespace
		}
		return c.verb + " " + r
	}
	want := map[string]bool{}
	got := map[string]bool{}
	for _, tc := range []struct {
		check
		allowed bool
	}{
		{check{"list", "", "services", ""}, true},
		{check{"watch", "", "services", ""}, true},
		{check{"list", "discovery.k8s.io", "endpointslices", ""}, true},
		{check{"watch", "discovery.k8s.io", "endpointslices", ""}, true},
		{check{"list", "", "nodes", ""}, true},
		{check{"watch", "", "nodes", ""}, true},
		{check{"create", "", "events", "default"}, true},
		{check{"patch", "", "events", "default"}, true},
		{check{"create", "events.k8s.io", "events", "default"}, true},
		{check{"patch", "events.k8s.io", "events", "default"}, true},

		{check{"get", "", "secrets", "kube-system"}, false},
		{check{"list", "", "secrets", ""}, false},
		{check{"update", "", "services", "default"}, false},
		{check{"delete", "discovery.k8s.io", "endpointslices", "default"}, false},
		{check{"patch", "", "nodes", ""}, false},
		{check{"create", "", "pods", "default"}, false},
		{check{"list", "", "configmaps", ""}, false},
	} {
		want[name(tc.check)] = tc.allowed
		got[name(tc.check)] = allowed(tc.check)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("%s's permissions (-want +got):\n%s", user, diff)
	}
	for _, k := range slices.Sorted(maps.Keys(got)) {
		t.Logf("%-50s allowed=%v", k, got[k])
	}

	// And with the service account's own token.
	kc, err := cp.ServiceAccountKubeconfig(ctx, "kube-system", "uproxy")
	if err != nil {
		t.Fatal(err)
	}
	saConfig, err := cp.RESTConfigFor(kc)
	if err != nil {
		t.Fatal(err)
	}
	sa, err := kubernetes.NewForConfig(saConfig)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sa.CoreV1().Services("").List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("listing services as %s: %v", user, err)
	}
	if _, err := sa.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("listing endpointslices as %s: %v", user, err)
	}
	if _, err := sa.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("listing secrets as %s: err = %v, want Forbidden", user, err)
	}
}
