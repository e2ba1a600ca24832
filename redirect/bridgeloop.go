package redirect

import (
	"errors"
	"fmt"
	"net"
	"os"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The bridge loop is a veth pair that tproxy mode sends bridged clients'
// packets through, so that they meet TPROXY a second time, off the bridge.
//
// With br_netfilter on (net.bridge.bridge-nf-call-iptables=1, which bridge
// CNIs and kubeadm require), br_nf_pre_routing runs the IPv4 PREROUTING
// hooks, TPROXY included, while the frame is still on the bridge. When the
// bridge then passes the frame up, ip_rcv_core (net/ipv4/ip_input.c)
// orphans the packet ("Must drop socket now because of tproxy"), which
// drops the socket that nf_tproxy_assign_sock gave it, and ip_sabotage_in
// (net/bridge/br_netfilter_hooks.c) keeps PREROUTING from running again;
// the stack then looks a socket up by the packet's own destination, a
// service address, and finds none. IPv6 does the same in ip6_rcv_core and
// br_nf_pre_routing_ipv6.
//
// So UPROXY-TPROXY puts the bridge mark on what it sees with physdev
// information (on the bridge) and takes it off again for what no TPROXY
// took. What TPROXY took carries both marks, and the rule before the
// TPROXY rule routes it out of BridgeLoopOut. The veth delivers it on
// BridgeLoopIn with its routing and bridge state scrubbed (skb_scrub_packet
// in __dev_forward_skb), where PREROUTING runs at the IP layer: the bridge
// mark comes off, TPROXY hands the packet to the listener, and it is
// delivered locally as any routed client's. Only a connection's first
// packet and datagrams take the loop: the later packets of a connection
// find its socket by the socket match and skip the bridge mark.
//
// Both ends have the same address and no ARP, so the neighbour entry of
// the out end resolves to its own address (arp_constructor, ndisc_
// constructor: NUD_NOARP takes dev_addr), which is the in end's too: the
// packet arrives as PACKET_HOST, and the IP layer takes it.
const (
	BridgeLoopOut = "uproxy-loop0"
	BridgeLoopIn  = "uproxy-loop1"
)

// bridgeLoopAddr is the link address of both ends: locally administered.
var bridgeLoopAddr = net.HardwareAddr{0x02, 0x75, 0x70, 0x72, 0x6f, 0x78}

// ensureBridgeLoop creates the veth pair, or repairs its state: up, no
// ARP, the shared address, and reverse-path filtering off on the in end
// (the clients' addresses are routed through the bridge, not the loop).
func ensureBridgeLoop() (repaired bool, err error) {
	out, err := netlink.LinkByName(BridgeLoopOut)
	var notFound netlink.LinkNotFoundError
	if errors.As(err, &notFound) {
		veth := &netlink.Veth{
			LinkAttrs:        netlink.LinkAttrs{Name: BridgeLoopOut, HardwareAddr: bridgeLoopAddr},
			PeerName:         BridgeLoopIn,
			PeerHardwareAddr: bridgeLoopAddr,
		}
		if err := netlink.LinkAdd(veth); err != nil && !errors.Is(err, unix.EEXIST) {
			return false, fmt.Errorf("adding the bridge loop %s: %w", BridgeLoopOut, err)
		}
		repaired = true
		out, err = netlink.LinkByName(BridgeLoopOut)
	}
	if err != nil {
		return repaired, fmt.Errorf("finding the bridge loop %s: %w", BridgeLoopOut, err)
	}
	in, err := netlink.LinkByName(BridgeLoopIn)
	if err != nil {
		return repaired, fmt.Errorf("finding the bridge loop %s (delete %s to recreate the pair): %w", BridgeLoopIn, BridgeLoopOut, err)
	}
	for _, l := range []netlink.Link{out, in} {
		a := l.Attrs()
		if a.RawFlags&unix.IFF_NOARP == 0 {
			if err := netlink.LinkSetARPOff(l); err != nil {
				return repaired, fmt.Errorf("turning ARP off on %s: %w", a.Name, err)
			}
			repaired = true
		}
		if a.HardwareAddr.String() != bridgeLoopAddr.String() {
			if err := netlink.LinkSetHardwareAddr(l, bridgeLoopAddr); err != nil {
				return repaired, fmt.Errorf("setting the address of %s: %w", a.Name, err)
			}
			repaired = true
		}
		if a.Flags&net.FlagUp == 0 {
			if err := netlink.LinkSetUp(l); err != nil {
				return repaired, fmt.Errorf("bringing %s up: %w", a.Name, err)
			}
			repaired = true
		}
	}
	rpf := "/proc/sys/net/ipv4/conf/" + BridgeLoopIn + "/rp_filter"
	if b, err := os.ReadFile(rpf); err == nil && string(b) != "0\n" {
		if err := os.WriteFile(rpf, []byte("0"), 0o644); err != nil {
			return repaired, fmt.Errorf("turning reverse-path filtering off on %s: %w", BridgeLoopIn, err)
		}
		repaired = true
	}
	return repaired, nil
}

// removeBridgeLoop deletes the veth pair (both ends). A missing one
// counts as removed.
func removeBridgeLoop() error {
	l, err := netlink.LinkByName(BridgeLoopOut)
	var notFound netlink.LinkNotFoundError
	if errors.As(err, &notFound) {
		return nil
	}
	if err == nil {
		err = netlink.LinkDel(l)
	}
	if err != nil && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("deleting the bridge loop %s: %w", BridgeLoopOut, err)
	}
	return nil
}

// bridgeRoute is the bridge table's only route: everything out of
// BridgeLoopOut.
func (r Routing) bridgeRoute(f Family) (*netlink.Route, error) {
	out, err := netlink.LinkByName(BridgeLoopOut)
	if err != nil {
		return nil, fmt.Errorf("finding %s: %w", BridgeLoopOut, err)
	}
	dst := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
	if f == IPv6 {
		dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	return &netlink.Route{
		LinkIndex: out.Attrs().Index,
		Dst:       dst,
		Table:     r.bridgeTable(),
		Scope:     netlink.SCOPE_LINK,
		Family:    netlinkFamily(f),
	}, nil
}

// ensureBridge installs or repairs the bridge loop, its rule and its
// route for family f.
func (r Routing) ensureBridge(f Family) (repaired bool, err error) {
	repaired, err = ensureBridgeLoop()
	if err != nil {
		return repaired, err
	}
	ok, err := ensureRule(f, r.bridgeRule(f))
	repaired = repaired || ok
	if err != nil {
		return repaired, err
	}
	route, err := r.bridgeRoute(f)
	if err != nil {
		return repaired, err
	}
	routes, err := netlink.RouteListFiltered(route.Family, &netlink.Route{Table: r.bridgeTable()}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return repaired, fmt.Errorf("listing %s routes of table %d: %w", f, r.bridgeTable(), err)
	}
	for _, rt := range routes {
		if rt.Type == unix.RTN_UNICAST && rt.LinkIndex == route.LinkIndex && (rt.Dst == nil || isDefault(rt.Dst)) {
			return repaired, nil
		}
	}
	if err := netlink.RouteReplace(route); err != nil {
		return repaired, fmt.Errorf("adding %s route default dev %s table %d: %w", f, BridgeLoopOut, r.bridgeTable(), err)
	}
	return true, nil
}

// removeBridge deletes the bridge rule of family f, and the bridge loop
// with its routes.
func (r Routing) removeBridge(f Family) error {
	return errors.Join(removeRule(f, r.bridgeRule(f)), removeBridgeLoop())
}

// ensureRule adds rule unless a rule of its table, mark and mask exists.
func ensureRule(f Family, rule *netlink.Rule) (added bool, err error) {
	rules, err := netlink.RuleListFiltered(rule.Family, rule, netlink.RT_FILTER_TABLE|netlink.RT_FILTER_MARK|netlink.RT_FILTER_MASK)
	if err != nil {
		return false, fmt.Errorf("listing %s policy rules: %w", f, err)
	}
	if len(rules) > 0 {
		return false, nil
	}
	if err := netlink.RuleAdd(rule); err != nil && !errors.Is(err, os.ErrExist) && !errors.Is(err, unix.EEXIST) {
		return false, fmt.Errorf("adding %s policy rule fwmark 0x%x/0x%x lookup %d: %w", f, rule.Mark, *rule.Mask, rule.Table, err)
	}
	return true, nil
}

// removeRule deletes every copy of rule; none counts as removed.
func removeRule(f Family, rule *netlink.Rule) error {
	for {
		err := netlink.RuleDel(rule)
		if err == nil {
			continue
		}
		if !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("deleting %s policy rule lookup %d: %w", f, rule.Table, err)
		}
		return nil
	}
}
