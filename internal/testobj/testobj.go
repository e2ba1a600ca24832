// Package testobj builds the Services and EndpointSlices that tests feed
// to uproxy, in namespace default.
package testobj

import (
	"fmt"
	"strings"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
)

// Service builds a ClusterIP Service in namespace default; ports are
// "name:port" (TCP) or "name:port/UDP".
func Service(name, ip string, ports ...string) *v1.Service {
	s := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
		Spec:       v1.ServiceSpec{Type: v1.ServiceTypeClusterIP, ClusterIP: ip, ClusterIPs: []string{ip}},
	}
	for _, p := range ports {
		n, rest, _ := strings.Cut(p, ":")
		num, proto, _ := strings.Cut(rest, "/")
		var port int32
		fmt.Sscan(num, &port)
		if proto == "" {
			proto = "TCP"
		}
		s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: n, Port: port, Protocol: v1.Protocol(proto), TargetPort: intstr.FromInt32(port)})
	}
	return s
}

// Endpoint is an endpoint for Slice; ready unless NotReady is set, and
// then serving and terminating as set.
type Endpoint struct {
	IP                             string
	NotReady, Serving, Terminating bool
}

// Slice builds an EndpointSlice for service svcName with one TCP port; it
// is IPv6 if any endpoint is.
func Slice(name, svcName, portName string, port int32, eps ...Endpoint) *discovery.EndpointSlice {
	s := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: name, Labels: map[string]string{discovery.LabelServiceName: svcName}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To(portName), Port: ptr.To(port), Protocol: ptr.To(v1.ProtocolTCP)}},
	}
	for _, e := range eps {
		if strings.Contains(e.IP, ":") {
			s.AddressType = discovery.AddressTypeIPv6
		}
		cond := discovery.EndpointConditions{Ready: ptr.To(!e.NotReady)}
		if e.NotReady {
			cond.Serving = ptr.To(e.Serving)
			cond.Terminating = ptr.To(e.Terminating)
		}
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{Addresses: []string{e.IP}, Conditions: cond})
	}
	return s
}
