package proxy

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/introspect"
	"github.com/uproxy/uproxy/proxy/listeners"
)

// interceptedPorts counts the service ports of Service name ("aaa/big")
// that the last rules write intercepts.
func (r *recordingRules) interceptedPorts(name string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := map[string]bool{}
	for _, i := range r.last {
		if s := i.Service.String(); strings.HasPrefix(s, name+":") {
			seen[s] = true
		}
	}
	return len(seen)
}

// TestOneServiceCannotTakeEveryListener checks that a Service of 40
// ports, in a namespace that comes first, no longer takes every port of
// a 32-port range from zzz/web, which then had no listener and no rule:
// the default quota stops it at half of the range, and without quotas
// the first sync opens the Services' listeners in rounds, so that zzz/web
// still gets its first. The refused ports are said once per sync, with
// the Service and what to do, and counted; the listeners a Service holds
// are never taken back for a Service that arrives later.
func TestOneServiceCannotTakeEveryListener(t *testing.T) {
	const size, bigPorts = 32, 40
	tests := []struct {
		name                     string
		perService, perNamespace int
		wantBig                  int    // listeners of aaa/big
		wantLine                 string // in the line that says the refusal
		lateGets                 bool   // whether a Service that comes later gets a listener
	}{
		{"the default quotas", 0, 0, size / 2, "for their Service (--max-listeners-per-service)", true},
		{"no quotas", -1, -1, size - 1, "every port of --proxy-port-range is taken", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			base := freePortRange(t, size)
			be := nameBackend(t, "a")
			reg := prometheus.NewRegistry()
			core, logs := observer.New(zap.ErrorLevel)
			p, rules := startProxier(t, Config{
				Config:                 datapath.Config{Logger: zap.New(core)},
				Metrics:                introspect.NewMetrics(reg),
				PortRange:              listeners.PortRange{Base: base, Size: size},
				MaxListenersPerService: tt.perService, MaxListenersPerNamespace: tt.perNamespace,
			})
			var ports []string
			for i := range bigPorts {
				ports = append(ports, fmt.Sprintf("p%02d:%d", i, 1000+i))
			}
			big := svc("big", "10.96.0.10", ports...)
			big.Namespace = "aaa"
			inZZZ := func(s *v1.Service) *v1.Service { s.Namespace = "zzz"; return s }
			web := inZZZ(svc("web", "10.96.0.11", "http:80"))
			var eps []*discovery.EndpointSlice
			for _, name := range []string{"web", "late"} {
				for _, s := range slicesFor(name, "http", be) {
					s.Namespace = "zzz"
					eps = append(eps, s)
				}
			}
			p.Tracker().Replace([]*v1.Service{big, web}, eps)
			if got, err := get(t, rules.port(t, "zzz/web:http")); err != nil || got != "a" {
				t.Errorf("zzz/web answered %q, %v; want a", got, err)
			}
			if got := rules.interceptedPorts("aaa/big"); got != tt.wantBig {
				t.Errorf("aaa/big has %d intercepted ports, want %d", got, tt.wantBig)
			}
			without := func() float64 {
				return series(t, reg, "uproxy_service_ports_without_listener")["uproxy_service_ports_without_listener{ip_family=IPv4}"]
			}
			testwait.Until(t, 5*time.Second, "the ports without a listener are counted", func() bool { return without() == float64(bigPorts-tt.wantBig) })
			testwait.Until(t, 5*time.Second, "a line says the refusal", func() bool { return logs.FilterMessageSnippet(tt.wantLine).Len() > 0 })
			line := logs.FilterMessageSnippet(tt.wantLine).All()[0]
			if !strings.Contains(line.Message, "--listener=shared") {
				t.Errorf("the line %q does not suggest --listener=shared", line.Message)
			}
			if got := fmt.Sprint(line.ContextMap()["services"]); got != "[aaa/big]" {
				t.Errorf("the line names the Services %s, want [aaa/big]", got)
			}
			if got := line.ContextMap()["servicePorts"]; got != int64(bigPorts-tt.wantBig) {
				t.Errorf("the line counts %v service ports, want %d", got, bigPorts-tt.wantBig)
			}
			if n := logs.FilterMessage("cannot open listener; will retry").Len(); n > 0 {
				t.Errorf("%d lines name a refused port each; want one line per sync", n)
			}

			late := inZZZ(svc("late", "10.96.0.12", "http:80"))
			p.Tracker().Replace([]*v1.Service{big, web, late}, eps)
			if tt.lateGets {
				rules.port(t, "zzz/late:http")
			} else {
				testwait.Never(t, 200*time.Millisecond, "zzz/late took a listener from aaa/big", func() bool { return rules.has("zzz/late:http") })
			}
			if got := rules.interceptedPorts("aaa/big"); got != tt.wantBig {
				t.Errorf("after zzz/late came, aaa/big has %d intercepted ports, want the %d it had", got, tt.wantBig)
			}
		})
	}
}
