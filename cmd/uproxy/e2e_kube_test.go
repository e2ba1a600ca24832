package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/internal/testkube"
	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/testwait"
)

// kubeCluster is a lab with a real etcd and kube-apiserver, and uproxy
// watching it.
type kubeCluster struct {
	*cluster
	cp *testkube.ControlPlane
}

// apiserverArgs are extra kube-apiserver flags.
func newKubeCluster(t *testing.T, pods int, apiserverArgs ...string) *kubeCluster {
	t.Helper()
	if testing.Short() {
		t.Skip("skipping: starts a real API server")
	}
	c := newCluster(t, pods)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cp, err := testkube.Start(ctx, testkube.Options{Lab: c.lab, Root: "../..", Logf: t.Logf, APIServerArgs: apiserverArgs})
	if err != nil {
		if kubeUnavailable(err) {
			t.Skipf("skipping: %v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(cp.Close)
	return &kubeCluster{cluster: c, cp: cp}
}

// kubeUnavailable reports whether the control plane cannot run here at
// all (no etcd), as opposed to failing.
func kubeUnavailable(err error) bool {
	return strings.Contains(err.Error(), "etcd is not installed")
}

// slice builds an EndpointSlice of service svc over pods, port http/8080.
func kubeSlice(name, svc string, eps ...discovery.Endpoint) *discovery.EndpointSlice {
	return &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: "default", Labels: map[string]string{"kubernetes.io/service-name": svc}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(v1.ProtocolTCP)}},
		Endpoints:   eps,
	}
}

func endpoint(p *testlab.Pod, ready, serving, terminating bool) discovery.Endpoint {
	return discovery.Endpoint{
		Addresses:  []string{p.IP.String()},
		Conditions: discovery.EndpointConditions{Ready: &ready, Serving: &serving, Terminating: &terminating},
		NodeName:   ptr.To("node-a"),
	}
}

func readyEP(p *testlab.Pod) discovery.Endpoint { return endpoint(p, true, true, false) }

// TestE2EKubernetes runs uproxy against a real API server and checks that
// traffic follows every kind of change within the sync bound, and that an
// API server outage changes nothing until it returns.
func TestE2EKubernetes(t *testing.T) {
	c := newKubeCluster(t, 3)
	ctx := context.Background()
	client := c.cp.Client
	p0, p1, p2 := c.pods[0], c.pods[1], c.pods[2]
	if err := c.cp.CreateNode(ctx, "node-a", "10.244.0.1"); err != nil {
		t.Fatal(err)
	}
	node, err := client.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Labels = map[string]string{v1.LabelTopologyZone: "zone-a"}
	if _, err := client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	// uproxy runs as the service account of deploy/, with deploy/'s RBAC:
	// if that is not enough for everything below, this test fails.
	if err := c.cp.Apply(ctx, "../../deploy/serviceaccount.yaml", "../../deploy/rbac.yaml"); err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := c.cp.ServiceAccountKubeconfig(ctx, "kube-system", "uproxy")
	if err != nil {
		t.Fatal(err)
	}
	argv := []string{"--kubeconfig", kubeconfig, "--hostname-override", "node-a",
		"--iptables-min-sync-period", "50ms", "--cluster-cidr", "10.244.0.0/16",
		"--upgrade-socket", filepath.Join(t.TempDir(), "upgrade.sock"), "--state-file", filepath.Join(t.TempDir(), "state.json")}
	if c.up, err = c.run("uproxy", argv...); err != nil {
		t.Fatal(err)
	}

	svc, err := client.CoreV1().Services("default").Create(ctx, &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: v1.ServiceSpec{
			Selector: map[string]string{"app": "web"},
			Ports:    []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + svc.Spec.ClusterIP + "/"
	slices := client.DiscoveryV1().EndpointSlices("default")
	sl, err := slices.Create(ctx, kubeSlice("web-abc", "web", readyEP(p0)), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	// followWithin waits until requests spread exactly over want, and logs
	// how long the change took to reach the data path.
	followWithin := func(what string, limit time.Duration, want ...string) {
		t.Helper()
		start := time.Now()
		testwait.UntilOK(t, limit, what+": traffic to follow", func() (bool, string) {
			r := c.get(c.client.NS, url, 3*len(want), "--timeout", "1s")
			ok := r.Errors == 0 && len(r.Counts) == len(want)
			for _, w := range want {
				ok = ok && r.Counts[w] > 0
			}
			return ok, fmt.Sprintf("%+v\nuproxy:\n%s", r, c.up.Output())
		})
		t.Logf("%s: traffic followed in %v", what, time.Since(start).Round(time.Millisecond))
	}
	follow := func(what string, want ...string) {
		t.Helper()
		followWithin(what, 10*time.Second, want...)
	}
	update := func(eps ...discovery.Endpoint) {
		t.Helper()
		sl.Endpoints = eps
		if sl, err = slices.Update(ctx, sl, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	follow("service created", "web-0")
	update(readyEP(p0), readyEP(p1), readyEP(p2))
	follow("scaled up", "web-0", "web-1", "web-2")
	update(readyEP(p1), readyEP(p2))
	follow("scaled down", "web-1", "web-2")
	update(readyEP(p1), endpoint(p2, false, false, false))
	follow("an endpoint not ready", "web-1")
	update(endpoint(p1, false, true, true), endpoint(p2, false, false, true))
	follow("only terminating endpoints: serving ones are used", "web-1")

	// A second slice for the same service counts too.
	if _, err := slices.Create(ctx, kubeSlice("web-def", "web", readyEP(p0)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	follow("a second slice", "web-0")
	if err := slices.Delete(ctx, "web-def", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}

	// Topology: the node's zone comes from its Node object.
	withZone := func(p *testlab.Pod, zone string) discovery.Endpoint {
		e := readyEP(p)
		e.Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: zone}}}
		return e
	}
	update(withZone(p0, "zone-b"), withZone(p1, "zone-a"), withZone(p2, "zone-b"))
	follow("zone hints", "web-1")
	update(readyEP(p0), readyEP(p1), readyEP(p2))
	follow("hints removed", "web-0", "web-1", "web-2")

	// The API server goes away for a minute: the last state keeps serving,
	// across the periodic full resyncs (--iptables-sync-period).
	c.cp.StopAPIServer()
	testwait.Throughout(t, time.Minute, 2*time.Second, "the services served without the API server", func() (bool, string) {
		r := c.get(c.client.NS, url, 3)
		return r.Errors == 0 && len(r.Counts) == 3, fmt.Sprintf("%+v", r)
	})
	if c.up.Exited() {
		t.Fatalf("uproxy exited while the API server was down:\n%s", c.up.Output())
	}
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := c.cp.StartAPIServer(sctx); err != nil {
		t.Fatal(err)
	}
	// Changes made after it returns are followed (the watch resumed or
	// relisted).
	if sl, err = slices.Get(ctx, "web-abc", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	update(readyEP(p2))
	// client-go's reflectors retry a broken watch with exponential backoff
	// capped at 30s, plus jitter of up to as much again (tools/cache/reflector.go:
	// defaultBackoffMax, defaultBackoffJitter); after a minute of failures
	// (and the restarted server's RBAC cache answering "forbidden" until it
	// has synced), the next attempt can be up to 60s away, and an attempt
	// the restarted server still refuses costs another such wait: two
	// waits and the relist bound it. kube-proxy shares this behaviour.
	const resume = 150 * time.Second
	followWithin("after the API server returned", resume, "web-2")

	if err := client.CoreV1().Services("default").Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// The Service informer's reflector backs off on its own schedule: the
	// EndpointSlice watch having resumed says nothing about it, so a
	// Service change gets the same window.
	c.waitRulesWithin("the service's rule to go", resume, func(s string) bool { return !strings.Contains(s, svc.Spec.ClusterIP+"/32") })
	if r := c.get(c.client.NS, url, 1, "--timeout", "1s"); r.Errors != 1 {
		t.Errorf("deleted service still answers: %+v", r)
	}
}
