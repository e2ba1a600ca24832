package proxy

import (
	"fmt"
	"strings"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
)

// svc builds a ClusterIP Service in namespace default; ports are
// "name:port" (TCP) or "name:port/UDP".
func svc(name, ip string, ports ...string) *v1.Service {
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

// ep is an endpoint for slice(); ready unless notReady is set.
type ep struct {
	ip                             string
	notReady, serving, terminating bool
}

// slice builds an IPv4 EndpointSlice for service svcName with one port.
func slice(name, svcName, portName string, port int32, eps ...ep) *discovery.EndpointSlice {
	s := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: name, Labels: map[string]string{LabelServiceName: svcName}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To(portName), Port: ptr.To(port), Protocol: ptr.To(v1.ProtocolTCP)}},
	}
	for _, e := range eps {
		if strings.Contains(e.ip, ":") {
			s.AddressType = discovery.AddressTypeIPv6
		}
		cond := discovery.EndpointConditions{Ready: ptr.To(!e.notReady)}
		if e.notReady {
			cond.Serving = ptr.To(e.serving)
			cond.Terminating = ptr.To(e.terminating)
		}
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{Addresses: []string{e.ip}, Conditions: cond})
	}
	return s
}
