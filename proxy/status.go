package proxy

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// Status is what a running Proxier serves: every service port it
// listens for, with its endpoints and their live counters.
type Status struct {
	// Mode is "redirect" or "tproxy".
	Mode string `json:"mode"`
	// LastSync is when the last successful sync ended; zero if none.
	LastSync time.Time `json:"lastSync"`
	// ActiveConnections counts the proxied TCP connections in progress.
	ActiveConnections int `json:"activeConnections"`
	// UDPFlows counts the live UDP flows.
	UDPFlows int `json:"udpFlows"`
	// EventLoops counts the event loops (Config.EventLoops); 0 when
	// goroutines carry the connections.
	EventLoops int `json:"eventLoops"`
	// IO is how the event loops wait and carry small messages: io_uring
	// or epoll; "goroutines" without event loops. A loop whose own ring
	// could not be set up uses epoll, and the log says so.
	IO    string            `json:"io"`
	Ports []ServicePortInfo `json:"ports"`
}

// ServicePortInfo is one listener: a service port in one address family.
type ServicePortInfo struct {
	// Service is "namespace/name"; Port the port's name.
	Service  string `json:"service"`
	Port     string `json:"port"`
	Protocol string `json:"protocol"`
	Family   string `json:"family"` // IPv4 or IPv6
	// Addresses are the destinations the kernel sends to the listener:
	// "ClusterIP 10.96.0.10:80", "NodePort :30080", ...
	Addresses  []string `json:"addresses"`
	ListenPort uint16   `json:"listenPort"`
	// ListenPortEnd, when set, is the last of the listener's consecutive
	// ports (the shared TCP listener under REDIRECT).
	ListenPortEnd uint16 `json:"listenPortEnd,omitempty"`
	// Mode is how traffic reaches the listener: redirect or tproxy.
	Mode     string `json:"mode"`
	Balancer string `json:"balancer"`
	// Affinity is "None" or "ClientIP"; AffinityTimeoutSeconds its timeout.
	Affinity               string `json:"affinity"`
	AffinityTimeoutSeconds int    `json:"affinityTimeoutSeconds,omitempty"`
	// InternalTrafficPolicy and ExternalTrafficPolicy are Cluster or Local.
	InternalTrafficPolicy string         `json:"internalTrafficPolicy"`
	ExternalTrafficPolicy string         `json:"externalTrafficPolicy,omitempty"`
	TopologyMode          string         `json:"topologyMode,omitempty"`
	Endpoints             []EndpointInfo `json:"endpoints"`
}

// ListenPorts returns the listener's port, or its range of ports as
// "first-last".
func (i ServicePortInfo) ListenPorts() string {
	if i.ListenPortEnd > i.ListenPort {
		return fmt.Sprintf("%d-%d", i.ListenPort, i.ListenPortEnd)
	}
	return strconv.Itoa(int(i.ListenPort))
}

// EndpointInfo is one endpoint of a service port, with the live counters
// of its backend.
type EndpointInfo struct {
	Address     string `json:"address"`
	Ready       bool   `json:"ready"`
	Serving     bool   `json:"serving"`
	Terminating bool   `json:"terminating"`
	NodeName    string `json:"nodeName,omitempty"`
	Zone        string `json:"zone,omitempty"`
	// Cluster and Local say whether the endpoint is in the set that
	// cluster traffic, and local traffic, is balanced over.
	Cluster bool `json:"cluster"`
	Local   bool `json:"local"`
	Weight  int  `json:"weight,omitempty"`
	// Active counts the connections in progress to it (and its UDP flows).
	Active int64 `json:"activeConnections"`
	// Ejected: it refused or timed out a recent connection, and balancers
	// skip it until its ejection ends.
	Ejected bool `json:"ejected"`
	// RecentDialErrors counts its consecutive failed connection attempts
	// (reset by a success or when it is re-admitted and succeeds).
	RecentDialErrors int `json:"recentDialErrors"`
}

// statusView is the immutable part of a Status; the live counters are
// read from the Backends when Status is called.
type statusView struct {
	ports []statusPort
}

type statusPort struct {
	info       ServicePortInfo // without Endpoints
	snap       *snapshot
	intercepts []Intercept
}

// updateStatus replaces the status entries of service name with its
// listeners' current snapshots, or removes them when it has none. The
// sync goroutine calls it for each service it applies, so that a sync's
// cost follows the services that changed: at 10,000 services, rebuilding
// every entry took most of an endpoint change's sync
// (BenchmarkSyncEndpointChange). An entry holds only the snapshot and
// the listener's ports; statusView builds the rest when asked, rather
// than every service holding it between requests.
func (p *Proxier) updateStatus(name types.NamespacedName) {
	ls := p.services[name]
	if len(ls) == 0 {
		p.statusPorts.Delete(name)
		return
	}
	entries := make([]statusEntry, 0, len(ls))
	for _, l := range ls {
		entries = append(entries, statusEntry{snap: l.snap.Load(), port: l.Port, portEnd: l.portEnd, v6: l.key.v6})
	}
	p.statusPorts.Store(name, entries)
}

// statusEntry is what a sync stores of one listener for the status.
type statusEntry struct {
	snap          *snapshot
	port, portEnd uint16 // the listener's
	v6            bool
}

// statusPort builds the status of the listener of e.
func (p *Proxier) statusPort(e statusEntry) statusPort {
	s := e.snap
	sp := s.sp
	info := ServicePortInfo{
		Service:               sp.Name.NamespacedName.String(),
		Port:                  sp.Name.Port,
		Protocol:              string(sp.Name.Protocol),
		Family:                "IPv4",
		ListenPort:            e.port,
		ListenPortEnd:         e.portEnd,
		Mode:                  p.mode(),
		Balancer:              string(sp.Balancer),
		Affinity:              "None",
		InternalTrafficPolicy: "Cluster",
		TopologyMode:          s.sets.TopologyMode,
	}
	if e.v6 {
		info.Family = "IPv6"
	}
	if sp.AffinityTimeout > 0 {
		info.Affinity = "ClientIP"
		info.AffinityTimeoutSeconds = int(sp.AffinityTimeout / time.Second)
	}
	if sp.InternalPolicyLocal {
		info.InternalTrafficPolicy = "Local"
	}
	if sp.ExternallyAccessible() {
		info.ExternalTrafficPolicy = "Cluster"
		if sp.ExternalPolicyLocal {
			info.ExternalTrafficPolicy = "Local"
		}
	}
	intercepts := interceptsOf(s, e.port, e.portEnd, e.v6)
	for _, i := range intercepts {
		a := i.Kind.String() + " " + netip.AddrPortFrom(i.VIP, i.Port).String()
		if i.Kind == NodePort {
			a = i.Kind.String() + " :" + strconv.Itoa(int(i.Port))
		}
		info.Addresses = append(info.Addresses, a)
	}
	return statusPort{info: info, snap: s, intercepts: intercepts}
}

// statusView collects every service's status entries, sorted. Safe for
// concurrent use; each service's entries are those of one sync, and
// nil means no sync has completed yet.
func (p *Proxier) statusView() *statusView {
	if p.LastSync().IsZero() {
		return nil
	}
	var v statusView
	p.statusPorts.Range(func(_, entries any) bool {
		for _, e := range entries.([]statusEntry) {
			v.ports = append(v.ports, p.statusPort(e))
		}
		return true
	})
	slices.SortFunc(v.ports, func(a, b statusPort) int {
		return cmp.Or(cmp.Compare(a.info.Service, b.info.Service), cmp.Compare(a.info.Port, b.info.Port),
			cmp.Compare(a.info.Protocol, b.info.Protocol), cmp.Compare(a.info.Family, b.info.Family))
	})
	return &v
}

func (p *Proxier) mode() string {
	if p.cfg.Transparent {
		return "tproxy"
	}
	return "redirect"
}

// Status returns the proxier's state as of its last sync, with live
// connection counts and ejections. Safe for concurrent use: it reads the
// immutable entries that syncs store, and atomic counters.
func (p *Proxier) Status() Status {
	st := Status{Mode: p.mode(), LastSync: p.LastSync(), ActiveConnections: p.ActiveConnections(), UDPFlows: p.UDPFlows()}
	st.EventLoops, st.IO = p.dp.EventLoops()
	v := p.statusView()
	if v == nil {
		return st
	}
	for _, sp := range v.ports {
		info := sp.info
		info.Addresses = slices.Clone(info.Addresses)
		s := sp.snap
		info.Endpoints = make([]EndpointInfo, 0, len(s.endpoints))
		for _, e := range s.endpoints {
			ei := EndpointInfo{
				Address: e.Addr.String(), Ready: e.Ready, Serving: e.Serving, Terminating: e.Terminating,
				NodeName: e.NodeName, Zone: e.Zone,
			}
			if b := s.Backend(e.Addr); b != nil {
				ei.Cluster = slices.Contains(s.ClusterBackends, b)
				ei.Local = slices.Contains(s.LocalBackends, b)
				ei.Weight = b.Weight
				ei.Active = b.Active()
				ei.Ejected = b.Ejected()
				ei.RecentDialErrors = p.dp.Failures(b)
			}
			info.Endpoints = append(info.Endpoints, ei)
		}
		st.Ports = append(st.Ports, info)
	}
	return st
}

// UDPFlows returns the number of live UDP flows. Safe for concurrent use.
func (p *Proxier) UDPFlows() int { return p.dp.UDPFlows() }
