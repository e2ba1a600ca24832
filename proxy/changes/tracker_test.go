package changes

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
)

func names(c Changes) []string {
	var out []string
	for _, s := range c.Services {
		out = append(out, s.Name.String())
	}
	return out
}

func TestTrackerRecordsOnlyChanges(t *testing.T) {
	notified := 0
	tr := NewTracker(nil, func() { notified++ })
	if tr.Synced() {
		t.Fatal("synced before any list")
	}
	tr.OnServiceUpsert(svc("web", "10.96.0.10", "http:80"))
	tr.OnSliceUpsert(slice("web-1", "web", "http", 8080, ep{IP: "10.244.0.1"}))
	tr.OnSliceUpsert(slice("db-1", "db", "", 5432, ep{IP: "10.244.0.2"}))
	tr.SetServicesSynced()
	if tr.Synced() {
		t.Fatal("synced before the slices list")
	}
	tr.SetSlicesSynced()
	if !tr.Synced() {
		t.Fatal("not synced after both lists")
	}
	c := tr.Take(false, nil)
	if diff := cmp.Diff([]string{"default/db", "default/web"}, names(c)); diff != "" {
		t.Errorf("first Take (-want +got):\n%s", diff)
	}
	if c.ServiceChanges != 1 || c.SliceChanges != 2 {
		t.Errorf("counts = %d, %d; want 1, 2", c.ServiceChanges, c.SliceChanges)
	}
	if c.Services[0].Service != nil || len(c.Services[0].Slices) != 1 {
		t.Errorf("db: service %v, %d slices; want nil, 1", c.Services[0].Service, len(c.Services[0].Slices))
	}

	// Same content again: nothing to do, no notification.
	before := notified
	tr.OnServiceUpsert(svc("web", "10.96.0.10", "http:80"))
	tr.OnSliceUpsert(slice("web-1", "web", "http", 8080, ep{IP: "10.244.0.1"}))
	if got := names(tr.Take(false, nil)); len(got) != 0 || notified != before {
		t.Errorf("identical upserts recorded %v (notified %d times)", got, notified-before)
	}

	// A slice moving to another service dirties both.
	tr.OnSliceUpsert(slice("web-1", "api", "http", 8080, ep{IP: "10.244.0.1"}))
	if diff := cmp.Diff([]string{"default/api", "default/web"}, names(tr.Take(false, nil))); diff != "" {
		t.Errorf("relabel (-want +got):\n%s", diff)
	}

	// A full Take lists every service plus the ones the caller still programs.
	gone := types.NamespacedName{Namespace: "x", Name: "gone"}
	if diff := cmp.Diff([]string{"default/web", "x/gone"}, names(tr.Take(true, []types.NamespacedName{gone}))); diff != "" {
		t.Errorf("full Take (-want +got):\n%s", diff)
	}
}

func TestTrackerRejectsInvalidObjectsAlone(t *testing.T) {
	tr := NewTracker(nil, nil)
	good := svc("web", "10.96.0.10", "http:80")
	tr.Replace([]*v1.Service{good, svc("db", "10.96.0.11", "pg:5432")}, []*discovery.EndpointSlice{slice("web-1", "web", "http", 8080, ep{IP: "10.244.0.1"})})
	tr.Take(false, nil)

	// web turns invalid (port 0), and its slice gets a bad IP, while db changes
	// validly: db's change applies, web keeps its last good objects.
	bad := svc("web", "10.96.0.10", "http:0")
	badSlice := slice("web-1", "web", "http", 8080, ep{IP: "10.244.0.300"})
	tr.Replace([]*v1.Service{bad, svc("db", "10.96.0.11", "pg:5433")}, []*discovery.EndpointSlice{badSlice})
	c := tr.Take(false, nil)
	if diff := cmp.Diff([]string{"default/db"}, names(c)); diff != "" {
		t.Errorf("changes (-want +got):\n%s", diff)
	}
	all := tr.Take(true, nil)
	web := all.Services[1]
	if web.Service != good || len(web.Slices) != 1 || web.Slices[0].Endpoints[0].Addresses[0] != "10.244.0.1" {
		t.Errorf("web lost its last good objects: %+v", web)
	}

	// A brand-new invalid object is simply not there.
	tr.OnServiceUpsert(svc("new", "not-an-ip", "a:1"))
	if got := names(tr.Take(false, nil)); len(got) != 0 {
		t.Errorf("invalid new service recorded: %v", got)
	}
}
