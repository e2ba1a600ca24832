package main

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/proxy/introspect"
)

func TestE2EExplain(t *testing.T) {
	c := newCluster(t, 3)
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
	c.write("sh.yaml", serviceYAML("sh", "10.96.0.11", 80, map[string]string{"uproxy.io/balancer": "source-hash"}, false, c.pods...))
	c.write("aff.yaml", serviceYAML("aff", "10.96.0.12", 80, nil, true, c.pods...))
	c.write("empty.yaml", serviceYAML("empty", "10.96.0.13", 80, nil, false))
	c.start(4, "--metrics-bind-address", metricsAddr)
	c.waitSynced()
	from := c.client.IP.String()
	explain := func(args ...string) introspect.Explanation {
		t.Helper()
		var ex introspect.Explanation
		out := c.uproxyCmd(append([]string{"explain", "--address", debugAddr, "-o", "json"}, args...)...)
		if err := json.Unmarshal([]byte(out), &ex); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		return ex
	}
	// The pick explain predicts is the one the client gets.
	for _, svc := range []struct{ name, vip string }{{"source-hash", "10.96.0.11"}, {"affinity", "10.96.0.12"}} {
		r := c.get(c.client.NS, "http://"+svc.vip+"/", 5)
		if r.Errors > 0 || len(r.Counts) != 1 {
			t.Fatalf("%s: %v", svc.name, r)
		}
		var pod string
		for name := range r.Counts {
			pod = name
		}
		want := c.lab.Pod(pod).IP.String() + ":8080"
		ex := explain(svc.vip+":80", "--from", from)
		if !ex.Caught || ex.Backend != want {
			t.Errorf("%s: explain picks %q, the client got %s (%s)\n%+v", svc.name, ex.Backend, pod, want, ex)
		}
		if len(ex.KernelRules) != 1 || !strings.Contains(ex.KernelRules[0], "-d "+svc.vip+"/32") || !strings.Contains(ex.KernelRules[0], "-j REDIRECT") {
			t.Errorf("%s: kernel rules %q", svc.name, ex.KernelRules)
		}
		if route := ex.Routes[want]; !strings.Contains(route, c.lab.Pod(pod).IP.String()) || !strings.Contains(route, "dev") {
			t.Errorf("%s: route to %s: %q", svc.name, want, route)
		}
	}
	ex := explain("10.96.0.10:80")
	if !ex.Caught || ex.Backend != "" || len(ex.Candidates) != 3 || !strings.Contains(ex.Pick, "next in turn") ||
		!strings.Contains(ex.OriginalDestination, "SO_ORIGINAL_DST") || len(ex.Routes) != 3 {
		t.Errorf("round-robin: %+v", ex)
	}
	// A service port without endpoints is refused by the kernel: no
	// listener catches it, and the rules say which REJECT does.
	if ex := explain("10.96.0.13:80"); ex.Caught || !slices.ContainsFunc(ex.KernelRules, func(r string) bool { return strings.Contains(r, "-j REJECT") }) {
		t.Errorf("a service port without endpoints: caught %v, kernel rules %q; want not caught, and a REJECT", ex.Caught, ex.KernelRules)
	}
	for arg, want := range map[string]string{
		"10.96.0.13:80":     "no ready endpoints",
		"10.96.0.10:8080":   "port mismatch",
		"10.96.0.10:80/udp": "port mismatch",
		"10.96.99.99:80":    "no such service",
	} {
		if ex := explain(arg); !strings.Contains(ex.Reason, want) {
			t.Errorf("%s: reason %q, want %q", arg, ex.Reason, want)
		}
	}
	text := c.uproxyCmd("explain", "--address", debugAddr, "10.96.0.11:80", "--from", from)
	for _, want := range []string{"kernel rules:", "-j REDIRECT --to-ports", "listener:", "SO_ORIGINAL_DST", "source-hash", "endpoint:", "route to"} {
		if !strings.Contains(text, want) {
			t.Errorf("text output lacks %q:\n%s", want, text)
		}
	}
	t.Logf("uproxy explain 10.96.0.11:80 --from %s:\n%s", from, text)
	if text := c.uproxyCmd("explain", "--address", debugAddr, "10.96.99.99:80"); !strings.Contains(text, "NOT CAUGHT: no such service") {
		t.Errorf("text output for an unknown address:\n%s", text)
	}
}

// TestE2EExplainShared checks that explain finds the rule that catches a
// service in the shared layout, where the rule names a kernel set, not
// the address: only a member of the set is caught by it.
func TestE2EExplainShared(t *testing.T) {
	c := newCluster(t, 2)
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
	c.start(1, "--metrics-bind-address", metricsAddr, "--listener", "shared")
	c.waitSynced()
	explain := func(arg string) introspect.Explanation {
		t.Helper()
		var ex introspect.Explanation
		out := c.uproxyCmd("explain", "-o", "json", arg)
		if err := json.Unmarshal([]byte(out), &ex); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		return ex
	}
	ex := explain("10.96.0.10:80")
	if !ex.Caught || len(ex.KernelRules) != 1 || !strings.Contains(ex.KernelRules[0], "--match-set uproxy-services4 dst,dst") {
		t.Errorf("a member of the service set: caught %v, kernel rules %q", ex.Caught, ex.KernelRules)
	}
	for _, arg := range []string{"10.96.0.10:81", "10.96.0.99:80", "10.96.0.10:80/udp"} {
		if ex := explain(arg); ex.Caught || len(ex.KernelRules) != 0 {
			t.Errorf("%s, not in the set: caught %v, kernel rules %q", arg, ex.Caught, ex.KernelRules)
		}
	}
}
