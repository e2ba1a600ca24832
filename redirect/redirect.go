// Package redirect puts uproxy's interception rules into the kernel and
// keeps them there.
//
// uproxy listens for each service port on a local port of the node. In the
// nat table, the chain UPROXY-SERVICES holds one REDIRECT rule per service
// port (VIP, protocol, port → local listener port), and the built-in chains
// PREROUTING (traffic from pods and routed through the node) and OUTPUT
// (traffic from the node itself) jump to it. The listener finds out which
// service a connection was for with OriginalDst.
//
// Render turns the wanted Rules into iptables-restore --noflush input, a
// pure function. A Syncer writes that input only when it differs from the
// last successful write, and on a full (periodic) sync reads the kernel back
// with iptables-save and repairs drift. Cleanup removes everything uproxy
// created. Every chain uproxy owns is described once, in the chain table in
// render.go, which Render, Sync and Cleanup all walk.
//
// The package is Linux-only: it drives iptables and reads conntrack.
package redirect

import (
	"errors"
	"fmt"
	"net/netip"
)

// Protocol is the transport protocol of an Intercept: "tcp" or "udp".
type Protocol string

// The protocols an Intercept may name.
const (
	TCP Protocol = "tcp"
	UDP Protocol = "udp"
)

// Family selects the IP family: IPv4 (iptables) or IPv6 (ip6tables).
type Family int

// The families. The zero Family is IPv4.
const (
	IPv4 Family = iota
	IPv6
)

// String returns "IPv4", "IPv6", or "Family(N)" for an unknown value.
func (f Family) String() string {
	switch f {
	case IPv4:
		return "IPv4"
	case IPv6:
		return "IPv6"
	}
	return fmt.Sprintf("Family(%d)", int(f))
}

// valid reports whether f is IPv4 or IPv6.
func (f Family) valid() bool { return f == IPv4 || f == IPv6 }

// command returns the name of the iptables tool with the given suffix
// ("", "-save", "-restore") for f: iptables... for IPv4, ip6tables... for
// IPv6.
func (f Family) command(suffix string) string {
	if f == IPv6 {
		return "ip6tables" + suffix
	}
	return "iptables" + suffix
}

// hostBits is the prefix length of a single address of f.
func (f Family) hostBits() int {
	if f == IPv6 {
		return 128
	}
	return 32
}

// familyOf returns the family of a, which must be unmapped.
func familyOf(a netip.Addr) Family {
	if a.Is4() {
		return IPv4
	}
	return IPv6
}

// Intercept is one destination whose traffic the kernel sends to a local
// proxy listener.
type Intercept struct {
	// Comment is shown in the rule's comment, e.g. "default/web:http".
	// Render quotes and escapes it as iptables-save does, replaces control
	// characters (newlines included) with spaces and invalid UTF-8 with
	// U+FFFD, and cuts it to 255 bytes, the kernel's limit, so any string
	// is safe.
	Comment string
	// Protocol is TCP or UDP.
	Protocol Protocol
	// Dest is the service VIP. An IPv4-mapped IPv6 address counts as IPv4.
	Dest netip.Addr
	// Port is the service port; it must not be zero.
	Port uint16
	// ToPort is the local listener port (REDIRECT --to-ports); it must not
	// be zero.
	ToPort uint16
}

// validate reports why i cannot be rendered, or nil.
func (i Intercept) validate() error {
	switch {
	case i.Protocol != TCP && i.Protocol != UDP:
		return fmt.Errorf("protocol %q is not %q or %q", i.Protocol, TCP, UDP)
	case !i.Dest.IsValid():
		return errors.New("no destination address")
	case i.Dest.Zone() != "":
		return fmt.Errorf("destination %s has a zone", i.Dest)
	case i.Port == 0:
		return errors.New("port 0")
	case i.ToPort == 0:
		return errors.New("listener port 0")
	}
	return nil
}

// key identifies the traffic an Intercept matches: two intercepts with the
// same key would conflict.
type interceptKey struct {
	dest  netip.Addr
	proto Protocol
	port  uint16
}

func (i Intercept) key() interceptKey {
	return interceptKey{dest: i.Dest.Unmap(), proto: i.Protocol, port: i.Port}
}

// Rules is everything uproxy wants in the kernel. One Rules value may mix
// families; each Render or Syncer keeps the parts of its own family.
//
// Later kinds of rules (node ports, external IPs, source ranges, TPROXY)
// become new fields here, rendered into their own chains of the chain table
// in render.go.
type Rules struct {
	// Intercepts may be in any order and mix IPv4 and IPv6 destinations.
	Intercepts []Intercept
}

// validate reports every invalid or conflicting intercept in r, or nil.
func (r Rules) validate() error {
	var errs []error
	seen := make(map[interceptKey]int, len(r.Intercepts))
	for n, i := range r.Intercepts {
		if err := i.validate(); err != nil {
			errs = append(errs, fmt.Errorf("intercept %d (%q): %w", n, i.Comment, err))
			continue
		}
		if prev, dup := seen[i.key()]; dup {
			errs = append(errs, fmt.Errorf("intercept %d (%q) and %d (%q) both match %s %s port %d",
				prev, r.Intercepts[prev].Comment, n, i.Comment, i.Dest.Unmap(), i.Protocol, i.Port))
			continue
		}
		seen[i.key()] = n
	}
	return errors.Join(errs...)
}
