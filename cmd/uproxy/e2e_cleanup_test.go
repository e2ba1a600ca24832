package main

import (
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/uproxy/uproxy/internal/testkube"
	"github.com/uproxy/uproxy/internal/testwait"
)

// kubeletChains are the KUBE-* chains kubelet owns, which a cleanup of
// kube-proxy's rules must leave.
var kubeletChains = []string{"KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY", "KUBE-FIREWALL"}

// savedChains returns "table chain" for every chain of iptables-save
// output.
func savedChains(saved string) []string {
	var chains []string
	table := ""
	for line := range strings.Lines(saved) {
		switch {
		case strings.HasPrefix(line, "*"):
			table = strings.TrimSpace(line[1:])
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			chains = append(chains, table+" "+name)
		}
	}
	slices.Sort(chains)
	return chains
}

// savedRules returns "table rule" for every rule of iptables-save output.
func savedRules(saved string) []string {
	var rules []string
	table := ""
	for line := range strings.Lines(saved) {
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "*"):
			table = line[1:]
		case strings.HasPrefix(line, "-A "):
			rules = append(rules, table+" "+line)
		}
	}
	return rules
}

// isKubeProxys reports whether "table chain" is a chain kube-proxy's
// iptables mode creates: a KUBE-* chain that is not kubelet's.
func isKubeProxys(chain string) bool {
	_, name, _ := strings.Cut(chain, " ")
	return strings.HasPrefix(name, "KUBE-") && !slices.Contains(kubeletChains, name)
}

// TestE2ECleanupKubeProxy runs the real kube-proxy (iptables mode) against
// the API server until it has programmed its Services, stops it as a
// DaemonSet rollout would (its rules stay behind), starts uproxy, and runs
// `uproxy cleanup --kube-proxy` beside it: kube-proxy's chains and jumps go,
// kubelet's chains, a foreign rule and uproxy's rules stay, and the Service
// keeps working through uproxy.
func TestE2ECleanupKubeProxy(t *testing.T) {
	c := newKubeCluster(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	client := c.cp.Client
	_, kubeProxy, err := testkube.Binaries("../..")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.cp.CreateNode(ctx, "node-a", "10.244.0.1"); err != nil {
		t.Fatal(err)
	}
	// A ClusterIP Service, and a NodePort one with externalTrafficPolicy
	// Local, so that kube-proxy writes each kind of per-service chain.
	var vip string
	for _, s := range []struct {
		name  string
		typ   v1.ServiceType
		local bool
	}{{"web", v1.ServiceTypeClusterIP, false}, {"web-local", v1.ServiceTypeNodePort, true}} {
		svc := &v1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: s.name},
			Spec: v1.ServiceSpec{
				Type:     s.typ,
				Selector: map[string]string{"app": "web"},
				Ports:    []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
			},
		}
		if s.local {
			svc.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
		}
		created, err := client.CoreV1().Services("default").Create(ctx, svc, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if s.name == "web" {
			vip = created.Spec.ClusterIP
		}
		if _, err := client.DiscoveryV1().EndpointSlices("default").Create(ctx, kubeSlice(s.name+"-abc", s.name, readyEP(c.pods[0])), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	kp, err := c.lab.Start(c.lab.Node, "kube-proxy", kubeProxy,
		"--kubeconfig="+c.cp.Kubeconfig, "--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16",
		"--proxy-mode=iptables", "--conntrack-max-per-core=0", "--conntrack-min=0",
		"--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0", "--oom-score-adj=0",
		"--metrics-bind-address=127.0.0.1:10249", "--healthz-bind-address=127.0.0.1:10256")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("kube-proxy's output:\n%s", kp.Output())
		}
	})
	c.waitRulesWithin("kube-proxy's service chains", time.Minute, func(s string) bool {
		return strings.Contains(s, ":KUBE-SVC-") && strings.Contains(s, ":KUBE-SVL-") && strings.Contains(s, ":KUBE-EXT-")
	})
	if err := kp.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := kp.Wait(30 * time.Second); err != nil {
		t.Logf("kube-proxy: %v", err)
	}

	// kubelet's chains (kube-proxy made its own KUBE-FIREWALL too), and a
	// rule of someone else's.
	save := func(tool string) string {
		t.Helper()
		out, err := c.lab.Exec(ctx, c.lab.Node, tool)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	restore := "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n" +
		"*filter\n-A INPUT -s 192.0.2.1/32 -m comment --comment \"a firewall of its own\" -j ACCEPT\nCOMMIT\n"
	if out, err := c.lab.Exec(ctx, c.lab.Node, "sh", "-c", fmt.Sprintf("printf '%%s' '%s' | iptables-restore --noflush", restore)); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}

	argv := []string{"--kubeconfig", c.cp.Kubeconfig, "--hostname-override", "node-a",
		"--iptables-min-sync-period", "50ms", "--cluster-cidr", "10.244.0.0/16",
		"--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249",
		"--upgrade-socket", c.dir + "-upgrade.sock"}
	if c.up, err = c.run("uproxy", argv...); err != nil {
		t.Fatal(err)
	}
	c.waitRules("uproxy's rule for web", func(s string) bool {
		return strings.Contains(s, "-d "+vip+"/32") && strings.Contains(s, "-j REDIRECT")
	})
	// The nat rules are written before the sync inserts its jumps into the
	// filter table's built-in chains: "before" must hold all of uproxy's
	// rules, which the cleanup of kube-proxy's must leave alone.
	c.waitSynced()
	before := save("iptables-save")
	if !slices.ContainsFunc(savedChains(before), isKubeProxys) {
		t.Fatalf("kube-proxy left no chains behind:\n%s", before)
	}

	out, err := c.lab.Exec(ctx, c.lab.Node, c.uproxy, "cleanup", "--kube-proxy")
	if err != nil {
		t.Fatalf("uproxy cleanup --kube-proxy: %v\n%s", err, out)
	}
	t.Logf("uproxy cleanup --kube-proxy:\n%s", out)
	after := save("iptables-save")

	// Exactly kube-proxy's chains are gone.
	var want []string
	for _, ch := range savedChains(before) {
		if !isKubeProxys(ch) {
			want = append(want, ch)
		}
	}
	if diff := cmp.Diff(want, savedChains(after)); diff != "" {
		t.Errorf("chains after cleanup (-want +got):\n%s\nbefore:\n%s\nafter:\n%s", diff, before, after)
	}
	// Every rule that is not in or to one of kube-proxy's chains stays, and
	// none in or to them is left.
	kubeProxyRef := regexp.MustCompile(`^\S+ -A (\S+) .*-[jg] (\S+)$|^\S+ -A (\S+) `)
	refersToKubeProxy := func(rule string) bool {
		table, _, _ := strings.Cut(rule, " ")
		for _, m := range kubeProxyRef.FindStringSubmatch(rule)[1:] {
			if m != "" && isKubeProxys(table+" "+m) {
				return true
			}
		}
		return false
	}
	var kept []string
	for _, r := range savedRules(before) {
		if !refersToKubeProxy(r) {
			kept = append(kept, r)
		}
	}
	afterRules := savedRules(after)
	if diff := cmp.Diff(kept, afterRules); diff != "" {
		t.Errorf("rules after cleanup (-want +got):\n%s", diff)
	}
	if !slices.Contains(afterRules, `filter -A INPUT -s 192.0.2.1/32 -m comment --comment "a firewall of its own" -j ACCEPT`) {
		t.Errorf("the foreign rule is gone:\n%s", after)
	}
	if v6 := save("ip6tables-save"); slices.ContainsFunc(savedChains(v6), isKubeProxys) {
		t.Errorf("kube-proxy's IPv6 chains are left:\n%s", v6)
	}

	// The Service works, through uproxy alone.
	if r := c.get(c.client.NS, "http://"+vip+"/", 3, "--timeout", "2s"); r.Errors != 0 || r.Counts["web-0"] != 3 {
		t.Errorf("after cleanup, GET http://%s/: %+v", vip, r)
	}
	// Again: nothing left to do, and no error.
	if out, err := c.lab.Exec(ctx, c.lab.Node, c.uproxy, "cleanup", "--kube-proxy"); err != nil || !strings.Contains(out, `"chains": 0`) {
		t.Errorf("second uproxy cleanup --kube-proxy: %v\n%s", err, out)
	}

	// kube-proxy's nftables mode keeps its rules in a table per family,
	// which stays behind too.
	if _, err := exec.LookPath("nft"); err != nil {
		t.Logf("nft is not installed (Debian package nftables): not checking kube-proxy's nftables mode")
	} else {
		kp, err := c.lab.Start(c.lab.Node, "kube-proxy-nft", kubeProxy,
			"--kubeconfig="+c.cp.Kubeconfig, "--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16",
			"--proxy-mode=nftables", "--conntrack-max-per-core=0", "--conntrack-min=0",
			"--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0", "--oom-score-adj=0",
			"--metrics-bind-address=127.0.0.1:10259", "--healthz-bind-address=127.0.0.1:10266")
		if err != nil {
			t.Fatal(err)
		}
		tables := func() string {
			out, _ := c.lab.Exec(ctx, c.lab.Node, "nft", "list", "tables")
			return out
		}
		testwait.UntilOK(t, time.Minute, "kube-proxy's nftables table", func() (bool, string) {
			if kp.Exited() {
				t.Fatalf("kube-proxy exited:\n%s", kp.Output())
			}
			out := tables()
			return strings.Contains(out, "table ip kube-proxy"), out
		})
		if err := kp.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		_ = kp.Wait(30 * time.Second)
		if out, err := c.lab.Exec(ctx, c.lab.Node, c.uproxy, "cleanup", "--kube-proxy"); err != nil {
			t.Fatalf("uproxy cleanup --kube-proxy: %v\n%s", err, out)
		}
		if got := tables(); strings.Contains(got, "kube-proxy") {
			t.Errorf("kube-proxy's nftables tables are left:\n%s", got)
		}
		if r := c.get(c.client.NS, "http://"+vip+"/", 3, "--timeout", "2s"); r.Errors != 0 || r.Counts["web-0"] != 3 {
			t.Errorf("after the nftables cleanup, GET http://%s/: %+v", vip, r)
		}
	}
	if c.up.Exited() {
		t.Errorf("uproxy exited:\n%s", c.up.Output())
	}
}

// TestE2ERunCleanupRemovesBoth runs `uproxy run --cleanup`, kube-proxy's
// own flag, on a node where both uproxy and kube-proxy left state behind
// (kube-proxy's iptables and IPVS modes' chains, an IPVS-mode ipset):
// as kube-proxy --cleanup, which runbooks call with whatever image the
// DaemonSet has, it removes uproxy's and kube-proxy's, and leaves
// kubelet's chain and a rule of someone else's.
func TestE2ERunCleanupRemovesBoth(t *testing.T) {
	c := newCluster(t, 1)
	ctx := context.Background()
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
	c.start(1)
	if err := c.up.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	c.up.Wait(30 * time.Second)
	restore := "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODE-PORT - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n" +
		"-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n" +
		"-A KUBE-SERVICES -j KUBE-NODE-PORT\nCOMMIT\n" +
		"*filter\n:KUBE-IPVS-FILTER - [0:0]\n-A INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER\n" +
		"-A INPUT -s 192.0.2.1/32 -m comment --comment \"a firewall of its own\" -j ACCEPT\nCOMMIT\n"
	for _, cmd := range [][]string{
		{"sh", "-c", fmt.Sprintf("printf '%%s' '%s' | iptables-restore --noflush", restore)},
		{"ipset", "create", "KUBE-CLUSTER-IP", "hash:ip,port"},
	} {
		if out, err := c.lab.Exec(ctx, c.lab.Node, cmd...); err != nil {
			t.Fatalf("%v: %v\n%s", cmd, err, out)
		}
	}
	before, _ := c.lab.Exec(ctx, c.lab.Node, "iptables-save")
	if !strings.Contains(before, ":UPROXY-SERVICES") {
		t.Fatalf("uproxy left no rules behind to clean:\n%s", before)
	}

	if out, err := c.lab.Exec(ctx, c.lab.Node, c.uproxy, "run", "--cleanup"); err != nil {
		t.Fatalf("uproxy run --cleanup: %v\n%s", err, out)
	}
	after, _ := c.lab.Exec(ctx, c.lab.Node, "iptables-save")
	for _, gone := range []string{":UPROXY-", ":KUBE-SERVICES", ":KUBE-NODE-PORT", ":KUBE-IPVS-FILTER", "-j KUBE-SERVICES", "-j KUBE-IPVS-FILTER"} {
		if strings.Contains(after, gone) {
			t.Errorf("after run --cleanup, %q is left:\n%s", gone, after)
		}
	}
	for _, kept := range []string{":KUBE-KUBELET-CANARY", "a firewall of its own"} {
		if !strings.Contains(after, kept) {
			t.Errorf("after run --cleanup, %q is gone:\n%s", kept, after)
		}
	}
	sets, _ := c.lab.Exec(ctx, c.lab.Node, "ipset", "list", "-n")
	if strings.Contains(sets, "KUBE-CLUSTER-IP") || strings.Contains(sets, "uproxy-") {
		t.Errorf("after run --cleanup, sets are left:\n%s", sets)
	}
}
