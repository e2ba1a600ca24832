package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/uproxy/uproxy/internal/testwait"
)

// healthAnswer is one /healthz or /livez answer, as the tests compare it.
type healthAnswer struct {
	Code         int
	Healthy      bool
	NodeEligible *bool
	Families     []string
}

// probeHealth GETs path on uproxy's health server inside the node
// namespace.
func (c *cluster) probeHealth(path string) healthAnswer {
	c.t.Helper()
	out, err := c.lab.Exec(context.Background(), c.lab.Node, "curl", "-sS", "--max-time", "5", "-w", "\n%{http_code}", "http://127.0.0.1:10256"+path)
	if err != nil {
		c.t.Fatalf("GET %s: %v", path, err)
	}
	body, code, _ := strings.Cut(strings.TrimSpace(out), "\n")
	var a healthAnswer
	a.Code, _ = strconv.Atoi(strings.TrimSpace(code))
	var b struct {
		Healthy      bool                       `json:"healthy"`
		NodeEligible *bool                      `json:"nodeEligible"`
		Status       map[string]json.RawMessage `json:"status"`
	}
	if err := json.Unmarshal([]byte(body), &b); err != nil {
		c.t.Fatalf("GET %s: %v in %q", path, err, body)
	}
	a.Healthy, a.NodeEligible = b.Healthy, b.NodeEligible
	for f := range b.Status {
		a.Families = append(a.Families, f)
	}
	return a
}

// TestE2EHealthUnreachableAPIServer runs uproxy with a kubeconfig whose
// server is a closed loopback port: the initial lists never arrive, so
// /healthz and /livez must keep answering 503, where they used to
// answer 200 from the start.
func TestE2EHealthUnreachableAPIServer(t *testing.T) {
	c := newCluster(t, 0)
	kubeconfig := filepath.Join(c.dir, "kubeconfig")
	// Nothing listens in the lab's node namespace: port 1 refuses.
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: lab, cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}}]
users: [{name: lab, user: {token: none}}]
contexts: [{name: lab, context: {cluster: lab, user: lab}}]
current-context: lab
`), 0o600); err != nil {
		t.Fatal(err)
	}
	var err error
	c.up, err = c.run("uproxy", "--kubeconfig", kubeconfig,
		"--hostname-override", "node-a", "--upgrade-socket", filepath.Join(c.dir, "upgrade.sock"),
		"--iptables-sync-period", "2s", "--iptables-min-sync-period", "50ms")
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 10*time.Second, "the health server to answer", func() bool {
		if c.up.Exited() {
			t.Fatalf("uproxy exited:\n%s", c.up.Output())
		}
		_, err := c.lab.Exec(context.Background(), c.lab.Node, "curl", "-s", "-o", "/dev/null", "--max-time", "2", "http://127.0.0.1:10256/livez")
		return err == nil
	})
	// Past several sync periods, and so past the health timeout, it stays
	// unhealthy.
	testwait.Never(t, 10*time.Second, "uproxy reported health with the API server unreachable", func() bool {
		no := false
		got := []healthAnswer{c.probeHealth("/healthz"), c.probeHealth("/livez")}
		want := []healthAnswer{
			{Code: 503, Healthy: false, NodeEligible: &no, Families: got[0].Families},
			{Code: 503, Healthy: false, Families: got[1].Families},
		}
		d := cmp.Diff(want, got)
		if d != "" {
			t.Logf("/healthz, /livez (-want +got):\n%s", d)
		}
		return d != ""
	})
	if strings.Contains(c.up.Output(), "\tsynced\t") {
		t.Errorf("uproxy synced without the initial lists:\n%s", c.up.Output())
	}
}
