package service

import (
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
)

// NameOf is an object's name, in namespace default when it has none, as
// manifests may leave it out.
func NameOf(ns, name string) types.NamespacedName {
	if ns == "" {
		ns = v1.NamespaceDefault
	}
	return types.NamespacedName{Namespace: ns, Name: name}
}

// SliceTriggerTime returns the slice's endpoints.kubernetes.io/last-change-trigger-time
// annotation: when the change it carries was triggered (a pod or service
// changed); zero when absent or malformed.
func SliceTriggerTime(s *discovery.EndpointSlice) time.Time {
	v, ok := s.Annotations[v1.EndpointsLastChangeTriggerTime]
	if !ok {
		return time.Time{}
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		return time.Time{}
	}
	return t
}

// SliceFamily is the IP family of a slice's addresses (FQDN slices,
// which no proxy serves, count as IPv4).
func SliceFamily(s *discovery.EndpointSlice) v1.IPFamily {
	if s.AddressType == discovery.AddressTypeIPv6 {
		return v1.IPv6Protocol
	}
	return v1.IPv4Protocol
}

// SliceService names the Service a slice belongs to (LabelServiceName);
// empty when it has no such label.
func SliceService(s *discovery.EndpointSlice) types.NamespacedName {
	name := s.Labels[LabelServiceName]
	if name == "" {
		return types.NamespacedName{}
	}
	return NameOf(s.Namespace, name)
}
