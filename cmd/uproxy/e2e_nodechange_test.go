package main

import (
	"context"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestE2ENodeIPsChangeStopsUproxy runs uproxy against a real API server
// with --nodeport-addresses primary, then changes its Node's InternalIP:
// uproxy stops, drained, with exit status 1 and the change in its log, as
// kube-proxy exits, so that its DaemonSet restarts it with the new
// address. A change that uproxy does not use (a label) does not stop it.
func TestE2ENodeIPsChangeStopsUproxy(t *testing.T) {
	c := newKubeCluster(t, 1)
	ctx := context.Background()
	client := c.cp.Client
	if err := c.cp.CreateNode(ctx, "node-a", "10.244.0.1"); err != nil {
		t.Fatal(err)
	}
	argv := []string{"--kubeconfig", c.cp.Kubeconfig, "--hostname-override", "node-a", "--nodeport-addresses", "primary",
		"--iptables-min-sync-period", "50ms", "--drain-timeout", "1s",
		"--upgrade-socket", filepath.Join(t.TempDir(), "upgrade.sock"), "--state-file", filepath.Join(t.TempDir(), "state.json")}
	var err error
	if c.up, err = c.run("uproxy", argv...); err != nil {
		t.Fatal(err)
	}
	c.waitSynced()

	node, err := client.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Labels["example.com/touched"] = "yes"
	if node, err = client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.up.Wait(2 * time.Second); err == nil || !strings.Contains(err.Error(), "still running") {
		t.Fatalf("uproxy stopped on a label change: %v\n%s", err, c.up.Output())
	}

	for i := range node.Status.Addresses {
		if node.Status.Addresses[i].Type == v1.NodeInternalIP {
			node.Status.Addresses[i].Address = "10.244.0.2"
		}
	}
	if _, err := client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	err = c.up.Wait(20 * time.Second)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("after the Node's IP changed: %v, want exit status 1\n%s", err, c.up.Output())
	}
	if out := c.up.Output(); !strings.Contains(out, "this node's IPs changed from [10.244.0.1] to [10.244.0.2]") || !strings.Contains(out, "draining connections") {
		t.Errorf("uproxy's log lacks the change or the drain:\n%s", out)
	}
}
