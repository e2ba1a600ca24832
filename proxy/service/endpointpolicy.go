package service

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// DefaultDeniedEndpoints are the networks that no endpoint may be in
// unless the operator says otherwise: the clouds' instance metadata and
// host services that are not link-local (link-local addresses, where
// most clouds put theirs, are refused anyway, see AddrRefusal). The
// proxy dials from the host network namespace, with the node's address
// for a client it does not keep, which gets around IMDSv2's hop limit
// and any host firewall that trusts the node.
var DefaultDeniedEndpoints = []netip.Prefix{
	netip.MustParsePrefix("fd00:ec2::254/128"),  // AWS instance metadata (IPv6)
	netip.MustParsePrefix("fd00:ec2::253/128"),  // AWS DNS resolver (IPv6)
	netip.MustParsePrefix("fd00:ec2::123/128"),  // AWS time sync (IPv6)
	netip.MustParsePrefix("100.100.100.200/32"), // Alibaba Cloud metadata
	netip.MustParsePrefix("168.63.129.16/32"),   // Azure WireServer
}

// ParsePrefixes parses a comma-separated list of networks (CIDRs) or
// single addresses, as --endpoint-deny-cidrs takes them. An empty
// string is an empty, non-nil list.
func ParsePrefixes(s string) ([]netip.Prefix, error) {
	out := []netip.Prefix{}
	for item := range strings.SplitSeq(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		if !strings.Contains(item, "/") {
			ip, err := netip.ParseAddr(item)
			if err != nil || ip.Zone() != "" {
				return nil, fmt.Errorf("%q is not an IP address or CIDR", item)
			}
			ip = ip.Unmap()
			out = append(out, netip.PrefixFrom(ip, ip.BitLen()))
			continue
		}
		p, err := netip.ParsePrefix(item)
		if err != nil {
			return nil, fmt.Errorf("%q is not an IP address or CIDR", item)
		}
		if p.Addr().Is4In6() {
			if p.Bits() < 96 {
				return nil, fmt.Errorf("%q: an IPv4-mapped network must be at least /96", item)
			}
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

// PortRange is the ports First to Last, inclusive.
type PortRange struct{ First, Last uint16 }

// Contains reports whether port is in r.
func (r PortRange) Contains(port uint16) bool { return r.First <= port && port <= r.Last }

// DefaultNodePortRange is the API server's default
// --service-node-port-range.
var DefaultNodePortRange = PortRange{First: 30000, Last: 32767}

// PortRanges is a set of ports, as --node-endpoint-ports takes it. The
// zero value holds none.
type PortRanges []PortRange

// Contains reports whether port is in r.
func (r PortRanges) Contains(port uint16) bool {
	return slices.ContainsFunc(r, func(pr PortRange) bool { return pr.Contains(port) })
}

// String formats r as ParsePortRanges reads it.
func (r PortRanges) String() string {
	parts := make([]string, len(r))
	for i, pr := range r {
		if pr.First == pr.Last {
			parts[i] = strconv.Itoa(int(pr.First))
		} else {
			parts[i] = fmt.Sprintf("%d-%d", pr.First, pr.Last)
		}
	}
	return strings.Join(parts, ",")
}

// ParsePortRanges parses a comma-separated list of ports and inclusive
// ranges ("6443,9100-9110").
func ParsePortRanges(s string) (PortRanges, error) {
	var out PortRanges
	port := func(v string) (uint16, error) {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < 1 || n > 65535 {
			return 0, fmt.Errorf("%q is not a port in 1-65535", strings.TrimSpace(v))
		}
		return uint16(n), nil
	}
	for item := range strings.SplitSeq(s, ",") {
		if strings.TrimSpace(item) == "" {
			continue
		}
		a, b, isRange := strings.Cut(item, "-")
		first, err := port(a)
		if err != nil {
			return nil, err
		}
		last := first
		if isRange {
			if last, err = port(b); err != nil {
				return nil, err
			}
			if last < first {
				return nil, fmt.Errorf("%q: the range ends before it starts", strings.TrimSpace(item))
			}
		}
		out = append(out, PortRange{First: first, Last: last})
	}
	return out, nil
}
