package proxy

import (
	"net/netip"
	"slices"
	"strings"

	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/service"
)

// snapshot is a listener's state as the sync goroutine built it: the
// data path's routing (datapath.Snapshot), which the listener publishes
// to the data path, with the model it was built from, for Status and
// Explain. Immutable, replaced whole.
type snapshot struct {
	*datapath.Snapshot
	sp        *service.Port
	endpoints []service.Endpoint // all endpoints of the listener's family
	sets      service.EndpointSets
}

// buildSnapshot builds a listener's next data-path state. Backends that
// survive keep their identity, so active counts and ejections carry over.
// Source-hash balancers take their tables from hashing.
func (p *Proxier) buildSnapshot(l *listener, sp *service.Port, vip netip.Addr, st changes.ServiceState, zone string, old *snapshot, hashing *balancer.MaglevRebuild) *snapshot {
	s := &snapshot{sp: sp, Snapshot: &datapath.Snapshot{
		Name: sp.Name, Service: sp.Name.NamespacedName.String(), VIP: netip.AddrPortFrom(vip, sp.Port), NodePort: sp.NodePort, Slots: p.portSlots(sp.Name),
		Policy:         datapath.Policy{InternalLocal: sp.InternalPolicyLocal, ExternalLocal: sp.ExternalPolicyLocal},
		MaxConnections: sp.MaxConnections, MaxConnectionsPerEndpoint: sp.MaxConnectionsPerEndpoint,
		ProxyProtocol: sp.ProxyProtocol, PreserveSourceIP: sp.PreserveSourceIP, UDPMode: sp.UDPMode,
	}}
	for _, ip := range slices.Concat(sp.ExternalIPs, sp.LoadBalancerIPs) {
		if ip.Is6() == l.key.v6 {
			s.External = append(s.External, ip)
		}
	}
	eps, refused := service.FilterPortEndpoints(sp, st.Slices, func(ap netip.AddrPort) string { return p.endpointRefusal(sp, ap) })
	for _, r := range refused {
		if r.Addr.Addr().Is6() == l.key.v6 { // once, by the listener of its family
			p.log.Warn("refusing an endpoint; the service's other endpoints are used",
				zap.String("kind", "EndpointSlice"), zap.String("object", r.Slice), zap.String("field", r.Field),
				zap.Stringer("endpoint", r.Addr), zap.Stringer("servicePort", sp.Name), zap.String("reason", r.Reason))
		}
	}
	otherFamily := func(e service.Endpoint) bool { return e.Addr.Addr().Is6() != l.key.v6 }
	if !slices.ContainsFunc(eps, otherFamily) {
		s.endpoints = eps // all of the listener's family: no copy (snapshots are immutable)
	} else {
		s.endpoints = slices.DeleteFunc(eps, otherFamily) // eps is this call's own
	}
	s.sets = service.CategorizeEndpoints(s.endpoints, sp, p.cfg.NodeName, zone)

	// One Backend per endpoint address, shared by both sets, found by a
	// scan of s.Backends while there are few (service.SmallSet).
	// Sized once: every endpoint has at most one backend, and appending
	// left the array with up to twice the room, held by the snapshot.
	s.Backends = make([]*balancer.Backend, 0, len(s.endpoints))
	var byAddr map[netip.AddrPort]*balancer.Backend
	if len(s.endpoints) > service.SmallSet {
		byAddr = make(map[netip.AddrPort]*balancer.Backend, len(s.endpoints))
	}
	find := func(a netip.AddrPort) *balancer.Backend {
		if byAddr == nil {
			return s.Backend(a)
		}
		return byAddr[a]
	}
	backendsOf := func(eps []service.Endpoint) []*balancer.Backend {
		out := make([]*balancer.Backend, 0, len(eps))
		for _, e := range eps {
			b := find(e.Addr)
			if b == nil {
				w := sp.Weights[e.Addr.Addr()]
				if old != nil {
					if ob := old.Backend(e.Addr); ob != nil && ob.Weight == w {
						b = ob
					}
				}
				if b == nil {
					b = balancer.NewBackend(e.Addr, w)
				}
				if byAddr != nil {
					byAddr[e.Addr] = b
				}
				s.Backends = append(s.Backends, b)
			}
			out = append(out, b)
		}
		return out
	}
	cluster, local := backendsOf(s.sets.Cluster), backendsOf(s.sets.Local)
	if old != nil {
		for _, ob := range old.Backends {
			if find(ob.Addr) != ob {
				p.dp.Forget(ob)
			}
		}
	}
	if sp.AffinityTimeout > 0 {
		if l.affinity == nil || l.affinityTimeout != sp.AffinityTimeout {
			l.affinity = balancer.NewAffinityTable(balancer.AffinityConfig{
				Timeout: sp.AffinityTimeout,
				Now:     p.cfg.clock().Now,
			})
			l.affinityTimeout = sp.AffinityTimeout
		}
	} else {
		l.affinity = nil
	}
	build := func(bs []*balancer.Backend) balancer.Balancer {
		var bal balancer.Balancer
		if sp.Balancer == balancer.SourceHash {
			bal = hashing.Balancer(bs)
		} else {
			bal = balancer.New(sp.Balancer, bs)
		}
		if l.affinity != nil {
			bal = l.affinity.Wrap(bal, bs)
		}
		return bal
	}
	s.Cluster, s.Local = build(cluster), build(local)
	s.ClusterBackends, s.LocalBackends = cluster, local
	s.Affinity = l.affinity
	s.Metrics = p.cfg.Metrics.forPort(sp, s.Backends)
	return s
}

// endpointRefusal returns why sp must not send traffic to the endpoint
// ap, or "" when it may (see service.FilterPortEndpoints). Besides the addresses that
// no Service may use (service.AddrRefusal), it refuses:
//   - an address and port that sp itself intercepts: the proxy's own
//     dial skips this node's rules (Config.OwnMark) but not another
//     node's, which would send it back, and so on;
//   - on an address of this node, the proxy's own ports: sp's node
//     port, a listener port, or a server of ServerAddrs, which a pod
//     must not reach through a Service address.
//
// Called by the sync goroutine, which owns the port allocator.
func (p *Proxier) endpointRefusal(sp *service.Port, ap netip.AddrPort) string {
	ip, port := ap.Addr(), ap.Port()
	if why := service.AddrRefusal(ip, p.cfg.LoopbackEndpoints); why != "" {
		return why
	}
	if port == sp.Port && (slices.Contains(sp.ClusterIPs, ip) || slices.Contains(sp.ExternalIPs, ip) || slices.Contains(sp.LoadBalancerIPs, ip)) {
		return "the service port's own address and port: the proxy's connections to it would be intercepted again"
	}
	for _, s := range p.cfg.ServerAddrs {
		if sp.Name.Protocol == v1.ProtocolTCP && s.Port() == port && (s.Addr().Unmap() == ip || s.Addr().IsUnspecified() && p.localAddr(ip)) {
			return "an address of the proxy's own servers"
		}
	}
	if !p.localAddr(ip) {
		return ""
	}
	if sp.NodePort != 0 && port == sp.NodePort {
		return "the service port's own node port on an address of this node"
	}
	if p.ports.inUse(portKey{name: sp.Name, v6: ip.Is6()}.network(), port) {
		return "a listener port of the proxy on an address of this node"
	}
	return ""
}

// localAddr reports whether ip is one of the node's addresses, as the
// last sync read them.
func (p *Proxier) localAddr(ip netip.Addr) bool {
	if addrs := p.localAddrs.Load(); addrs != nil {
		_, found := slices.BinarySearchFunc(*addrs, ip, netip.Addr.Compare)
		return found
	}
	return false
}

// intercepts returns the addresses whose traffic the kernel must send to
// l, given its snapshot s.
func (l *listener) intercepts(s *snapshot) []Intercept {
	return interceptsOf(s, l.Port, l.portEnd, l.key.v6)
}

// interceptsOf returns the intercepts of a listener of family v6 on
// port (to portEnd), given its snapshot s.
func interceptsOf(s *snapshot, port, portEnd uint16, v6 bool) []Intercept {
	proto := s.sp.Name.Protocol
	base := Intercept{Service: s.sp.Name, Protocol: proto, Port: s.sp.Port, ListenPort: port, ListenPortEnd: portEnd,
		Reject: len(s.sets.Cluster) == 0 && len(s.sets.Local) == 0}
	out := []Intercept{with(base, ClusterIP, s.VIP.Addr())}
	for _, ip := range s.sp.ExternalIPs {
		if ip.Is6() == v6 {
			out = append(out, with(base, ExternalIP, ip))
		}
	}
	for _, ip := range s.sp.LoadBalancerIPs {
		if ip.Is6() == v6 {
			i := with(base, LoadBalancerIP, ip)
			i.SourceRanges = s.sp.SourceRanges
			out = append(out, i)
		}
	}
	if s.NodePort != 0 {
		any := netip.IPv4Unspecified()
		if v6 {
			any = netip.IPv6Unspecified()
		}
		i := with(base, NodePort, any)
		i.Port = s.NodePort
		out = append(out, i)
	}
	return out
}

func with(i Intercept, k InterceptKind, ip netip.Addr) Intercept {
	i.Kind, i.VIP = k, ip
	return i
}

func interceptEqual(a, b Intercept) bool {
	return a.Service == b.Service && a.Kind == b.Kind && a.Protocol == b.Protocol && a.VIP == b.VIP &&
		a.Port == b.Port && a.ListenPort == b.ListenPort && a.ListenPortEnd == b.ListenPortEnd &&
		a.Reject == b.Reject && slices.Equal(a.SourceRanges, b.SourceRanges)
}

// Intercepts returns the intercepts of every listener, sorted. It must be
// called from the sync goroutine (or before Run).
func (p *Proxier) Intercepts() []Intercept {
	var out []Intercept
	for _, ls := range p.services {
		for _, l := range ls {
			out = append(out, l.intercepts(l.snap.Load())...)
		}
	}
	slices.SortFunc(out, func(a, b Intercept) int {
		if c := a.VIP.Compare(b.VIP); c != 0 {
			return c
		}
		if a.Port != b.Port {
			return int(a.Port) - int(b.Port)
		}
		if a.Protocol != b.Protocol {
			return strings.Compare(string(a.Protocol), string(b.Protocol))
		}
		if a.Kind != b.Kind {
			return int(a.Kind) - int(b.Kind)
		}
		// Two services claiming one destination: the first wins in the
		// rules, and in a shared listener's routes (servicePortLess).
		return strings.Compare(a.Service.String(), b.Service.String())
	})
	return out
}
