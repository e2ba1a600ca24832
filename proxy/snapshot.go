package proxy

import (
	"net/netip"
	"slices"
	"strings"

	"github.com/uproxy/uproxy/proxy/routing"

	"go.uber.org/zap"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/listeners"
	"github.com/uproxy/uproxy/proxy/service"
)

// buildSnapshot builds a listener's next data-path state. Backends that
// survive keep their identity, so active counts and ejections carry over.
// Source-hash balancers take their tables from hashing.
func (p *Proxier) buildSnapshot(l *listener, sp *service.Port, vip netip.Addr, st changes.ServiceState, zone string, old *routing.Snapshot, hashing *balancer.MaglevRebuild[types.NamespacedName]) *routing.Snapshot {
	s := &routing.Snapshot{ServicePort: sp, Snapshot: &datapath.Snapshot{
		Name: sp.Name, Service: sp.Name.NamespacedName.String(), VIP: netip.AddrPortFrom(vip, sp.Port), NodePort: sp.NodePort, Slots: p.slots.get(sp.Name),
		Policy:         datapath.Policy{InternalLocal: sp.InternalPolicyLocal, ExternalLocal: sp.ExternalPolicyLocal},
		MaxConnections: sp.MaxConnections, MaxConnectionsPerEndpoint: sp.MaxConnectionsPerEndpoint,
		ProxyProtocol: sp.ProxyProtocol, SourceIP: sp.SourceIP, UDPMode: sp.UDPMode,
	}}
	for _, ip := range slices.Concat(sp.ExternalIPs, sp.LoadBalancerIPs) {
		if ip.Is6() == l.Key.V6 {
			s.External = append(s.External, ip)
		}
	}
	eps, refused := service.FilterPortEndpoints(sp, st.Slices, func(ap netip.AddrPort) string { return p.endpointRefusal(sp, ap) })
	for _, r := range refused {
		if r.Addr.Addr().Is6() == l.Key.V6 { // once, by the listener of its family
			p.log.Warn("refusing an endpoint; the service's other endpoints are used",
				zap.String("kind", "EndpointSlice"), zap.String("object", r.Slice), zap.String("field", r.Field),
				zap.Stringer("endpoint", r.Addr), zap.Stringer("servicePort", sp.Name), zap.String("reason", r.Reason))
		}
	}
	otherFamily := func(e service.Endpoint) bool { return e.Addr.Addr().Is6() != l.Key.V6 }
	if !slices.ContainsFunc(eps, otherFamily) {
		s.Endpoints = eps // all of the listener's family: no copy (snapshots are immutable)
	} else {
		s.Endpoints = slices.DeleteFunc(eps, otherFamily) // eps is this call's own
	}
	// Source-hash ports keep the same subset on every node, so that every
	// node sends a client to the same endpoint; the others a subset of
	// their own, so that the nodes together reach every endpoint.
	seed := p.cfg.NodeName
	if sp.Balancer == balancer.SourceHash {
		seed = ""
	}
	all := len(s.Endpoints)
	limit := p.cfg.maxEndpointsPerPort()
	var left int
	if s.Endpoints, left = service.SubsetEndpoints(s.Endpoints, limit, p.cfg.NodeName, seed); left > 0 {
		fam := v1.IPv4Protocol
		if l.Key.V6 {
			fam = v1.IPv6Protocol
		}
		p.log.Warn("too many endpoints for one service port; balancing over a subset of them",
			zap.Stringer("servicePort", sp.Name), zap.String("family", string(fam)),
			zap.Int("endpoints", all), zap.Int("leftOut", left), zap.Int("maxEndpointsPerPort", limit))
	}
	s.Sets = service.CategorizeEndpoints(s.Endpoints, sp, p.cfg.NodeName, zone)

	// One Backend per endpoint address, shared by both sets, found by a
	// scan of s.Backends while there are few (service.SmallSet).
	// Sized once: every endpoint has at most one backend, and appending
	// left the array with up to twice the room, held by the snapshot.
	s.Backends = make([]*balancer.Backend, 0, len(s.Endpoints))
	var byAddr map[netip.AddrPort]*balancer.Backend
	if len(s.Endpoints) > service.SmallSet {
		byAddr = make(map[netip.AddrPort]*balancer.Backend, len(s.Endpoints))
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
	cluster, local := backendsOf(s.Sets.Cluster), backendsOf(s.Sets.Local)
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
	s.Metrics = p.cfg.Metrics.ForPort(sp, s.Backends)
	return s
}

// endpointRefusal returns why sp must not send traffic to the endpoint
// ap, or "" when it may (see service.FilterPortEndpoints). Besides the addresses that
// no Service may use (service.AddrRefusal), it refuses:
//   - an address and port that sp itself intercepts: the proxy's own
//     dial skips this node's rules (Config.OwnMark) but not another
//     node's, which would send it back, and so on. An external IP that
//     is a pod's address (in the cluster CIDR) is the exception: it ends
//     at the pod's node, whose proxy delivers it to the pod, one hop, as
//     kube-proxy does;
//   - on an address of this node, the proxy's own ports: sp's node
//     port, a listener port, or a server of ServerAddrs, which a pod
//     must not reach through a Service address;
//   - a port of Config.NodePortRange on an address of this node, or
//     outside the pod networks when they are known: a loop between
//     nodes;
//   - an address in Config.DeniedEndpoints;
//   - an address of this node on a port Config.NodeEndpointPorts does
//     not allow.
//
// Called by the sync goroutine, which owns the port allocator.
func (p *Proxier) endpointRefusal(sp *service.Port, ap netip.AddrPort) string {
	ip, port := ap.Addr(), ap.Port()
	if why := service.AddrRefusal(ip, p.cfg.LoopbackEndpoints); why != "" {
		return why
	}
	for _, n := range p.cfg.deniedEndpoints() {
		if n.Contains(ip) {
			return "in " + n.String() + ", a network no endpoint may be in (--endpoint-deny-cidrs)"
		}
	}
	pod, podsKnown := p.addrs.inPodNetworks(ip)
	if port == sp.Port && (slices.Contains(sp.ClusterIPs, ip) || slices.Contains(sp.LoadBalancerIPs, ip) ||
		slices.Contains(sp.ExternalIPs, ip) && !pod) {
		return "the service port's own address and port: the proxy's connections to it would be intercepted again"
	}
	for _, s := range p.cfg.ServerAddrs {
		if sp.Name.Protocol == v1.ProtocolTCP && s.Port() == port && (s.Addr().Unmap() == ip || s.Addr().IsUnspecified() && p.addrs.has(ip)) {
			return "an address of the proxy's own servers"
		}
	}
	local := p.addrs.has(ip)
	switch {
	case local && sp.NodePort != 0 && port == sp.NodePort:
		return "the service port's own node port on an address of this node"
	case p.cfg.nodePortRange().Contains(port) && (local || podsKnown && !pod) && !(ip.IsLoopback() && p.cfg.LoopbackEndpoints):
		return "a port of the node-port range on an address outside the pod networks: a node's proxy would intercept it and could send it back"
	case !local:
		return ""
	}
	if p.sockets.InUse(listeners.Key{Name: sp.Name, V6: ip.Is6()}.Network(), port) {
		return "a listener port of the proxy on an address of this node"
	}
	if ip.IsLoopback() && p.cfg.LoopbackEndpoints || sp.Name.NamespacedName == apiServerService || p.cfg.NodeEndpointPorts.Contains(port) {
		return ""
	}
	return "an address of this node, on a port that --node-endpoint-ports does not allow"
}

// apiServerService is the Service of the API server, whose endpoints
// the API server itself writes: they are its own addresses, which on a
// control-plane node are the node's.
var apiServerService = types.NamespacedName{Namespace: "default", Name: "kubernetes"}

// intercepts returns the addresses whose traffic the kernel must send to
// l, given its snapshot s.
func (l *listener) intercepts(s *routing.Snapshot) []routing.Intercept {
	return routing.Intercepts(s, l.Port, l.PortEnd, l.Key.V6)
}

// Intercepts returns the intercepts of every listener, sorted. It must be
// called from the sync goroutine (or before Run).
func (p *Proxier) Intercepts() []routing.Intercept {
	var out []routing.Intercept
	for _, ls := range p.services {
		for _, l := range ls {
			out = append(out, l.intercepts(l.snap.Load())...)
		}
	}
	slices.SortFunc(out, func(a, b routing.Intercept) int {
		if c := a.VIP.Compare(b.VIP); c != 0 {
			return c
		}
		if a.Port != b.Port {
			return int(a.Port) - int(b.Port)
		}
		if a.Protocol != b.Protocol {
			return strings.Compare(string(a.Protocol), string(b.Protocol))
		}
		// Two services claiming one destination: the first wins in the
		// rules (redirect.ServiceRules), and in a shared listener's
		// routes (rebuildRoutes).
		return routing.CompareClaims(a, b)
	})
	return out
}
