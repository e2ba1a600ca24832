package redirect

import (
	"errors"
	"fmt"
	"net"
	"os"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Routing is the policy routing that TPROXY needs: TPROXY hands a packet
// to a local socket, but the packet must also be routed for local
// delivery, which its destination (a service VIP, not the node's) would
// not be. Packets carrying Mark (under Mask) are looked up in Table, whose
// only route is "local default dev lo" (the kernel's TPROXY documentation,
// Documentation/networking/tproxy.rst). The same mark steers node-originated
// packets (marked in mangle OUTPUT) through lo into PREROUTING, and the
// replies to sockets that dial from a client's address back to them.
type Routing struct {
	// Mark and Mask select the packets; zero Mark means 0x200000 (a bit
	// kube-proxy and common CNIs leave alone), zero Mask means Mark.
	Mark, Mask uint32
	// Table is the routing table; zero means 117.
	Table int
	// Priority is the rule's priority; zero means 100 (before main).
	Priority int
}

// DefaultRouting is the Routing uproxy uses.
var DefaultRouting = Routing{}

func (r Routing) mark() uint32 {
	if r.Mark == 0 {
		return 0x200000
	}
	return r.Mark
}

func (r Routing) mask() uint32 {
	if r.Mask == 0 {
		return r.mark()
	}
	return r.Mask
}

func (r Routing) table() int {
	if r.Table == 0 {
		return 117
	}
	return r.Table
}

func (r Routing) priority() int {
	if r.Priority == 0 {
		return 100
	}
	return r.Priority
}

// validate reports why r cannot be rendered, or nil.
func (r Routing) validate() error {
	if m, mask := r.mark(), r.mask(); m&^mask != 0 {
		// MARK --set-xmark and TPROXY --tproxy-mark would flip the bits
		// outside the mask, and the policy rule would test only those
		// inside.
		return fmt.Errorf("mark 0x%x has bits outside its mask 0x%x", m, mask)
	}
	return nil
}

// MarkString is the mark as iptables' MARK and TPROXY targets take it.
func (r Routing) MarkString() string { return fmt.Sprintf("0x%x/0x%x", r.mark(), r.mask()) }

func (r Routing) rule(f Family) *netlink.Rule {
	rule := netlink.NewRule()
	rule.Family = netlinkFamily(f)
	rule.Mark = r.mark()
	mask := r.mask()
	rule.Mask = &mask
	rule.Table = r.table()
	rule.Priority = r.priority()
	return rule
}

func (r Routing) route(f Family) (*netlink.Route, error) {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return nil, fmt.Errorf("finding lo: %w", err)
	}
	dst := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
	if f == IPv6 {
		dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	return &netlink.Route{
		LinkIndex: lo.Attrs().Index,
		Dst:       dst,
		Table:     r.table(),
		Type:      unix.RTN_LOCAL,
		Scope:     netlink.SCOPE_HOST,
		Family:    netlinkFamily(f),
	}, nil
}

func netlinkFamily(f Family) int {
	if f == IPv6 {
		return netlink.FAMILY_V6
	}
	return netlink.FAMILY_V4
}

// Ensure installs the rule and the route for family f if they are
// missing. It is idempotent, and repairs a deleted rule or route.
func (r Routing) Ensure(f Family) (repaired bool, err error) {
	rule := r.rule(f)
	rules, err := netlink.RuleListFiltered(rule.Family, rule, netlink.RT_FILTER_TABLE|netlink.RT_FILTER_MARK|netlink.RT_FILTER_MASK)
	if err != nil {
		return false, fmt.Errorf("listing %s policy rules: %w", f, err)
	}
	if len(rules) == 0 {
		if err := netlink.RuleAdd(rule); err != nil && !errors.Is(err, os.ErrExist) && !errors.Is(err, unix.EEXIST) {
			return false, fmt.Errorf("adding %s policy rule fwmark %s lookup %d: %w", f, r.MarkString(), r.table(), err)
		}
		repaired = true
	}
	route, err := r.route(f)
	if err != nil {
		return repaired, err
	}
	routes, err := netlink.RouteListFiltered(route.Family, &netlink.Route{Table: r.table()}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return repaired, fmt.Errorf("listing %s routes of table %d: %w", f, r.table(), err)
	}
	found := false
	for _, rt := range routes {
		if rt.Type == unix.RTN_LOCAL && rt.LinkIndex == route.LinkIndex && (rt.Dst == nil || isDefault(rt.Dst)) {
			found = true
		}
	}
	if !found {
		if err := netlink.RouteReplace(route); err != nil {
			return repaired, fmt.Errorf("adding %s route local default dev lo table %d: %w", f, r.table(), err)
		}
		repaired = true
	}
	return repaired, nil
}

func isDefault(n *net.IPNet) bool {
	ones, _ := n.Mask.Size()
	return ones == 0
}

// Remove deletes the rule and the route for family f. Missing ones count
// as removed.
func (r Routing) Remove(f Family) error {
	var errs []error
	rule := r.rule(f)
	for {
		err := netlink.RuleDel(rule)
		if err != nil {
			if !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ESRCH) {
				errs = append(errs, fmt.Errorf("deleting %s policy rule: %w", f, err))
			}
			break
		}
	}
	route, err := r.route(f)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	if err := netlink.RouteDel(route); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
		errs = append(errs, fmt.Errorf("deleting %s route of table %d: %w", f, r.table(), err))
	}
	return errors.Join(errs...)
}
