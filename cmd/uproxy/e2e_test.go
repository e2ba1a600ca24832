package main

// End-to-end tests: the real uproxy binary, real iptables rules and real
// backends, in a namespace lab (see internal/testlab). They need root and the
// iptables tools, and skip with the reason otherwise.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/redirect"
)

var (
	buildOnce           sync.Once
	uproxyBin, benchBin string
	buildErr            error
	binDir              string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// binaries builds uproxy and the lab's peer program (testpeer) once per test run.
func binaries(t *testing.T) (string, string) {
	t.Helper()
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "uproxy-e2e-")
		if buildErr != nil {
			return
		}
		uproxyBin, benchBin, buildErr = testlab.BuildBinaries("../..", binDir)
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return uproxyBin, benchBin
}

// cluster is a lab node running uproxy over manifests in a folder, with
// HTTP backends in pods.
type cluster struct {
	t       *testing.T
	lab     *testlab.Lab
	dir     string
	up      *testlab.Proc
	bench   string
	uproxy  string
	pods    []*testlab.Pod
	servers []*testlab.Proc // one per pod
	client  *testlab.Pod
	// launcher, if set, is the command uproxy runs under (prlimit, to
	// give it a small open-files limit).
	launcher []string
}

// newCluster builds a lab with n backend pods (web-0…, serving on :8080)
// and a client pod. uproxy is not started yet.
func newCluster(t *testing.T, n int) *cluster {
	t.Helper()
	return newClusterWith(t, n, testlab.Options{})
}

// newClusterWith is newCluster on a lab built with o (its Logf is t's).
func newClusterWith(t *testing.T, n int, o testlab.Options) *cluster {
	t.Helper()
	testlab.RequireRoot(t, "iptables", "iptables-save", "iptables-restore")
	up, bench := binaries(t)
	o.Logf = t.Logf
	l, err := testlab.New(o)
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, lab: l, dir: t.TempDir(), bench: bench, uproxy: up}
	t.Cleanup(func() {
		if t.Failed() && c.up != nil {
			t.Logf("uproxy output:\n%s", c.up.Output())
		}
		l.Close()
	})
	for i := range n {
		p, err := l.AddPod(fmt.Sprintf("web-%d", i))
		if err != nil {
			t.Fatal(err)
		}
		srv, err := l.Start(p.NS, p.Name, bench, "serve", "--name", p.Name, "--listen", ":8080")
		if err != nil {
			t.Fatal(err)
		}
		c.pods = append(c.pods, p)
		c.servers = append(c.servers, srv)
	}
	if c.client, err = l.AddPod("client"); err != nil {
		t.Fatal(err)
	}
	return c
}

// write writes a manifest file into the watched folder, atomically.
func (c *cluster) write(name, content string) {
	c.t.Helper()
	tmp := filepath.Join(c.dir, ".tmp-"+name)
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		c.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(c.dir, name)); err != nil {
		c.t.Fatal(err)
	}
}

// start runs uproxy in the node namespace and waits until its first sync
// has ended with n REDIRECT rules installed. The rules show before the
// sync ends (the other tables and the sets follow), so both are waited for.
func (c *cluster) start(rules int, args ...string) {
	c.t.Helper()
	var err error
	if c.up, err = c.run("uproxy", append([]string{"--manifests", c.dir, "--iptables-min-sync-period", "50ms"}, args...)...); err != nil {
		c.t.Fatal(err)
	}
	c.waitRules("uproxy to install its rules", func(s string) bool { return strings.Count(s, "-j REDIRECT") == rules })
	c.waitSynced()
}

// run starts `uproxy run args...` (under c.launcher, if set) in the node
// namespace, as process name. The upgrade socket and the state file are
// the cluster's own, beside its manifest folder: the binary's defaults are
// one per host, under /run/uproxy, and tests of other labs run at the same
// time. args may still name others: the last flag wins.
func (c *cluster) run(name string, args ...string) (*testlab.Proc, error) {
	base := filepath.Join(c.dir, "..", filepath.Base(c.dir))
	argv := append(slices.Clone(c.launcher), c.uproxy, "run", "--upgrade-socket", base+"-upgrade.sock", "--state-file", base+"-state.json")
	return c.lab.Start(c.lab.Node, name, append(argv, args...)...)
}

// waitSynced waits until uproxy has completed a sync.
func (c *cluster) waitSynced() {
	c.t.Helper()
	testwait.UntilOK(c.t, 10*time.Second, "uproxy's first sync", func() (bool, string) {
		if c.up.Exited() {
			c.t.Fatalf("uproxy exited before it synced:\n%s", c.up.Output())
		}
		return strings.Contains(c.up.Output(), "\tsynced\t"), "uproxy's output:\n" + c.up.Output()
	})
}

func (c *cluster) natRules() string {
	c.t.Helper()
	out, err := c.lab.Exec(context.Background(), c.lab.Node, "iptables-save", "-t", "nat")
	if err != nil {
		c.t.Fatal(err)
	}
	return out
}

// waitRules waits up to 10s until cond holds for the node's nat table.
func (c *cluster) waitRules(what string, cond func(string) bool) {
	c.t.Helper()
	c.waitRulesWithin(what, 10*time.Second, cond)
}

// waitRulesWithin is waitRules with its own limit.
func (c *cluster) waitRulesWithin(what string, limit time.Duration, cond func(string) bool) {
	c.t.Helper()
	start := time.Now()
	testwait.UntilOK(c.t, limit, what, func() (bool, string) {
		if c.up != nil && c.up.Exited() {
			c.t.Fatalf("uproxy exited while waiting for %s:\n%s", what, c.up.Output())
		}
		rules := c.natRules()
		return cond(rules), "nat table:\n" + rules
	})
	if limit > 10*time.Second {
		c.t.Logf("%s: took %v", what, time.Since(start).Round(time.Millisecond))
	}
}

// get sends n requests from namespace ns and returns the spread.
func (c *cluster) get(ns, url string, n int, extra ...string) getResult {
	c.t.Helper()
	args := append([]string{c.bench, "get", "-n", fmt.Sprint(n), url}, extra...)
	out, err := c.lab.Exec(context.Background(), ns, args...)
	if err != nil {
		c.t.Fatal(err)
	}
	var r getResult
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		c.t.Fatalf("decoding %q: %v", out, err)
	}
	return r
}

type getResult struct {
	Counts     map[string]int `json:"counts"`
	Peers      map[string]int `json:"peers"`
	Errors     int            `json:"errors"`
	FirstError string         `json:"firstError"`
}

// serviceYAML renders a Service and its EndpointSlice over the given pods.
func serviceYAML(name, vip string, port int, annotations map[string]string, affinity bool, pods ...*testlab.Pod) string {
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: v1\nkind: Service\nmetadata:\n  name: %s\n", name)
	if len(annotations) > 0 {
		b.WriteString("  annotations:\n")
		for k, v := range annotations {
			fmt.Fprintf(&b, "    %s: %q\n", k, v)
		}
	}
	fmt.Fprintf(&b, "spec:\n  clusterIP: %s\n  ports:\n  - name: http\n    port: %d\n    targetPort: http\n", vip, port)
	if affinity {
		b.WriteString("  sessionAffinity: ClientIP\n")
	}
	fmt.Fprintf(&b, "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: %s-x\n  labels:\n    kubernetes.io/service-name: %s\naddressType: IPv4\nports:\n- name: http\n  port: 8080\nendpoints:\n", name, name)
	for _, p := range pods {
		fmt.Fprintf(&b, "- addresses: [%q]\n", p.IP)
	}
	return b.String()
}

func TestE2EBalancersFromNodeAndPod(t *testing.T) {
	c := newCluster(t, 3)
	a, b, d := c.pods[0], c.pods[1], c.pods[2]
	weights := map[string]string{"uproxy.io/weights": fmt.Sprintf("%s=3,%s=1,%s=1", a.IP, b.IP, d.IP)}
	with := func(kind string, m map[string]string) map[string]string {
		out := map[string]string{"uproxy.io/balancer": kind}
		for k, v := range m {
			out[k] = v
		}
		return out
	}
	c.write("rr.yaml", serviceYAML("rr", "10.96.0.10", 80, nil, false, a, b, d))
	c.write("wrr.yaml", serviceYAML("wrr", "10.96.0.11", 80, with("weighted-round-robin", weights), false, a, b, d))
	c.write("lc.yaml", serviceYAML("lc", "10.96.0.12", 80, with("least-conn", nil), false, a, b, d))
	c.write("wlc.yaml", serviceYAML("wlc", "10.96.0.13", 80, with("weighted-least-conn", weights), false, a, b, d))
	c.write("sh.yaml", serviceYAML("sh", "10.96.0.14", 80, with("source-hash", nil), false, a, b, d))
	c.write("aff.yaml", serviceYAML("aff", "10.96.0.15", 80, nil, true, a, b, d))
	c.start(6)

	for _, from := range []struct{ name, ns string }{{"pod", c.client.NS}, {"node", c.lab.Node}} {
		t.Run("from "+from.name, func(t *testing.T) {
			check := func(svc, url string, n int, ok func(map[string]int) bool) {
				t.Helper()
				r := c.get(from.ns, url, n)
				if r.Errors > 0 || !ok(r.Counts) {
					t.Errorf("%s: spread %v, %d errors (%s)", svc, r.Counts, r.Errors, r.FirstError)
				}
			}
			exact := func(want map[string]int) func(map[string]int) bool {
				return func(got map[string]int) bool { return fmt.Sprint(got) == fmt.Sprint(want) }
			}
			single := func(got map[string]int) bool { return len(got) == 1 }
			check("round-robin", "http://10.96.0.10/", 30, exact(map[string]int{"web-0": 10, "web-1": 10, "web-2": 10}))
			check("weighted-round-robin", "http://10.96.0.11/", 25, exact(map[string]int{"web-0": 15, "web-1": 5, "web-2": 5}))
			// A connection's backend is released only when the proxy sees it
			// end, which races with the client's next request, so the spread
			// is checked loosely here (the balancer's tests check it exactly).
			check("least-conn", "http://10.96.0.12/", 30, func(got map[string]int) bool {
				return got["web-0"] > 0 && got["web-1"] > 0 && got["web-2"] > 0
			})
			check("weighted-least-conn", "http://10.96.0.13/", 25, func(got map[string]int) bool {
				return got["web-0"] > got["web-1"] && got["web-0"] > got["web-2"] && got["web-1"] > 0 && got["web-2"] > 0
			})
			check("source-hash", "http://10.96.0.14/", 20, single)
			check("ClientIP affinity", "http://10.96.0.15/", 20, single)
		})
	}
	if out, err := c.lab.Exec(context.Background(), c.client.NS, "curl", "-sS", "--max-time", "5", "http://10.96.0.10/"); err != nil || !strings.HasPrefix(out, "web-") {
		t.Errorf("curl from the client pod: %q, %v", out, err)
	}
}

func TestE2EFailoverKilledAndBlackholed(t *testing.T) {
	c := newCluster(t, 4)
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
	c.start(1, "--endpoint-dial-timeout", "300ms")
	// web-0's server dies (connections refused); web-1 drops every SYN.
	if err := c.servers[0].Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	c.servers[0].Wait(5 * time.Second)
	if _, err := c.lab.Exec(context.Background(), c.pods[1].NS, "iptables", "-A", "INPUT", "-p", "tcp", "--dport", "8080", "-j", "DROP"); err != nil {
		t.Fatal(err)
	}
	for _, ns := range []string{c.client.NS, c.lab.Node} {
		r := c.get(ns, "http://10.96.0.10/", 40, "-c", "4")
		if r.Errors != 0 || r.Counts["web-0"]+r.Counts["web-1"] != 0 || r.Counts["web-2"] == 0 || r.Counts["web-3"] == 0 {
			t.Errorf("from %s: spread %v, %d errors (%s); want web-2 and web-3 only, no errors", ns, r.Counts, r.Errors, r.FirstError)
		}
	}
}

func TestE2EReload(t *testing.T) {
	c := newCluster(t, 3)
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods[0], c.pods[1]))
	c.write("old.yaml", serviceYAML("old", "10.96.0.20", 80, nil, false, c.pods[2]))
	c.start(2)
	if r := c.get(c.client.NS, "http://10.96.0.10/", 10); r.Errors > 0 || len(r.Counts) != 2 {
		t.Fatalf("before reload: %v", r)
	}
	// Add a service, remove one, and move web's endpoints.
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods[1], c.pods[2]))
	c.write("new.yaml", serviceYAML("new", "10.96.0.30", 8080, nil, false, c.pods[0]))
	if err := os.Remove(filepath.Join(c.dir, "old.yaml")); err != nil {
		t.Fatal(err)
	}
	c.waitRules("new in, old out", func(s string) bool {
		return strings.Contains(s, "10.96.0.30/32") && !strings.Contains(s, "10.96.0.20/32")
	})
	testwait.UntilOK(t, 10*time.Second, "web's endpoints to follow the reload", func() (bool, string) {
		r := c.get(c.client.NS, "http://10.96.0.10/", 10)
		return r.Errors == 0 && r.Counts["web-0"] == 0 && r.Counts["web-1"] == 5 && r.Counts["web-2"] == 5, fmt.Sprintf("%+v", r)
	})
	if r := c.get(c.client.NS, "http://10.96.0.30:8080/", 3); r.Errors > 0 || r.Counts["web-0"] != 3 {
		t.Errorf("new service: %v", r)
	}
	if r := c.get(c.client.NS, "http://10.96.0.20/", 1, "--timeout", "1s"); r.Errors != 1 {
		t.Errorf("removed service still answers: %v", r)
	}

	// A malformed file keeps its last good state; an invalid object is
	// rejected alone.
	c.write("web.yaml", "apiVersion: v1\nkind: Service\nmetadata: [oops\n")
	c.write("bad.yaml", serviceYAML("bad", "10.96.0.400", 80, nil, false, c.pods[0])+"---\n"+serviceYAML("good", "10.96.0.40", 80, nil, false, c.pods[0]))
	c.waitRules("good in", func(s string) bool { return strings.Contains(s, "10.96.0.40/32") })
	if r := c.get(c.client.NS, "http://10.96.0.10/", 4); r.Errors > 0 {
		t.Errorf("web broke after a malformed edit: %v", r)
	}
	if out := c.up.Output(); !strings.Contains(out, "web.yaml: document 0") || !strings.Contains(out, `default/bad`) || !strings.Contains(out, `10.96.0.400\" is not a valid IP`) {
		t.Errorf("uproxy did not log the malformed file and the invalid object clearly:\n%s", out)
	}
}

func TestE2ELifecycle(t *testing.T) {
	c := newCluster(t, 2)
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
	// Someone else's rule in the same built-in chain must survive cleanup.
	if _, err := c.lab.Exec(context.Background(), c.lab.Node, "iptables", "-t", "nat", "-A", "OUTPUT", "-d", "10.96.9.9/32", "-m", "comment", "--comment", "not ours", "-j", "RETURN"); err != nil {
		t.Fatal(err)
	}
	c.start(1, "--iptables-sync-period", "1s")
	ok := func() {
		t.Helper()
		if r := c.get(c.client.NS, "http://10.96.0.10/", 4); r.Errors > 0 {
			t.Fatalf("requests failed: %v", r)
		}
	}
	ok()

	t.Run("drift is repaired", func(t *testing.T) {
		ctx := context.Background()
		if _, err := c.lab.Exec(ctx, c.lab.Node, "iptables", "-t", "nat", "-F", redirect.ServicesChain); err != nil {
			t.Fatal(err)
		}
		c.waitRules("the flushed chain to be repaired", func(s string) bool { return strings.Count(s, "-j REDIRECT") == 1 })
		if _, err := c.lab.Exec(ctx, c.lab.Node, "iptables", "-t", "nat", "-D", "OUTPUT", "-m", "mark", "!", "--mark", "0x400000/0x400000", "-m", "comment", "--comment", "uproxy service portals", "-j", redirect.ServicesChain); err != nil {
			t.Fatal(err)
		}
		c.waitRules("the deleted jump to be repaired", func(s string) bool {
			return strings.Contains(s, `-A OUTPUT -m mark ! --mark 0x400000/0x400000 -m comment --comment "uproxy service portals" -j UPROXY-SERVICES`)
		})
		ok()
	})

	t.Run("SIGTERM leaves rules and a restart adopts them", func(t *testing.T) {
		before := c.natRules()
		if err := c.up.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if err := c.up.Wait(10 * time.Second); err != nil {
			t.Fatalf("uproxy did not exit cleanly on SIGTERM: %v\n%s", err, c.up.Output())
		}
		if after := c.natRules(); strings.Count(after, "UPROXY") != strings.Count(before, "UPROXY") {
			t.Fatalf("rules changed on SIGTERM:\nbefore:\n%s\nafter:\n%s", before, after)
		}
		c.start(1, "--iptables-sync-period", "1s")
		// Wait for the new listener port to be in the rule.
		deadline := time.Now().Add(10 * time.Second)
		for c.get(c.client.NS, "http://10.96.0.10/", 1, "--timeout", "1s").Errors > 0 {
			if time.Now().After(deadline) {
				t.Fatal("the restarted uproxy does not serve")
			}
		}
		s := c.natRules()
		for _, want := range []string{"-A PREROUTING -m mark ! --mark 0x400000/0x400000 -m comment --comment \"uproxy service portals\"", "-A OUTPUT -m mark ! --mark 0x400000/0x400000 -m comment --comment \"uproxy service portals\"", "-j REDIRECT"} {
			if n := strings.Count(s, want); n != 1 {
				t.Errorf("%d copies of %q after restart:\n%s", n, want, s)
			}
		}
		ok()
	})

	t.Run("cleanup removes only ours", func(t *testing.T) {
		if err := c.up.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if err := c.up.Wait(10 * time.Second); err != nil {
			t.Fatal(err)
		}
		for range 2 { // idempotent
			if out, err := c.lab.Exec(context.Background(), c.lab.Node, c.uproxy, "cleanup"); err != nil {
				t.Fatalf("cleanup: %v\n%s", err, out)
			}
		}
		s := c.natRules()
		if strings.Contains(s, "UPROXY") || strings.Contains(s, "uproxy") {
			t.Errorf("cleanup left rules behind:\n%s", s)
		}
		if !strings.Contains(s, `--comment "not ours" -j RETURN`) {
			t.Errorf("cleanup removed someone else's rule:\n%s", s)
		}
	})
}

func TestE2EMalformedManifestAtStartup(t *testing.T) {
	up, _ := binaries(t)
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "a.yaml"), []byte(serviceYAML("a", "10.96.0.10", 80, nil, false)), 0o644)
	os.WriteFile(filepath.Join(dir, "b.yaml"), []byte(serviceYAML("b", "10.96.0.11", 80, nil, false)+"---\nkind: Service\nspec: [\n"), 0o644)
	out, err := exec.Command(up, "run", "--manifests", dir, "--upgrade-socket", filepath.Join(t.TempDir(), "upgrade.sock"), "--state-file", "").CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() == 0 {
		t.Fatalf("uproxy run with a malformed manifest: %v, want a non-zero exit", err)
	}
	if want := filepath.Join(dir, "b.yaml") + ": document 2:"; !strings.Contains(string(out), want) {
		t.Errorf("error does not name the file and document (%q):\n%s", want, out)
	}
}
