package proxy

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
)

// TestSyncLogLine checks the one-line summary every sync logs: services,
// endpoints, rules, rules written and the processes run to write them,
// duration; and that a sync that changed only endpoints says it wrote no
// rules and ran no process.
func TestSyncLogLine(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	a, b := nameBackend(t, "a"), nameBackend(t, "b")
	p, rules := startProxier(t, Config{Config: datapath.Config{Logger: zap.New(core)}})
	web := svc("web", "10.96.0.10", "http:80")
	p.Tracker().Replace([]*v1.Service{web}, slicesFor("web", "http", a, b))
	rules.port(t, "default/web:http")

	type summary struct {
		Services, Endpoints int64
		Rules, RulesWritten int64 // -1: absent
		RuleCommands        int64 // -1: absent
		HasDuration         bool
	}
	last := func() (summary, bool) {
		entries := logs.FilterMessage("synced").All()
		if len(entries) == 0 {
			return summary{}, false
		}
		m := entries[len(entries)-1].ContextMap()
		s := summary{Rules: -1, RulesWritten: -1, RuleCommands: -1}
		s.Services, _ = m["services"].(int64)
		s.Endpoints, _ = m["endpoints"].(int64)
		if v, ok := m["rules"].(int64); ok {
			s.Rules = v
		}
		if v, ok := m["rulesWritten"].(int64); ok {
			s.RulesWritten = v
		}
		if v, ok := m["ruleCommands"].(int64); ok {
			s.RuleCommands = v
		}
		_, s.HasDuration = m["duration"]
		return s, true
	}
	got, ok := last()
	if !ok {
		t.Fatal("no sync summary was logged")
	}
	// recordingRules reports one rule per intercept, all written.
	if diff := cmp.Diff(summary{Services: 1, Endpoints: 2, Rules: 1, RulesWritten: 1, RuleCommands: 1, HasDuration: true}, got); diff != "" {
		t.Errorf("summary of the first sync (-want +got):\n%s", diff)
	}

	n := len(logs.FilterMessage("synced").All())
	p.Tracker().Replace([]*v1.Service{web}, slicesFor("web", "http", a))
	testwait.Until(t, 5*time.Second, "a second sync", func() bool { return len(logs.FilterMessage("synced").All()) > n })
	got, _ = last()
	if diff := cmp.Diff(summary{Services: 1, Endpoints: 1, Rules: -1, RulesWritten: 0, RuleCommands: 0, HasDuration: true}, got); diff != "" {
		t.Errorf("summary of an endpoint-only sync (-want +got):\n%s", diff)
	}
}
