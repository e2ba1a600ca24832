package service

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
)

// SkipReason returns why uproxy does not proxy svc at all, or "" when it
// does. These are not errors: kube-proxy skips the same services.
func SkipReason(svc *v1.Service) string {
	// kube-proxy selects with "!label": the label's presence counts, even
	// with an empty value.
	if _, ok := svc.Labels[LabelServiceProxyName]; ok {
		return "labelled " + LabelServiceProxyName
	}
	switch {
	case svc.Spec.Type == v1.ServiceTypeExternalName:
		return "type ExternalName"
	case svc.Spec.ClusterIP == v1.ClusterIPNone:
		return "headless"
	case svc.Spec.ClusterIP == "":
		return "no cluster IP"
	}
	return ""
}

// ValidateService checks the fields of svc that uproxy relies on. An
// invalid Service is rejected whole, on its own: the error says which field
// and why. Services that uproxy skips (headless, ExternalName, another
// proxy's) are valid.
func ValidateService(svc *v1.Service) error {
	if svc.Name == "" {
		return errors.New("metadata.name is empty")
	}
	if SkipReason(svc) != "" {
		return nil
	}
	if _, err := clusterIPs(svc); err != nil {
		return err
	}
	names := map[string]bool{}
	seen := map[string]bool{}
	for i, p := range svc.Spec.Ports {
		field := fmt.Sprintf("spec.ports[%d]", i)
		if p.Port < 1 || p.Port > 65535 {
			return fmt.Errorf("%s.port: %d is not in 1-65535", field, p.Port)
		}
		if err := checkProtocol(p.Protocol); err != nil {
			return fmt.Errorf("%s.protocol: %w", field, err)
		}
		if names[p.Name] {
			return fmt.Errorf("%s.name: duplicate port name %q", field, p.Name)
		}
		names[p.Name] = true
		key := fmt.Sprintf("%d/%s", p.Port, protocolOf(p.Protocol))
		if seen[key] {
			return fmt.Errorf("%s: duplicate port %s", field, key)
		}
		seen[key] = true
		if tp := p.TargetPort; tp.IntVal < 0 || tp.IntVal > 65535 {
			return fmt.Errorf("%s.targetPort: %d is not in 0-65535", field, tp.IntVal)
		}
		if p.NodePort < 0 || p.NodePort > 65535 {
			return fmt.Errorf("%s.nodePort: %d is not in 0-65535", field, p.NodePort)
		}
	}
	if _, err := parseIPs("spec.externalIPs", svc.Spec.ExternalIPs); err != nil {
		return err
	}
	for i, ing := range svc.Status.LoadBalancer.Ingress {
		if ing.IP == "" {
			continue // a hostname-only ingress: nothing to intercept
		}
		if _, err := parseIPs(fmt.Sprintf("status.loadBalancer.ingress[%d].ip", i), []string{ing.IP}); err != nil {
			return err
		}
	}
	if _, err := sourceRanges(svc); err != nil {
		return err
	}
	if hc := svc.Spec.HealthCheckNodePort; hc < 0 || hc > 65535 {
		return fmt.Errorf("spec.healthCheckNodePort: %d is not in 0-65535", hc)
	}
	if _, err := parseBalancer(svc.Annotations); err != nil {
		return err
	}
	if _, err := ParseWeights(svc.Annotations[AnnotationWeights]); err != nil {
		return fmt.Errorf("annotation %s: %w", AnnotationWeights, err)
	}
	if _, err := parsePreserveSourceIP(svc.Annotations); err != nil {
		return err
	}
	if _, err := parseProxyProtocol(svc.Annotations); err != nil {
		return err
	}
	if _, _, err := parseUDPMode(svc.Annotations); err != nil {
		return err
	}
	if svc.Spec.SessionAffinity == v1.ServiceAffinityClientIP {
		if c := svc.Spec.SessionAffinityConfig; c != nil && c.ClientIP != nil && c.ClientIP.TimeoutSeconds != nil {
			if t := *c.ClientIP.TimeoutSeconds; t <= 0 || t > 86400 {
				return fmt.Errorf("spec.sessionAffinityConfig.clientIP.timeoutSeconds: %d is not in 1-86400", t)
			}
		}
	}
	return nil
}

// ValidateSlice checks an EndpointSlice the way ValidateService checks a
// Service. A slice without the service-name label is valid but unused.
func ValidateSlice(s *discovery.EndpointSlice) error {
	if s.Name == "" {
		return errors.New("metadata.name is empty")
	}
	switch s.AddressType {
	case discovery.AddressTypeIPv4, discovery.AddressTypeIPv6, discovery.AddressTypeFQDN:
	default:
		return fmt.Errorf("addressType: unknown type %q", s.AddressType)
	}
	names := map[string]bool{}
	for i, p := range s.Ports {
		field := fmt.Sprintf("ports[%d]", i)
		if p.Port == nil || *p.Port < 1 || *p.Port > 65535 {
			if p.Port == nil {
				return fmt.Errorf("%s.port: missing", field)
			}
			return fmt.Errorf("%s.port: %d is not in 1-65535", field, *p.Port)
		}
		if p.Protocol != nil {
			if err := checkProtocol(*p.Protocol); err != nil {
				return fmt.Errorf("%s.protocol: %w", field, err)
			}
		}
		name := ""
		if p.Name != nil {
			name = *p.Name
		}
		if names[name] {
			return fmt.Errorf("%s.name: duplicate port name %q", field, name)
		}
		names[name] = true
	}
	if s.AddressType == discovery.AddressTypeFQDN {
		return nil
	}
	for i, ep := range s.Endpoints {
		if len(ep.Addresses) == 0 {
			return fmt.Errorf("endpoints[%d].addresses: empty", i)
		}
		for j, a := range ep.Addresses {
			ip, err := netip.ParseAddr(a)
			if err != nil || ip.Zone() != "" {
				return fmt.Errorf("endpoints[%d].addresses[%d]: %q is not an IP address", i, j, a)
			}
			// Unmapped, as PortEndpoints uses it: an IPv4-mapped IPv6
			// address is an IPv4 endpoint.
			if ip.Unmap().Is4() != (s.AddressType == discovery.AddressTypeIPv4) {
				return fmt.Errorf("endpoints[%d].addresses[%d]: %s does not match addressType %s", i, j, a, s.AddressType)
			}
		}
	}
	return nil
}

// checkProtocol accepts the API's protocols. SCTP is valid but not
// proxied: Ports leaves its ports out and Warnings says so,
// because rejecting the object would take its TCP and UDP ports down too.
func checkProtocol(p v1.Protocol) error {
	switch p {
	case "", v1.ProtocolTCP, v1.ProtocolUDP, v1.ProtocolSCTP:
		return nil
	}
	return fmt.Errorf("unknown protocol %q (want TCP, UDP or SCTP)", p)
}

// sctpWarnings returns one error per SCTP port of svc, naming the port:
// uproxy has no SCTP listener, so those ports are not proxied.
func sctpWarnings(svc *v1.Service) []error {
	var errs []error
	for i, p := range svc.Spec.Ports {
		if p.Protocol == v1.ProtocolSCTP {
			errs = append(errs, fmt.Errorf("spec.ports[%d] (%q, %d/SCTP): SCTP is not supported by uproxy; this port is ignored, the service's other ports are proxied", i, p.Name, p.Port))
		}
	}
	return errs
}

// protocolOf applies the API default (TCP) to an empty protocol.
func protocolOf(p v1.Protocol) v1.Protocol {
	if p == "" {
		return v1.ProtocolTCP
	}
	return p
}

// clusterIPs returns the Service's cluster IPs, one per family, falling
// back to spec.clusterIP for objects written without spec.clusterIPs.
func clusterIPs(svc *v1.Service) ([]netip.Addr, error) {
	raw := svc.Spec.ClusterIPs
	if len(raw) == 0 {
		raw = []string{svc.Spec.ClusterIP}
	} else if svc.Spec.ClusterIP != "" && svc.Spec.ClusterIP != raw[0] {
		return nil, fmt.Errorf("spec.clusterIP %q differs from spec.clusterIPs[0] %q", svc.Spec.ClusterIP, raw[0])
	}
	if len(raw) > 2 {
		return nil, fmt.Errorf("spec.clusterIPs: %d addresses, at most 2 (one per family)", len(raw))
	}
	var out []netip.Addr
	for i, s := range raw {
		ip, err := netip.ParseAddr(s)
		if err != nil || ip.Zone() != "" || ip.IsUnspecified() {
			return nil, fmt.Errorf("spec.clusterIPs[%d]: %q is not a valid IP address", i, s)
		}
		ip = ip.Unmap()
		for _, o := range out {
			if o.Is4() == ip.Is4() {
				return nil, fmt.Errorf("spec.clusterIPs[%d]: two addresses of the same family", i)
			}
		}
		out = append(out, ip)
	}
	return out, nil
}

// parseIPs parses addresses, naming the field of the first bad one.
func parseIPs(field string, raw []string) ([]netip.Addr, error) {
	var out []netip.Addr
	for i, r := range raw {
		ip, err := netip.ParseAddr(strings.TrimSpace(r))
		if err != nil || ip.Zone() != "" || ip.IsUnspecified() {
			return nil, fmt.Errorf("%s[%d]: %q is not a valid IP address", field, i, r)
		}
		out = append(out, ip.Unmap())
	}
	return out, nil
}

// sourceRanges parses spec.loadBalancerSourceRanges. Like kube-proxy it
// accepts surrounding spaces.
func sourceRanges(svc *v1.Service) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for i, r := range svc.Spec.LoadBalancerSourceRanges {
		p, err := netip.ParsePrefix(strings.TrimSpace(r))
		if err != nil {
			return nil, fmt.Errorf("spec.loadBalancerSourceRanges[%d]: %q is not a CIDR", i, r)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

// parseUDPMode reads the uproxy.io/udp-mode annotation; set is false
// without one.
func parseUDPMode(ann map[string]string) (m UDPMode, set bool, err error) {
	v, ok := ann[AnnotationUDPMode]
	if !ok {
		return UDPFlow, false, nil
	}
	if m, ok := datapath.ParseUDPMode(strings.TrimSpace(v)); ok {
		return m, true, nil
	}
	return UDPFlow, false, fmt.Errorf("annotation %s: %q is not request-reply, flow or auto", AnnotationUDPMode, v)
}

func parsePreserveSourceIP(ann map[string]string) (datapath.SourceIP, error) {
	v, ok := ann[AnnotationPreserveSourceIP]
	if !ok {
		return datapath.SourceAsKubeProxy, nil
	}
	b, err := strconv.ParseBool(strings.TrimSpace(v))
	if err != nil {
		return datapath.SourceAsKubeProxy, fmt.Errorf("annotation %s: %q is not true or false", AnnotationPreserveSourceIP, v)
	}
	if b {
		return datapath.SourceClient, nil
	}
	return datapath.SourceNode, nil
}

func parseProxyProtocol(ann map[string]string) (int, error) {
	switch v := strings.TrimSpace(ann[AnnotationProxyProtocol]); v {
	case "":
		return 0, nil
	case "v1":
		return 1, nil
	case "v2":
		return 2, nil
	default:
		return 0, fmt.Errorf("annotation %s: %q is not v1 or v2", AnnotationProxyProtocol, v)
	}
}

// maxConnectionLimit is the largest connection limit the annotations take.
const maxConnectionLimit = math.MaxInt32

// connectionLimits parses the uproxy.io/max-connections and
// uproxy.io/max-connections-per-endpoint annotations: a positive integer
// each, absent meaning no limit. It returns the limits (zero for an absent
// or invalid one) and an error for each invalid one.
//
// Unlike the other annotations, an invalid limit does not reject the
// Service: a limit only protects the backends, and rejecting the object
// would take a new service down (or freeze an old one at its last valid
// version) over a typo in it. The limit is ignored instead, and
// Warnings reports why.
func connectionLimits(ann map[string]string) (total, perEndpoint int, errs []error) {
	parse := func(name string) int {
		v, ok := ann[name]
		if !ok {
			return 0
		}
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil || n < 1 || n > maxConnectionLimit {
			errs = append(errs, fmt.Errorf("annotation %s: %q is not an integer in 1-%d; ignored; the default applies", name, v, maxConnectionLimit))
			return 0
		}
		return int(n)
	}
	total = parse(AnnotationMaxConnections)
	perEndpoint = parse(AnnotationMaxConnectionsPerEndpoint)
	return total, perEndpoint, errs
}

// Warnings returns the problems of a valid Service (see
// ValidateService) that uproxy works around rather than rejecting the
// Service for: the SCTP ports and annotations it ignores, and why. Nil
// means none.
func Warnings(svc *v1.Service) []error {
	if SkipReason(svc) != "" {
		return nil
	}
	_, _, errs := connectionLimits(svc.Annotations)
	return append(sctpWarnings(svc), errs...)
}

func parseBalancer(ann map[string]string) (balancer.Kind, error) {
	v, ok := ann[AnnotationBalancer]
	if !ok {
		return "", nil
	}
	k, err := balancer.ParseKind(strings.TrimSpace(v))
	if err != nil {
		return "", fmt.Errorf("annotation %s: %w", AnnotationBalancer, err)
	}
	return k, nil
}

// ParseWeights parses the uproxy.io/weights annotation:
// "10.244.0.11=3,10.244.0.12=1". Spaces around items are allowed. The
// empty string means no weights.
func ParseWeights(s string) (map[netip.Addr]int, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	out := map[netip.Addr]int{}
	for item := range strings.SplitSeq(s, ",") {
		item = strings.TrimSpace(item)
		ipStr, wStr, ok := strings.Cut(item, "=")
		if !ok {
			return nil, fmt.Errorf("%q: want IP=weight", item)
		}
		ip, err := netip.ParseAddr(strings.TrimSpace(ipStr))
		if err == nil && ip.Zone() != "" {
			// Endpoint addresses have no zone (ValidateSlice), so a
			// weight for a zoned address would never apply.
			err = errors.New("an endpoint address has no zone")
		}
		if err != nil {
			return nil, fmt.Errorf("%q: bad IP: %w", item, err)
		}
		w, err := strconv.Atoi(strings.TrimSpace(wStr))
		if err != nil || w < 1 || w > 1000000 {
			return nil, fmt.Errorf("%q: weight must be an integer in 1-1000000", item)
		}
		ip = ip.Unmap()
		if _, dup := out[ip]; dup {
			return nil, fmt.Errorf("%q: %s listed twice", item, ip)
		}
		out[ip] = w
	}
	return out, nil
}

// Defaults are the proxy-wide settings that a Service can override.
type Defaults struct {
	// Balancer is used when the Service has no uproxy.io/balancer
	// annotation. Empty means round-robin.
	Balancer balancer.Kind
	// NoExternalIPs ignores spec.externalIPs, as kube-proxy does with the
	// AllowServiceExternalIPs feature gate off (the CVE-2020-8554
	// mitigation). False intercepts them.
	NoExternalIPs bool
	// MaxConnections bounds the TCP connections in progress per service
	// port when the Service has no uproxy.io/max-connections annotation.
	// Zero means no bound.
	MaxConnections int
}

// Ports converts a valid Service (see ValidateService) into its
// service ports, leaving out SCTP ports (see Warnings). It returns
// nil for services uproxy skips.
func Ports(svc *v1.Service, d Defaults) []*Port {
	if SkipReason(svc) != "" {
		return nil
	}
	ips, err := clusterIPs(svc)
	if err != nil {
		return nil
	}
	kind, _ := parseBalancer(svc.Annotations)
	if kind == "" {
		kind = d.Balancer
	}
	if kind == "" {
		kind = balancer.RoundRobin
	}
	weights, _ := ParseWeights(svc.Annotations[AnnotationWeights])
	var affinity time.Duration
	if svc.Spec.SessionAffinity == v1.ServiceAffinityClientIP {
		affinity = DefaultAffinityTimeout
		if c := svc.Spec.SessionAffinityConfig; c != nil && c.ClientIP != nil && c.ClientIP.TimeoutSeconds != nil {
			affinity = time.Duration(*c.ClientIP.TimeoutSeconds) * time.Second
		}
	}
	name := types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}
	nodePorts := svc.Spec.Type == v1.ServiceTypeNodePort || svc.Spec.Type == v1.ServiceTypeLoadBalancer
	var externalIPs []netip.Addr
	if !d.NoExternalIPs {
		externalIPs, _ = parseIPs("", svc.Spec.ExternalIPs)
	}
	var lbIPs []netip.Addr
	if svc.Spec.Type == v1.ServiceTypeLoadBalancer {
		for _, ing := range svc.Status.LoadBalancer.Ingress {
			// ipMode Proxy: the load balancer rewrites the destination to the
			// node, so the node must not intercept the IP (KEP-1860).
			if ing.IP == "" || (ing.IPMode != nil && *ing.IPMode == v1.LoadBalancerIPModeProxy) {
				continue
			}
			ip, _ := parseIPs("", []string{ing.IP})
			lbIPs = append(lbIPs, ip...)
		}
	}
	ranges, _ := sourceRanges(svc)
	sourceIP, _ := parsePreserveSourceIP(svc.Annotations)
	proxyProto, _ := parseProxyProtocol(svc.Annotations)
	udpMode, udpModeSet, _ := parseUDPMode(svc.Annotations)
	maxConns, maxPerEndpoint, _ := connectionLimits(svc.Annotations)
	internalLocal := svc.Spec.InternalTrafficPolicy != nil && *svc.Spec.InternalTrafficPolicy == v1.ServiceInternalTrafficPolicyLocal
	out := make([]*Port, 0, len(svc.Spec.Ports))
	for _, p := range svc.Spec.Ports {
		if p.Protocol == v1.ProtocolSCTP {
			continue
		}
		sp := &Port{
			Name:                PortName{NamespacedName: name, Port: p.Name, Protocol: protocolOf(p.Protocol)},
			ClusterIPs:          ips,
			Port:                uint16(p.Port),
			ExternalIPs:         externalIPs,
			LoadBalancerIPs:     lbIPs,
			SourceRanges:        ranges,
			InternalPolicyLocal: internalLocal,
			Balancer:            kind,
			Weights:             weights,
			AffinityTimeout:     affinity,
		}
		if nodePorts {
			sp.NodePort = uint16(p.NodePort)
		}
		sp.ExternalPolicyLocal = svc.Spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal && sp.ExternallyAccessible()
		sp.SourceIP = sourceIP
		sp.ProxyProtocol = proxyProto
		sp.UDPMode = udpMode
		if !udpModeSet && p.Port == 53 {
			sp.UDPMode = UDPRequestReply
		}
		sp.MaxConnections, sp.MaxConnectionsPerEndpoint = maxConns, maxPerEndpoint
		if sp.MaxConnections == 0 {
			sp.MaxConnections = d.MaxConnections
		}
		if sp.ExternalPolicyLocal && svc.Spec.Type == v1.ServiceTypeLoadBalancer {
			sp.HealthCheckNodePort = uint16(svc.Spec.HealthCheckNodePort)
		}
		out = append(out, sp)
	}
	return out
}

// SmallSet is the count of endpoints up to which a sync finds them, and
// their backends, by scanning a slice instead of through a map. With 10
// endpoints per service, building those maps (a table each, once past 8
// entries) took a third of the first sync of 10,000 services
// (BenchmarkSyncAll); a scan of 16 addresses costs less than a map's
// hashing.
const SmallSet = 16

// endpointIndex returns the index of the endpoint at ap in eps, or -1.
func endpointIndex(eps []Endpoint, ap netip.AddrPort) int {
	for i, e := range eps {
		if e.Addr == ap {
			return i
		}
	}
	return -1
}

// PortEndpoints returns the endpoints of sp found in its service's slices,
// resolving the target port the way kube-proxy does: through the slice port
// whose name and protocol equal the service port's. Endpoints listed in
// several slices appear once; the first slice (by name) wins. Endpoints of
// both families are returned; the caller splits them per listener family.
func PortEndpoints(sp *Port, slices []*discovery.EndpointSlice) []Endpoint {
	eps, _ := FilterPortEndpoints(sp, slices, nil)
	return eps
}

// Refused is an endpoint that FilterPortEndpoints left out, and why.
type Refused struct {
	// slice names the EndpointSlice ("namespace/name"), field the
	// endpoint's address in it ("endpoints[2].addresses[0]").
	Slice, Field string
	Addr         netip.AddrPort
	Reason       string
}

// AddrRefusal returns why no Service may send traffic to an
// endpoint at ip, or "" when one may. A tenant writes the endpoints of a
// Service without a selector (or a manifest), and the proxy dials them
// from the node: without this, a pod could reach through a Service
// address what only the node should, such as the metrics server on
// 127.0.0.1:10249 or the cloud's metadata service on 169.254.169.254,
// or make the proxy send to a group. Loopback addresses are
// allowed when loopback is set (Config.LoopbackEndpoints).
func AddrRefusal(ip netip.Addr, loopback bool) string {
	switch {
	case ip.IsUnspecified():
		return "an unspecified address"
	case ip.IsLoopback() && !loopback:
		return "a loopback address"
	case ip.IsLinkLocalUnicast():
		return "a link-local address"
	case ip.IsMulticast():
		return "a multicast address"
	case ip == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return "the broadcast address"
	}
	return ""
}

// FilterPortEndpoints is PortEndpoints that also leaves out, and returns, the
// endpoints for which refuse, when not nil, gives a reason.
func FilterPortEndpoints(sp *Port, slices []*discovery.EndpointSlice, refuse func(netip.AddrPort) string) ([]Endpoint, []Refused) {
	var refused []Refused
	// Sized once: appending grew the slice of 10 endpoints five times, a
	// sixth of a 10,000-service sync's allocations (BenchmarkSyncAll).
	n := 0
	for _, s := range slices {
		n += len(s.Endpoints)
	}
	out := make([]Endpoint, 0, n)
	var seen map[netip.AddrPort]int // index in out; nil: out is scanned instead
	if n > SmallSet {
		seen = make(map[netip.AddrPort]int, n)
	}
	for _, s := range sortedSlices(slices) {
		if s.AddressType != discovery.AddressTypeIPv4 && s.AddressType != discovery.AddressTypeIPv6 {
			continue
		}
		if _, ok := s.Labels[LabelHeadless]; ok {
			continue
		}
		port, ok := slicePort(s, sp.Name)
		if !ok {
			continue
		}
		for i, ep := range s.Endpoints {
			if len(ep.Addresses) == 0 {
				continue
			}
			ip, err := netip.ParseAddr(ep.Addresses[0])
			if err != nil {
				continue
			}
			ap := netip.AddrPortFrom(ip.Unmap(), port)
			if refuse != nil {
				if why := refuse(ap); why != "" {
					refused = append(refused, Refused{
						Slice: s.Namespace + "/" + s.Name, Field: fmt.Sprintf("endpoints[%d].addresses[0]", i), Addr: ap, Reason: why,
					})
					continue
				}
			}
			// An address in two slices (an endpoint moving between
			// slices, or a pod IP reused while the terminating pod that
			// had it is still listed) keeps its first copy, unless that
			// one is terminating and the later one is not: the running
			// pod wins, as in kube-proxy's EndpointSliceCache.
			terminating := ep.Conditions.Terminating != nil && *ep.Conditions.Terminating
			at := -1
			if seen != nil {
				if i, ok := seen[ap]; ok {
					at = i
				}
			} else {
				at = endpointIndex(out, ap)
			}
			if at >= 0 && (terminating || !out[at].Terminating) {
				continue
			}
			e := Endpoint{Addr: ap}
			// kube-proxy's reading of unset conditions: ready and serving
			// count as true, terminating as false.
			e.Ready = ep.Conditions.Ready == nil || *ep.Conditions.Ready
			e.Serving = ep.Conditions.Serving == nil || *ep.Conditions.Serving
			e.Terminating = terminating
			if ep.NodeName != nil {
				e.NodeName = *ep.NodeName
			}
			if ep.Zone != nil {
				e.Zone = *ep.Zone
			}
			if h := ep.Hints; h != nil && len(h.ForZones)+len(h.ForNodes) > 0 {
				e.Hints = &EndpointHints{}
				for _, z := range h.ForZones {
					e.Hints.Zones = append(e.Hints.Zones, z.Name)
				}
				for _, n := range h.ForNodes {
					e.Hints.Nodes = append(e.Hints.Nodes, n.Name)
				}
			}
			if at >= 0 {
				out[at] = e
				continue
			}
			if seen != nil {
				seen[ap] = len(out)
			}
			out = append(out, e)
		}
	}
	return out, refused
}

func slicePort(s *discovery.EndpointSlice, name PortName) (uint16, bool) {
	for _, p := range s.Ports {
		pn := ""
		if p.Name != nil {
			pn = *p.Name
		}
		proto := v1.ProtocolTCP
		if p.Protocol != nil {
			proto = *p.Protocol
		}
		if pn == name.Port && proto == name.Protocol && p.Port != nil && *p.Port > 0 && *p.Port <= 65535 {
			return uint16(*p.Port), true
		}
	}
	return 0, false
}

func sortedSlices(in []*discovery.EndpointSlice) []*discovery.EndpointSlice {
	out := slices.Clone(in)
	slices.SortFunc(out, func(a, b *discovery.EndpointSlice) int { return strings.Compare(a.Name, b.Name) })
	return out
}
