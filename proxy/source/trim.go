package source

import (
	"strings"

	"github.com/uproxy/uproxy/proxy/service"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// A node agent holds every Service and EndpointSlice of the cluster, and
// the whole objects carry much that uproxy never reads: managed fields,
// the last applied configuration, selectors, owner and target references,
// status conditions. The client-go documentation recommends that such
// components trim their informers' objects with a transform. The
// functions below keep exactly what uproxy reads (convert.go, the
// tracker's comparisons, the state file) and what an Event on the object
// needs (its name, namespace, UID and resourceVersion); every source
// applies them, so that an object from the API server, a manifest or a
// state file compares and converts alike.
//
// They trim in place, which client-go allows of a transform since 1.27,
// and are idempotent: trimming a trimmed object changes nothing and
// allocates nothing.

// annotationPrefix is the prefix of uproxy's own annotations: every
// annotation under it is uproxy's to read.
const annotationPrefix = "uproxy.io/"

// TrimObject is the informers' transform (cache.TransformFunc): it trims
// Services, EndpointSlices and Nodes, and passes anything else through.
func TrimObject(obj any) (any, error) {
	switch o := obj.(type) {
	case *v1.Service:
		TrimService(o)
	case *discovery.EndpointSlice:
		TrimSlice(o)
	case *v1.Node:
		TrimNode(o)
	}
	return obj, nil
}

// trimMeta keeps the identity of an object (what an Event's reference
// and the tracker's keys use), its deletion, and the labels and
// annotations that keepLabel and keepAnnotation accept: those uproxy
// reads.
func trimMeta(m *metav1.ObjectMeta, keepLabel, keepAnnotation func(string) bool) {
	*m = metav1.ObjectMeta{
		Name:              m.Name,
		Namespace:         m.Namespace,
		UID:               m.UID,
		ResourceVersion:   m.ResourceVersion,
		DeletionTimestamp: m.DeletionTimestamp,
		Labels:            filterMap(m.Labels, keepLabel),
		Annotations:       filterMap(m.Annotations, keepAnnotation),
	}
}

// filterMap returns m itself when keep holds for all of its keys (so
// that trimming twice allocates nothing), otherwise a new map of the
// keys it keeps, or nil when none.
func filterMap(m map[string]string, keep func(string) bool) map[string]string {
	drop := 0
	for k := range m {
		if !keep(k) {
			drop++
		}
	}
	if drop == 0 {
		return m
	}
	if drop == len(m) {
		return nil
	}
	out := make(map[string]string, len(m)-drop)
	for k, v := range m {
		if keep(k) {
			out[k] = v
		}
	}
	return out
}

func isServiceLabel(k string) bool { return k == service.LabelServiceProxyName }

func isServiceAnnotation(k string) bool { return strings.HasPrefix(k, annotationPrefix) }

func isSliceLabel(k string) bool {
	return k == service.LabelServiceName || k == service.LabelHeadless || k == service.LabelServiceProxyName
}

func isSliceAnnotation(k string) bool { return k == v1.EndpointsLastChangeTriggerTime }

func isNodeLabel(k string) bool { return k == v1.LabelTopologyZone }

func none(string) bool { return false }

// TrimService keeps the fields of svc that uproxy reads (see the
// functions of convert.go) and drops the rest.
func TrimService(svc *v1.Service) {
	trimMeta(&svc.ObjectMeta, isServiceLabel, isServiceAnnotation)
	s := &svc.Spec
	for i := range s.Ports {
		p := &s.Ports[i]
		*p = v1.ServicePort{Name: p.Name, Protocol: p.Protocol, Port: p.Port, TargetPort: p.TargetPort, NodePort: p.NodePort}
	}
	*s = v1.ServiceSpec{
		Type:                     s.Type,
		ClusterIP:                s.ClusterIP,
		ClusterIPs:               s.ClusterIPs,
		Ports:                    s.Ports,
		ExternalIPs:              s.ExternalIPs,
		LoadBalancerSourceRanges: s.LoadBalancerSourceRanges,
		SessionAffinity:          s.SessionAffinity,
		SessionAffinityConfig:    s.SessionAffinityConfig,
		ExternalTrafficPolicy:    s.ExternalTrafficPolicy,
		InternalTrafficPolicy:    s.InternalTrafficPolicy,
		HealthCheckNodePort:      s.HealthCheckNodePort,
	}
	// Only the ingress IPs and their modes are read: a hostname-only
	// ingress is skipped, and conditions and ports are the cloud's.
	ing := svc.Status.LoadBalancer.Ingress
	for i := range ing {
		ing[i] = v1.LoadBalancerIngress{IP: ing[i].IP, IPMode: ing[i].IPMode}
	}
	svc.Status = v1.ServiceStatus{LoadBalancer: v1.LoadBalancerStatus{Ingress: ing}}
}

// TrimSlice keeps the fields of s that uproxy reads (ValidateSlice,
// PortEndpoints, the tracker's service index and trigger times) and
// drops the rest: chiefly each endpoint's targetRef and hostname.
func TrimSlice(s *discovery.EndpointSlice) {
	trimMeta(&s.ObjectMeta, isSliceLabel, isSliceAnnotation)
	for i := range s.Ports {
		p := &s.Ports[i]
		*p = discovery.EndpointPort{Name: p.Name, Protocol: p.Protocol, Port: p.Port}
	}
	for i := range s.Endpoints {
		e := &s.Endpoints[i]
		*e = discovery.Endpoint{Addresses: e.Addresses, Conditions: e.Conditions, NodeName: e.NodeName, Zone: e.Zone, Hints: e.Hints}
	}
	// Decoding appends the endpoints one by one, so their array has up to
	// twice the room they need; a slice is kept until it changes.
	if cap(s.Endpoints) > len(s.Endpoints) {
		eps := make([]discovery.Endpoint, len(s.Endpoints)) // cap is len: trimming again allocates nothing
		copy(eps, s.Endpoints)
		s.Endpoints = eps
	}
}

// TrimNode keeps what uproxy reads of its own Node: its deletion, its
// taints (the health check's eligibility), its zone label, and its
// addresses and podCIDRs, whose change stops uproxy as it stops
// kube-proxy. The rest of the status, with its images and conditions, is
// the largest part dropped.
func TrimNode(n *v1.Node) {
	trimMeta(&n.ObjectMeta, isNodeLabel, none)
	n.Spec = v1.NodeSpec{Taints: n.Spec.Taints, PodCIDR: n.Spec.PodCIDR, PodCIDRs: n.Spec.PodCIDRs}
	n.Status = v1.NodeStatus{Addresses: n.Status.Addresses}
}
