package source

import (
	"fmt"
	"maps"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/reference"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/randfill"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/healthcheck"
	"github.com/uproxy/uproxy/proxy/service"
)

// The fixtures below start from objects whose every field randfill has
// set, then give the fields uproxy reads valid values. A field that some
// code reads but the trim drops thus differs between an object and its
// trimmed copy: a read field that the fixtures forget keeps its random
// value, and the reading of the trimmed copy (where it is zero) differs.

// filledService is a LoadBalancer Service with every field set: two
// families, three ports (one SCTP), external IPs, source ranges, ClientIP
// affinity, both traffic policies Local, ingress of each kind, and every
// uproxy annotation.
func filledService(seed int64) *v1.Service {
	svc := &v1.Service{}
	randfill.NewWithSeed(seed).NilChance(0).NumElements(2, 3).Fill(svc)
	svc.TypeMeta = metav1.TypeMeta{} // as the informers deliver them
	svc.Name, svc.Namespace = "web", "shop"
	svc.Annotations[service.AnnotationBalancer] = string(balancer.WeightedLeastConn)
	svc.Annotations[service.AnnotationWeights] = "10.244.0.11=3, 10.244.0.12=1"
	svc.Annotations[service.AnnotationPreserveSourceIP] = "true"
	svc.Annotations[service.AnnotationProxyProtocol] = "v2"
	svc.Annotations[service.AnnotationMaxConnections] = "100"
	svc.Annotations[service.AnnotationMaxConnectionsPerEndpoint] = "ten" // a warning
	s := &svc.Spec
	s.Type = v1.ServiceTypeLoadBalancer
	s.ClusterIP, s.ClusterIPs = "10.96.0.10", []string{"10.96.0.10", "2001:db8::10"}
	ports := []struct {
		name  string
		proto v1.Protocol
		port  int32
	}{{"http", v1.ProtocolTCP, 80}, {"dns", v1.ProtocolUDP, 53}, {"assoc", v1.ProtocolSCTP, 9}}
	s.Ports = make([]v1.ServicePort, len(ports))
	for i, p := range ports {
		randfill.NewWithSeed(seed + int64(i)).NilChance(0).Fill(&s.Ports[i])
		s.Ports[i].Name, s.Ports[i].Protocol, s.Ports[i].Port = p.name, p.proto, p.port
		s.Ports[i].TargetPort = intstr.FromInt32(8000 + int32(i))
		s.Ports[i].NodePort = 30080 + int32(i)
	}
	s.ExternalIPs = []string{"192.0.2.10", "2001:db8::a"}
	s.LoadBalancerSourceRanges = []string{"192.0.2.0/25", " 2001:db8:1::/48 "}
	s.SessionAffinity = v1.ServiceAffinityClientIP
	s.SessionAffinityConfig.ClientIP.TimeoutSeconds = ptr.To[int32](600)
	s.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	s.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal)
	s.HealthCheckNodePort = 31000
	ing := svc.Status.LoadBalancer.Ingress
	ing = append(ing[:0], ing[0], ing[0], ing[0]) // three, each fully set
	ing[0].IP, ing[0].IPMode = "192.0.2.20", ptr.To(v1.LoadBalancerIPModeVIP)
	ing[1].IP, ing[1].IPMode = "192.0.2.21", ptr.To(v1.LoadBalancerIPModeProxy)
	ing[2].IP, ing[2].IPMode = "", nil
	svc.Status.LoadBalancer.Ingress = ing
	return svc
}

// filledSlice is an EndpointSlice of the "web" Service with every field
// set: three endpoints of family, with every condition, topology and hint.
func filledSlice(seed int64, name string, family discovery.AddressType) *discovery.EndpointSlice {
	sl := &discovery.EndpointSlice{}
	randfill.NewWithSeed(seed).NilChance(0).NumElements(2, 3).Fill(sl)
	sl.TypeMeta = metav1.TypeMeta{}
	sl.Name, sl.Namespace = name, "shop"
	sl.Labels[service.LabelServiceName] = "web"
	sl.Annotations[v1.EndpointsLastChangeTriggerTime] = time.Now().Add(time.Hour).UTC().Format(time.RFC3339Nano)
	sl.AddressType = family
	sl.Ports = sl.Ports[:2]
	sl.Ports[0].Name, sl.Ports[0].Protocol, sl.Ports[0].Port = ptr.To("http"), ptr.To(v1.ProtocolTCP), ptr.To[int32](8080)
	sl.Ports[1].Name, sl.Ports[1].Protocol, sl.Ports[1].Port = ptr.To("dns"), ptr.To(v1.ProtocolUDP), ptr.To[int32](5353)
	sl.Endpoints = append(sl.Endpoints[:0], sl.Endpoints[0], sl.Endpoints[0], sl.Endpoints[0])
	for i := range sl.Endpoints {
		e := &sl.Endpoints[i]
		randfill.NewWithSeed(seed+int64(i)).NilChance(0).NumElements(1, 2).Fill(e)
		ip := fmt.Sprintf("10.244.0.%d", 11+i)
		if family == discovery.AddressTypeIPv6 {
			ip = fmt.Sprintf("2001:db8:244::%d", 11+i)
		}
		e.Addresses = []string{ip}
		e.Conditions = discovery.EndpointConditions{Ready: ptr.To(i != 1), Serving: ptr.To(i != 2), Terminating: ptr.To(i == 2)}
		e.NodeName, e.Zone = ptr.To(fmt.Sprintf("node-%d", i)), ptr.To(fmt.Sprintf("zone-%d", i%2))
		e.Hints = &discovery.EndpointHints{
			ForZones: []discovery.ForZone{{Name: fmt.Sprintf("zone-%d", i)}},
			ForNodes: []discovery.ForNode{{Name: fmt.Sprintf("node-%d", i)}},
		}
	}
	return sl
}

func filledSlices(seed int64) []*discovery.EndpointSlice {
	return []*discovery.EndpointSlice{
		filledSlice(seed, "web-a", discovery.AddressTypeIPv4),
		filledSlice(seed+10, "web-b", discovery.AddressTypeIPv6),
	}
}

// filledNode is a Node with every field set, a zone and a taint.
func filledNode(seed int64) *v1.Node {
	n := &v1.Node{}
	randfill.NewWithSeed(seed).NilChance(0).NumElements(2, 3).Fill(n)
	n.TypeMeta = metav1.TypeMeta{}
	n.Labels[v1.LabelTopologyZone] = "zone-1"
	n.DeletionTimestamp = nil
	n.Spec.Taints[0].Key = healthcheck.ToBeDeletedTaint
	return n
}

// reading is everything uproxy reads of a Service and its slices: what
// ValidateService, service.Warnings, service.Ports, PortEndpoints,
// ValidateSlice and the tracker's index and trigger times make of them,
// and the references that an Event on each would carry.
type reading struct {
	Skip      string
	Invalid   string
	Warnings  []string
	Ports     []*service.Port
	Endpoints [][]service.Endpoint // per port
	Ref       string
	Slices    []sliceReading
}

type sliceReading struct {
	Key     types.NamespacedName
	Invalid string
	Service types.NamespacedName
	Trigger time.Time
	Family  v1.IPFamily
	Ref     string
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func readAll(svc *v1.Service, sls []*discovery.EndpointSlice) reading {
	r := reading{Skip: service.SkipReason(svc), Invalid: errString(service.ValidateService(svc))}
	for _, err := range service.Warnings(svc) {
		r.Warnings = append(r.Warnings, err.Error())
	}
	ref, err := reference.GetReference(scheme.Scheme, svc)
	r.Ref = fmt.Sprintf("%+v %v", ref, err)
	if r.Invalid == "" {
		r.Ports = service.Ports(svc, service.Defaults{Balancer: balancer.SourceHash})
	}
	for _, sp := range r.Ports {
		r.Endpoints = append(r.Endpoints, service.PortEndpoints(sp, sls))
	}
	for _, sl := range sls {
		ref, err := reference.GetReference(scheme.Scheme, sl)
		r.Slices = append(r.Slices, sliceReading{
			Key: service.NameOf(sl.Namespace, sl.Name), Invalid: errString(service.ValidateSlice(sl)), Service: service.SliceService(sl),
			Trigger: service.SliceTriggerTime(sl), Family: service.SliceFamily(sl), Ref: fmt.Sprintf("%+v %v", ref, err),
		})
	}
	return r
}

var readingOpts = cmp.Options{
	cmp.Comparer(func(a, b netip.Addr) bool { return a == b }),
	cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b }),
	cmp.Comparer(func(a, b netip.Prefix) bool { return a == b }),
}

func trimmedCopy(svc *v1.Service, sls []*discovery.EndpointSlice) (*v1.Service, []*discovery.EndpointSlice) {
	tsvc := svc.DeepCopy()
	if _, err := TrimObject(tsvc); err != nil {
		panic(err)
	}
	var tsls []*discovery.EndpointSlice
	for _, sl := range sls {
		c := sl.DeepCopy()
		if _, err := TrimObject(c); err != nil {
			panic(err)
		}
		tsls = append(tsls, c)
	}
	return tsvc, tsls
}

// shapes turn the filled LoadBalancer Service into the other kinds of
// Service, so that every branch of the conversion reads its fields.
var shapes = map[string]func(*v1.Service){
	"load balancer": func(*v1.Service) {},
	"node port":     func(s *v1.Service) { s.Spec.Type = v1.ServiceTypeNodePort },
	"cluster IP": func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeClusterIP
		s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyCluster
	},
	"default affinity": func(s *v1.Service) { s.Spec.SessionAffinityConfig = nil },
	"single stack":     func(s *v1.Service) { s.Spec.ClusterIPs = nil },
	"external name":    func(s *v1.Service) { s.Spec.Type = v1.ServiceTypeExternalName },
	"headless":         func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = v1.ClusterIPNone, nil },
	"other proxy":      func(s *v1.Service) { s.Labels[service.LabelServiceProxyName] = "" },
	"invalid weights":  func(s *v1.Service) { s.Annotations[service.AnnotationWeights] = "10.244.0.11" },
	"headless slices":  func(*v1.Service) {},
}

// TestTrimKeepsWhatIsRead checks that a trimmed object reads exactly as
// the whole one: the same validation, warnings, service ports, endpoints,
// slice index, trigger times and event references.
func TestTrimKeepsWhatIsRead(t *testing.T) {
	for name, shape := range shapes {
		for seed := int64(1); seed <= 20; seed++ {
			svc, sls := filledService(seed), filledSlices(seed)
			shape(svc)
			if name == "headless slices" {
				sls[1].Labels[service.LabelHeadless] = ""
			}
			want := readAll(svc, sls)
			if name == "load balancer" && (want.Invalid != "" || len(want.Ports) != 2 || len(want.Endpoints[0]) != 6 || len(want.Warnings) != 2) {
				t.Fatalf("the filled Service does not read as intended: %+v", want)
			}
			tsvc, tsls := trimmedCopy(svc, sls)
			if diff := cmp.Diff(want, readAll(tsvc, tsls), readingOpts); diff != "" {
				t.Errorf("%s, seed %d: the trimmed objects read differently (-whole +trimmed):\n%s", name, seed, diff)
			}
		}
	}
}

// TestTrimKeepsNode checks what the health check and the zone read of
// the Node survive its trim.
func TestTrimKeepsNode(t *testing.T) {
	read := func(n *v1.Node) string {
		h := healthcheck.NewProxyHealth(healthcheck.ProxyHealthConfig{WaitForNode: true})
		h.SyncNode(n)
		return fmt.Sprintf("eligible %v zone %q", h.NodeEligible(), n.Labels[v1.LabelTopologyZone])
	}
	for seed := int64(1); seed <= 20; seed++ {
		for _, deleted := range []bool{false, true} {
			for _, tainted := range []bool{false, true} {
				n := filledNode(seed)
				if deleted {
					n.DeletionTimestamp = &metav1.Time{Time: time.Now()}
				}
				if !tainted {
					n.Spec.Taints = n.Spec.Taints[1:]
				}
				want := read(n)
				c := n.DeepCopy()
				TrimObject(c)
				if got := read(c); got != want {
					t.Errorf("seed %d, deleted %v, tainted %v: the trimmed Node reads %s, the whole one %s", seed, deleted, tainted, got, want)
				}
			}
		}
	}
}

// TestTrimSeesEveryReadField changes one read field at a time: the change
// must show in the reading (else the field is not read and the case
// proves nothing), survive the trim, and, for the fields the tracker
// compares, make the tracker record a change between the trimmed
// versions.
func TestTrimSeesEveryReadField(t *testing.T) {
	type objs struct {
		svc *v1.Service
		sls []*discovery.EndpointSlice
	}
	tests := []struct {
		name string
		// compared: the tracker records a change of this field to a
		// valid value (the identity and the trigger time are read, not
		// compared).
		compared bool
		change   func(o objs)
	}{
		{"metadata.uid", false, func(o objs) { o.svc.UID = "other" }},
		{"metadata.resourceVersion", false, func(o objs) { o.svc.ResourceVersion = "other" }},
		{"label service-proxy-name", true, func(o objs) { o.svc.Labels[service.LabelServiceProxyName] = "other" }},
		{"annotation balancer", true, func(o objs) { o.svc.Annotations[service.AnnotationBalancer] = string(balancer.RoundRobin) }},
		{"annotation weights", true, func(o objs) { o.svc.Annotations[service.AnnotationWeights] = "10.244.0.11=2" }},
		{"annotation preserve-source-ip", true, func(o objs) {
			o.svc.Annotations[service.AnnotationPreserveSourceIP] = "false"
		}},
		{"annotation proxy-protocol", true, func(o objs) { o.svc.Annotations[service.AnnotationProxyProtocol] = "v1" }},
		{"annotation max-connections", true, func(o objs) { o.svc.Annotations[service.AnnotationMaxConnections] = "7" }},
		{"annotation max-connections-per-endpoint", true, func(o objs) {
			o.svc.Annotations[service.AnnotationMaxConnectionsPerEndpoint] = "7"
		}},
		{"spec.type", true, func(o objs) { o.svc.Spec.Type = v1.ServiceTypeNodePort }},
		{"spec.clusterIP", true, func(o objs) { o.svc.Spec.ClusterIP = "10.96.0.11" }},
		{"spec.clusterIPs", true, func(o objs) { o.svc.Spec.ClusterIPs = o.svc.Spec.ClusterIPs[:1] }},
		{"spec.ports[].name", true, func(o objs) { o.svc.Spec.Ports[0].Name = "web" }},
		{"spec.ports[].protocol", true, func(o objs) { o.svc.Spec.Ports[2].Protocol = v1.ProtocolTCP }},
		{"spec.ports[].port", true, func(o objs) { o.svc.Spec.Ports[0].Port = 81 }},
		{"spec.ports[].targetPort", true, func(o objs) { o.svc.Spec.Ports[0].TargetPort = intstr.FromInt32(-1) }},
		{"spec.ports[].nodePort", true, func(o objs) { o.svc.Spec.Ports[0].NodePort = 30090 }},
		{"spec.externalIPs", true, func(o objs) { o.svc.Spec.ExternalIPs = o.svc.Spec.ExternalIPs[:1] }},
		{"spec.loadBalancerSourceRanges", true, func(o objs) { o.svc.Spec.LoadBalancerSourceRanges = nil }},
		{"spec.sessionAffinity", true, func(o objs) { o.svc.Spec.SessionAffinity = v1.ServiceAffinityNone }},
		{"spec.sessionAffinityConfig", true, func(o objs) {
			o.svc.Spec.SessionAffinityConfig.ClientIP.TimeoutSeconds = ptr.To[int32](60)
		}},
		{"spec.externalTrafficPolicy", true, func(o objs) {
			o.svc.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyCluster
		}},
		{"spec.internalTrafficPolicy", true, func(o objs) { o.svc.Spec.InternalTrafficPolicy = nil }},
		{"spec.healthCheckNodePort", true, func(o objs) { o.svc.Spec.HealthCheckNodePort = 31001 }},
		{"status.loadBalancer.ingress[].ip", true, func(o objs) {
			o.svc.Status.LoadBalancer.Ingress[0].IP = "192.0.2.22"
		}},
		{"status.loadBalancer.ingress[].ipMode", true, func(o objs) {
			o.svc.Status.LoadBalancer.Ingress[1].IPMode = nil
		}},
		{"slice metadata.uid", false, func(o objs) { o.sls[0].UID = "other" }},
		{"slice label service-name", true, func(o objs) { o.sls[1].Labels[service.LabelServiceName] = "other" }},
		{"slice label headless", true, func(o objs) { o.sls[1].Labels[service.LabelHeadless] = "" }},
		{"slice annotation last-change-trigger-time", false, func(o objs) {
			o.sls[0].Annotations[v1.EndpointsLastChangeTriggerTime] = time.Now().Add(2 * time.Hour).UTC().Format(time.RFC3339Nano)
		}},
		{"slice addressType", true, func(o objs) { o.sls[0].AddressType = discovery.AddressTypeFQDN }},
		{"slice ports[].name", true, func(o objs) { o.sls[0].Ports[0].Name = ptr.To("web") }},
		{"slice ports[].protocol", true, func(o objs) { o.sls[0].Ports[1].Protocol = ptr.To(v1.ProtocolTCP) }},
		{"slice ports[].port", true, func(o objs) { o.sls[0].Ports[0].Port = ptr.To[int32](8081) }},
		{"slice endpoints[].addresses", true, func(o objs) { o.sls[0].Endpoints[0].Addresses[0] = "10.244.0.99" }},
		{"slice endpoints[].conditions.ready", true, func(o objs) { o.sls[0].Endpoints[0].Conditions.Ready = nil }},
		{"slice endpoints[].conditions.serving", true, func(o objs) {
			o.sls[0].Endpoints[0].Conditions.Serving = ptr.To(false)
		}},
		{"slice endpoints[].conditions.terminating", true, func(o objs) {
			o.sls[0].Endpoints[0].Conditions.Terminating = ptr.To(true)
		}},
		{"slice endpoints[].nodeName", true, func(o objs) { o.sls[0].Endpoints[0].NodeName = ptr.To("other") }},
		{"slice endpoints[].zone", true, func(o objs) { o.sls[0].Endpoints[0].Zone = ptr.To("other") }},
		{"slice endpoints[].hints.forZones", true, func(o objs) { o.sls[0].Endpoints[0].Hints.ForZones = nil }},
		{"slice endpoints[].hints.forNodes", true, func(o objs) { o.sls[0].Endpoints[0].Hints.ForNodes = nil }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			base := objs{filledService(1), filledSlices(1)}
			changed := objs{filledService(1), filledSlices(1)}
			tt.change(changed)
			before, after := readAll(base.svc, base.sls), readAll(changed.svc, changed.sls)
			if cmp.Equal(before, after, readingOpts) {
				t.Fatalf("the change does not show in what uproxy reads: the case proves nothing")
			}
			tbase, tchanged := objs{}, objs{}
			tbase.svc, tbase.sls = trimmedCopy(base.svc, base.sls)
			tchanged.svc, tchanged.sls = trimmedCopy(changed.svc, changed.sls)
			if diff := cmp.Diff(after, readAll(tchanged.svc, tchanged.sls), readingOpts); diff != "" {
				t.Errorf("the change does not survive the trim (-whole +trimmed):\n%s", diff)
			}
			if !tt.compared || after.Invalid != "" {
				return // the tracker rejects an invalid version whole
			}
			tr := changes.NewTracker(nil, nil)
			for _, o := range []objs{tbase, tchanged} {
				tr.OnServiceUpsert(o.svc)
				for _, sl := range o.sls {
					tr.OnSliceUpsert(sl)
				}
			}
			if svc, sl := tr.Pending(); svc+sl != 2+len(base.sls) {
				t.Errorf("the tracker recorded %d Service and %d EndpointSlice changes, want the change of the second version recorded too", svc, sl)
			}
		})
	}
}

// TestTrimDrops checks that the trim drops what uproxy does not read, and
// that the tracker then takes a change of only such fields for none.
func TestTrimDrops(t *testing.T) {
	svc, sls := filledService(1), filledSlices(1)
	n := filledNode(1)
	tsvc, tsls := trimmedCopy(svc, sls)
	TrimObject(n)
	sl := tsls[0]
	for _, c := range []struct {
		field string
		kept  any
	}{
		{"Service metadata.managedFields", tsvc.ManagedFields},
		{"Service metadata.ownerReferences", tsvc.OwnerReferences},
		{"Service metadata.finalizers", tsvc.Finalizers},
		{"Service metadata.generateName", tsvc.GenerateName},
		{"Service metadata.creationTimestamp", tsvc.CreationTimestamp},
		{"Service metadata.generation", tsvc.Generation},
		{"Service spec.selector", tsvc.Spec.Selector},
		{"Service spec.ipFamilies", tsvc.Spec.IPFamilies},
		{"Service spec.externalName", tsvc.Spec.ExternalName},
		{"Service spec.loadBalancerClass", tsvc.Spec.LoadBalancerClass},
		{"Service spec.ports[].appProtocol", tsvc.Spec.Ports[0].AppProtocol},
		{"Service status.conditions", tsvc.Status.Conditions},
		{"Service status.loadBalancer.ingress[].hostname", tsvc.Status.LoadBalancer.Ingress[0].Hostname},
		{"Service status.loadBalancer.ingress[].ports", tsvc.Status.LoadBalancer.Ingress[0].Ports},
		{"EndpointSlice metadata.managedFields", sl.ManagedFields},
		{"EndpointSlice metadata.ownerReferences", sl.OwnerReferences},
		{"EndpointSlice ports[].appProtocol", sl.Ports[0].AppProtocol},
		{"EndpointSlice endpoints[].targetRef", sl.Endpoints[0].TargetRef},
		{"EndpointSlice endpoints[].hostname", sl.Endpoints[0].Hostname},
		{"EndpointSlice endpoints[].deprecatedTopology", sl.Endpoints[0].DeprecatedTopology},
		{"Node metadata.managedFields", n.ManagedFields},
		{"Node spec.providerID", n.Spec.ProviderID},
		{"Node status.conditions", n.Status.Conditions},
		{"Node status.images", n.Status.Images},
		{"Node status.nodeInfo", n.Status.NodeInfo},
		{"Node status.capacity", n.Status.Capacity},
	} {
		if v := c.kept; !reflect.ValueOf(v).IsZero() {
			t.Errorf("%s survives the trim: %v", c.field, v)
		}
	}
	for name, m := range map[string]map[string]string{
		"Service labels": tsvc.Labels, "Service annotations": tsvc.Annotations,
		"EndpointSlice labels": sl.Labels, "EndpointSlice annotations": sl.Annotations,
		"Node labels": n.Labels, "Node annotations": n.Annotations,
	} {
		for k := range m {
			if !strings.HasPrefix(k, annotationPrefix) && !slices.Contains([]string{service.LabelServiceProxyName, service.LabelServiceName,
				v1.EndpointsLastChangeTriggerTime, v1.LabelTopologyZone}, k) {
				t.Errorf("%s: %q survives the trim", name, k)
			}
		}
	}
	grown := filledSlice(1, "web-c", discovery.AddressTypeIPv4)
	grown.Endpoints = slices.Grow(grown.Endpoints, 13) // as decoding appends them
	TrimSlice(grown)
	if cap(grown.Endpoints) != len(grown.Endpoints) {
		t.Errorf("the trimmed slice keeps room for %d endpoints, holding %d", cap(grown.Endpoints), len(grown.Endpoints))
	}
	if got, want := slices.Sorted(maps.Keys(tsvc.Annotations)), 6; len(got) != want {
		t.Errorf("the trimmed Service's annotations are %q, want uproxy's %d", got, want)
	}

	// Another version that differs only in what is not read: no change.
	other := filledService(2)
	other.Spec, other.Status.LoadBalancer.Ingress = *svc.Spec.DeepCopy(), nil
	other.Status.LoadBalancer.Ingress = svc.DeepCopy().Status.LoadBalancer.Ingress
	for i := range other.Spec.Ports {
		other.Spec.Ports[i].AppProtocol = ptr.To("other")
	}
	other.Spec.Selector = map[string]string{"app": "other"}
	for _, k := range []string{service.AnnotationBalancer, service.AnnotationWeights, service.AnnotationPreserveSourceIP, service.AnnotationProxyProtocol,
		service.AnnotationMaxConnections, service.AnnotationMaxConnectionsPerEndpoint} {
		other.Annotations[k] = svc.Annotations[k]
	}
	TrimService(other)
	tr := changes.NewTracker(nil, nil)
	tr.OnServiceUpsert(tsvc)
	tr.OnServiceUpsert(other)
	if got, _ := tr.Pending(); got != 1 {
		t.Errorf("a version that differs only in unread fields counted as a change (%d changes recorded)", got)
	}
}

// TestTrimIdempotent checks that trimming a trimmed object changes and
// allocates nothing, as a transform whose objects may be trimmed again
// must.
func TestTrimIdempotent(t *testing.T) {
	svc, sls := trimmedCopy(filledService(1), filledSlices(1))
	n := filledNode(1)
	TrimNode(n)
	want := []any{svc.DeepCopy(), sls[0].DeepCopy(), n.DeepCopy()}
	allocs := testing.AllocsPerRun(10, func() {
		TrimService(svc)
		TrimSlice(sls[0])
		TrimNode(n)
	})
	if allocs != 0 {
		t.Errorf("trimming trimmed objects allocated %v times, want none", allocs)
	}
	if diff := cmp.Diff(want, []any{svc, sls[0], n}); diff != "" {
		t.Errorf("trimming again changed the objects (-once +twice):\n%s", diff)
	}
}
