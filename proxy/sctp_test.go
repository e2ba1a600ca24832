package proxy

import (
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/service"
)

// TestSCTPPortsIgnoredOneByOne checks that an SCTP port costs a Service
// that port only: the Service and its slices validate, its TCP and UDP
// ports are converted, and one warning per SCTP port names it.
func TestSCTPPortsIgnoredOneByOne(t *testing.T) {
	tests := []struct {
		name      string
		ports     []string // for svc()
		wantPorts []string
		warnings  []string
	}{
		{"no SCTP", []string{"http:80", "dns:53/UDP"}, []string{"default/web:http/TCP", "default/web:dns/UDP"}, nil},
		{"TCP and SCTP", []string{"http:80", "sig:80/SCTP"}, []string{"default/web:http/TCP"},
			[]string{`spec.ports[1] ("sig", 80/SCTP): SCTP is not supported by uproxy; this port is ignored, the service's other ports are proxied`}},
		{"SCTP between TCP and UDP", []string{"http:80", "sig:3868/SCTP", "dns:53/UDP", "m3ua:2905/SCTP"},
			[]string{"default/web:http/TCP", "default/web:dns/UDP"},
			[]string{
				`spec.ports[1] ("sig", 3868/SCTP): SCTP is not supported by uproxy; this port is ignored, the service's other ports are proxied`,
				`spec.ports[3] ("m3ua", 2905/SCTP): SCTP is not supported by uproxy; this port is ignored, the service's other ports are proxied`,
			}},
		{"only SCTP", []string{"sig:3868/SCTP"}, []string{},
			[]string{`spec.ports[0] ("sig", 3868/SCTP): SCTP is not supported by uproxy; this port is ignored, the service's other ports are proxied`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := svc("web", "10.96.0.10", tt.ports...)
			if err := service.ValidateService(s); err != nil {
				t.Fatalf("ValidateService() = %v, want nil", err)
			}
			got := []string{}
			for _, sp := range service.Ports(s, service.Defaults{}) {
				got = append(got, fmt.Sprintf("%s/%s", sp.Name, sp.Name.Protocol))
			}
			if diff := cmp.Diff(tt.wantPorts, got); diff != "" {
				t.Errorf("service.Ports() (-want +got):\n%s", diff)
			}
			var warnings []string
			for _, w := range service.Warnings(s) {
				warnings = append(warnings, w.Error())
			}
			if diff := cmp.Diff(tt.warnings, warnings); diff != "" {
				t.Errorf("service.Warnings() (-want +got):\n%s", diff)
			}
		})
	}

	// A slice with an SCTP port is valid too: its TCP port still has
	// endpoints.
	sl := slice("web-abc", "web", "http", 8080, ep{IP: "10.244.0.11"})
	sl.Ports = append(sl.Ports, discovery.EndpointPort{Name: ptr.To("sig"), Port: ptr.To[int32](3868), Protocol: ptr.To(v1.ProtocolSCTP)})
	if err := service.ValidateSlice(sl); err != nil {
		t.Errorf("ValidateSlice() of a slice with an SCTP port = %v, want nil", err)
	}
}

// TestSCTPPortLeavesTCPPortProxied checks, through the proxier, that a
// Service with TCP and SCTP ports keeps serving its TCP port, and that
// the SCTP port is logged once with the object's name.
func TestSCTPPortLeavesTCPPortProxied(t *testing.T) {
	be, _ := holdingBackend(t)
	core, logs := observer.New(zap.WarnLevel)
	p, rules := startProxier(t, Config{Config: datapath.Config{Logger: zap.New(core)}, Sync: changes.RunnerConfig{MaxInterval: 20 * time.Millisecond}})
	s := svc("web", "10.96.0.10", "http:80", "sig:3868/SCTP")
	p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", be))
	port := rules.port(t, "default/web:http")
	c, err := open(t, "tcp4", port)
	if err != nil {
		t.Fatalf("the TCP port of a service with an SCTP port does not work: %v", err)
	}
	c.Close()
	testwait.Never(t, 100*time.Millisecond, "the periodic resyncs repeated the warning", func() bool {
		return logs.FilterMessageSnippet("ignoring part of a service").Len() > 1
	})
	var got []string
	for _, e := range logs.FilterMessageSnippet("ignoring part of a service").All() {
		m := e.ContextMap()
		got = append(got, fmt.Sprintf("%v %v", m["object"], m["error"]))
	}
	want := []string{`default/web spec.ports[1] ("sig", 3868/SCTP): SCTP is not supported by uproxy; this port is ignored, the service's other ports are proxied`}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("warnings (-want +got):\n%s", diff)
	}
	if rules.has("default/web:sig") {
		t.Errorf("an intercept for the SCTP port")
	}
}
