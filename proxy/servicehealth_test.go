package proxy

import (
	"errors"
	"maps"
	"net/netip"
	"syscall"
	"testing"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/datapath"
)

// fakeServiceHealth records what each call was given.
type fakeServiceHealth struct {
	calls []healthCall
	err   error // returned by SyncServices
}

type healthCall struct {
	Ports  map[types.NamespacedName]uint16
	Counts map[types.NamespacedName]int
}

func (f *fakeServiceHealth) SyncServices(ports map[types.NamespacedName]uint16) error {
	f.calls = append(f.calls, healthCall{Ports: maps.Clone(ports)})
	return f.err
}

func (f *fakeServiceHealth) SyncEndpoints(counts map[types.NamespacedName]int) error {
	f.calls[len(f.calls)-1].Counts = maps.Clone(counts)
	return nil
}

var _ ServiceHealthSyncer = (*fakeServiceHealth)(nil)

// TestServiceHealthFollowsChanges checks what the health-check server is
// told, sync after sync: each health-checked service's port and ready
// local endpoints, only when they change (or after a failure, or on a
// full sync), and nothing for a change elsewhere.
func TestServiceHealthFollowsChanges(t *testing.T) {
	hc := &fakeServiceHealth{}
	p := NewProxier(Config{
		Config: datapath.Config{
			OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) { return netip.AddrPort{}, nil },
		},
		SharedListeners: []v1.Protocol{v1.ProtocolTCP},
		LocalAddrs:      func() ([]netip.Addr, error) { return nil, nil },
		Rules:           &recordingRules{},
		NodeName:        "node-a",
		ServiceHealth:   hc,
	})
	t.Cleanup(func() { p.Shutdown(t.Context()) })

	local := svc("local", "10.96.0.13", "http:80")
	local.Spec.Type = v1.ServiceTypeLoadBalancer
	local.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	local.Spec.HealthCheckNodePort = 32000
	local.Spec.Ports[0].NodePort = 30083
	other := svc("other", "10.96.0.14", "http:80")
	onNodes := func(name, svcName string, nodes ...string) *discovery.EndpointSlice {
		var eps []ep
		for i := range nodes {
			eps = append(eps, ep{IP: netip.AddrFrom4([4]byte{10, 244, 0, byte(i + 1)}).String()})
		}
		sl := slice(name, svcName, "http", 8080, eps...)
		for i, n := range nodes {
			sl.Endpoints[i].NodeName = ptr.To(n)
		}
		return sl
	}
	name := types.NamespacedName{Namespace: "default", Name: "local"}
	step := func(what string, full bool, want []healthCall) {
		t.Helper()
		hc.calls = nil
		if err := p.sync(t.Context(), full); err != nil {
			t.Fatalf("%s: sync: %v", what, err)
		}
		if diff := cmp.Diff(want, hc.calls); diff != "" {
			t.Errorf("%s: calls (-want +got):\n%s", what, diff)
		}
	}
	port := func(n int) healthCall {
		return healthCall{Ports: map[types.NamespacedName]uint16{name: 32000}, Counts: map[types.NamespacedName]int{name: n}}
	}

	p.Tracker().Replace([]*v1.Service{local, other}, []*discovery.EndpointSlice{
		onNodes("local-1", "local", "node-a", "node-b"),
		onNodes("other-1", "other", "node-a"),
	})
	step("first sync", true, []healthCall{port(1)})

	p.Tracker().OnSliceUpsert(onNodes("local-1", "local", "node-a", "node-b", "node-a"))
	step("a second local endpoint", false, []healthCall{port(2)})

	p.Tracker().OnSliceUpsert(onNodes("other-1", "other", "node-a", "node-a"))
	step("a change of a service without a health check", false, nil)

	p.Tracker().OnSliceUpsert(onNodes("local-1", "local", "node-a", "node-b", "node-a", "node-b"))
	step("a remote endpoint more: the same count", false, nil)

	step("a full sync", true, []healthCall{port(2)})

	hc.err = errors.New("bind: address already in use")
	p.Tracker().OnSliceUpsert(onNodes("local-1", "local", "node-a"))
	step("a failing SyncServices", false, []healthCall{port(1)})
	hc.err = nil
	step("the retry, with no change", false, []healthCall{port(1)})
	step("no change, no failure", false, nil)

	p.Tracker().OnServiceDelete(local)
	step("the service is gone", false, []healthCall{{Ports: map[types.NamespacedName]uint16{}, Counts: map[types.NamespacedName]int{}}})
}
