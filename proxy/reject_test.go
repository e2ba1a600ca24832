package proxy

import (
	"fmt"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/uproxy/uproxy/proxy/changes"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// TestTrackerOnReject checks that every object the tracker rejects is
// handed to OnReject with its reason, and valid ones are not.
func TestTrackerOnReject(t *testing.T) {
	badService := svc("bad", "10.96.0.1", "http:0")
	noPort := slice("web-1", "web", "http", 8080, ep{IP: "10.244.0.1"})
	noPort.Ports[0].Port = nil
	tests := []struct {
		name   string
		record func(*changes.Tracker)
		want   []string
	}{
		{"valid objects", func(tr *changes.Tracker) {
			tr.OnServiceUpsert(svc("web", "10.96.0.10", "http:80"))
			tr.OnSliceUpsert(slice("web-1", "web", "http", 8080, ep{IP: "10.244.0.1"}))
		}, nil},
		{"a Service", func(tr *changes.Tracker) { tr.OnServiceUpsert(badService) },
			[]string{"Service default/bad: spec.ports[0].port: 0 is not in 1-65535"}},
		{"an EndpointSlice", func(tr *changes.Tracker) { tr.OnSliceUpsert(noPort) },
			[]string{"EndpointSlice default/web-1: ports[0].port: missing"}},
		{"through Replace", func(tr *changes.Tracker) { tr.Replace([]*v1.Service{badService}, []*discovery.EndpointSlice{noPort}) },
			[]string{"Service default/bad: spec.ports[0].port: 0 is not in 1-65535", "EndpointSlice default/web-1: ports[0].port: missing"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := changes.NewTracker(nil, nil)
			var got []string
			tr.OnReject = func(obj runtime.Object, err error) {
				switch o := obj.(type) {
				case *v1.Service:
					got = append(got, fmt.Sprintf("Service %s/%s: %v", o.Namespace, o.Name, err))
				case *discovery.EndpointSlice:
					got = append(got, fmt.Sprintf("EndpointSlice %s/%s: %v", o.Namespace, o.Name, err))
				default:
					got = append(got, fmt.Sprintf("%T: %v", obj, err))
				}
			}
			tt.record(tr)
			if d := cmp.Diff(tt.want, got); d != "" {
				t.Errorf("rejections (-want +got):\n%s", d)
			}
		})
	}
}
