package main

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/introspect"
)

// uproxyCmd runs the uproxy binary with args in the node namespace.
func (c *cluster) uproxyCmd(args ...string) string {
	c.t.Helper()
	out, err := c.lab.Exec(context.Background(), c.lab.Node, append([]string{c.uproxy}, args...)...)
	if err != nil {
		c.t.Fatalf("uproxy %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

func TestE2EStatus(t *testing.T) {
	c := newCluster(t, 3)
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
	c.write("sh.yaml", serviceYAML("sh", "10.96.0.11", 80, map[string]string{"uproxy.io/balancer": "source-hash"}, true, c.pods[1]))
	c.start(2, "--metrics-bind-address", metricsAddr, "--endpoint-dial-timeout", "300ms")
	c.waitSynced()
	// web-0's server dies: its connections are refused, and it is ejected.
	if err := c.servers[0].Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	c.servers[0].Wait(5 * time.Second)
	if r := c.get(c.client.NS, "http://10.96.0.10/", 6); r.Errors > 0 {
		t.Fatalf("requests failed: %v", r)
	}

	var st introspect.Status
	if err := json.Unmarshal([]byte(c.uproxyCmd("status", "-o", "json")), &st); err != nil {
		t.Fatal(err)
	}
	if st.Mode != "redirect" || st.LastSync.IsZero() || len(st.Ports) != 2 {
		t.Fatalf("status: %+v", st)
	}
	// Default flags: io_uring where the kernel allows it, epoll elsewhere,
	// on one loop less than the CPUs, at least one.
	wantIO := "io_uring"
	if datapath.IOURingSupported() != nil {
		wantIO = "epoll"
	}
	wantLoops := max(1, runtime.GOMAXPROCS(0)-1) // uproxy inherits the test's CPUs and environment
	if st.IO != wantIO || st.EventLoops != wantLoops {
		t.Errorf("status says %d event loops on %q, want %d on %q", st.EventLoops, st.IO, wantLoops, wantIO)
	}
	sh, web := st.Ports[0], st.Ports[1]
	rule := regexp.MustCompile(`-d 10\.96\.0\.10/32 .*--to-ports (\d+)`).FindStringSubmatch(c.natRules())
	if rule == nil || fmt.Sprint(web.ListenPort) != rule[1] {
		t.Errorf("web's listener port %d is not the rule's (%v)", web.ListenPort, rule)
	}
	if web.Service != "default/web" || web.Port != "http" || web.Protocol != "TCP" || web.Family != "IPv4" ||
		web.Balancer != "round-robin" || web.Affinity != "None" || strings.Join(web.Addresses, ",") != "ClusterIP 10.96.0.10:80" {
		t.Errorf("web: %+v", web)
	}
	if sh.Balancer != "source-hash" || sh.Affinity != "ClientIP" || sh.AffinityTimeoutSeconds != 10800 || len(sh.Endpoints) != 1 {
		t.Errorf("sh: %+v", sh)
	}
	if len(web.Endpoints) != 3 {
		t.Fatalf("web endpoints: %+v", web.Endpoints)
	}
	for _, e := range web.Endpoints {
		dead := e.Address == c.pods[0].IP.String()+":8080"
		if !e.Ready || e.Ejected != dead || (e.RecentDialErrors > 0) != dead || e.Active != 0 {
			t.Errorf("endpoint %+v (dead: %v)", e, dead)
		}
	}

	table := c.uproxyCmd("status", "--address", debugAddr)
	for _, want := range []string{"on " + wantIO + ", last sync", "SERVICE", "LISTENER", "default/web", "ClusterIP 10.96.0.10:80", "source-hash", "ClientIP (10800s)", c.pods[0].IP.String() + ":8080", "RECENT DIAL ERRORS"} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
	if y := c.uproxyCmd("status", "--address", debugAddr, "-o", "yaml"); !strings.Contains(y, "listenPort: "+fmt.Sprint(web.ListenPort)) {
		t.Errorf("yaml output:\n%s", y)
	}
	t.Logf("uproxy status:\n%s", table)
}

// TestE2EDebugAddress checks, on a running uproxy without --profiling,
// that the metrics address serves neither /status, /explain nor pprof,
// and that the debug address serves /status but not pprof.
func TestE2EDebugAddress(t *testing.T) {
	c := newCluster(t, 1)
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
	c.start(1)
	c.waitSynced()
	code := func(url string) string {
		out, err := c.lab.Exec(context.Background(), c.lab.Node, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5", url)
		if err != nil {
			t.Errorf("%s: %v %s", url, err, out) // curl still printed 000
		}
		return strings.Fields(out + " 000")[0]
	}
	got := map[string]string{}
	for _, url := range []string{
		"http://" + metricsAddr + "/metrics",
		"http://" + metricsAddr + "/status",
		"http://" + metricsAddr + "/explain?dst=10.96.0.10:80",
		"http://" + metricsAddr + "/debug/pprof/",
		"http://" + debugAddr + "/status",
		"http://" + debugAddr + "/debug/pprof/",
	} {
		got[url] = code(url)
	}
	want := map[string]string{
		"http://" + metricsAddr + "/metrics":                   "200",
		"http://" + metricsAddr + "/status":                    "404",
		"http://" + metricsAddr + "/explain?dst=10.96.0.10:80": "404",
		"http://" + metricsAddr + "/debug/pprof/":              "404",
		"http://" + debugAddr + "/status":                      "200",
		"http://" + debugAddr + "/debug/pprof/":                "404",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("status codes (-want +got):\n%s", diff)
	}
	// Explains in a burst: past the bucket, 429.
	codes := map[string]int{}
	for range 10 {
		codes[code("http://"+debugAddr+"/explain?dst=10.96.0.10:80")]++
	}
	if codes["429"] == 0 || codes["200"] == 0 {
		t.Errorf("10 explains in a row answered %v; want some 200 and, past the burst, 429", codes)
	}
}
