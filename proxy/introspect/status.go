package introspect

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/proxy/routing"

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
	// EventLoops counts the event loops (Config.EventLoops).
	EventLoops int `json:"eventLoops"`
	// IO is how the event loops wait and carry small messages: io_uring
	// or epoll. A loop whose own ring could not be set up uses epoll,
	// and the log says so.
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
	snap       *routing.Snapshot
	intercepts []routing.Intercept
}

// Entry is what a sync stores of one listener for introspection.
type Entry struct {
	Snap          *routing.Snapshot
	Port, PortEnd uint16 // the listener's
	V6            bool
}

// Table holds the entries of every service, each service's replaced
// whole by the sync goroutine (Store) as it applies the service. Safe for
// concurrent use.
type Table struct {
	m sync.Map // types.NamespacedName → []Entry
}

// Store replaces the entries of service name; none removes it.
func (t *Table) Store(name types.NamespacedName, entries []Entry) {
	if len(entries) == 0 {
		t.m.Delete(name)
		return
	}
	t.m.Store(name, entries)
}

// Range calls yield with every entry, in no order, until it returns false.
func (t *Table) Range(yield func(Entry) bool) {
	t.m.Range(func(_, entries any) bool {
		for _, e := range entries.([]Entry) {
			if !yield(e) {
				return false
			}
		}
		return true
	})
}

// Engine is what introspection reads of the data path (datapath.Engine).
// Its methods are safe for concurrent use.
type Engine interface {
	ActiveConnections() int
	UDPFlows() int
	// EventLoops returns the number of event loops and how they wait.
	EventLoops() (int, string)
	// Failures returns b's consecutive failed connection attempts.
	Failures(b *balancer.Backend) int
}

// Inspector answers Status and Explain from the entries of its Table and
// the live counters of the data path. Its fields are set before first
// use; its methods are safe for concurrent use.
type Inspector struct {
	Table
	// Engine is the data path whose counters Status reads.
	Engine Engine
	// Transparent is true in tproxy mode, false in redirect mode.
	Transparent bool
	// LastSync returns when the last successful sync ended; zero if none
	// has, and then Status shows no port and Explain explains nothing.
	LastSync func() time.Time
	// IsLocal reports whether an address is the node's own (or loopback).
	IsLocal func(netip.Addr) bool
	// Internal reports whether a client is a pod or the node itself.
	Internal func(netip.Addr) bool
	// Clients and MasqueradeAll are the data path's, which decide the
	// address backends see (datapath.KeepClient).
	Clients       datapath.Clients
	MasqueradeAll bool
}

// statusPort builds the status of the listener of e.
func (in *Inspector) statusPort(e Entry) statusPort {
	s := e.Snap
	sp := s.ServicePort
	info := ServicePortInfo{
		Service:               sp.Name.NamespacedName.String(),
		Port:                  sp.Name.Port,
		Protocol:              string(sp.Name.Protocol),
		Family:                "IPv4",
		ListenPort:            e.Port,
		ListenPortEnd:         e.PortEnd,
		Mode:                  in.mode(),
		Balancer:              string(sp.Balancer),
		Affinity:              "None",
		InternalTrafficPolicy: "Cluster",
		TopologyMode:          s.Sets.TopologyMode,
	}
	if e.V6 {
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
	intercepts := routing.Intercepts(s, e.Port, e.PortEnd, e.V6)
	for _, i := range intercepts {
		a := i.Kind.String() + " " + netip.AddrPortFrom(i.VIP, i.Port).String()
		if i.Kind == routing.NodePort {
			a = i.Kind.String() + " :" + strconv.Itoa(int(i.Port))
		}
		info.Addresses = append(info.Addresses, a)
	}
	return statusPort{info: info, snap: s, intercepts: intercepts}
}

// statusView collects every service's status entries, sorted. Safe for
// concurrent use; each service's entries are those of one sync, and
// nil means no sync has completed yet.
func (in *Inspector) statusView() *statusView {
	if in.LastSync().IsZero() {
		return nil
	}
	var v statusView
	in.Range(func(e Entry) bool {
		v.ports = append(v.ports, in.statusPort(e))
		return true
	})
	slices.SortFunc(v.ports, func(a, b statusPort) int {
		return cmp.Or(cmp.Compare(a.info.Service, b.info.Service), cmp.Compare(a.info.Port, b.info.Port),
			cmp.Compare(a.info.Protocol, b.info.Protocol), cmp.Compare(a.info.Family, b.info.Family))
	})
	return &v
}

func (in *Inspector) mode() string {
	if in.Transparent {
		return "tproxy"
	}
	return "redirect"
}

// Status returns the proxier's state as of its last sync, with live
// connection counts and ejections. Safe for concurrent use: it reads the
// immutable entries that syncs store, and atomic counters.
func (in *Inspector) Status() Status {
	st := Status{Mode: in.mode(), LastSync: in.LastSync(), ActiveConnections: in.Engine.ActiveConnections(), UDPFlows: in.Engine.UDPFlows()}
	st.EventLoops, st.IO = in.Engine.EventLoops()
	v := in.statusView()
	if v == nil {
		return st
	}
	for _, sp := range v.ports {
		info := sp.info
		info.Addresses = slices.Clone(info.Addresses)
		s := sp.snap
		info.Endpoints = make([]EndpointInfo, 0, len(s.Endpoints))
		for _, e := range s.Endpoints {
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
				ei.RecentDialErrors = in.Engine.Failures(b)
			}
			info.Endpoints = append(info.Endpoints, ei)
		}
		st.Ports = append(st.Ports, info)
	}
	return st
}
