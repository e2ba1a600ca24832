package service

import (
	"fmt"
	"maps"
	"math"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
)

// The fuzz targets below run their seeds with every `go test`; `make fuzz`
// (part of `make test`) also fuzzes each for a bounded time. They check
// invariants of the code that reads user input (manifest files, Service and
// EndpointSlice fields, annotations, flags), not merely that it does not
// panic.

// Bits of convertCase.Flags.
const (
	fSecondPort       = 1 << iota // the Service has a second port
	fAnnBalancer                  // the uproxy.io/balancer annotation is set
	fAnnWeights                   // uproxy.io/weights is set
	fAnnPreserve                  // uproxy.io/preserve-source-ip is set
	fAnnProxyProto                // uproxy.io/proxy-protocol is set
	fAffinity                     // sessionAffinity: ClientIP
	fAffinityTimeout              // sessionAffinityConfig.clientIP.timeoutSeconds is set
	fIPModeProxy                  // the first load-balancer ingress has ipMode: Proxy
	fOtherProxy                   // the Service has the service-proxy-name label
	fInternalPolicy               // internalTrafficPolicy is set
	fHeadless                     // the slice has the headless label
	fSlicePortNoName              // the slice port's name is nil
	fSlicePortNoProto             // the slice port's protocol is nil
	fSlicePortNoPort              // the slice port's number is nil
	fTopology                     // endpoints have a node, a zone and hints
)

// Bits of convertCase.Conditions, for the first endpoint; endpoint i uses
// Conditions XOR i, so endpoints differ.
const (
	cReadySet = 1 << iota
	cReady
	cServingSet
	cServing
	cTerminatingSet
	cTerminating
)

// convertCase is a Service and one of its EndpointSlices, in fields the
// fuzzer can mutate. Lists are comma-separated; an endpoint's addresses are
// separated by "|".
type convertCase struct {
	Namespace, Name, Type                string
	ClusterIP, ClusterIPs                string
	ExternalIPs, IngressIPs, SourceRange string
	Port1Name, Port1Proto                string
	Port1, Port1Target, Port1Node        int32
	Port2Name, Port2Proto                string
	Port2                                int32
	HealthCheckNodePort, AffinityTimeout int32
	ExternalPolicy, InternalPolicy       string
	Balancer, Weights                    string
	PreserveSourceIP, ProxyProtocol      string
	SliceName, AddressType, Endpoints    string
	SlicePortName, SlicePortProto        string
	SlicePort                            int32
	NodeName, Zone                       string
	Flags, Conditions                    uint16
}

func (c convertCase) add(f *testing.F) {
	f.Add(c.Namespace, c.Name, c.Type, c.ClusterIP, c.ClusterIPs, c.ExternalIPs, c.IngressIPs, c.SourceRange,
		c.Port1Name, c.Port1Proto, c.Port1, c.Port1Target, c.Port1Node, c.Port2Name, c.Port2Proto, c.Port2,
		c.HealthCheckNodePort, c.AffinityTimeout, c.ExternalPolicy, c.InternalPolicy,
		c.Balancer, c.Weights, c.PreserveSourceIP, c.ProxyProtocol,
		c.SliceName, c.AddressType, c.Endpoints, c.SlicePortName, c.SlicePortProto, c.SlicePort,
		c.NodeName, c.Zone, c.Flags, c.Conditions)
}

// split splits a comma-separated list; "" is the empty list.
func split(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

func (c convertCase) service() *v1.Service {
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: c.Namespace, Name: c.Name},
		Spec: v1.ServiceSpec{
			Type:                     v1.ServiceType(c.Type),
			ClusterIP:                c.ClusterIP,
			ClusterIPs:               split(c.ClusterIPs),
			ExternalIPs:              split(c.ExternalIPs),
			LoadBalancerSourceRanges: split(c.SourceRange),
			ExternalTrafficPolicy:    v1.ServiceExternalTrafficPolicy(c.ExternalPolicy),
			HealthCheckNodePort:      c.HealthCheckNodePort,
			Ports: []v1.ServicePort{{
				Name: c.Port1Name, Port: c.Port1, Protocol: v1.Protocol(c.Port1Proto),
				TargetPort: intstr.FromInt32(c.Port1Target), NodePort: c.Port1Node,
			}},
		},
	}
	if c.Flags&fSecondPort != 0 {
		svc.Spec.Ports = append(svc.Spec.Ports, v1.ServicePort{
			Name: c.Port2Name, Port: c.Port2, Protocol: v1.Protocol(c.Port2Proto), TargetPort: intstr.FromString(c.Port2Name),
		})
	}
	for i, ip := range split(c.IngressIPs) {
		ing := v1.LoadBalancerIngress{IP: ip}
		if i == 0 && c.Flags&fIPModeProxy != 0 {
			ing.IPMode = ptr.To(v1.LoadBalancerIPModeProxy)
		}
		svc.Status.LoadBalancer.Ingress = append(svc.Status.LoadBalancer.Ingress, ing)
	}
	if c.Flags&fInternalPolicy != 0 {
		svc.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicy(c.InternalPolicy))
	}
	if c.Flags&fAffinity != 0 {
		svc.Spec.SessionAffinity = v1.ServiceAffinityClientIP
	}
	if c.Flags&fAffinityTimeout != 0 {
		svc.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To(c.AffinityTimeout)}}
	}
	if c.Flags&fOtherProxy != 0 {
		svc.Labels = map[string]string{LabelServiceProxyName: "other"}
	}
	for _, a := range []struct {
		flag       uint16
		key, value string
	}{
		{fAnnBalancer, AnnotationBalancer, c.Balancer},
		{fAnnWeights, AnnotationWeights, c.Weights},
		{fAnnPreserve, AnnotationPreserveSourceIP, c.PreserveSourceIP},
		{fAnnProxyProto, AnnotationProxyProtocol, c.ProxyProtocol},
	} {
		if c.Flags&a.flag != 0 {
			if svc.Annotations == nil {
				svc.Annotations = map[string]string{}
			}
			svc.Annotations[a.key] = a.value
		}
	}
	return svc
}

func (c convertCase) slice() *discovery.EndpointSlice {
	s := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: c.Namespace, Name: c.SliceName, Labels: map[string]string{LabelServiceName: c.Name}},
		AddressType: discovery.AddressType(c.AddressType),
	}
	if c.Flags&fHeadless != 0 {
		s.Labels[LabelHeadless] = ""
	}
	p := discovery.EndpointPort{Name: ptr.To(c.SlicePortName), Port: ptr.To(c.SlicePort), Protocol: ptr.To(v1.Protocol(c.SlicePortProto))}
	if c.Flags&fSlicePortNoName != 0 {
		p.Name = nil
	}
	if c.Flags&fSlicePortNoProto != 0 {
		p.Protocol = nil
	}
	if c.Flags&fSlicePortNoPort != 0 {
		p.Port = nil
	}
	s.Ports = []discovery.EndpointPort{p}
	for i, e := range split(c.Endpoints) {
		ep := discovery.Endpoint{}
		if e != "" {
			ep.Addresses = strings.Split(e, "|")
		}
		cond := c.Conditions ^ uint16(i)
		if cond&cReadySet != 0 {
			ep.Conditions.Ready = ptr.To(cond&cReady != 0)
		}
		if cond&cServingSet != 0 {
			ep.Conditions.Serving = ptr.To(cond&cServing != 0)
		}
		if cond&cTerminatingSet != 0 {
			ep.Conditions.Terminating = ptr.To(cond&cTerminating != 0)
		}
		if c.Flags&fTopology != 0 {
			ep.NodeName, ep.Zone = ptr.To(c.NodeName), ptr.To(c.Zone)
			ep.Hints = &discovery.EndpointHints{
				ForZones: []discovery.ForZone{{Name: c.Zone}},
				ForNodes: []discovery.ForNode{{Name: c.NodeName}},
			}
		}
		s.Endpoints = append(s.Endpoints, ep)
	}
	return s
}

// convertSeeds: valid objects of every type and policy, and the mistakes
// TestValidateService and TestValidateSlice expect to be rejected.
func convertSeeds() []convertCase {
	web := convertCase{
		Namespace: "default", Name: "web", Type: "ClusterIP", ClusterIP: "10.96.0.10", ClusterIPs: "10.96.0.10",
		Port1Name: "http", Port1Proto: "TCP", Port1: 80, Port1Target: 8080,
		Port2Name: "dns", Port2Proto: "UDP", Port2: 53,
		SliceName: "web-a", AddressType: "IPv4", Endpoints: "10.244.0.11,10.244.0.12,10.244.0.11",
		SlicePortName: "http", SlicePortProto: "TCP", SlicePort: 8080,
		NodeName: "node-a", Zone: "zone-a", Flags: fSecondPort, Conditions: cReadySet | cReady,
	}
	with := func(mutate func(*convertCase)) convertCase {
		c := web
		mutate(&c)
		return c
	}
	return []convertCase{
		web,
		with(func(c *convertCase) {
			c.ClusterIPs = "10.96.0.10,2001:db8::10"
			c.AddressType, c.Endpoints = "IPv6", "2001:db8::11,2001:db8::12|2001:db8::13,"
			c.Flags |= fTopology | fInternalPolicy
			c.InternalPolicy = "Local"
			c.Conditions = cServingSet | cServing | cTerminatingSet | cTerminating
		}),
		with(func(c *convertCase) {
			c.Type, c.Port1Node, c.ExternalPolicy, c.HealthCheckNodePort = "LoadBalancer", 30080, "Local", 32000
			c.ExternalIPs, c.IngressIPs, c.SourceRange = "192.0.2.1", "192.0.2.10,192.0.2.11", "192.0.2.0/24, 2001:db8::/32"
			c.Flags |= fIPModeProxy | fAnnBalancer | fAnnWeights | fAnnPreserve | fAnnProxyProto | fAffinity | fAffinityTimeout
			c.Balancer, c.Weights, c.PreserveSourceIP, c.ProxyProtocol = "weighted-round-robin", "10.244.0.11=3, 10.244.0.12=1", "true", "v1"
			c.AffinityTimeout = 600
		}),
		with(func(c *convertCase) { c.Type, c.Port1Node = "NodePort", 30080 }),
		with(func(c *convertCase) { c.Port1Name, c.Port2Name, c.SlicePortName = "", "", "" }),
		with(func(c *convertCase) {
			c.Flags |= fSlicePortNoName | fSlicePortNoProto
			c.Port1Name, c.Port1Proto = "", ""
		}),
		with(func(c *convertCase) { c.AddressType, c.Endpoints = "FQDN", "web.example.com" }),
		with(func(c *convertCase) { c.Flags |= fHeadless }),
		with(func(c *convertCase) { c.ClusterIP, c.ClusterIPs = "None", "None" }),
		with(func(c *convertCase) { c.Type, c.ClusterIP, c.ClusterIPs = "ExternalName", "", "" }),
		with(func(c *convertCase) { c.Flags |= fOtherProxy; c.Port1 = 0 }),
		with(func(c *convertCase) { c.ClusterIP, c.ClusterIPs = "::ffff:10.96.0.10", "::ffff:10.96.0.10" }),
		with(func(c *convertCase) { c.Endpoints = "10.244.0.11,::ffff:10.244.0.12" }),
		// Rejected.
		with(func(c *convertCase) { c.Name = "" }),
		with(func(c *convertCase) { c.ClusterIP, c.ClusterIPs = "10.96.0.300", "10.96.0.300" }),
		with(func(c *convertCase) { c.ClusterIP = "10.96.0.11" }),
		with(func(c *convertCase) { c.ClusterIPs = "10.96.0.10,10.96.0.11" }),
		with(func(c *convertCase) { c.ClusterIPs = "10.96.0.10,2001:db8::10,2001:db8::11" }),
		with(func(c *convertCase) { c.ClusterIP, c.ClusterIPs = "fe80::1%eth0", "fe80::1%eth0" }),
		with(func(c *convertCase) { c.Port1 = 0 }),
		with(func(c *convertCase) { c.Port1 = 70000 }),
		with(func(c *convertCase) { c.Port1Proto = "QUIC" }),
		with(func(c *convertCase) { c.Port2Proto = "SCTP" }),
		with(func(c *convertCase) { c.Port2Name = "http" }),
		with(func(c *convertCase) { c.Port2, c.Port2Proto = 80, "" }),
		with(func(c *convertCase) { c.Port1Target = -1 }),
		with(func(c *convertCase) { c.Port1Node = 70000 }),
		with(func(c *convertCase) { c.HealthCheckNodePort = -1 }),
		with(func(c *convertCase) { c.ExternalIPs = "10.96.300.1" }),
		with(func(c *convertCase) { c.IngressIPs = "0.0.0.0" }),
		with(func(c *convertCase) { c.SourceRange = "10.0.0.0/33" }),
		with(func(c *convertCase) { c.Flags |= fAnnBalancer; c.Balancer = "random" }),
		with(func(c *convertCase) { c.Flags |= fAnnWeights; c.Weights = "10.244.0.1=x" }),
		with(func(c *convertCase) { c.Flags |= fAnnPreserve; c.PreserveSourceIP = "yes please" }),
		with(func(c *convertCase) { c.Flags |= fAnnProxyProto; c.ProxyProtocol = "v3" }),
		with(func(c *convertCase) { c.Flags |= fAffinity | fAffinityTimeout; c.AffinityTimeout = 0 }),
		with(func(c *convertCase) { c.SliceName = "" }),
		with(func(c *convertCase) { c.AddressType = "IPv5" }),
		with(func(c *convertCase) { c.Endpoints = "10.244.0.999" }),
		with(func(c *convertCase) { c.Endpoints = "2001:db8::1" }),
		with(func(c *convertCase) { c.Endpoints = "10.244.0.1," }),
		with(func(c *convertCase) { c.SlicePort = 65536 }),
		with(func(c *convertCase) { c.Flags |= fSlicePortNoPort }),
		with(func(c *convertCase) { c.SlicePortProto = "ICMP" }),
		with(func(c *convertCase) { c.AddressType, c.Endpoints = "IPv6", "::ffff:10.244.0.1" }),
	}
}

// FuzzConvert builds a Service and an EndpointSlice from fuzzed fields and
// runs them through validation and the conversion to service
// ports and endpoints. What validation accepts must convert to sound
// values: ports in 1-65535, valid addresses of the right family, no
// duplicate port names or endpoints. What it rejects must be rejected with
// an error naming the field.
func FuzzConvert(f *testing.F) {
	for _, c := range convertSeeds() {
		c.add(f)
	}
	f.Fuzz(func(t *testing.T, ns, name, typ, clusterIP, clusterIPs, externalIPs, ingressIPs, sourceRange,
		port1Name, port1Proto string, port1, port1Target, port1Node int32, port2Name, port2Proto string, port2 int32,
		healthCheckNodePort, affinityTimeout int32, externalPolicy, internalPolicy,
		balancerAnn, weights, preserveSourceIP, proxyProtocol,
		sliceName, addressType, endpoints, slicePortName, slicePortProto string, slicePort int32,
		nodeName, zone string, flags, conditions uint16) {
		c := convertCase{
			Namespace: ns, Name: name, Type: typ, ClusterIP: clusterIP, ClusterIPs: clusterIPs,
			ExternalIPs: externalIPs, IngressIPs: ingressIPs, SourceRange: sourceRange,
			Port1Name: port1Name, Port1Proto: port1Proto, Port1: port1, Port1Target: port1Target, Port1Node: port1Node,
			Port2Name: port2Name, Port2Proto: port2Proto, Port2: port2,
			HealthCheckNodePort: healthCheckNodePort, AffinityTimeout: affinityTimeout,
			ExternalPolicy: externalPolicy, InternalPolicy: internalPolicy,
			Balancer: balancerAnn, Weights: weights, PreserveSourceIP: preserveSourceIP, ProxyProtocol: proxyProtocol,
			SliceName: sliceName, AddressType: addressType, Endpoints: endpoints,
			SlicePortName: slicePortName, SlicePortProto: slicePortProto, SlicePort: slicePort,
			NodeName: nodeName, Zone: zone, Flags: flags, Conditions: conditions,
		}
		svc, s := c.service(), c.slice()
		svcErr, sliceErr := ValidateService(svc), ValidateSlice(s)
		checkRejection(t, "Service", svcErr, "metadata.name", "spec.", "status.", "annotation ")
		checkRejection(t, "EndpointSlice", sliceErr, "metadata.name", "addressType", "ports[", "endpoints[")
		if svcErr != nil {
			return
		}
		sps := Ports(svc, Defaults{})
		checkServicePorts(t, svc, sps)
		if sliceErr != nil {
			return
		}
		for _, sp := range sps {
			eps := PortEndpoints(sp, []*discovery.EndpointSlice{s})
			checkEndpoints(t, sp, s, eps)
			// The same endpoints in a second slice (sorted after the
			// first) must not appear twice.
			dup := s.DeepCopy()
			dup.Name += "~"
			both := PortEndpoints(sp, []*discovery.EndpointSlice{dup, s})
			if diff := cmp.Diff(eps, both, cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
				t.Errorf("%s: endpoints listed in two slices differ from one slice's (-one +two):\n%s", sp.Name, diff)
			}
		}
	})
}

// checkRejection checks that a validation error names the field at fault.
func checkRejection(t *testing.T, kind string, err error, fields ...string) {
	t.Helper()
	if err == nil {
		return
	}
	for _, f := range fields {
		if strings.HasPrefix(err.Error(), f) {
			return
		}
	}
	t.Errorf("%s rejected with %q, which does not start with a field (one of %q)", kind, err, fields)
}

// checkAddrs checks addresses that the data path will listen on or
// intercept: valid, not unspecified, without a zone, and unmapped (so that
// Is4 tells the family).
func checkAddrs(t *testing.T, what string, addrs []netip.Addr) {
	t.Helper()
	for _, a := range addrs {
		if !a.IsValid() || a.IsUnspecified() || a.Zone() != "" || a.Is4In6() {
			t.Errorf("%s: %v is not a usable address", what, a)
		}
	}
}

// checkServicePorts checks the conversion of a Service that validated.
func checkServicePorts(t *testing.T, svc *v1.Service, sps []*Port) {
	t.Helper()
	if SkipReason(svc) != "" {
		if sps != nil {
			t.Errorf("Ports() of a skipped service (%s) = %v, want nil", SkipReason(svc), sps)
		}
		return
	}
	// SCTP ports are left out, the others kept in order.
	var proxied []int // indexes into spec.ports
	for i, p := range svc.Spec.Ports {
		if p.Protocol != v1.ProtocolSCTP {
			proxied = append(proxied, i)
		}
	}
	if len(sps) != len(proxied) {
		t.Fatalf("Ports() returned %d ports for %d TCP and UDP ports", len(sps), len(proxied))
	}
	if n := len(svc.Spec.Ports) - len(proxied); len(sctpWarnings(svc)) != n {
		t.Errorf("Warnings() = %v, want one per SCTP port (%d)", Warnings(svc), n)
	}
	nodePorts := svc.Spec.Type == v1.ServiceTypeNodePort || svc.Spec.Type == v1.ServiceTypeLoadBalancer
	names := map[PortName]bool{}
	for j, sp := range sps {
		i := proxied[j]
		p := svc.Spec.Ports[i]
		if sp.Port == 0 || int32(sp.Port) != p.Port {
			t.Errorf("%s: port %d, spec.ports[%d].port is %d", sp.Name, sp.Port, i, p.Port)
		}
		if sp.Name.Namespace != svc.Namespace || sp.Name.Name != svc.Name || sp.Name.Port != p.Name {
			t.Errorf("spec.ports[%d] of %s/%s is named %s", i, svc.Namespace, svc.Name, sp.Name)
		}
		if sp.Name.Protocol != v1.ProtocolTCP && sp.Name.Protocol != v1.ProtocolUDP {
			t.Errorf("%s: protocol %q", sp.Name, sp.Name.Protocol)
		}
		if names[sp.Name] {
			t.Errorf("%s: two ports of that name", sp.Name)
		}
		names[sp.Name] = true
		if n := len(sp.ClusterIPs); n < 1 || n > 2 || (n == 2 && sp.ClusterIPs[0].Is4() == sp.ClusterIPs[1].Is4()) {
			t.Errorf("%s: cluster IPs %v, want one per family", sp.Name, sp.ClusterIPs)
		}
		checkAddrs(t, sp.Name.String()+" cluster IPs", sp.ClusterIPs)
		checkAddrs(t, sp.Name.String()+" external IPs", sp.ExternalIPs)
		checkAddrs(t, sp.Name.String()+" load-balancer IPs", sp.LoadBalancerIPs)
		if len(sp.LoadBalancerIPs) > 0 && svc.Spec.Type != v1.ServiceTypeLoadBalancer {
			t.Errorf("%s: load-balancer IPs %v on a %q service", sp.Name, sp.LoadBalancerIPs, svc.Spec.Type)
		}
		for _, r := range sp.SourceRanges {
			if !r.IsValid() || r != r.Masked() {
				t.Errorf("%s: source range %v is not a masked prefix", sp.Name, r)
			}
		}
		if (nodePorts && int32(sp.NodePort) != p.NodePort) || (!nodePorts && sp.NodePort != 0) {
			t.Errorf("%s: node port %d on a %q service with spec.ports[%d].nodePort %d", sp.Name, sp.NodePort, svc.Spec.Type, i, p.NodePort)
		}
		if sp.HealthCheckNodePort != 0 && (!sp.ExternalPolicyLocal || svc.Spec.Type != v1.ServiceTypeLoadBalancer) {
			t.Errorf("%s: health-check node port %d without externalTrafficPolicy Local on a load balancer", sp.Name, sp.HealthCheckNodePort)
		}
		if !slices.Contains(balancer.Kinds, sp.Balancer) {
			t.Errorf("%s: balancer %q is not one of %v", sp.Name, sp.Balancer, balancer.Kinds)
		}
		checkWeights(t, sp.Name.String(), sp.Weights)
		if svc.Spec.SessionAffinity == v1.ServiceAffinityClientIP {
			if sp.AffinityTimeout < time.Second || sp.AffinityTimeout > 86400*time.Second {
				t.Errorf("%s: affinity timeout %v, want 1s-24h", sp.Name, sp.AffinityTimeout)
			}
		} else if sp.AffinityTimeout != 0 {
			t.Errorf("%s: affinity timeout %v without ClientIP affinity", sp.Name, sp.AffinityTimeout)
		}
		if sp.ProxyProtocol < 0 || sp.ProxyProtocol > 2 {
			t.Errorf("%s: PROXY protocol version %d", sp.Name, sp.ProxyProtocol)
		}
	}
}

// checkEndpoints checks PortEndpoints' result for a slice that validated.
func checkEndpoints(t *testing.T, sp *Port, s *discovery.EndpointSlice, eps []Endpoint) {
	t.Helper()
	if _, headless := s.Labels[LabelHeadless]; headless || s.AddressType == discovery.AddressTypeFQDN {
		if len(eps) != 0 {
			t.Errorf("%s: endpoints %v from a headless or FQDN slice", sp.Name, eps)
		}
		return
	}
	var ports []uint16 // the slice ports that serve sp
	for _, p := range s.Ports {
		if ptr.Deref(p.Name, "") == sp.Name.Port && ptr.Deref(p.Protocol, v1.ProtocolTCP) == sp.Name.Protocol {
			ports = append(ports, uint16(*p.Port))
		}
	}
	seen := map[netip.AddrPort]bool{}
	for _, e := range eps {
		a := e.Addr.Addr()
		if !a.IsValid() || a.Zone() != "" || a.Is4In6() || a.Is4() != (s.AddressType == discovery.AddressTypeIPv4) {
			t.Errorf("%s: endpoint address %v from an %s slice", sp.Name, a, s.AddressType)
		}
		if e.Addr.Port() == 0 || !slices.Contains(ports, e.Addr.Port()) {
			t.Errorf("%s: endpoint %v: port is not the slice's port for it (%v)", sp.Name, e.Addr, ports)
		}
		if seen[e.Addr] {
			t.Errorf("%s: endpoint %v listed twice", sp.Name, e.Addr)
		}
		seen[e.Addr] = true
		// Of the endpoints of the slice with this address, the first one
		// not terminating is kept, else the first: a running pod wins
		// over a terminating one with the same IP, as in kube-proxy.
		withAddr := func(ep discovery.Endpoint) bool {
			ip, err := netip.ParseAddr(ep.Addresses[0])
			return err == nil && ip.Unmap() == a
		}
		i := slices.IndexFunc(s.Endpoints, func(ep discovery.Endpoint) bool {
			return withAddr(ep) && !ptr.Deref(ep.Conditions.Terminating, false)
		})
		if i < 0 {
			i = slices.IndexFunc(s.Endpoints, withAddr)
		}
		if i < 0 {
			t.Errorf("%s: endpoint %v is not in the slice", sp.Name, e.Addr)
			continue
		}
		src := s.Endpoints[i]
		want := Endpoint{
			Addr:        e.Addr,
			Ready:       ptr.Deref(src.Conditions.Ready, true),
			Terminating: ptr.Deref(src.Conditions.Terminating, false),
			NodeName:    ptr.Deref(src.NodeName, ""),
			Zone:        ptr.Deref(src.Zone, ""),
		}
		want.Serving = ptr.Deref(src.Conditions.Serving, true) // kube-proxy's reading of an unset condition
		if h := src.Hints; h != nil && len(h.ForZones)+len(h.ForNodes) > 0 {
			want.Hints = &EndpointHints{}
			for _, z := range h.ForZones {
				want.Hints.Zones = append(want.Hints.Zones, z.Name)
			}
			for _, n := range h.ForNodes {
				want.Hints.Nodes = append(want.Hints.Nodes, n.Name)
			}
		}
		if diff := cmp.Diff(want, e, cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
			t.Errorf("%s: endpoint %v (-from the slice +got):\n%s", sp.Name, e.Addr, diff)
		}
	}
	if len(ports) == 0 && len(eps) != 0 {
		t.Errorf("%s: endpoints %v from a slice without the port", sp.Name, eps)
	}
}

// checkWeights checks parsed weights: each within the documented 1-1000000,
// for an address an endpoint can have (valid, unmapped, no zone).
func checkWeights(t *testing.T, what string, w map[netip.Addr]int) {
	t.Helper()
	for a, n := range w {
		if !a.IsValid() || a.Is4In6() || a.Zone() != "" {
			t.Errorf("%s: weight for %v, which no endpoint can have", what, a)
		}
		if n < 1 || n > 1000000 {
			t.Errorf("%s: weight %d for %v is not in 1-1000000", what, n, a)
		}
	}
}

// FuzzAnnotations checks the parsers of uproxy's Service annotations: a
// value that parses gives a value within bounds that reads back the same
// when written canonically; a value that does not is an error naming the
// annotation; and ValidateService accepts a Service exactly when all its
// annotations parse, which Ports then applies.
func FuzzAnnotations(f *testing.F) {
	const all = 1<<4 - 1
	f.Add("least-conn", "10.244.0.11=3, 10.244.0.12=1", "true", "v1", uint8(all))
	f.Add(" source-hash ", "2001:db8::1=2", "FALSE", " v2 ", uint8(all))
	f.Add("weighted-least-conn", "::ffff:10.244.0.1=1000000", "1", "", uint8(all))
	f.Add("", "", "", "", uint8(all))
	f.Add("random", "10.244.0.11", "yes please", "v3", uint8(all))
	f.Add("round-robin", "10.244.0.x=1", "t", "V1", uint8(all))
	f.Add("Round-Robin", "10.244.0.11=0", "", "v1", uint8(all))
	f.Add("", "10.244.0.11=1,10.244.0.11=2", "", "", uint8(1<<1))
	f.Add("", "10.244.0.11=1,::ffff:10.244.0.11=2", "", "", uint8(1<<1))
	f.Add("", "10.244.0.11=1000001", "", "", uint8(1<<1))
	f.Add("", "10.244.0.11=1,", "", "", uint8(1<<1))
	f.Add("", "fe80::1%eth0=2", "", "", uint8(1<<1))
	f.Fuzz(func(t *testing.T, bal, weights, preserve, proxyProto string, present uint8) {
		ann := map[string]string{}
		for i, kv := range [][2]string{{AnnotationBalancer, bal}, {AnnotationWeights, weights}, {AnnotationPreserveSourceIP, preserve}, {AnnotationProxyProtocol, proxyProto}} {
			if present&(1<<i) != 0 {
				ann[kv[0]] = kv[1]
			}
		}

		kind, balErr := parseBalancer(ann)
		if v, ok := ann[AnnotationBalancer]; !ok && (kind != "" || balErr != nil) {
			t.Errorf("parseBalancer() without the annotation = %q, %v", kind, balErr)
		} else if ok && balErr == nil && (!slices.Contains(balancer.Kinds, kind) || string(kind) != strings.TrimSpace(v)) {
			t.Errorf("parseBalancer(%q) = %q, not one of %v", v, kind, balancer.Kinds)
		}
		checkAnnotationError(t, AnnotationBalancer, balErr)

		w, wErr := ParseWeights(ann[AnnotationWeights])
		if wErr == nil {
			checkWeights(t, "ParseWeights", w)
			if strings.TrimSpace(ann[AnnotationWeights]) == "" {
				if w != nil {
					t.Errorf("ParseWeights(%q) = %v, want nil", ann[AnnotationWeights], w)
				}
			} else if n := strings.Count(ann[AnnotationWeights], ",") + 1; len(w) != n {
				t.Errorf("ParseWeights(%q) = %v: %d weights from %d items", ann[AnnotationWeights], w, len(w), n)
			}
			var items []string
			for _, a := range slices.SortedFunc(maps.Keys(w), netip.Addr.Compare) {
				items = append(items, fmt.Sprintf("%s=%d", a, w[a]))
			}
			again, err := ParseWeights(strings.Join(items, ","))
			if diff := cmp.Diff(w, again, cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); err != nil || diff != "" {
				t.Errorf("ParseWeights(%q) = %v, which written back reads as %v, %v", ann[AnnotationWeights], w, again, err)
			}
		} else if w != nil {
			t.Errorf("ParseWeights(%q) = %v with error %v", ann[AnnotationWeights], w, wErr)
		}

		keep, presErr := parsePreserveSourceIP(ann)
		if _, set := ann[AnnotationPreserveSourceIP]; presErr == nil && set {
			again, err := parsePreserveSourceIP(map[string]string{AnnotationPreserveSourceIP: strconv.FormatBool(keep == datapath.SourceClient)})
			if err != nil || again != keep {
				t.Errorf("parsePreserveSourceIP(%q) = %v, which written back reads as %v, %v", ann[AnnotationPreserveSourceIP], keep, again, err)
			}
		}
		checkAnnotationError(t, AnnotationPreserveSourceIP, presErr)

		version, ppErr := parseProxyProtocol(ann)
		if ppErr == nil {
			if version < 0 || version > 2 || (version == 0) != (strings.TrimSpace(ann[AnnotationProxyProtocol]) == "") {
				t.Errorf("parseProxyProtocol(%q) = %d", ann[AnnotationProxyProtocol], version)
			}
			if version > 0 {
				again, err := parseProxyProtocol(map[string]string{AnnotationProxyProtocol: "v" + strconv.Itoa(version)})
				if err != nil || again != version {
					t.Errorf("parseProxyProtocol(%q) = %d, which written back reads as %d, %v", ann[AnnotationProxyProtocol], version, again, err)
				}
			}
		}
		checkAnnotationError(t, AnnotationProxyProtocol, ppErr)

		s := svc("web", "10.96.0.10", "http:80")
		s.Annotations = ann
		err := ValidateService(s)
		if wantOK := balErr == nil && wErr == nil && presErr == nil && ppErr == nil; (err == nil) != wantOK {
			t.Fatalf("ValidateService() with annotations %q = %v; the parsers' errors: %v, %v, %v, %v", ann, err, balErr, wErr, presErr, ppErr)
		}
		if err != nil {
			return
		}
		sps := Ports(s, Defaults{Balancer: balancer.LeastConn})
		if len(sps) != 1 {
			t.Fatalf("Ports() = %v, want one port", sps)
		}
		want := *sps[0]
		want.Balancer, want.Weights, want.SourceIP, want.ProxyProtocol = kind, w, keep, version
		if kind == "" {
			want.Balancer = balancer.LeastConn
		}
		if diff := cmp.Diff(&want, sps[0], cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); diff != "" {
			t.Errorf("Ports() does not apply the annotations %q (-want +got):\n%s", ann, diff)
		}
	})
}

// checkAnnotationError checks that an annotation's parse error names it.
func checkAnnotationError(t *testing.T, annotation string, err error) {
	t.Helper()
	if err != nil && !strings.Contains(err.Error(), annotation) {
		t.Errorf("error %q does not name the annotation %s", err, annotation)
	}
}

// FuzzConnectionLimits checks the uproxy.io/max-connections and
// uproxy.io/max-connections-per-endpoint annotations: a value that parses
// is a limit in 1-2^31-1 that reads back the same when written as a
// number; one that does not is ignored with a warning naming its
// annotation; neither ever rejects the Service, and Ports applies
// the limits that parse to every port.
func FuzzConnectionLimits(f *testing.F) {
	const both = 1<<2 - 1
	f.Add("100", "10", uint8(both))
	f.Add(" 1 ", "2147483647", uint8(both))
	f.Add("0", "-1", uint8(both))
	f.Add("2147483648", "9223372036854775808", uint8(both))
	f.Add("1e3", "0x10", uint8(both))
	f.Add("+5", "", uint8(both))
	f.Add("", "", uint8(0))
	f.Fuzz(func(t *testing.T, total, perEndpoint string, present uint8) {
		ann := map[string]string{}
		for i, kv := range [][2]string{{AnnotationMaxConnections, total}, {AnnotationMaxConnectionsPerEndpoint, perEndpoint}} {
			if present&(1<<i) != 0 {
				ann[kv[0]] = kv[1]
			}
		}
		gotTotal, gotPer, errs := connectionLimits(ann)
		named := map[string]bool{}
		for _, err := range errs {
			for _, name := range []string{AnnotationMaxConnectionsPerEndpoint, AnnotationMaxConnections} {
				if strings.Contains(err.Error(), "annotation "+name+":") {
					named[name] = true
					break
				}
			}
		}
		for _, l := range []struct {
			name string
			got  int
		}{{AnnotationMaxConnections, gotTotal}, {AnnotationMaxConnectionsPerEndpoint, gotPer}} {
			v, ok := ann[l.name]
			switch {
			case !ok && (l.got != 0 || named[l.name]):
				t.Errorf("%s absent: limit %d, warned %t", l.name, l.got, named[l.name])
			case ok && l.got == 0 && !named[l.name]:
				t.Errorf("%s %q: no limit and no warning", l.name, v)
			case ok && l.got != 0 && named[l.name]:
				t.Errorf("%s %q: limit %d and a warning", l.name, v, l.got)
			case l.got < 0 || l.got > math.MaxInt32:
				t.Errorf("%s %q: limit %d out of range", l.name, v, l.got)
			case l.got > 0:
				if again, _, errs := connectionLimits(map[string]string{AnnotationMaxConnections: strconv.Itoa(l.got)}); again != l.got || errs != nil {
					t.Errorf("%s %q: limit %d, which written back reads as %d, %v", l.name, v, l.got, again, errs)
				}
			}
		}
		if len(errs) != len(named) {
			t.Errorf("warnings %v: %d of them name an annotation", errs, len(named))
		}

		s := svc("web", "10.96.0.10", "http:80", "dns:53/UDP")
		s.Annotations = ann
		if err := ValidateService(s); err != nil {
			t.Fatalf("ValidateService() with limits %q = %v; a limit never rejects a Service", ann, err)
		}
		if diff := cmp.Diff(errs, Warnings(s), cmp.Comparer(func(a, b error) bool { return a.Error() == b.Error() })); diff != "" {
			t.Errorf("Warnings() and connectionLimits() disagree (-limits +warnings):\n%s", diff)
		}
		for _, sp := range Ports(s, Defaults{}) {
			if sp.MaxConnections != gotTotal || sp.MaxConnectionsPerEndpoint != gotPer {
				t.Errorf("%s: limits %d, %d; want %d, %d", sp.Name, sp.MaxConnections, sp.MaxConnectionsPerEndpoint, gotTotal, gotPer)
			}
		}
	})
}

// FuzzTopologyHints checks CategorizeEndpoints on EndpointSlices with any
// conditions, nodes and topology hints, as PortEndpoints reads them: each
// set holds endpoints of the port, in their order; the local set only
// this node's; a topology filter keeps only ready endpoints hinted for
// this node or zone, and never leaves the cluster set empty while an
// endpoint is ready; without ready endpoints the sets fall back to the
// serving, terminating ones.
//
// data describes the endpoints, three bytes each: the conditions and
// node, the zones hinted, the nodes hinted (see the decoding below).
func FuzzTopologyHints(f *testing.F) {
	f.Add([]byte{0x07, 0x01, 0x01, 0x17, 0x02, 0x02}, "node-a", "zone-a", uint8(0))
	f.Add([]byte{0x07, 0x01, 0x00, 0x07, 0x02, 0x00, 0x01, 0x01, 0x01}, "node-a", "zone-a", uint8(0))
	f.Add([]byte{0x06, 0x00, 0x00, 0x16, 0x00, 0x00}, "node-a", "", uint8(1))
	f.Add([]byte{0x27, 0x05, 0x05, 0x07, 0x03, 0x03}, "", "zone-a", uint8(2))
	f.Add([]byte{0x07, 0x04, 0x04}, "", "", uint8(3))
	f.Fuzz(func(t *testing.T, data []byte, node, zone string, policy uint8) {
		if len(data) > 3*64 {
			data = data[:3*64]
		}
		// Names that the hints and nodeName choose from: this node or
		// zone, another, or the empty name.
		nodes := []string{node, "node-other", ""}
		zones := []string{zone, "zone-other", ""}
		pick := func(names []string, mask byte) []discovery.ForZone {
			var out []discovery.ForZone
			for i, n := range names {
				if mask&(1<<i) != 0 {
					out = append(out, discovery.ForZone{Name: n})
				}
			}
			return out
		}
		sl := slice("web-1", "web", "http", 8080)
		for i := 0; i+2 < len(data); i += 3 {
			c, zh, nh := data[i], data[i+1], data[i+2]
			e := discovery.Endpoint{
				Addresses: []string{fmt.Sprintf("10.244.%d.%d", i/3/250, i/3%250+1)},
				Conditions: discovery.EndpointConditions{
					Ready: ptr.To(c&1 != 0), Serving: ptr.To(c&2 != 0), Terminating: ptr.To(c&4 != 0),
				},
			}
			if n := nodes[int(c>>4)%len(nodes)]; c&8 != 0 || n != "" {
				e.NodeName = ptr.To(n)
			}
			if zh != 0 || nh != 0 {
				e.Hints = &discovery.EndpointHints{ForZones: pick(zones, zh)}
				for _, n := range pick(nodes, nh) {
					e.Hints.ForNodes = append(e.Hints.ForNodes, discovery.ForNode(n))
				}
			}
			sl.Endpoints = append(sl.Endpoints, e)
		}
		s := svc("web", "10.96.0.10", "http:80")
		s.Spec.Type = v1.ServiceTypeNodePort
		s.Spec.Ports[0].NodePort = 30080
		if policy&1 != 0 {
			s.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal)
		}
		if policy&2 != 0 {
			s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
		}
		if err := ValidateSlice(sl); err != nil {
			return
		}
		sps := Ports(s, Defaults{})
		if len(sps) != 1 {
			t.Fatalf("Ports() = %v, want one port", sps)
		}
		sp := sps[0]
		eps := PortEndpoints(sp, []*discovery.EndpointSlice{sl})
		sets := CategorizeEndpoints(eps, sp, node, zone)

		subsequence := func(what string, set []Endpoint) {
			t.Helper()
			i := 0
			for _, e := range set {
				for i < len(eps) && eps[i].Addr != e.Addr {
					i++
				}
				if i == len(eps) {
					t.Fatalf("%s set %v is not a subsequence of the endpoints %v", what, set, eps)
				}
				i++
			}
		}
		subsequence("cluster", sets.Cluster)
		subsequence("local", sets.Local)
		anyReady := slices.ContainsFunc(eps, func(e Endpoint) bool { return e.Ready })
		draining := func(e Endpoint) bool { return e.Serving && e.Terminating }

		if !sp.UsesClusterEndpoints() && (sets.Cluster != nil || sets.TopologyMode != "") {
			t.Errorf("the port uses no cluster endpoints, but the set is %v (topology %q)", sets.Cluster, sets.TopologyMode)
		}
		if sp.UsesClusterEndpoints() {
			switch sets.TopologyMode {
			case "":
			case v1.ServiceTrafficDistributionPreferSameNode, v1.ServiceTrafficDistributionPreferSameZone:
				hints, want := func(e Endpoint) []string { return e.Hints.nodes() }, node
				if sets.TopologyMode == v1.ServiceTrafficDistributionPreferSameZone {
					hints, want = func(e Endpoint) []string { return e.Hints.zones() }, zone
				}
				for _, e := range sets.Cluster {
					if !e.Ready || !slices.Contains(hints(e), want) {
						t.Errorf("%s: cluster endpoint %+v is not ready and hinted for %q", sets.TopologyMode, e, want)
					}
				}
				for _, e := range eps {
					if e.Ready && len(hints(e)) == 0 {
						t.Errorf("%s although ready endpoint %v has no such hints", sets.TopologyMode, e.Addr)
					}
				}
			default:
				t.Errorf("unknown topology mode %q", sets.TopologyMode)
			}
			for _, e := range sets.Cluster {
				if anyReady && !e.Ready || !anyReady && !draining(e) {
					t.Errorf("cluster endpoint %+v is not usable (any ready: %t)", e, anyReady)
				}
			}
			if anyReady && len(sets.Cluster) == 0 {
				t.Errorf("no cluster endpoint although some are ready (topology %q): %+v", sets.TopologyMode, eps)
			}
			if !anyReady && len(sets.Cluster) != len(filter(eps, draining)) {
				t.Errorf("cluster set %v without ready endpoints; want the serving, terminating ones", sets.Cluster)
			}
		}
		if !sp.UsesLocalEndpoints() && sets.Local != nil {
			t.Errorf("the port uses no local endpoints, but the set is %v", sets.Local)
		}
		localReady := slices.ContainsFunc(eps, func(e Endpoint) bool { return e.Ready && node != "" && e.NodeName == node })
		for _, e := range sets.Local {
			if node == "" || e.NodeName != node || localReady && !e.Ready || !localReady && !draining(e) {
				t.Errorf("local endpoint %+v on node %q (any local ready: %t)", e, node, localReady)
			}
		}
	})
}
