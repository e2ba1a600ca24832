package datapath

import (
	"context"
	"net"
	"net/netip"
	"syscall"
	"testing"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/internal/testlab"
)

// TestUDPPoolNotForPreserveSourceIP runs a request-reply port in tproxy
// mode, in a namespace of its own, where the node's routes put every
// client on its backend's segment, so that preserve-source-ip falls back
// to the node's address (srcfallback.go): a port that asks to keep the
// client's address still gives each client a flow of its own, never a
// pooled socket, whichever address the flow is dialled from. The same
// port without the annotation pools its queries.
func TestUDPPoolNotForPreserveSourceIP(t *testing.T) {
	if !testlab.RunInNetns(t) {
		return
	}
	// The clients send to addresses of their own, where the kernel's
	// TPROXY rule would send them to a listener on loopback: to the
	// listener's port on 127.0.0.2, .3 and .4, which a listener on every
	// address receives. A reply leaves from a socket bound to the
	// address the client sent to (tproxySocket), which takes that
	// address's later datagrams from the listener: hence one address per
	// client.
	vips := []netip.Addr{netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("127.0.0.3"), netip.MustParseAddr("127.0.0.4")}
	listenUDP := func(ctx context.Context, network, _ string) (*net.UDPConn, error) {
		lc := transparentListenConfig()
		transparent := lc.Control
		lc.Control = func(network, address string, c syscall.RawConn) error {
			if err := transparent(network, address, c); err != nil {
				return err
			}
			var serr error
			if err := c.Control(func(fd uintptr) {
				// As the reply sockets do, so that they can bind next to it.
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
			}); err != nil {
				return err
			}
			return serr
		}
		pc, err := lc.ListenPacket(ctx, network, "0.0.0.0:0")
		if err != nil {
			return nil, err
		}
		return pc.(*net.UDPConn), nil
	}
	type counts struct {
		Replies       int
		Flows, Pooled int
		Fallbacks     uint64
	}
	for _, tt := range []struct {
		name     string
		preserve bool
		want     counts
	}{
		{"preserve-source-ip", true, counts{Replies: 3, Flows: 3, Fallbacks: 3}},
		{"the node's address", false, counts{Replies: 3, Pooled: 1}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			be := udpBackend(t, "a", false)
			p := startEngine(t, Config{Transparent: true, EventLoops: 1, ListenUDP: listenUDP})
			// One segment for every address: no reply could come back.
			p.src.lookup = func(netip.Addr) (segment, error) { return segment{link: 1, direct: true}, nil }
			l := serve(t, p, "udp4", "default/dns:dns", be)
			snap := testSnapshot("default/dns:dns", be)
			snap.VIP, snap.External = netip.AddrPortFrom(vips[0], l.Port), vips[1:]
			snap.Metrics = testPortMetrics(snap.Backends...)
			snap.UDPMode, snap.PreserveSourceIP = UDPRequestReply, tt.preserve
			l.Snap.Store(snap)

			var got counts
			for _, vip := range vips {
				c, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(vip, l.Port)))
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				if r := exchange(t, c, []byte("q")); r == "a:1" {
					got.Replies++
				}
			}
			got.Flows, got.Pooled = p.UDPFlows(), int(p.poolOpen.Load())
			got.Fallbacks = snap.Metrics.C.SourceFallbacks[fallbackSameSegment].Load()
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}
