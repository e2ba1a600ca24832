package service

import (
	"slices"

	v1 "k8s.io/api/core/v1"
)

// EndpointSets are the endpoints each kind of traffic to a service port may
// use on this node.
type EndpointSets struct {
	// Cluster are the endpoints for traffic under the Cluster policy, after
	// topology filtering; nil when the port never uses them.
	Cluster []Endpoint
	// Local are this node's endpoints, for traffic under the Local policy;
	// nil when the port never uses them.
	Local []Endpoint
	// TopologyMode is the topology filter applied to Cluster: "" (none),
	// PreferSameZone or PreferSameNode.
	TopologyMode string
}

// CategorizeEndpoints splits eps the way kube-proxy's CategorizeEndpoints
// does (pkg/proxy/topology.go): usable means Ready, falling back to
// Serving and Terminating when none is ready, separately for the cluster
// set and the local set; the cluster set honours topology hints when every
// ready endpoint has one and some are for this node (PreferSameNode) or its
// zone (PreferSameZone); the local set is the endpoints whose nodeName is
// this node.
func CategorizeEndpoints(eps []Endpoint, sp *Port, node, zone string) EndpointSets {
	var sets EndpointSets
	if len(eps) == 0 {
		return sets
	}
	if sp.UsesClusterEndpoints() {
		sets.TopologyMode = topologyMode(eps, node, zone)
		if sets.TopologyMode == "" && !slices.ContainsFunc(eps, func(e Endpoint) bool { return !e.Ready }) {
			// The common case, every endpoint ready and no topology: the
			// cluster set is eps itself (both are read-only).
			sets.Cluster = eps
		} else {
			sets.Cluster = make([]Endpoint, 0, len(eps))
			for _, e := range eps {
				if e.Ready && availableForTopology(e, sets.TopologyMode, node, zone) {
					sets.Cluster = append(sets.Cluster, e)
				}
			}
		}
		if len(sets.Cluster) == 0 {
			// No ready endpoint anywhere (topology was already dropped if
			// none was ready in this zone): use the draining ones.
			sets.Cluster = filter(eps, func(e Endpoint) bool { return e.Serving && e.Terminating })
		}
	}
	if sp.UsesLocalEndpoints() {
		local := func(e Endpoint) bool { return node != "" && e.NodeName == node }
		sets.Local = filter(eps, func(e Endpoint) bool { return local(e) && e.Ready })
		if len(sets.Local) == 0 {
			sets.Local = filter(eps, func(e Endpoint) bool { return local(e) && e.Serving && e.Terminating })
		}
	}
	return sets
}

func filter(eps []Endpoint, keep func(Endpoint) bool) []Endpoint {
	var out []Endpoint
	for _, e := range eps {
		if keep(e) {
			out = append(out, e)
		}
	}
	return out
}

// topologyMode decides which hints, if any, the cluster set follows: the
// node hints if every ready endpoint has node hints and one names this
// node, else the zone hints if every ready endpoint has zone hints and one
// names this node's zone, else none. Partial hints are ignored, so a slice
// controller that is part way through an update never strands traffic.
func topologyMode(eps []Endpoint, node, zone string) string {
	ready, allNode, forNode, allZone, forZone := false, true, false, true, false
	for _, e := range eps {
		if !e.Ready {
			continue
		}
		ready = true
		if len(e.Hints.nodes()) == 0 {
			allNode = false
		} else if slices.Contains(e.Hints.nodes(), node) {
			forNode = true
		}
		if len(e.Hints.zones()) == 0 {
			allZone = false
		} else if slices.Contains(e.Hints.zones(), zone) {
			forZone = true
		}
	}
	switch {
	case !ready:
		return ""
	case allNode && forNode:
		return v1.ServiceTrafficDistributionPreferSameNode
	case allZone && forZone:
		return v1.ServiceTrafficDistributionPreferSameZone
	}
	return ""
}

func availableForTopology(e Endpoint, mode, node, zone string) bool {
	switch mode {
	case v1.ServiceTrafficDistributionPreferSameNode:
		return slices.Contains(e.Hints.nodes(), node)
	case v1.ServiceTrafficDistributionPreferSameZone:
		return slices.Contains(e.Hints.zones(), zone)
	}
	return true
}
