package testkube

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"

	authorizationv1 "k8s.io/api/authorization/v1"
)

// createKubeadmProxy creates kube-proxy's objects as `kubeadm init` does:
// the ServiceAccount, its binding to system:node-proxier, and the ConfigMap
// and DaemonSet rendered from kubeadm's own templates. It returns the
// DaemonSet as created.
func createKubeadmProxy(ctx context.Context, t *testing.T, cp *ControlPlane, root, kubeProxy string) (*KubeadmProxy, *appsv1.DaemonSet) {
	t.Helper()
	kp, err := RenderKubeadmProxy(ctx, KubeadmProxyOptions{
		Root:                 root,
		KubeProxy:            kubeProxy,
		ControlPlaneEndpoint: fmt.Sprintf("https://%s:%d", AdvertiseAddress, APIServerPort),
		PodSubnet:            "10.244.0.0/16",
	})
	if err != nil {
		t.Fatal(err)
	}
	var objs []runtime.Object
	for _, m := range [][]byte{kp.ConfigMap, kp.DaemonSet} {
		o, err := decodeObjects(string(m))
		if err != nil {
			t.Fatalf("decoding kubeadm's manifest: %v\n%s", err, m)
		}
		objs = append(objs, o...)
	}
	c := cp.Client
	if _, err := c.CoreV1().ServiceAccounts("kube-system").Create(ctx, &v1.ServiceAccount{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-proxy", Namespace: "kube-system"},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: kp.ClusterRoleBinding},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: kp.ClusterRole},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: "kube-proxy", Namespace: "kube-system"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var ds *appsv1.DaemonSet
	for _, o := range objs {
		switch o := o.(type) {
		case *v1.ConfigMap:
			if _, err := c.CoreV1().ConfigMaps(o.Namespace).Create(ctx, o, metav1.CreateOptions{}); err != nil {
				t.Fatalf("creating kubeadm's ConfigMap: %v", err)
			}
		case *appsv1.DaemonSet:
			if ds, err = c.AppsV1().DaemonSets(o.Namespace).Create(ctx, o, metav1.CreateOptions{}); err != nil {
				t.Fatalf("creating kubeadm's DaemonSet: %v", err)
			}
		default:
			t.Fatalf("kubeadm's manifests hold a %T", o)
		}
	}
	if ds == nil {
		t.Fatal("kubeadm's manifests hold no DaemonSet")
	}
	return kp, ds
}

// TestDeployKubeadm applies deploy/kubeadm, the overlay that swaps uproxy
// into a kubeadm cluster's kube-proxy DaemonSet, to the DaemonSet and
// ConfigMap kubeadm v1.37 creates (from its own templates), first as a
// server-side dry run and then for real, and checks that the result runs
// uproxy's image with kubeadm's command, ConfigMap and service account, and
// can be upgraded hitlessly: probes, surge, the upgrade socket.
func TestDeployKubeadm(t *testing.T) {
	// kubeadm's API server allows privileged containers, which kube-proxy's
	// DaemonSet asks for.
	l, cp := startControlPlane(t, "--allow-privileged=true")
	root, err := ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	_, kubeProxy, err := Binaries(root)
	if err != nil {
		t.Fatal(err)
	}
	k := newKubectl(t, l.Node, kubectlBinary(t, root), cp.Kubeconfig)
	overlay := filepath.Join(root, "deploy", "kubeadm")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	kp, orig := createKubeadmProxy(ctx, t, cp, root, kubeProxy)
	if orig.Spec.Template.Spec.Containers[0].Image != kp.Image {
		t.Fatalf("kubeadm's DaemonSet runs %q, want %q", orig.Spec.Template.Spec.Containers[0].Image, kp.Image)
	}

	// What an operator applies: the dry run succeeds and shows the merge,
	// and changes nothing.
	out, err := k.run(ctx, "apply", "-k", overlay, "--dry-run=server", "-o", "yaml")
	if err != nil {
		t.Fatal(err)
	}
	dry, err := decodeObjects(out)
	if err != nil {
		t.Fatalf("decoding the dry run's output: %v\n%s", err, out)
	}
	if diff := cmp.Diff([]string{"v1.DaemonSet kube-system/kube-proxy"}, objectKeys(t, dry)); diff != "" {
		t.Fatalf("deploy/kubeadm objects (-want +got):\n%s", diff)
	}
	checkKubeadmSwap(t, orig, daemonSet(t, dry))
	live, err := cp.Client.AppsV1().DaemonSets("kube-system").Get(ctx, "kube-proxy", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := live.Spec.Template.Spec.Containers[0].Image; got != kp.Image {
		t.Errorf("after the dry run the DaemonSet runs %q, want kubeadm's %q still", got, kp.Image)
	}

	// For real, twice: applying again changes nothing.
	for i := range 2 {
		if _, err := k.run(ctx, "apply", "-k", overlay); err != nil {
			t.Fatalf("apply %d: %v", i+1, err)
		}
	}
	live, err = cp.Client.AppsV1().DaemonSets("kube-system").Get(ctx, "kube-proxy", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	checkKubeadmSwap(t, orig, live)

	// kubeadm's binding gives the kube-proxy ServiceAccount, which uproxy now
	// runs as, what uproxy reads and writes.
	const user = "system:serviceaccount:kube-system:kube-proxy"
	for _, ra := range []authorizationv1.ResourceAttributes{
		{Verb: "list", Resource: "services"},
		{Verb: "watch", Resource: "services"},
		{Verb: "list", Group: "discovery.k8s.io", Resource: "endpointslices"},
		{Verb: "watch", Group: "discovery.k8s.io", Resource: "endpointslices"},
		{Verb: "list", Resource: "nodes"},
		{Verb: "watch", Resource: "nodes"},
		{Verb: "create", Group: "events.k8s.io", Resource: "events", Namespace: "default"},
		{Verb: "create", Resource: "events", Namespace: "default"},
	} {
		sar, err := cp.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
			Spec: authorizationv1.SubjectAccessReviewSpec{
				User:               user,
				Groups:             []string{"system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"},
				ResourceAttributes: &ra,
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !sar.Status.Allowed {
			t.Errorf("%s may not %s %s.%s", user, ra.Verb, ra.Resource, ra.Group)
		}
	}
}

// checkKubeadmSwap checks that got is kubeadm's DaemonSet orig with
// uproxy's image, probes, surge strategy and upgrade socket, and
// otherwise unchanged.
func checkKubeadmSwap(t *testing.T, orig, got *appsv1.DaemonSet) {
	t.Helper()
	want := orig.DeepCopy()
	want.Spec.UpdateStrategy = appsv1.DaemonSetUpdateStrategy{
		Type: appsv1.RollingUpdateDaemonSetStrategyType,
		RollingUpdate: &appsv1.RollingUpdateDaemonSet{
			MaxSurge:       ptrTo(intstr.FromInt32(1)),
			MaxUnavailable: ptrTo(intstr.FromInt32(0)),
		},
	}
	want.Spec.MinReadySeconds = 10
	pod := &want.Spec.Template.Spec
	pod.TerminationGracePeriodSeconds = ptrTo[int64](30)
	c := &pod.Containers[0]
	c.Image = "uproxy:latest"
	probe := func(path string) *v1.Probe {
		return &v1.Probe{ProbeHandler: v1.ProbeHandler{HTTPGet: &v1.HTTPGetAction{
			Path: path, Port: intstr.FromInt32(10256), Scheme: v1.URISchemeHTTP,
		}}, PeriodSeconds: 10, TimeoutSeconds: 5, SuccessThreshold: 1, FailureThreshold: 3}
	}
	c.ReadinessProbe = probe("/healthz")
	c.LivenessProbe = probe("/livez")
	c.LivenessProbe.InitialDelaySeconds, c.LivenessProbe.FailureThreshold = 10, 6
	c.VolumeMounts = append(c.VolumeMounts, v1.VolumeMount{Name: "uproxy-upgrade", MountPath: "/run/uproxy"})
	pod.Volumes = append(pod.Volumes, v1.Volume{Name: "uproxy-upgrade", VolumeSource: v1.VolumeSource{
		HostPath: &v1.HostPathVolumeSource{Path: "/run/uproxy", Type: ptrTo(v1.HostPathDirectoryOrCreate)},
	}})
	sortPod := func(p *v1.PodSpec) {
		slices.SortFunc(p.Volumes, func(a, b v1.Volume) int { return cmpString(a.Name, b.Name) })
		slices.SortFunc(p.Containers[0].VolumeMounts, func(a, b v1.VolumeMount) int { return cmpString(a.MountPath, b.MountPath) })
	}
	gotSpec := got.Spec.DeepCopy()
	sortPod(&gotSpec.Template.Spec)
	sortPod(pod)
	if diff := cmp.Diff(want.Spec, *gotSpec); diff != "" {
		t.Errorf("kube-proxy DaemonSet after deploy/kubeadm (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(orig.Labels, got.Labels); diff != "" {
		t.Errorf("kube-proxy DaemonSet labels (-kubeadm +got):\n%s", diff)
	}
}

func ptrTo[T any](v T) *T { return &v }

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
