package datapath

import (
	"net/netip"
	"sync/atomic"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/uproxy/uproxy/balancer"
)

// TestUDPGuardedListenerSkipsConntrack runs new clients through a service
// port's own UDP listener in redirect mode, UDPOriginalDst standing for
// conntrack and counting its lookups: a listener whose kernel guard is in
// place (Guarded) and whose addresses all route alike forwards new flows
// without asking; one without the guard, or whose Local policy routes by
// the original destination, or whose source address depends on it (a
// pod keeps its address to the cluster IP, not to a node port), still
// asks once per new client.
func TestUDPGuardedListenerSkipsConntrack(t *testing.T) {
	const clients = 4
	vip := netip.MustParseAddrPort("10.96.0.10:53")
	cases := []struct {
		name    string
		guarded bool
		mode    UDPMode
		// nodePort and policy make the route depend on the original
		// destination when both are set.
		nodePort uint16
		policy   Policy
		// source, unless the annotation sets it, makes the source
		// address depend on the original destination with a node port.
		source SourceIP
		want   int
	}{
		{name: "guarded cluster IP", guarded: true, want: 0},
		{name: "guarded cluster IP, request-reply", guarded: true, mode: UDPRequestReply, want: 0},
		{name: "guarded node port, cluster policies, source by annotation", guarded: true, nodePort: 30053, source: SourceNode, want: 0},
		{name: "guarded node port, cluster policies, source as kube-proxy", guarded: true, nodePort: 30053, want: clients},
		{name: "guarded cluster IP, internal Local", guarded: true, policy: Policy{InternalLocal: true}, want: 0},
		{name: "unguarded", want: clients},
		{name: "unguarded, request-reply", mode: UDPRequestReply, want: clients},
		{name: "guarded node port, external Local", guarded: true, nodePort: 30053, policy: Policy{ExternalLocal: true}, want: clients},
		{name: "guarded node port, internal Local", guarded: true, nodePort: 30053, policy: Policy{InternalLocal: true}, mode: UDPRequestReply, want: clients},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			be := udpBackend(t, "a", false)
			p, lookups := lookupCountingEngine(t, vip)
			l := serve(t, p, "udp4", "kube-system/kube-dns:dns", be)
			snap := testSnapshot("kube-system/kube-dns:dns", be)
			snap.VIP, snap.NodePort, snap.Policy, snap.UDPMode, snap.SourceIP = vip, tc.nodePort, tc.policy, tc.mode, tc.source
			if tc.policy.InternalLocal {
				// The backend is local, so that Local routes reach it too.
				snap.LocalBackends, snap.Local = snap.ClusterBackends, snap.Cluster
			}
			l.Snap.Store(snap)
			l.Guarded.Store(tc.guarded)
			var replies []string
			for range clients {
				replies = append(replies, exchange(t, dialUDP(t, int(l.Port)), []byte("q")))
			}
			want := []string{"a:1", "a:1", "a:1", "a:1"}
			if diff := cmp.Diff(want, replies); diff != "" {
				t.Errorf("replies (-want +got):\n%s", diff)
			}
			if got := int(lookups.Load()); got != tc.want {
				t.Errorf("%d original destination lookups for %d new clients, want %d", got, clients, tc.want)
			}
		})
	}
}

// TestUDPGuardedFlowRoutedByDestinationLater checks that a flow admitted
// without a conntrack lookup is looked up once its service routes by the
// original destination: when externalTrafficPolicy Local comes with a node
// port, the flow's datagrams to the node port go to the local endpoint,
// not on as cluster-IP traffic.
func TestUDPGuardedFlowRoutedByDestinationLater(t *testing.T) {
	a, b := udpBackend(t, "a", false), udpBackend(t, "b", false)
	nodePort := netip.MustParseAddrPort("192.0.2.1:30053")
	p, lookups := lookupCountingEngine(t, nodePort)
	l := serve(t, p, "udp4", "default/syslog:syslog", a)
	snap := testSnapshot("default/syslog:syslog", a)
	// The annotation chooses the source: only the policy routes by the
	// original destination.
	snap.VIP, snap.NodePort, snap.SourceIP = netip.MustParseAddrPort("10.96.0.11:514"), nodePort.Port(), SourceNode
	l.Snap.Store(snap)
	l.Guarded.Store(true)
	c := dialUDP(t, int(l.Port))
	got := []string{exchange(t, c, []byte("q"))}
	n := []int32{lookups.Load()}
	// The same endpoints, now with b local and externalTrafficPolicy Local.
	local := testSnapshot("default/syslog:syslog", a, b)
	local.VIP, local.NodePort, local.Policy, local.SourceIP = snap.VIP, snap.NodePort, Policy{ExternalLocal: true}, SourceNode
	local.LocalBackends = local.Backends[1:]
	local.Local = balancer.New(balancer.RoundRobin, local.LocalBackends)
	l.Snap.Store(local)
	got = append(got, exchange(t, c, []byte("q")))
	n = append(n, lookups.Load())
	if diff := cmp.Diff([]string{"a:1", "b:1"}, got); diff != "" {
		t.Errorf("replies (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]int32{0, 1}, n); diff != "" {
		t.Errorf("lookups after each datagram (-want +got):\n%s", diff)
	}
}

// lookupCountingEngine starts an engine with one event loop whose
// conntrack lookup (Config.UDPOriginalDst) answers orig and counts its
// calls.
func lookupCountingEngine(t *testing.T, orig netip.AddrPort) (*Engine, *atomic.Int32) {
	t.Helper()
	var lookups atomic.Int32
	p := startEngine(t, Config{
		EventLoops: 1,
		UDPOriginalDst: func(client, local netip.AddrPort) (netip.AddrPort, error) {
			lookups.Add(1)
			return orig, nil
		},
	})
	return p, &lookups
}
