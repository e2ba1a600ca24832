package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/uproxy/uproxy/internal/testwait"
)

// TestE2EKubernetesLoadBalancerStatus checks that a load balancer's
// address assigned after the Service exists, through the status
// subresource as the cloud controller does, is intercepted with its source
// ranges: such an update changes nothing but the status.
func TestE2EKubernetesLoadBalancerStatus(t *testing.T) {
	c := newKubeCluster(t, 2)
	ctx := context.Background()
	client := c.cp.Client
	allowed, err := c.lab.AddExternal("ext1")
	if err != nil {
		t.Fatal(err)
	}
	denied, err := c.lab.AddExternal("ext2")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.cp.CreateNode(ctx, "node-a", "10.244.0.1"); err != nil {
		t.Fatal(err)
	}
	if err := c.cp.Apply(ctx, "../../deploy/serviceaccount.yaml", "../../deploy/rbac.yaml"); err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := c.cp.ServiceAccountKubeconfig(ctx, "kube-system", "uproxy")
	if err != nil {
		t.Fatal(err)
	}
	argv := []string{"--kubeconfig", kubeconfig, "--hostname-override", "node-a",
		"--iptables-min-sync-period", "50ms", "--cluster-cidr", "10.244.0.0/16",
		"--upgrade-socket", filepath.Join(t.TempDir(), "upgrade.sock")}
	if c.up, err = c.run("uproxy", argv...); err != nil {
		t.Fatal(err)
	}

	services := client.CoreV1().Services("default")
	svc, err := services.Create(ctx, &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "lb"},
		Spec: v1.ServiceSpec{
			Type:                     v1.ServiceTypeLoadBalancer,
			LoadBalancerSourceRanges: []string{allowed.IP.String() + "/32"},
			Ports:                    []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.DiscoveryV1().EndpointSlices("default").Create(ctx,
		kubeSlice("lb-abc", "lb", readyEP(c.pods[0]), readyEP(c.pods[1])), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The cluster IP works before the load balancer has an address.
	waitGet := func(what, from, url string) {
		t.Helper()
		testwait.UntilOK(t, 10*time.Second, fmt.Sprintf("%s: GET %s from %s to reach both pods", what, url, from), func() (bool, string) {
			r := c.get(from, url, 6, "--timeout", "1s")
			return r.Errors == 0 && len(r.Counts) == 2, fmt.Sprintf("%+v\nuproxy:\n%s", r, c.up.Output())
		})
	}
	waitGet("the cluster IP", c.client.NS, "http://"+svc.Spec.ClusterIP+"/")

	const lbIP = "10.96.200.200"
	svc.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: lbIP}}
	if _, err := services.UpdateStatus(ctx, svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	c.waitRules("the load balancer's address", func(s string) bool { return strings.Contains(s, lbIP+"/32") })
	waitGet("the load balancer's address, from a source range", allowed.NS, "http://"+lbIP+"/")
	if r := c.get(denied.NS, "http://"+lbIP+"/", 1, "--timeout", "1s"); r.Errors != 1 {
		t.Errorf("GET the load balancer's address from outside its source ranges answered %v; want no answer", r.Counts)
	}
}
