package testkube

import (
	"context"
	"net/netip"
	"os"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/internal/testlab"
)

// startControlPlane starts a lab and a control plane in it, with extra
// kube-apiserver flags, skipping (or, under CI, failing) when a requirement
// is missing. Both are closed when t ends.
func startControlPlane(t *testing.T, apiserverArgs ...string) (*testlab.Lab, *ControlPlane) {
	t.Helper()
	if testing.Short() {
		t.Skip("skipping: starts a real etcd and kube-apiserver (not -short)")
	}
	testlab.RequireRoot(t, "socat", "curl")
	if _, err := os.Stat(EtcdPath); err != nil {
		t.Skipf("skipping: %s is missing (install the Debian package etcd-server)", EtcdPath)
	}
	root, err := ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, _, err := Binaries(root); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI must be able to build the Kubernetes binaries: %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
	t.Logf("binaries ready after %v", time.Since(start).Round(time.Millisecond))

	l, err := testlab.New(testlab.Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cp, err := Start(ctx, Options{Lab: l, Root: root, APIServerArgs: apiserverArgs, Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("control plane logs:\n%s", cp.Logs())
		}
		cp.Close() // before the Lab's Close: cleanups run last-in first-out
	})
	return l, cp
}

func TestControlPlane(t *testing.T) {
	l, cp := startControlPlane(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := cp.Client

	// A Service gets a ClusterIP from the service range.
	svc, err := c.CoreV1().Services("default").Create(ctx, &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: v1.ServiceSpec{
			Selector: map[string]string{"app": "web"},
			Ports:    []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: v1.ProtocolTCP}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating the service: %v", err)
	}
	ip, err := netip.ParseAddr(svc.Spec.ClusterIP)
	if err != nil || !netip.MustParsePrefix(DefaultServiceCIDR).Contains(ip) {
		t.Errorf("ClusterIP = %q, want an address in %s", svc.Spec.ClusterIP, DefaultServiceCIDR)
	}

	// An EndpointSlice for it, as the endpointslice controller would write.
	_, err = c.DiscoveryV1().EndpointSlices("default").Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:   "web-abc",
			Labels: map[string]string{discoveryv1.LabelServiceName: "web"},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{
			{Addresses: []string{"10.244.0.10"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}},
			{Addresses: []string{"10.244.0.11"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}},
		},
		Ports: []discoveryv1.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(v1.ProtocolTCP)}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating the endpointslice: %v", err)
	}

	svcs, err := c.CoreV1().Services("default").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatalf("listing services: %v", err)
	}
	found := false
	for _, s := range svcs.Items {
		found = found || s.Name == "web" && s.Spec.ClusterIP == svc.Spec.ClusterIP
	}
	if !found {
		t.Errorf("the service list lacks web (%s): %+v", svc.Spec.ClusterIP, svcs.Items)
	}
	slices, err := c.DiscoveryV1().EndpointSlices("default").List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=web"})
	if err != nil {
		t.Fatalf("listing endpointslices: %v", err)
	}
	if len(slices.Items) != 1 || len(slices.Items[0].Endpoints) != 2 {
		t.Errorf("endpointslices for web = %+v, want one with two endpoints", slices.Items)
	}

	// A Node, as kube-proxy needs.
	if err := cp.CreateNode(ctx, "lab-node", "10.244.0.1", "2001:db8:244::1"); err != nil {
		t.Fatal(err)
	}
	node, err := c.CoreV1().Nodes().Get(ctx, "lab-node", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("getting the node: %v", err)
	}
	if len(node.Status.Addresses) != 3 || node.Status.Addresses[0].Address != "10.244.0.1" || len(node.Status.Conditions) == 0 {
		t.Errorf("node status = %+v, want two InternalIPs, a Hostname and Ready", node.Status)
	}

	// A service account token works, but grants nothing yet.
	kc, err := cp.ServiceAccountKubeconfig(ctx, "kube-system", "uproxy")
	if err != nil {
		t.Fatal(err)
	}
	const user = "system:serviceaccount:kube-system:uproxy"
	sar, err := c.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
		Spec: authorizationv1.SubjectAccessReviewSpec{
			User:               user,
			Groups:             []string{"system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"},
			ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: "list", Resource: "services"},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating a SubjectAccessReview: %v", err)
	}
	if sar.Status.Allowed {
		t.Errorf("%s may list services before any RBAC grants it: %+v", user, sar.Status)
	}

	saConfig, err := cp.RESTConfigFor(kc)
	if err != nil {
		t.Fatal(err)
	}
	saClient, err := kubernetes.NewForConfig(saConfig)
	if err != nil {
		t.Fatal(err)
	}
	review, err := saClient.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("SelfSubjectReview with the service account's token: %v", err)
	}
	if got := review.Status.UserInfo.Username; got != user {
		t.Errorf("the service account's token authenticates as %q, want %q", got, user)
	}
	if _, err := saClient.CoreV1().Services("").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("listing services as %s: err = %v, want Forbidden", user, err)
	}

	// Inside the node namespace, the kubeconfig's server answers too, and
	// on the bridge address (what pods and kube-proxy may use).
	for _, url := range []string{Server + "/readyz", "https://" + AdvertiseAddress + ":6443/readyz"} {
		out, err := l.Exec(ctx, l.Node, "curl", "-sS", "--cacert", cp.CAFile, url)
		if err != nil || out != "ok" {
			t.Errorf("curl %s in the node namespace = %q, %v; want ok", url, out, err)
		}
	}
}
