package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/uproxy/uproxy/internal/promtest"
	"github.com/uproxy/uproxy/internal/testwait"
)

const metricsAddr = "127.0.0.1:10249"

// debugAddr is the default --debug-bind-address.
const debugAddr = defaultDebugAddress

// scrapeMetrics curls uproxy's /metrics inside the node namespace and
// parses the exposition.
func (c *cluster) scrapeMetrics() map[string]*dto.MetricFamily {
	c.t.Helper()
	out, err := c.lab.Exec(context.Background(), c.lab.Node, "curl", "-sS", "--max-time", "5", "http://"+metricsAddr+"/metrics")
	if err != nil {
		c.t.Fatal(err)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(out))
	if err != nil {
		c.t.Fatalf("parsing /metrics: %v\n%s", err, out)
	}
	return mfs
}

func TestE2EMetrics(t *testing.T) {
	c := newCluster(t, 2)
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
	// No periodic full sync: the endpoint change below must be the only
	// sync that could run a process.
	c.start(1, "--metrics-bind-address", metricsAddr, "--iptables-sync-period=1h")
	c.waitSynced()
	if r := c.get(c.client.NS, "http://10.96.0.10/", 10); r.Errors > 0 {
		t.Fatalf("requests failed: %v", r)
	}
	// An endpoint change triggered now, as the EndpointSlice controller
	// would annotate it: uproxy observes its network programming latency.
	c.write("api.yaml", strings.Replace(serviceYAML("api", "10.96.0.20", 80, nil, false, c.pods[0]),
		"  name: api-x\n", fmt.Sprintf("  name: api-x\n  annotations: {endpoints.kubernetes.io/last-change-trigger-time: %q}\n", time.Now().UTC().Format(time.RFC3339Nano)), 1))
	c.waitRules("api's rule", func(s string) bool { return strings.Contains(s, "10.96.0.20/32") })

	var mfs map[string]*dto.MetricFamily
	testwait.UntilOK(t, 10*time.Second, "10 connections and a network programming latency counted", func() (bool, string) {
		mfs = c.scrapeMetrics()
		ok, _ := promtest.Sum(mfs["uproxy_connections_total"], map[string]string{"service": "default/web", "port": "http", "result": "ok"})
		prog, _ := promtest.Sum(mfs["kubeproxy_network_programming_duration_seconds"], nil)
		return ok == 10 && prog >= 1, fmt.Sprintf("connections ok = %v, network programming observations = %v", ok, prog)
	})
	for name, typ := range map[string]dto.MetricType{
		"kubeproxy_sync_proxy_rules_duration_seconds":       dto.MetricType_HISTOGRAM,
		"kubeproxy_sync_proxy_rules_last_timestamp_seconds": dto.MetricType_GAUGE,
		"kubeproxy_network_programming_duration_seconds":    dto.MetricType_HISTOGRAM,
		"kubeproxy_sync_proxy_rules_endpoint_changes_total": dto.MetricType_COUNTER,
		"kubeproxy_sync_proxy_rules_service_changes_total":  dto.MetricType_COUNTER,
		"uproxy_connections_total":                          dto.MetricType_COUNTER,
		"uproxy_active_connections":                         dto.MetricType_GAUGE,
		"uproxy_bytes_total":                                dto.MetricType_COUNTER,
		"uproxy_dial_duration_seconds":                      dto.MetricType_HISTOGRAM,
		"uproxy_dial_errors_total":                          dto.MetricType_COUNTER,
		"uproxy_udp_flows_active":                           dto.MetricType_GAUGE,
		"uproxy_udp_flows_evicted_total":                    dto.MetricType_COUNTER,
		"uproxy_connections_over_max_total":                 dto.MetricType_COUNTER,
		"uproxy_balancer_picks_total":                       dto.MetricType_COUNTER,
		"uproxy_rule_commands_total":                        dto.MetricType_COUNTER,
		"uproxy_conntrack_entries_deleted_total":            dto.MetricType_COUNTER,
		"go_goroutines":                                     dto.MetricType_GAUGE,
		"process_open_fds":                                  dto.MetricType_GAUGE,
	} {
		mf := mfs[name]
		if mf == nil {
			t.Errorf("/metrics lacks %s", name)
			continue
		}
		if mf.GetType() != typ {
			t.Errorf("%s is a %v, want a %v", name, mf.GetType(), typ)
		}
	}
	if v, _ := promtest.Sum(mfs["kubeproxy_sync_proxy_rules_last_timestamp_seconds"], nil); time.Since(time.Unix(int64(v), 0)) > time.Minute {
		t.Errorf("last sync timestamp %v is not recent", v)
	}
	for _, p := range c.pods {
		if v, _ := promtest.Sum(mfs["uproxy_balancer_picks_total"], map[string]string{"service": "default/web", "backend": p.IP.String() + ":8080"}); v != 5 {
			t.Errorf("picks of %s = %v, want 5 (round-robin over two)", p.IP, v)
		}
	}
	if v, _ := promtest.Sum(mfs["uproxy_bytes_total"], map[string]string{"service": "default/web", "direction": "upstream"}); v == 0 {
		t.Error("no upstream bytes counted")
	}
	// No client addresses in any label.
	for name, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if strings.Contains(lp.GetValue(), c.client.IP.String()) {
					t.Errorf("%s has the client's address in label %s", name, lp.GetName())
				}
			}
		}
	}

	// The syncs so far ran iptables-restore; an endpoint change runs
	// nothing, though its sync must still end.
	if v, _ := promtest.Sum(mfs["uproxy_rule_commands_total"], map[string]string{"command": "iptables-restore"}); v == 0 {
		t.Error("no iptables-restore counted in uproxy_rule_commands_total")
	}
	commands, _ := promtest.Sum(mfs["uproxy_rule_commands_total"], nil)
	changes, _ := promtest.Sum(mfs["kubeproxy_sync_proxy_rules_endpoint_changes_total"], nil)
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods[0]))
	testwait.Until(t, 10*time.Second, "the endpoint change counted", func() bool {
		v, _ := promtest.Sum(c.scrapeMetrics()["kubeproxy_sync_proxy_rules_endpoint_changes_total"], nil)
		return v > changes
	})
	// Every request now reaches the one endpoint left, so the change's
	// sync has ended.
	testwait.UntilOK(t, 10*time.Second, "traffic to follow the endpoint change", func() (bool, string) {
		r := c.get(c.client.NS, "http://10.96.0.10/", 4)
		return r.Errors == 0 && r.Counts[c.pods[0].Name] == 4, fmt.Sprintf("%+v", r)
	})
	if v, _ := promtest.Sum(c.scrapeMetrics()["uproxy_rule_commands_total"], nil); v != commands {
		t.Errorf("uproxy_rule_commands_total went from %v to %v on an endpoint change, want no process run", commands, v)
	}
}
