package proxy

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/changes"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

// series flattens the families named (without the kubeproxy_ prefix) into
// "name{label=value,...}" keys. A histogram's value is its sample count; a
// timestamp gauge's is 1 when it is within a minute of now, so that the
// result can be compared whole.
func series(t *testing.T, reg *prometheus.Registry, names ...string) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		name := strings.TrimPrefix(mf.GetName(), "kubeproxy_")
		if !slices.Contains(names, name) {
			continue
		}
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, lp := range m.GetLabel() {
				labels = append(labels, lp.GetName()+"="+lp.GetValue())
			}
			key := fmt.Sprintf("%s{%s}", name, strings.Join(labels, ","))
			switch mf.GetType() {
			case dto.MetricType_HISTOGRAM:
				out[key] = float64(m.GetHistogram().GetSampleCount())
			case dto.MetricType_GAUGE:
				v := m.GetGauge().GetValue()
				if strings.HasSuffix(name, "_timestamp_seconds") {
					v = 0
					if time.Since(time.Unix(0, int64(m.GetGauge().GetValue()*1e9))) < time.Minute {
						v = 1
					}
				}
				out[key] = v
			default:
				out[key] = m.GetCounter().GetValue()
			}
		}
	}
	return out
}

// TestKubeProxySyncMetrics checks kube-proxy's sync metrics under its
// labels: one child per IP family in use, the local-policy services
// without local endpoints counted as kube-proxy's iptables proxier counts
// them, and the network programming latency under its slice's family.
func TestKubeProxySyncMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := introspect.NewMetrics(reg)
	m.SetIPFamilies(v1.IPv4Protocol, v1.IPv6Protocol)
	p, rules := startProxier(t, Config{Metrics: m, NodeName: "node-a"})

	onNode := func(node string, s *v1.Service, ip string) []any {
		sl := slice(s.Name+"-1", s.Name, "http", 8080, ep{IP: ip})
		sl.Endpoints[0].NodeName = ptr.To(node)
		return []any{s, sl}
	}
	intLocal := svc("int-local", "10.96.0.1", "http:80")
	intLocal.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal)
	extLocal := svc("ext-local", "10.96.0.2", "http:80")
	extLocal.Spec.ExternalIPs = []string{"192.0.2.10"}
	extLocal.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	localOK := svc("local-ok", "10.96.0.3", "http:80")
	localOK.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal)
	noEndpoints := svc("no-endpoints", "10.96.0.4", "http:80")
	noEndpoints.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal)

	objs := slices.Concat(onNode("node-b", intLocal, "10.244.1.1"), onNode("node-b", extLocal, "10.244.1.2"),
		onNode("node-a", localOK, "10.244.0.3"), []any{noEndpoints})
	var (
		services []*v1.Service
		sl       []*discovery.EndpointSlice
	)
	for _, o := range objs {
		switch o := o.(type) {
		case *v1.Service:
			services = append(services, o)
		case *discovery.EndpointSlice:
			sl = append(sl, o)
		}
	}
	// A change triggered now: observed under its slice's family only.
	sl[0].Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: time.Now().Format(time.RFC3339Nano)}
	p.Tracker().Replace(services, sl)
	rules.port(t, "default/local-ok:http")
	testwait.Until(t, 5*time.Second, "a sync", func() bool { return !p.LastSync().IsZero() })

	got := series(t, reg, "sync_proxy_rules_no_local_endpoints_total", "network_programming_duration_seconds",
		"sync_proxy_rules_last_timestamp_seconds", "sync_proxy_rules_last_queued_timestamp_seconds",
		"sync_proxy_rules_service_changes_pending", "sync_proxy_rules_endpoint_changes_pending")
	want := map[string]float64{
		"sync_proxy_rules_no_local_endpoints_total{ip_family=IPv4,traffic_policy=internal}": 1,
		"sync_proxy_rules_no_local_endpoints_total{ip_family=IPv4,traffic_policy=external}": 1,
		"sync_proxy_rules_no_local_endpoints_total{ip_family=IPv6,traffic_policy=internal}": 0,
		"sync_proxy_rules_no_local_endpoints_total{ip_family=IPv6,traffic_policy=external}": 0,
		"network_programming_duration_seconds{ip_family=IPv4}":                              1,
		"sync_proxy_rules_last_timestamp_seconds{ip_family=IPv4}":                           1,
		"sync_proxy_rules_last_timestamp_seconds{ip_family=IPv6}":                           1,
		"sync_proxy_rules_last_queued_timestamp_seconds{ip_family=IPv4}":                    1,
		"sync_proxy_rules_last_queued_timestamp_seconds{ip_family=IPv6}":                    1,
		"sync_proxy_rules_service_changes_pending{}":                                        0,
		"sync_proxy_rules_endpoint_changes_pending{}":                                       0,
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("metrics (-want +got):\n%s", d)
	}

	// Every sync is either full or partial, in each family.
	durations := series(t, reg, "sync_proxy_rules_duration_seconds", "sync_full_proxy_rules_duration_seconds", "sync_partial_proxy_rules_duration_seconds")
	for _, f := range []string{"IPv4", "IPv6"} {
		all := durations["sync_proxy_rules_duration_seconds{ip_family="+f+"}"]
		split := durations["sync_full_proxy_rules_duration_seconds{ip_family="+f+"}"] + durations["sync_partial_proxy_rules_duration_seconds{ip_family="+f+"}"]
		if all < 1 || split != all {
			t.Errorf("%s: %v syncs, %v of them full or partial: %v", f, all, split, durations)
		}
	}

	// A local endpoint arrives: the service leaves the count.
	sl = slices.Clone(sl)
	sl[0] = sl[0].DeepCopy()
	sl[0].Endpoints[0].NodeName = ptr.To("node-a")
	p.Tracker().Replace(services, sl)
	testwait.Until(t, 5*time.Second, "the internal count to drop", func() bool {
		return series(t, reg, "sync_proxy_rules_no_local_endpoints_total")["sync_proxy_rules_no_local_endpoints_total{ip_family=IPv4,traffic_policy=internal}"] == 0
	})
}

// TestChangesPending checks that the pending gauges count the changes the
// tracker holds until a sync takes them, as kube-proxy's change trackers
// do.
func TestChangesPending(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := introspect.NewMetrics(reg)
	tr := changes.NewTracker(nil, nil)
	m.SetPending(tr.Pending)
	tr.OnServiceUpsert(svc("web", "10.96.0.10", "http:80"))
	tr.OnSliceUpsert(slice("web-1", "web", "http", 8080, ep{IP: "10.244.0.1"}))
	tr.OnSliceUpsert(slice("web-2", "web", "http", 8080, ep{IP: "10.244.0.2"}))
	names := []string{"sync_proxy_rules_service_changes_pending", "sync_proxy_rules_endpoint_changes_pending"}
	want := map[string]float64{"sync_proxy_rules_service_changes_pending{}": 1, "sync_proxy_rules_endpoint_changes_pending{}": 2}
	if d := cmp.Diff(want, series(t, reg, names...)); d != "" {
		t.Errorf("before a sync (-want +got):\n%s", d)
	}
	tr.Take(false, nil)
	want = map[string]float64{"sync_proxy_rules_service_changes_pending{}": 0, "sync_proxy_rules_endpoint_changes_pending{}": 0}
	if d := cmp.Diff(want, series(t, reg, names...)); d != "" {
		t.Errorf("after a sync (-want +got):\n%s", d)
	}
}

// TestKubeProxyBuckets checks the histograms' buckets against kube-proxy
// v1.37.2's (pkg/proxy/metrics/metrics.go): ExponentialBuckets(0.001, 2,
// 15) for the syncs, and component-base's MergeBuckets for the network
// programming latency, which starts with a bucket of 0.
func TestKubeProxyBuckets(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := introspect.NewMetrics(reg)
	m.ObserveSync(time.Now(), time.Now(), true, map[types.NamespacedName][]changes.TriggerTime{{Name: "web"}: {{At: time.Now(), Family: v1.IPv4Protocol}}})
	var sync, programming []float64
	for i := range 15 {
		sync = append(sync, 0.001*float64(int(1)<<i))
	}
	programming = []float64{0, 0.25, 0.5}
	for i := 1; i <= 59; i++ {
		programming = append(programming, float64(i))
	}
	for i := 60; i <= 115; i += 5 {
		programming = append(programming, float64(i))
	}
	for i := 120; i <= 300; i += 30 {
		programming = append(programming, float64(i))
	}
	want := map[string][]float64{
		"kubeproxy_sync_proxy_rules_duration_seconds":      sync,
		"kubeproxy_sync_full_proxy_rules_duration_seconds": sync,
		"kubeproxy_network_programming_duration_seconds":   programming,
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]float64{}
	for _, mf := range mfs {
		if _, ok := want[mf.GetName()]; !ok {
			continue
		}
		for _, b := range mf.GetMetric()[0].GetHistogram().GetBucket() {
			got[mf.GetName()] = append(got[mf.GetName()], b.GetUpperBound())
		}
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("buckets (-want +got):\n%s", d)
	}
}
