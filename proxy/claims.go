package proxy

import (
	"fmt"
	"net/netip"
	"slices"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/types"

	"github.com/uproxy/uproxy/proxy/service"
)

// addrClaims records which Service owns each cluster IP and which
// Services name each address as an external or load-balancer IP, so that
// no Service takes another's cluster IP through spec.externalIPs or its
// load balancer's status: the API server allocates a cluster IP to one
// Service, but lets any tenant write any address in externalIPs, even one
// that is not allocated yet. Owned by the sync goroutine.
type addrClaims struct {
	owner     map[netip.Addr]types.NamespacedName
	clusterOf map[types.NamespacedName][]netip.Addr
	// external are the services naming each external or load-balancer
	// address, refused or not, so that a change of the address's owner
	// re-applies them.
	external   map[netip.Addr]map[types.NamespacedName]bool
	externalOf map[types.NamespacedName][]netip.Addr
	// refused are each service's addresses refused when it was last
	// applied, so that a refusal is reported when it starts, not at
	// every sync.
	refused map[types.NamespacedName][]netip.Addr
}

// update records the cluster IPs and the external and load-balancer
// addresses of the service name as applied now (none: deleted). It
// returns the other services whose refusals may change with it: those
// naming as external an address whose owner changed.
func (c *addrClaims) update(name types.NamespacedName, cluster, external []netip.Addr) []types.NamespacedName {
	if c.owner == nil {
		c.owner = map[netip.Addr]types.NamespacedName{}
		c.clusterOf = map[types.NamespacedName][]netip.Addr{}
		c.external = map[netip.Addr]map[types.NamespacedName]bool{}
		c.externalOf = map[types.NamespacedName][]netip.Addr{}
		c.refused = map[types.NamespacedName][]netip.Addr{}
	}
	var changed []netip.Addr
	for _, ip := range c.clusterOf[name] {
		if !slices.Contains(cluster, ip) && c.owner[ip] == name {
			delete(c.owner, ip)
			changed = append(changed, ip)
		}
	}
	for _, ip := range cluster {
		if c.owner[ip] != name {
			c.owner[ip] = name
			changed = append(changed, ip)
		}
	}
	setOrDelete(c.clusterOf, name, cluster)

	for _, ip := range c.externalOf[name] {
		if m := c.external[ip]; m != nil {
			delete(m, name)
			if len(m) == 0 {
				delete(c.external, ip)
			}
		}
	}
	for _, ip := range external {
		m := c.external[ip]
		if m == nil {
			m = map[types.NamespacedName]bool{}
			c.external[ip] = m
		}
		m[name] = true
	}
	setOrDelete(c.externalOf, name, external)
	if len(external) == 0 {
		delete(c.refused, name)
	}

	var affected []types.NamespacedName
	for _, ip := range changed {
		for other := range c.external[ip] {
			if other != name && !slices.Contains(affected, other) {
				affected = append(affected, other)
			}
		}
	}
	return affected
}

func setOrDelete(m map[types.NamespacedName][]netip.Addr, name types.NamespacedName, ips []netip.Addr) {
	if len(ips) == 0 {
		delete(m, name)
	} else {
		m[name] = slices.Clone(ips)
	}
}

// takenBy returns the service other than name that owns ip as its
// cluster IP, if any.
func (c *addrClaims) takenBy(name types.NamespacedName, ip netip.Addr) (types.NamespacedName, bool) {
	o, ok := c.owner[ip.Unmap()]
	return o, ok && o != name
}

// refusal is an address a service names that another service owns as
// its cluster IP.
type refusal struct {
	field string // where the service names it
	addr  netip.Addr
	owner types.NamespacedName
}

func (r refusal) Error() string {
	return fmt.Sprintf("%s: %s is the cluster IP of Service %s; refused, the Service's other addresses are served", r.field, r.addr, r.owner)
}

// refuseTaken returns sp without the external and load-balancer
// addresses that are another service's cluster IP, and what it refused;
// sp itself when it refuses nothing (service ports are immutable, and
// shared by the listeners of both families).
func (c *addrClaims) refuseTaken(sp *service.Port) (*service.Port, []refusal) {
	var refused []refusal
	name := sp.Name.NamespacedName
	keep := func(field string, ips []netip.Addr) []netip.Addr {
		var out []netip.Addr
		for i, ip := range ips {
			owner, taken := c.takenBy(name, ip)
			switch {
			case taken && out == nil:
				out = slices.Clone(ips[:i])
				fallthrough
			case taken:
				refused = append(refused, refusal{field: field, addr: ip, owner: owner})
			case out != nil:
				out = append(out, ip)
			}
		}
		if out == nil {
			return ips
		}
		return out
	}
	ext := keep("spec.externalIPs", sp.ExternalIPs)
	lb := keep("status.loadBalancer.ingress", sp.LoadBalancerIPs)
	if len(refused) == 0 {
		return sp, nil
	}
	cp := *sp
	cp.ExternalIPs, cp.LoadBalancerIPs = ext, lb
	return &cp, refused
}

// newlyRefused records the addresses refused for the service name in
// this apply, and returns those that were not refused in the last one:
// a refusal is reported when it starts, not at every sync.
func (c *addrClaims) newlyRefused(name types.NamespacedName, refused []refusal) []refusal {
	before := c.refused[name]
	var now []netip.Addr
	var fresh []refusal
	for _, r := range refused {
		if slices.Contains(now, r.addr) {
			continue // the same address in both families' ports, or fields
		}
		now = append(now, r.addr)
		if !slices.Contains(before, r.addr) {
			fresh = append(fresh, r)
		}
	}
	if len(now) == 0 {
		delete(c.refused, name)
	} else {
		c.refused[name] = now
	}
	return fresh
}

// refuseTakenAddrs records the addresses of the changed services in
// p.claims, then takes out of their service ports the external and
// load-balancer addresses that are another service's cluster IP, and
// reports the new refusals. Services outside wants that name an address
// whose owner changed are requeued, and the sync runs again for them.
// The rules would rank a cluster IP first anyway (routing.CompareClaims);
// refusing the claim also keeps the other service's Status, Explain and
// health check from advertising an address it does not get.
func (p *Proxier) refuseTakenAddrs(wants []serviceWant) {
	batch := make(map[types.NamespacedName]bool, len(wants))
	for _, w := range wants {
		batch[w.st.Name] = true
	}
	var requeue []types.NamespacedName
	for _, w := range wants {
		var cluster, external []netip.Addr
		for _, wp := range w.ports {
			cluster = appendNew(cluster, wp.sp.ClusterIPs...)
			external = appendNew(external, wp.sp.ExternalIPs...)
			external = appendNew(external, wp.sp.LoadBalancerIPs...)
		}
		for _, other := range p.claims.update(w.st.Name, cluster, external) {
			if !batch[other] && !slices.Contains(requeue, other) {
				requeue = append(requeue, other)
			}
		}
	}
	if len(requeue) > 0 {
		p.tracker.Requeue(requeue...)
		p.reclaim = true
	}
	for _, w := range wants {
		var refused []refusal
		done := map[*service.Port]*service.Port{}
		for i, wp := range w.ports {
			sp, ok := done[wp.sp]
			if !ok {
				var r []refusal
				sp, r = p.claims.refuseTaken(wp.sp)
				done[wp.sp] = sp
				refused = append(refused, r...)
			}
			w.ports[i].sp = sp
		}
		for _, r := range p.claims.newlyRefused(w.st.Name, refused) {
			p.log.Warn("refusing an address of a service: it is another service's cluster IP",
				zap.String("kind", "Service"), zap.Stringer("object", w.st.Name), zap.String("field", r.field),
				zap.Stringer("address", r.addr), zap.Stringer("owner", r.owner))
			p.cfg.Metrics.CountRefusedAddress(refusedTakenClusterIP)
			if p.cfg.OnRefuse != nil && w.st.Service != nil {
				p.cfg.OnRefuse(w.st.Service, r)
			}
		}
	}
}

// refusedTakenClusterIP is the reason label of an address refused because
// it is another service's cluster IP.
const refusedTakenClusterIP = "cluster_ip_of_another_service"

// appendNew appends to s each of ips that it does not hold yet.
func appendNew(s []netip.Addr, ips ...netip.Addr) []netip.Addr {
	for _, ip := range ips {
		if ip = ip.Unmap(); !slices.Contains(s, ip) {
			s = append(s, ip)
		}
	}
	return s
}
