package introspect

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/uproxy/uproxy/proxy/routing"

	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
)

// Explanation says what happens to a connection (or datagram) to one
// destination from one client: which listener catches it, how the
// listener learns where it was going, and which endpoint it would reach.
// The command fills KernelRules and Routes from the node's kernel.
type Explanation struct {
	Destination string `json:"destination"` // "10.96.0.10:80/TCP"
	Client      string `json:"client,omitempty"`
	// Caught is true when a listener takes the traffic; Reason says why
	// not otherwise, or why no endpoint would be reached.
	Caught bool   `json:"caught"`
	Reason string `json:"reason,omitempty"`
	// KernelRules are the node's iptables-save lines that intercept (or
	// drop) the traffic.
	KernelRules []string `json:"kernelRules,omitempty"`
	Service     string   `json:"service,omitempty"`
	Port        string   `json:"port,omitempty"`
	// Kind is the kind of service address: ClusterIP, ExternalIP,
	// LoadBalancerIP or NodePort.
	Kind     string `json:"kind,omitempty"`
	Listener string `json:"listener,omitempty"`
	Mode     string `json:"mode,omitempty"`
	// OriginalDestination says how the listener recovers the address the
	// client sent to.
	OriginalDestination string `json:"originalDestination,omitempty"`
	// EndpointSet is the traffic policy's choice: cluster or local
	// endpoints, and why.
	EndpointSet string `json:"endpointSet,omitempty"`
	// BackendsSee is the source address the backend sees, and why.
	BackendsSee string `json:"backendsSee,omitempty"`
	Balancer    string `json:"balancer,omitempty"`
	Affinity    string `json:"affinity,omitempty"`
	// Pick says how the endpoint is chosen for this client; Backend is
	// the endpoint when it is determined (affinity, source hash, a single
	// candidate, least connections without ties).
	Pick       string   `json:"pick,omitempty"`
	Backend    string   `json:"backend,omitempty"`
	Candidates []string `json:"candidates,omitempty"`
	// Routes maps endpoint addresses to the node's `ip route get` for them.
	Routes map[string]string `json:"routes,omitempty"`
}

// Explain explains traffic to dst over proto from client (invalid: not
// given) with the state of the last sync. It has no side effects: it
// picks nothing and refreshes no affinity. Safe for concurrent use.
func (in *Inspector) Explain(dst netip.AddrPort, proto v1.Protocol, client netip.Addr) Explanation {
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	client = client.Unmap()
	ex := Explanation{Destination: fmt.Sprintf("%s/%s", dst, proto)}
	if client.IsValid() {
		ex.Client = client.String()
	}
	v := in.statusView()
	if v == nil {
		ex.Reason = "uproxy has not synced yet"
		return ex
	}
	local := in.IsLocal(dst.Addr())
	var (
		sp     *statusPort
		caught routing.Intercept
		others []string // ports served at dst's address
	)
	for i := range v.ports {
		for _, in := range v.ports[i].intercepts {
			var addrMatch bool
			if in.Kind == routing.NodePort {
				addrMatch = local && in.VIP.Is4() == dst.Addr().Is4()
			} else {
				addrMatch = in.VIP == dst.Addr()
			}
			if !addrMatch {
				continue
			}
			if in.Port == dst.Port() && in.Protocol == proto {
				if sp == nil {
					sp, caught = &v.ports[i], in
				}
				continue
			}
			if in.Kind != routing.NodePort {
				others = append(others, fmt.Sprintf("%d/%s (%s)", in.Port, in.Protocol, in.Service))
			}
		}
	}
	if sp == nil {
		switch {
		case len(others) > 0:
			slices.Sort(others)
			ex.Reason = fmt.Sprintf("port mismatch: no service port %d/%s at %s; it serves %s", dst.Port(), proto, dst.Addr(), strings.Join(slices.Compact(others), ", "))
		case local:
			ex.Reason = fmt.Sprintf("no such service: %s is a node address, and no service has node port %d/%s", dst.Addr(), dst.Port(), proto)
		default:
			ex.Reason = fmt.Sprintf("no such service: no service has the address %s", dst.Addr())
		}
		return ex
	}
	s := sp.snap
	ex.Service, ex.Port, ex.Kind = sp.info.Service, sp.info.Port, caught.Kind.String()
	ex.Mode = in.mode()
	if len(s.Sets.Cluster) == 0 && len(s.Sets.Local) == 0 {
		// The rules refuse a port with no endpoint at all
		// (Intercept.Reject), from every source, before any listener.
		ex.Reason = fmt.Sprintf("no ready endpoints at all (%d endpoints of this family, %d not ready): the kernel refuses the connection (uproxy's REJECT rule), before any listener", len(s.Endpoints), routing.NotReady(s))
		return ex
	}
	ex.Balancer, ex.Affinity = sp.info.Balancer, sp.info.Affinity
	if sp.info.AffinityTimeoutSeconds > 0 {
		ex.Affinity += fmt.Sprintf(" (%ds)", sp.info.AffinityTimeoutSeconds)
	}
	host := "0.0.0.0"
	if sp.info.Family == "IPv6" {
		host = "[::]"
	}
	udp := proto == v1.ProtocolUDP
	known := !udp || in.Transparent
	switch {
	case in.Transparent:
		host = "127.0.0.1"
		if sp.info.Family == "IPv6" {
			host = "[::1]"
		}
		ex.OriginalDestination = "getsockname: TPROXY delivers the connection unchanged, its local address is the original destination"
		if udp {
			ex.OriginalDestination = "IP_RECVORIGDSTADDR: each datagram carries its original destination"
		}
	case udp:
		ex.OriginalDestination = "not recoverable: REDIRECT rewrote the destination of the datagrams, so they count as cluster-IP traffic (replies leave from the redirected address, which conntrack maps back)"
	default:
		ex.OriginalDestination = "SO_ORIGINAL_DST: read from the REDIRECT's conntrack entry, and checked against the service's addresses"
	}
	ex.Listener = fmt.Sprintf("%s:%s (%s)", host, sp.info.ListenPorts(), strings.ToLower(string(proto)))

	if len(caught.SourceRanges) > 0 {
		if !client.IsValid() {
			ex.Reason = fmt.Sprintf("loadBalancerSourceRanges %v apply: give --from to check the client", caught.SourceRanges)
		} else if !slices.ContainsFunc(caught.SourceRanges, func(r netip.Prefix) bool { return r.Contains(client) }) {
			// The kernel rules that drop it are the rules section's to
			// name: proxy knows the model, not redirect's chains.
			ex.Reason = fmt.Sprintf("loadBalancerSourceRanges reject the client: %s is not in %v (uproxy's firewall rules drop it)", client, caught.SourceRanges)
			return ex
		}
	}
	ex.Caught = true

	internal := in.Internal
	if !client.IsValid() {
		internal = func(netip.Addr) bool { return true }
	}
	choice := datapath.PolicySet(s.Policy, !known || caught.Kind == routing.ClusterIP, client, internal)
	backends, set := s.ClusterBackends, s.Cluster
	if choice.Local() {
		backends, set = s.LocalBackends, s.Local
	}
	switch choice {
	case datapath.LocalInternal:
		ex.EndpointSet = "local: internalTrafficPolicy Local"
	case datapath.LocalExternal:
		ex.EndpointSet = "local: externalTrafficPolicy Local, and the client is outside the cluster"
	case datapath.ClusterShortCircuit:
		ex.EndpointSet = "cluster: externalTrafficPolicy Local, but the client is a pod or the node (kube-proxy's short circuit)"
		if !client.IsValid() {
			ex.EndpointSet = "cluster if the client is a pod or the node, else local (externalTrafficPolicy Local; give --from)"
		}
	default:
		ex.EndpointSet = "cluster"
	}
	ex.BackendsSee = in.backendsSee(s, !known || caught.Kind == routing.ClusterIP, client)
	if s.Sets.TopologyMode != "" && !choice.Local() {
		ex.EndpointSet += ", filtered by topology (" + s.Sets.TopologyMode + ")"
	}
	if len(backends) == 0 {
		ex.Reason = fmt.Sprintf("no ready endpoints in the %s set (%d endpoints of this family, %d not ready): the listener refuses the connection", strings.SplitN(ex.EndpointSet, ":", 2)[0], len(s.Endpoints), routing.NotReady(s))
		return ex
	}
	healthy := slices.ContainsFunc(backends, func(b *balancer.Backend) bool { return !b.Ejected() })
	usable := func(b *balancer.Backend) bool { return !healthy || !b.Ejected() }
	for _, b := range backends {
		c := fmt.Sprintf("%s (%d active", b.Addr, b.Active())
		if b.Ejected() {
			c += ", ejected"
		}
		if sp.info.Balancer == string(balancer.WeightedRoundRobin) || sp.info.Balancer == string(balancer.WeightedLeastConn) {
			c += fmt.Sprintf(", weight %d", max(b.Weight, 1))
		}
		ex.Candidates = append(ex.Candidates, c+")")
	}
	if s.Affinity != nil && client.IsValid() {
		if addr, expires, ok := s.Affinity.Lookup(client); ok {
			if i := slices.IndexFunc(backends, func(b *balancer.Backend) bool { return b.Addr == addr }); i >= 0 && usable(backends[i]) {
				ex.Backend = addr.String()
				ex.Pick = fmt.Sprintf("ClientIP affinity: the client's recorded endpoint, until %s (refreshed by each new connection)", expires.UTC().Format(time.RFC3339))
				return ex
			}
		}
	}
	then := ""
	if s.Affinity != nil {
		then = "; then recorded for ClientIP affinity"
	}
	switch balancer.Kind(sp.info.Balancer) {
	case balancer.SourceHash:
		if !client.IsValid() {
			ex.Pick = "by the client's address (Maglev hash): give --from"
			break
		}
		// The set's own balancer, without its affinity wrapper: a source
		// hash's Pick records nothing.
		hash := balancer.Unwrap(set)
		if b := hash.Pick(client); b != nil {
			ex.Backend = b.Addr.String()
		}
		ex.Pick = "source hash (" + balancer.SourceHashMethod(hash) + ") of the client's address" + then
		if balancer.SourceHashMethod(hash) == "rendezvous" {
			ex.Pick += "; rendezvous because the source-hash tables reached their memory bound"
		}
	case balancer.LeastConn, balancer.WeightedLeastConn:
		weighted := balancer.Kind(sp.info.Balancer) == balancer.WeightedLeastConn
		if balancer.PowerOfTwoChoices(set) {
			ex.Pick = "the fewer active connections of two endpoints drawn at random"
			if weighted {
				ex.Pick = "the fewer active connections per unit of weight of two endpoints drawn in proportion to their weights"
			}
			ex.Pick += fmt.Sprintf(" (power of two choices, past %d endpoints)", balancer.MaxLeastConnScan) + then
			break
		}
		// The balancer's own comparison, without taking its turn.
		best := balancer.LeastLoaded(set)
		ex.Pick = "the fewest active connections"
		if weighted {
			ex.Pick += " per unit of weight"
		}
		if len(best) == 1 {
			ex.Backend = best[0].Addr.String()
		} else {
			ex.Pick += fmt.Sprintf("; %d tie, next in turn among them", len(best))
		}
		ex.Pick += then
	default:
		ex.Pick = "next in turn among the candidates" + then
		if sp.info.Balancer == string(balancer.WeightedRoundRobin) {
			ex.Pick = "next in turn, in proportion to the weights" + then
		}
	}
	if ex.Backend == "" {
		if n := slices.IndexFunc(backends, usable); n >= 0 && len(backends) == 1 {
			ex.Backend = backends[n].Addr.String()
		}
	}
	return ex
}

// backendsSee says which address the backends of s see a client's
// connection come from, and why (datapath.KeepClient).
func (in *Inspector) backendsSee(s *routing.Snapshot, toClusterIP bool, client netip.Addr) string {
	const fallback = " (the node's where the replies could not come back: counted in uproxy_source_ip_fallbacks_total)"
	switch {
	case s.SourceIP == datapath.SourceNode:
		return `the node's address: the service's uproxy.io/preserve-source-ip is "false"`
	case !client.IsValid():
		return "the client's own address where kube-proxy would keep it, else the node's (give --from)"
	case in.Clients != nil && in.Clients.Node(client):
		return "the node's address: the client is the node"
	case datapath.KeepClient(s.SourceIP, in.MasqueradeAll, s.Policy, toClusterIP, client, in.Clients):
		why := "as kube-proxy, which does not masquerade it"
		if s.SourceIP == datapath.SourceClient {
			why = `the service's uproxy.io/preserve-source-ip is "true"`
		}
		return fmt.Sprintf("the client's own address, %s: %s%s", client, why, fallback)
	case in.MasqueradeAll:
		return "the node's address: --masquerade-all"
	case toClusterIP:
		return "the node's address: the client is outside the pod networks, which kube-proxy masquerades"
	}
	return "the node's address: externalTrafficPolicy Cluster, under which kube-proxy masquerades external traffic (it may cross nodes)"
}
