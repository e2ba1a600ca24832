package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/internal/testkube"
	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/testwait"
)

// familyShape is what the metrics diff compares of a metric family: its
// type, the names of its labels (over all its series), and a histogram's
// bucket bounds.
type familyShape struct {
	Type    string
	Labels  []string
	Buckets []float64
}

func shapes(mfs map[string]*dto.MetricFamily) map[string]familyShape {
	out := map[string]familyShape{}
	for name, mf := range mfs {
		s := familyShape{Type: mf.GetType().String()}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if !slices.Contains(s.Labels, lp.GetName()) {
					s.Labels = append(s.Labels, lp.GetName())
				}
			}
			if h := m.GetHistogram(); h != nil && s.Buckets == nil {
				for _, b := range h.GetBucket() {
					s.Buckets = append(s.Buckets, b.GetUpperBound())
				}
			}
		}
		slices.Sort(s.Labels)
		out[name] = s
	}
	return out
}

func parseMetrics(t *testing.T, text string) map[string]*dto.MetricFamily {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatalf("parsing /metrics: %v\n%s", err, text)
	}
	return mfs
}

// notProvided reads the table of kube-proxy metrics that uproxy does not
// provide from docs/operations.md: the rows of the table that follows the
// line "<!-- kube-proxy metrics not provided -->", whose first cell is a
// metric name in backquotes, or a prefix ending in `*`. It returns each
// entry with its reason.
func notProvided(t *testing.T) map[string]string {
	t.Helper()
	f, err := os.Open("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	row := regexp.MustCompile("^\\| `([a-zA-Z0-9_:*]+)` \\| (.+) \\|$")
	out := map[string]string{}
	in := false
	for sc := bufio.NewScanner(f); sc.Scan(); {
		line := sc.Text()
		switch {
		case strings.TrimSpace(line) == "<!-- kube-proxy metrics not provided -->":
			in = true
		case in && strings.HasPrefix(line, "|"):
			if m := row.FindStringSubmatch(line); m != nil {
				out[m[1]] = m[2]
			}
		case in && len(out) > 0 && strings.TrimSpace(line) == "":
			return out
		}
	}
	if len(out) == 0 {
		t.Fatal("docs/operations.md has no table after <!-- kube-proxy metrics not provided -->")
	}
	return out
}

// listed returns the entry of notProvided that covers name, if any.
func listed(list map[string]string, name string) (string, bool) {
	if _, ok := list[name]; ok {
		return name, true
	}
	for k := range list {
		if p, ok := strings.CutSuffix(k, "*"); ok && strings.HasPrefix(name, p) {
			return k, true
		}
	}
	return "", false
}

// TestE2EMetricsMatchKubeProxy runs the real kube-proxy v1.37.2 (iptables
// mode, bench/tools/build.sh) and uproxy side by side, each in a lab of
// its own, against the same API server and the same Services, and diffs
// their metric families: every family kube-proxy exposes must be exposed
// by uproxy with the same type, label names and buckets, or be listed in
// docs/operations.md with the reason it is not.
func TestE2EMetricsMatchKubeProxy(t *testing.T) {
	c := newKubeCluster(t, 2)
	ctx := context.Background()
	_, kubeProxy, err := testkube.Binaries("../..")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.cp.CreateNode(ctx, "node-a", "10.244.0.1"); err != nil {
		t.Fatal(err)
	}
	// kube-proxy's lab reaches the API server as the benchmarks' do: a
	// socat on its loopback relays to the control plane's socket.
	kl, err := testlab.New(testlab.Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kl.Close)
	if _, err := kl.Start(kl.Node, "apiserver-relay", "socat",
		fmt.Sprintf("TCP-LISTEN:%d,bind=127.0.0.1,fork,reuseaddr,nodelay", testkube.APIServerPort), "UNIX-CONNECT:"+c.cp.Socket); err != nil {
		t.Fatal(err)
	}
	kp, err := kl.Start(kl.Node, "kube-proxy", kubeProxy,
		"--kubeconfig="+c.cp.Kubeconfig, "--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16",
		"--proxy-mode=iptables", "--iptables-min-sync-period=50ms",
		// The conntrack table's size is the machine's: leave it alone.
		"--conntrack-max-per-core=0", "--conntrack-min=0",
		"--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
		"--oom-score-adj=0", "--metrics-bind-address=127.0.0.1:10249", "--healthz-bind-address=127.0.0.1:10256")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("kube-proxy output:\n%s", kp.Output())
		}
	})
	c.up, err = c.run("uproxy", "--kubeconfig", c.cp.Kubeconfig, "--hostname-override", "node-a",
		"--cluster-cidr", "10.244.0.0/16", "--iptables-min-sync-period", "50ms", "--metrics-bind-address", metricsAddr,
		"--upgrade-socket", filepath.Join(t.TempDir(), "upgrade.sock"))
	if err != nil {
		t.Fatal(err)
	}
	c.waitSynced()
	// Give kube-proxy its start too: its metrics server answers once it
	// has its Node.
	curlIn := func(l *testlab.Lab, url string) (string, error) {
		return l.Exec(ctx, l.Node, "curl", "-sS", "--max-time", "5", url)
	}
	testwait.UntilOK(t, time.Minute, "kube-proxy's first sync", func() (bool, string) {
		if kp.Exited() {
			t.Fatalf("kube-proxy exited:\n%s", kp.Output())
		}
		out, err := curlIn(kl, "http://127.0.0.1:10249/metrics")
		return err == nil && strings.Contains(out, "kubeproxy_sync_proxy_rules_last_timestamp_seconds{"), fmt.Sprint(err)
	})

	// The same Services for both, created after both started (so their
	// trigger times count): one with ready endpoints, one whose internal
	// traffic policy is Local with no endpoint on this node.
	client := c.cp.Client
	trigger := map[string]string{v1.EndpointsLastChangeTriggerTime: time.Now().UTC().Format(time.RFC3339Nano)}
	for _, s := range []struct {
		name     string
		local    bool
		nodeName string
	}{{"web", false, "node-a"}, {"local", true, "node-b"}} {
		svc := &v1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: s.name},
			Spec:       v1.ServiceSpec{Ports: []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}},
		}
		if s.local {
			svc.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal)
		}
		if _, err := client.CoreV1().Services("default").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		sl := kubeSlice(s.name+"-1", s.name, readyEP(c.pods[0]), readyEP(c.pods[1]))
		for i := range sl.Endpoints {
			sl.Endpoints[i].NodeName = ptr.To(s.nodeName)
		}
		sl.Annotations = trigger
		sl.Ports = []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(v1.ProtocolTCP)}}
		if _, err := client.DiscoveryV1().EndpointSlices("default").Create(ctx, sl, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// Both have programmed both services (and observed the trigger), and
	// both health servers have answered each endpoint once.
	scrape := func(l *testlab.Lab, metricsURL, healthURL string) map[string]*dto.MetricFamily {
		t.Helper()
		var mfs map[string]*dto.MetricFamily
		// The sync that observed the trigger time also counted the
		// local-policy service.
		testwait.UntilOK(t, 30*time.Second, metricsURL+": a network programming latency", func() (bool, string) {
			for _, p := range []string{"/healthz", "/livez"} {
				_, _ = l.Exec(ctx, l.Node, "curl", "-s", "-o", "/dev/null", "--max-time", "2", healthURL+p)
			}
			out, err := curlIn(l, metricsURL)
			if err != nil {
				t.Fatal(err)
			}
			mfs = parseMetrics(t, out)
			return mfs["kubeproxy_network_programming_duration_seconds"] != nil, out
		})
		return mfs
	}
	kubeMFs := scrape(kl, "http://127.0.0.1:10249/metrics", "http://127.0.0.1:10256")
	upMFs := scrape(c.lab, "http://"+metricsAddr+"/metrics", "http://127.0.0.1:10256")
	kubeShapes, upShapes := shapes(kubeMFs), shapes(upMFs)

	list := notProvided(t)
	used := map[string]bool{}
	var missing []string
	want, got := map[string]familyShape{}, map[string]familyShape{}
	for name, ks := range kubeShapes {
		if entry, ok := listed(list, name); ok {
			used[entry] = true
			if _, has := upShapes[name]; has && !strings.HasSuffix(entry, "*") {
				t.Errorf("docs/operations.md lists %s as not provided, but uproxy provides it", name)
			}
			continue
		}
		us, ok := upShapes[name]
		if !ok {
			missing = append(missing, name)
			continue
		}
		want[name], got[name] = ks, us
	}
	slices.Sort(missing)
	if len(missing) > 0 {
		t.Errorf("kube-proxy's metric families absent from uproxy and not listed in docs/operations.md:\n%s", strings.Join(missing, "\n"))
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("metric families (-kube-proxy +uproxy):\n%s", d)
	}
	for entry := range list {
		if !used[entry] {
			t.Errorf("docs/operations.md lists %s as not provided, but kube-proxy v1.37.2 does not expose it here: remove it", entry)
		}
	}
}
