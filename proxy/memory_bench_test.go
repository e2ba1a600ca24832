package proxy

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/service"
	"github.com/uproxy/uproxy/proxy/source"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
)

// liveHeap returns the bytes of the heap's live objects, after two
// collections (the second frees what the first's finalizers released).
func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// apiObjects returns n Services of one port and their EndpointSlices of
// 10 endpoints each, as the API server lists them to an informer when the
// benchmark harness created them (internal/testkube): with identity,
// managed fields, selector, families and the defaults the API server
// fills in. Each object is built on its own, as decoding makes them.
func apiObjects(n int) ([]*v1.Service, []*discovery.EndpointSlice) {
	created := metav1.NewTime(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
	managed := func(raw string) []metav1.ManagedFieldsEntry {
		return []metav1.ManagedFieldsEntry{{
			Manager: "uproxy-bench", Operation: metav1.ManagedFieldsOperationUpdate, APIVersion: "v1",
			Time: &created, FieldsType: "FieldsV1", FieldsV1: metav1.NewFieldsV1(raw),
		}}
	}
	svcs := make([]*v1.Service, n)
	sls := make([]*discovery.EndpointSlice, n)
	for i := range n {
		name := fmt.Sprintf("scale-%05d", i)
		ip := fmt.Sprintf("10.96.%d.%d", i/250, i%250+1)
		svcs[i] = &v1.Service{
			ObjectMeta: metav1.ObjectMeta{
				Name: name, Namespace: "default", UID: types.UID(fmt.Sprintf("5c6f1a2e-0000-4000-8000-%012d", i)),
				ResourceVersion: fmt.Sprint(1000 + 2*i), CreationTimestamp: created,
				ManagedFields: managed(`{"f:spec":{"f:internalTrafficPolicy":{},"f:ports":{".":{},"k:{\"port\":80,\"protocol\":\"TCP\"}":{".":{},"f:name":{},"f:port":{},"f:protocol":{},"f:targetPort":{}}},"f:selector":{},"f:sessionAffinity":{},"f:type":{}}}`),
			},
			Spec: v1.ServiceSpec{
				Selector:              map[string]string{"app": name},
				Ports:                 []v1.ServicePort{{Name: "http", Protocol: v1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(8080)}},
				ClusterIP:             ip,
				ClusterIPs:            []string{ip},
				Type:                  v1.ServiceTypeClusterIP,
				SessionAffinity:       v1.ServiceAffinityNone,
				IPFamilies:            []v1.IPFamily{v1.IPv4Protocol},
				IPFamilyPolicy:        ptr.To(v1.IPFamilyPolicySingleStack),
				InternalTrafficPolicy: ptr.To(v1.ServiceInternalTrafficPolicyCluster),
			},
		}
		sl := &discovery.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{
				Name: name + "-1", Namespace: "default", UID: types.UID(fmt.Sprintf("7d1e9b3c-0000-4000-8000-%012d", i)),
				ResourceVersion: fmt.Sprint(1001 + 2*i), Generation: 1, CreationTimestamp: created,
				Labels:        map[string]string{service.LabelServiceName: name},
				ManagedFields: managed(`{"f:addressType":{},"f:endpoints":{},"f:metadata":{"f:labels":{".":{},"f:kubernetes.io/service-name":{}}},"f:ports":{}}`),
			},
			AddressType: discovery.AddressTypeIPv4,
			Ports:       []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(v1.ProtocolTCP)}},
		}
		for j := range 10 {
			sl.Endpoints = append(sl.Endpoints, discovery.Endpoint{
				Addresses:  []string{fmt.Sprintf("10.244.%d.%d", (i/25)%256, (i%25)*10+j+1)},
				Conditions: discovery.EndpointConditions{Ready: ptr.To(true)},
			})
		}
		sls[i] = sl
	}
	return svcs, sls
}

// BenchmarkHeld measures the heap that 10,000 services of 10 endpoints
// each hold in a synced Proxier, with metrics on, as uproxy runs:
// the objects as the informers keep them (whole, or trimmed by
// TrimObject), and what a sync builds of them (listeners, snapshots,
// balancers, metric children). The figures are bytes per service.
func BenchmarkHeld(b *testing.B) {
	const n = 10000
	for _, trim := range []bool{false, true} {
		name := "whole"
		if trim {
			name = "trimmed"
		}
		b.Run(name, func(b *testing.B) {
			var objects, model uint64
			for b.Loop() {
				start := liveHeap()
				svcs, sls := apiObjects(n)
				if trim {
					for i := range svcs {
						source.TrimObject(svcs[i])
						source.TrimObject(sls[i])
					}
				}
				held := liveHeap()
				p, _, _ := benchProxier(b, 0)
				p.Tracker().Replace(svcs, sls)
				if err := p.sync(b.Context(), true); err != nil {
					b.Fatal(err)
				}
				synced := liveHeap()
				objects, model = held-start, synced-held
				runtime.KeepAlive(svcs)
				runtime.KeepAlive(sls)
				p.Shutdown(b.Context())
			}
			b.ReportMetric(float64(objects)/n, "objects-B/service")
			b.ReportMetric(float64(model)/n, "model-B/service")
		})
	}
}
