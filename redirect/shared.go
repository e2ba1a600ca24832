package redirect

import (
	"fmt"
	"iter"
	"net/netip"
)

// The shared layout (Rules.Shared) keeps the number of rules constant as
// services come and go; docs/rules.md ("The shared layout")
// says how, and why guarded intercepts keep their own rules.

// SharedComment is the comment of the rule of protocol p that matches
// the service set: PreviousListenerPorts keys the shared listener's port
// by it.
func SharedComment(p Protocol) string { return fmt.Sprintf("uproxy shared %s listener", p) }

// sharedNodePortComment is the comment of the rules of protocol p that
// match the node-port set.
func sharedNodePortComment(p Protocol) string { return fmt.Sprintf("uproxy shared %s node ports", p) }

// protocols are the protocols in the order their rules are rendered.
var protocols = []Protocol{TCP, UDP}

// sharedIntercepts yields, in the shared layout, the valid intercepts of
// f that no Firewall guards, in r's order: the members of f's service
// set. It yields nothing in the per-service layout.
func sharedIntercepts(f Family, r Rules) iter.Seq[InterceptRule] {
	return func(yield func(InterceptRule) bool) {
		if !r.Shared {
			return
		}
		guarded := firewallAllows(f, r)
		for _, i := range r.Intercepts {
			if i.validate() != nil || familyOf(i.Dest.Unmap()) != f {
				continue
			}
			if _, ok := guarded[i.key()]; !ok && !yield(i) {
				return
			}
		}
	}
}

// sharedNodePorts yields, in the shared layout, the valid node ports of
// f, in r's order: the members of f's node-port sets. It yields nothing
// in the per-service layout.
func sharedNodePorts(f Family, r Rules) iter.Seq[NodePort] {
	return func(yield func(NodePort) bool) {
		if !r.Shared {
			return
		}
		for _, n := range r.NodePorts {
			if n.validate() == nil && n.Family == f && !yield(n) {
				return
			}
		}
	}
}

// sharedTarget is the rule of one protocol of the shared layout: the
// protocol and the listener port (or ports toPort-toPortEnd) that its
// set's members are sent to.
type sharedTarget struct {
	proto             Protocol
	toPort, toPortEnd uint16
}

// sharedTargets returns the protocols that have members among the given
// listener ports by protocol, in rendering order, each with its listener
// ports. Rules that Sync accepts have one port (or range) per protocol;
// with several (Sync rejects those), the lowest is taken, so that Render
// does not depend on the input's order.
func sharedTargets(ports map[Protocol]sharedTarget) []sharedTarget {
	var ts []sharedTarget
	for _, p := range protocols {
		if t, ok := ports[p]; ok {
			ts = append(ts, t)
		}
	}
	return ts
}

// lowest records the ports port-end for p in ports unless lower ones are
// there.
func lowest(ports map[Protocol]sharedTarget, p Protocol, port, end uint16) {
	if old, ok := ports[p]; !ok || port < old.toPort || port == old.toPort && end < old.toPortEnd {
		ports[p] = sharedTarget{proto: p, toPort: port, toPortEnd: end}
	}
}

// sharedServiceTargets returns the rules of f's service set: one per
// protocol that has members.
func sharedServiceTargets(f Family, r Rules) []sharedTarget {
	ports := map[Protocol]sharedTarget{}
	for i := range sharedIntercepts(f, r) {
		lowest(ports, i.Protocol, i.ToPort, i.ToPortEnd)
	}
	return sharedTargets(ports)
}

// sharedNodePortTargets returns the rules of f's node-port sets: one per
// protocol that has node ports.
func sharedNodePortTargets(f Family, r Rules) []sharedTarget {
	ports := map[Protocol]sharedTarget{}
	for n := range sharedNodePorts(f, r) {
		lowest(ports, n.Protocol, n.ToPort, n.ToPortEnd)
	}
	return sharedTargets(ports)
}

// serviceSetMatch returns the match of f's service set, as iptables-save
// prints it after the protocol.
func serviceSetMatch(f Family) string {
	return fmt.Sprintf("-m set --match-set %s dst,dst", setOf(serviceSet, f, "").name)
}

// nodePortSetMatch returns the match of the node-port set of f and p, as
// iptables-save prints it.
func nodePortSetMatch(f Family, p Protocol) string {
	return fmt.Sprintf("-m set --match-set %s dst", setOf(nodePortSet, f, p).name)
}

// sharedServiceRules renders the rules of chain that send what f's
// service set matches to target (e.g. "-j REDIRECT --to-ports"), one per
// protocol with members; target gets the protocol's listener ports.
func sharedServiceRules(chain string, f Family, r Rules, target func(port, end uint16) string) []string {
	var rules []string
	for _, t := range sharedServiceTargets(f, r) {
		rules = append(rules, fmt.Sprintf("-A %s -p %s %s -m comment --comment %s %s",
			chain, t.proto, serviceSetMatch(f), quoteComment(SharedComment(t.proto)), target(t.toPort, t.toPortEnd)))
	}
	return rules
}

// sharedKey identifies the listener of the shared layout that an
// intercept or node port goes to.
type sharedKey struct {
	family Family
	proto  Protocol
}

// validateShared reports every valid intercept and node port whose
// listener ports differ from those of the first intercept or node port of
// its family and protocol: the shared layout has one rule, so one
// listener, per family and protocol.
func (r Rules) validateShared() []error {
	type first struct {
		what  string
		ports string
	}
	firsts := map[sharedKey]first{}
	var errs []error
	check := func(k sharedKey, what string, toPort, toPortEnd uint16) {
		ports := fmt.Sprint(toPort)
		if toPortEnd > toPort {
			ports = fmt.Sprintf("%d-%d", toPort, toPortEnd)
		}
		f, ok := firsts[k]
		if !ok {
			firsts[k] = first{what: what, ports: ports}
			return
		}
		if f.ports != ports {
			errs = append(errs, fmt.Errorf("shared layout: %s goes to listener port %s, but %s goes to %s: every %s %s intercept and node port must go to the same one",
				what, ports, f.what, f.ports, k.family, k.proto))
		}
	}
	for n, i := range r.Intercepts {
		if i.validate() == nil {
			dest := i.Dest.Unmap()
			check(sharedKey{familyOf(dest), i.Protocol}, fmt.Sprintf("intercept %d (%q, %s %s)", n, i.Comment, i.Protocol, netip.AddrPortFrom(dest, i.Port)), i.ToPort, i.ToPortEnd)
		}
	}
	for n, np := range r.NodePorts {
		if np.validate() == nil {
			check(sharedKey{np.Family, np.Protocol}, fmt.Sprintf("node port %d (%q, %s port %d)", n, np.Comment, np.Protocol, np.Port), np.ToPort, np.ToPortEnd)
		}
	}
	return errs
}
