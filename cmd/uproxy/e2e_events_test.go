package main

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/internal/promtest"
	"github.com/uproxy/uproxy/internal/testwait"
)

// TestE2EKubeHealthAndEvents runs uproxy against a real API server, as
// deploy/'s service account: /healthz waits for the Node and follows its
// eligibility while /livez does not, every answer is counted in
// kube-proxy's metrics, and uproxy records kube-proxy's Starting event on
// its Node and a Warning on an object it rejects.
func TestE2EKubeHealthAndEvents(t *testing.T) {
	c := newKubeCluster(t, 1)
	ctx := context.Background()
	client := c.cp.Client
	if err := c.cp.Apply(ctx, "../../deploy/serviceaccount.yaml", "../../deploy/rbac.yaml"); err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := c.cp.ServiceAccountKubeconfig(ctx, "kube-system", "uproxy")
	if err != nil {
		t.Fatal(err)
	}
	// The Node does not exist yet.
	c.up, err = c.run("uproxy", "--kubeconfig", kubeconfig, "--hostname-override", "node-a",
		"--iptables-min-sync-period", "50ms", "--metrics-bind-address", metricsAddr,
		"--upgrade-socket", filepath.Join(t.TempDir(), "upgrade.sock"))
	if err != nil {
		t.Fatal(err)
	}
	c.waitSynced()

	yes, no := true, false
	expect := func(what string, healthz, livez healthAnswer) {
		t.Helper()
		testwait.UntilOK(t, 10*time.Second, what+": /healthz and /livez", func() (bool, string) {
			got := []healthAnswer{c.probeHealth("/healthz"), c.probeHealth("/livez")}
			got[0].Families, got[1].Families = nil, nil
			d := cmp.Diff([]healthAnswer{healthz, livez}, got)
			return d == "", "(-want +got):\n" + d
		})
	}
	expect("synced, no Node", healthAnswer{Code: 503, Healthy: true, NodeEligible: &no}, healthAnswer{Code: 200, Healthy: true})
	if err := c.cp.CreateNode(ctx, "node-a", "10.244.0.1"); err != nil {
		t.Fatal(err)
	}
	expect("the Node arrived", healthAnswer{Code: 200, Healthy: true, NodeEligible: &yes}, healthAnswer{Code: 200, Healthy: true})
	node, err := client.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Spec.Taints = []v1.Taint{{Key: "ToBeDeletedByClusterAutoscaler", Value: "1700000000", Effect: v1.TaintEffectNoSchedule}}
	if _, err := client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	expect("the autoscaler's taint", healthAnswer{Code: 503, Healthy: true, NodeEligible: &no}, healthAnswer{Code: 200, Healthy: true})

	mfs := c.scrapeMetrics()
	for _, m := range []struct {
		name, code string
	}{{"kubeproxy_proxy_healthz_total", "200"}, {"kubeproxy_proxy_healthz_total", "503"}, {"kubeproxy_proxy_livez_total", "200"}} {
		if v, _ := promtest.Sum(mfs[m.name], map[string]string{"code": m.code}); v < 1 {
			t.Errorf("%s{code=%q} = %v, want at least 1", m.name, m.code, v)
		}
	}

	// An EndpointSlice the API server accepts and uproxy refuses: a port
	// without a number.
	if _, err := client.CoreV1().Services("default").Create(ctx, &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec:       v1.ServiceSpec{Ports: []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	bad := kubeSlice("web-bad", "web", readyEP(c.pods[0]))
	bad.Ports = []discovery.EndpointPort{{Name: ptr.To("http"), Protocol: ptr.To(v1.ProtocolTCP)}}
	if _, err := client.DiscoveryV1().EndpointSlices("default").Create(ctx, bad, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	type event struct{ Type, Reason, Action, Kind, Name, Controller, Note string }
	want := []event{
		{"Normal", "Starting", "StartKubeProxy", "Node", "node-a", "uproxy", ""},
		{"Warning", "Rejected", "Proxy", "EndpointSlice", "web-bad", "uproxy", "uproxy cannot proxy this object and keeps its last valid version: ports[0].port: missing"},
	}
	testwait.UntilOK(t, 20*time.Second, "uproxy's events", func() (bool, string) {
		list, err := client.EventsV1().Events("default").List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var got []event
		for _, e := range list.Items {
			if e.ReportingController != "uproxy" {
				continue
			}
			got = append(got, event{e.Type, e.Reason, e.Action, e.Regarding.Kind, e.Regarding.Name, e.ReportingController, e.Note})
		}
		d := cmp.Diff(want, got)
		return d == "", "(-want +got):\n" + d
	})
	if strings.Contains(c.up.Output(), "forbidden") {
		t.Errorf("uproxy was refused something by deploy/'s RBAC:\n%s", c.up.Output())
	}
}
