package redirect

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// conntrackDumpTimeout bounds each send and receive of NetlinkConntrack's
// sockets. The kernel answers a dump in parts as the reader takes them,
// and a delete at once, so it only ends a clean that something has gone
// badly wrong with.
const conntrackDumpTimeout = 10 * conntrackTimeout

// NetlinkConntrack is the ConntrackTable of the network namespace it was
// made in, over netlink: ctnetlink (NETLINK_NETFILTER) for the entries,
// rtnetlink for the node's addresses. It is not safe for concurrent use;
// Close releases its sockets.
type NetlinkConntrack struct {
	h *netlink.Handle
}

var _ ConntrackTable = (*NetlinkConntrack)(nil)

// NewNetlinkConntrack returns the NetlinkConntrack of the calling
// thread's network namespace: its sockets stay in that namespace.
func NewNetlinkConntrack() (*NetlinkConntrack, error) {
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("redirect: conntrack table: opening netlink sockets: %w", err)
	}
	if err := h.SetSocketTimeout(conntrackDumpTimeout); err != nil {
		h.Close()
		return nil, fmt.Errorf("redirect: conntrack table: netlink timeouts: %w", err)
	}
	return &NetlinkConntrack{h: h}, nil
}

// Close closes the sockets.
func (n *NetlinkConntrack) Close() {
	n.h.Close()
}

// DeleteUDP dumps family f's conntrack table and deletes, one request
// each, the UDP entries stale reports, at most limit. A dump that the
// kernel reports interrupted (NLM_F_DUMP_INTR: the table changed while it
// was read) may miss entries; those it did return are still judged, and
// the next clean finds the rest, so it is not an error.
func (n *NetlinkConntrack) DeleteUDP(f Family, stale func(ConntrackEntry) bool, limit int) (int, error) {
	family := netlink.InetFamily(unix.AF_INET)
	if f == IPv6 {
		family = unix.AF_INET6
	}
	filter := &staleFilter{stale: stale, left: limit}
	deleted, err := n.h.ConntrackDeleteFilters(netlink.ConntrackTable, family, filter)
	if err != nil {
		err = errors.Join(dropDumpInterrupted(err)...)
	}
	return int(deleted), err
}

// dropDumpInterrupted returns err, or the errors joined in it (the
// interruption and the deletions that failed), but
// netlink.ErrDumpInterrupted.
func dropDumpInterrupted(err error) []error {
	var out []error
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range j.Unwrap() {
			if !errors.Is(e, netlink.ErrDumpInterrupted) {
				out = append(out, e)
			}
		}
		return out
	}
	if !errors.Is(err, netlink.ErrDumpInterrupted) {
		out = append(out, err)
	}
	return out
}

// LocalAddrs returns the addresses of every link of family f.
func (n *NetlinkConntrack) LocalAddrs(f Family) ([]netip.Addr, error) {
	family := netlink.FAMILY_V4
	if f == IPv6 {
		family = netlink.FAMILY_V6
	}
	addrs, err := n.h.AddrList(nil, family)
	if err != nil {
		return nil, fmt.Errorf("listing the %s addresses: %w", f, err)
	}
	out := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}

// staleFilter is the netlink.CustomConntrackFilter of DeleteUDP: it
// matches the UDP entries that stale reports, until left runs out.
type staleFilter struct {
	stale func(ConntrackEntry) bool
	left  int
}

// MatchConntrackFlow reports whether flow is to be deleted.
func (s *staleFilter) MatchConntrackFlow(flow *netlink.ConntrackFlow) bool {
	if s.left <= 0 || flow.Forward.Protocol != unix.IPPROTO_UDP {
		return false
	}
	e := ConntrackEntry{
		Original: ConntrackTuple{Src: addrPort(flow.Forward.SrcIP, flow.Forward.SrcPort), Dst: addrPort(flow.Forward.DstIP, flow.Forward.DstPort)},
		Reply:    ConntrackTuple{Src: addrPort(flow.Reverse.SrcIP, flow.Reverse.SrcPort), Dst: addrPort(flow.Reverse.DstIP, flow.Reverse.DstPort)},
	}
	if !s.stale(e) {
		return false
	}
	s.left--
	return true
}

// addrPort is ip and port as a netip.AddrPort, unmapped; the zero
// AddrPort when ip is not an address.
func addrPort(ip net.IP, port uint16) netip.AddrPort {
	a, ok := netip.AddrFromSlice(ip)
	if !ok {
		return netip.AddrPort{}
	}
	return netip.AddrPortFrom(a.Unmap(), port)
}
