package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/source"
)

// TestE2EKubeRestartWithoutAPIServer kills uproxy (SIGKILL: its rules
// stay), stops the API server, and starts uproxy again: the Services it
// last synced keep answering from the state file, on the ports the rules
// left behind name, and no rule is written until the API server returns.
// Then the initial lists reconcile: a Service deleted meanwhile goes.
func TestE2EKubeRestartWithoutAPIServer(t *testing.T) {
	for _, layout := range []string{"per-service", "shared"} {
		t.Run(layout, func(t *testing.T) { testRestartWithoutAPIServer(t, layout) })
	}
}

func testRestartWithoutAPIServer(t *testing.T, layout string) {
	c := newKubeCluster(t, 2)
	ctx := context.Background()
	client := c.cp.Client
	if err := c.cp.CreateNode(ctx, "node-a", "10.244.0.1"); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	state := filepath.Join(dir, "state.json")
	argv := []string{"--kubeconfig", c.cp.Kubeconfig, "--hostname-override", "node-a",
		"--iptables-min-sync-period", "50ms", "--cluster-cidr", "10.244.0.0/16",
		"--upgrade-socket", filepath.Join(dir, "upgrade.sock"), "--state-file", state, "--listener", layout}
	var err error
	if c.up, err = c.run("uproxy", argv...); err != nil {
		t.Fatal(err)
	}
	vips := map[string]string{}
	for _, name := range []string{"web", "gone"} {
		svc, err := client.CoreV1().Services("default").Create(ctx, &v1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec:       v1.ServiceSpec{Ports: []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		vips[name] = svc.Spec.ClusterIP
		if _, err := client.DiscoveryV1().EndpointSlices("default").Create(ctx, kubeSlice(name+"-abc", name, readyEP(c.pods[0]), readyEP(c.pods[1])), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	serves := func(name string) getResult {
		return c.get(c.client.NS, "http://"+vips[name]+"/", 4, "--timeout", "1s")
	}
	testwait.Until(t, 20*time.Second, "both Services to answer", func() bool {
		a, b := serves("web"), serves("gone")
		return a.Errors == 0 && len(a.Counts) == 2 && b.Errors == 0 && len(b.Counts) == 2
	})
	testwait.Until(t, 40*time.Second, "the state file to hold both Services", func() bool {
		st, err := source.LoadState(state)
		return err == nil && len(st.Services) >= 2
	})

	// Killed: the rules stay. "gone" is deleted while uproxy is away,
	// then the API server goes down too.
	if err := c.up.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	c.up.Wait(5 * time.Second)
	rules := c.ourRules()
	if err := client.CoreV1().Services("default").Delete(ctx, "gone", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	c.cp.StopAPIServer()

	start := time.Now()
	if c.up, err = c.run("uproxy", argv...); err != nil {
		t.Fatal(err)
	}
	ok, err := firstSuccess(c.client.NS, vips["web"]+":80", start.Add(10*time.Second))
	if err != nil {
		t.Fatalf("the Service did not answer after a restart without the API server: %v\nuproxy:\n%s", err, c.up.Output())
	}
	t.Logf("the first request succeeded %v after the restart", ok.Sub(start).Round(time.Millisecond))
	testwait.Throughout(t, 5*time.Second, time.Second, "web served without the API server", func() (bool, string) {
		r := serves("web")
		return r.Errors == 0 && len(r.Counts) == 2, fmt.Sprintf("%+v\nuproxy:\n%s", r, c.up.Output())
	})
	if got := c.ourRules(); strings.Join(got, "\n") != strings.Join(rules, "\n") {
		t.Errorf("the rules changed before the initial lists:\nbefore:\n%s\nafter:\n%s", strings.Join(rules, "\n"), strings.Join(got, "\n"))
	}
	if out := c.up.Output(); strings.Contains(out, "\tsynced\t") || !strings.Contains(out, "serving the previous instance's Services") {
		t.Errorf("want the previous Services served and no sync before the initial lists; uproxy:\n%s", out)
	}
	if layout == "per-service" {
		// Longer than deploy/'s liveness probe takes to restart a
		// container (10 s, then 6 failures 10 s apart): /livez passes
		// while the saved Services are served; /healthz does not, as
		// kube-proxy's, which has not synced.
		testwait.Throughout(t, 75*time.Second, 5*time.Second, "/livez 200 and /healthz 503 while the saved Services are served", func() (bool, string) {
			live, healthz := c.probeHealth("/livez"), c.probeHealth("/healthz")
			r := serves("web")
			return live.Code == 200 && healthz.Code == 503 && r.Errors == 0,
				fmt.Sprintf("/livez %d, /healthz %d, requests %+v", live.Code, healthz.Code, r)
		})
	}

	// The API server returns: the initial lists reconcile.
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := c.cp.StartAPIServer(sctx); err != nil {
		t.Fatal(err)
	}
	// client-go's reflector backoff (see TestE2EKubernetes).
	testwait.Until(t, 150*time.Second, "the Service deleted meanwhile to stop answering", func() bool {
		return c.get(c.client.NS, "http://"+vips["gone"]+"/", 1, "--timeout", "1s").Errors == 1
	})
	// The rules are written before the sync's log line.
	testwait.Until(t, 10*time.Second, "the first sync's log line", func() bool { return strings.Contains(c.up.Output(), "\tsynced\t") })
	if r := serves("web"); r.Errors > 0 || len(r.Counts) != 2 {
		t.Errorf("after the initial lists: %+v", r)
	}
}
