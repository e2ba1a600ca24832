package listeners

import (
	"errors"
	"fmt"
	"iter"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
)

// PortRange is the range of local ports listeners may use, as given to
// --proxy-port-range. The zero value means any port the kernel would
// assign to bind(0) (see portAllocator).
type PortRange struct {
	Base uint16 // first port
	Size int    // number of ports; zero means the kernel's range for bind(0)
}

// ParsePortRange parses kube-proxy's --proxy-port-range syntax:
// "begin-end" (inclusive), "begin+offset", a single port, or "" for
// the kernel's range for bind(0).
func ParsePortRange(s string) (PortRange, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return PortRange{}, nil
	}
	parse := func(v string) (int, error) {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < 1 || n > 65535 {
			return 0, fmt.Errorf("invalid port range %q: %q is not a port in 1-65535", s, v)
		}
		return n, nil
	}
	if a, b, ok := strings.Cut(s, "-"); ok {
		lo, err := parse(a)
		if err != nil {
			return PortRange{}, err
		}
		hi, err := parse(b)
		if err != nil {
			return PortRange{}, err
		}
		if hi < lo {
			return PortRange{}, fmt.Errorf("invalid port range %q: end is before start", s)
		}
		return PortRange{Base: uint16(lo), Size: hi - lo + 1}, nil
	}
	if a, b, ok := strings.Cut(s, "+"); ok {
		lo, err := parse(a)
		if err != nil {
			return PortRange{}, err
		}
		off, err := strconv.Atoi(strings.TrimSpace(b))
		if err != nil || off < 0 || off > 65535-lo { // not lo+off: it can overflow
			return PortRange{}, fmt.Errorf("invalid port range %q: offset must keep the range within 65535", s)
		}
		return PortRange{Base: uint16(lo), Size: off + 1}, nil
	}
	p, err := parse(s)
	if err != nil {
		return PortRange{}, err
	}
	return PortRange{Base: uint16(p), Size: 1}, nil
}

// String returns the range in "begin-end" form, or "" for the kernel's
// range.
func (r PortRange) String() string {
	if r.Size == 0 {
		return ""
	}
	return fmt.Sprintf("%d-%d", r.Base, int(r.Base)+r.Size-1)
}

// ErrPorts says that the listeners hold every port they may: all of
// --proxy-port-range, or, without one, their share of the kernel's range
// for bind(0) (portAllocator.checkShare).
var ErrPorts = errors.New("the listener ports are spent")

// errRangeExhausted says that every port of the range is taken.
var errRangeExhausted = fmt.Errorf("%w: every port of the proxy port range is taken", ErrPorts)

// errOutsideRange says that a port is not in the range.
var errOutsideRange = errors.New("outside the proxy port range")

// portAllocator hands out ports from a PortRange, round-robin so a port
// that was just freed is reused last (its old connections may linger in
// TIME_WAIT). It is used only by the sync goroutine.
//
// With no range it picks from the kernel's own range for bind(0)
// (ephemeralPorts), the ports the kernel would have assigned, instead of
// binding port 0: with thousands of listeners, each bind(0) scans the
// range past the ports already taken (inet_csk_find_open_port), so
// binding them all grows with the square of their number, where a port
// named in the call is found at once. Of that range, the listeners of a
// protocol hold at most half (checkShare).
type portAllocator struct {
	r    PortRange
	next int
	used map[string]map[uint16]bool // by network ("tcp4", "udp6", …)

	// eph is the kernel's range, read on the first allocation without a
	// range (ephOnce); nil if it could not be read, and then the kernel
	// assigns ports.
	eph     *ephemeralPorts
	ephOnce bool
	// ephShare is how many ports of eph one protocol's listeners may
	// hold (checkShare); ephHeld counts those they hold, by protocol
	// ("tcp", "udp"), a port held in both families once.
	ephShare int
	ephHeld  map[string]int
	// readEph reads the kernel's range; nil means readEphemeralPorts.
	readEph func() (*ephemeralPorts, error)
	// randN returns a random offset in [0, n), where a scan of the
	// kernel's range starts; nil means rand.IntN.
	randN func(n int) int
	// warn, if set, is told once why the kernel's range could not be
	// read.
	warn func(error)
}

// ephemeralPorts is the range the kernel assigns local ports from, less
// the ports reserved for explicit binds (ip(7): ip_local_port_range,
// ip_local_reserved_ports), read once: a later change is not followed.
type ephemeralPorts struct {
	lo, hi   uint16
	reserved map[uint16]bool
}

// size is the number of ports in e, reserved ones included.
func (e *ephemeralPorts) size() int { return int(e.hi) - int(e.lo) + 1 }

// candidates yields the ports of e that are not reserved, from the
// offset start on and round: the odd ones first, then the even ones. The
// kernel does the same for bind(0) and the opposite for connect(), so
// that listeners leave the even half of the range to outgoing
// connections (Linux 4.6, "tcp/dccp: try to not exhaust
// ip_local_port_range in connect()").
func (e *ephemeralPorts) candidates(start int) iter.Seq[uint16] {
	return func(yield func(uint16) bool) {
		n := e.size()
		for _, parity := range []int{1, 0} {
			for i := range n {
				p := uint16(int(e.lo) + (start+i)%n)
				if int(p)%2 != parity || e.reserved[p] {
					continue
				}
				if !yield(p) {
					return
				}
			}
		}
	}
}

// readEphemeralPorts reads the kernel's range for bind(0) in uproxy's
// network namespace. The IPv4 settings apply to IPv6 too (ip(7)).
func readEphemeralPorts() (*ephemeralPorts, error) {
	rng, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return nil, err
	}
	reserved, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_reserved_ports")
	if err != nil {
		return nil, err
	}
	return parseEphemeralPorts(string(rng), string(reserved))
}

// parseEphemeralPorts parses ip_local_port_range ("32768\t60999") and
// ip_local_reserved_ports ("", or "8080,9000-9100").
func parseEphemeralPorts(rng, reserved string) (*ephemeralPorts, error) {
	f := strings.Fields(rng)
	if len(f) != 2 {
		return nil, fmt.Errorf("ip_local_port_range %q: not two ports", strings.TrimSpace(rng))
	}
	lo, err1 := strconv.ParseUint(f[0], 10, 16)
	hi, err2 := strconv.ParseUint(f[1], 10, 16)
	if err := errors.Join(err1, err2); err != nil || lo == 0 || hi < lo {
		return nil, fmt.Errorf("ip_local_port_range %q: not a range of ports", strings.TrimSpace(rng))
	}
	e := &ephemeralPorts{lo: uint16(lo), hi: uint16(hi), reserved: map[uint16]bool{}}
	if s := strings.TrimSpace(reserved); s != "" {
		for _, item := range strings.Split(s, ",") {
			r, err := ParsePortRange(item)
			if err != nil || r.Size == 0 {
				return nil, fmt.Errorf("ip_local_reserved_ports %q: %q is not a port or range", s, item)
			}
			for i := range r.Size {
				e.reserved[r.Base+uint16(i)] = true
			}
		}
	}
	return e, nil
}

// handedOut reports whether the kernel may hand port to bind(0) or to an
// outgoing connection: it is in the range and not reserved.
func (e *ephemeralPorts) handedOut(port uint16) bool {
	return port >= e.lo && port <= e.hi && !e.reserved[port]
}

// ephemeral returns the kernel's range for bind(0), reading it on first
// use; nil when it cannot be read.
func (a *portAllocator) ephemeral() *ephemeralPorts {
	if !a.ephOnce {
		a.ephOnce = true
		read := a.readEph
		if read == nil {
			read = readEphemeralPorts
		}
		var err error
		// Without the range, bind(0) assigns ports.
		if a.eph, err = read(); err != nil && a.warn != nil {
			a.warn(err)
		}
		if a.eph != nil {
			// Half, the odd ports that bind(0) and allocateEphemeral take
			// first: connect() starts from the even ones, which then stay
			// whole for the node's own connections.
			a.ephShare = a.eph.exposed(PortRange{Base: a.eph.lo, Size: a.eph.size()}) / 2
		}
	}
	return a.eph
}

// portCapacity returns how many ports one network's listeners may hold:
// the range's size, or without one the share of the kernel's range
// (checkShare); zero when the kernel's range is unknown.
func (a *portAllocator) portCapacity() int {
	if a.r.Size > 0 {
		return a.r.Size
	}
	if a.ephemeral() == nil {
		return 0
	}
	return a.ephShare
}

// checkShare returns ErrPorts when, with no range, the listeners of
// network's protocol hold their share of the kernel's range for bind(0):
// half of the ports it hands out. The kernel's connect() and UDP's
// autobind skip every port that a socket of either family is bound to
// (__inet_hash_connect, udp_lib_get_port), so listeners that held the
// whole range would leave the node's own outgoing connections none, and
// they would fail with EADDRNOTAVAIL.
func (a *portAllocator) checkShare(network string) error {
	if a.r.Size > 0 {
		return nil
	}
	e := a.ephemeral()
	if e == nil {
		return nil
	}
	proto := network[:3]
	if n := a.ephHeld[proto]; n >= a.ephShare {
		return fmt.Errorf("%w: %s listeners hold %d ports of the kernel's local port range %d-%d (net.ipv4.ip_local_port_range), the half they may take; the rest stays for the node's own connections",
			ErrPorts, strings.ToUpper(proto), n, e.lo, e.hi)
	}
	return nil
}

// countShare adds d to the ports of the kernel's range that network's
// protocol holds, when port is one of them and the protocol's other
// family does not hold it too. Called after port was marked (d = 1) or
// released (d = -1) in network.
func (a *portAllocator) countShare(network string, port uint16, d int) {
	if a.r.Size > 0 {
		return
	}
	if e := a.ephemeral(); e == nil || !e.handedOut(port) {
		return
	}
	if a.used[otherFamily(network)][port] {
		return
	}
	if a.ephHeld == nil {
		a.ephHeld = map[string]int{}
	}
	a.ephHeld[network[:3]] += d
}

// otherFamily returns the network of the other address family and the
// same protocol: "tcp6" for "tcp4".
func otherFamily(network string) string {
	if strings.HasSuffix(network, "6") {
		return network[:3] + "4"
	}
	return network[:3] + "6"
}

// allocatePreferred tries want first, when it is in the range (any port
// is, with no range) and not in use, then falls back to allocate.
func (a *portAllocator) allocatePreferred(network string, want uint16, try func(port uint16) (uint16, error)) (uint16, error) {
	if a.r.Size == 0 {
		if got, err := try(want); err == nil {
			a.mark(network, got)
			return got, nil
		}
		return a.allocateEphemeral(network, try)
	}
	if want >= a.r.Base && int(want-a.r.Base) < a.r.Size && !a.used[network][want] {
		if got, err := try(want); err == nil {
			a.mark(network, got)
			return got, nil
		}
	}
	return a.allocate(network, try)
}

// allocateExact calls try with port alone, which must be in the range
// (any port is, with no range) and not in use.
func (a *portAllocator) allocateExact(network string, port uint16, try func(port uint16) (uint16, error)) (uint16, error) {
	if a.r.Size > 0 {
		if port < a.r.Base || int(port-a.r.Base) >= a.r.Size {
			return 0, fmt.Errorf("port %d: %w %s", port, errOutsideRange, a.r)
		}
		if a.used[network][port] {
			return 0, fmt.Errorf("port %d is another listener's", port)
		}
	}
	got, err := try(port)
	if err != nil {
		return 0, err
	}
	a.mark(network, got)
	return got, nil
}

// mark records port as in use: allocated, or an adopted socket's.
func (a *portAllocator) mark(network string, port uint16) {
	if a.used[network][port] {
		return
	}
	if a.used == nil {
		a.used = map[string]map[uint16]bool{}
	}
	if a.used[network] == nil {
		a.used[network] = map[uint16]bool{}
	}
	a.used[network][port] = true
	a.countShare(network, port, 1)
}

// allocate calls try with candidate ports until it succeeds, and returns
// the port it succeeded with. With a zero range the candidates are the
// kernel's (allocateEphemeral).
func (a *portAllocator) allocate(network string, try func(port uint16) (uint16, error)) (uint16, error) {
	if a.r.Size == 0 {
		return a.allocateEphemeral(network, try)
	}
	var lastErr error
	for i := 0; i < a.r.Size; i++ {
		p := a.r.Base + uint16((a.next+i)%a.r.Size)
		if a.used[network][p] {
			continue
		}
		got, err := try(p)
		if err != nil {
			lastErr = err // in use by another process: try the next one
			continue
		}
		a.next = (a.next + i + 1) % a.r.Size
		a.mark(network, got)
		return got, nil
	}
	if lastErr != nil {
		return 0, fmt.Errorf("%w (%s): last error: %w", errRangeExhausted, a.r, lastErr)
	}
	return 0, fmt.Errorf("%w (%s)", errRangeExhausted, a.r)
}

// ephemeralTries is how many taken ports allocateEphemeral tries before
// it leaves the choice to bind(0).
const ephemeralTries = 32

// allocateEphemeral allocates, with no range, a port of the kernel's
// range for bind(0) that neither uproxy nor anyone else holds, and falls
// back to bind(0) when there is none (or the range is unknown). The scan
// starts at a random port, as the kernel's does: a shared listener that
// needs consecutive free ports then tries another part of the range
// each time, and a port just freed is seldom the next one taken.
func (a *portAllocator) allocateEphemeral(network string, try func(port uint16) (uint16, error)) (uint16, error) {
	if e := a.ephemeral(); e != nil {
		randN := a.randN
		if randN == nil {
			randN = rand.IntN
		}
		failed := 0
		for p := range e.candidates(randN(e.size())) {
			if a.used[network][p] {
				continue
			}
			got, err := try(p)
			if err != nil {
				// Held by another socket. A range that others have
				// nearly filled is left to the kernel, which knows
				// which ports are free without trying each.
				if failed++; failed == ephemeralTries {
					break
				}
				continue
			}
			a.mark(network, got)
			return got, nil
		}
	}
	// The kernel's pick is uproxy's as much as the others: marked, a
	// later scan skips it rather than counting it among the ports others
	// hold.
	got, err := try(0)
	if err == nil {
		a.mark(network, got)
	}
	return got, err
}

// count returns how many ports are in use, in every network: one
// listening socket each.
func (a *portAllocator) count() int {
	n := 0
	for _, ports := range a.used {
		n += len(ports)
	}
	return n
}

// release returns a port to the range.
func (a *portAllocator) release(network string, port uint16) {
	if !a.used[network][port] {
		return
	}
	delete(a.used[network], port)
	a.countShare(network, port, -1)
}

// inUse reports whether port is a listener's port of network ("tcp4",
// "udp6", …).
func (a *portAllocator) inUse(network string, port uint16) bool {
	return a.used[network][port]
}

// ExposedPorts returns how many ports of r the kernel may hand to any
// process's bind(0) or outgoing connection, in uproxy's network
// namespace: those inside ip_local_port_range that
// ip_local_reserved_ports leaves out. A listener may find such a port
// taken; deploy/README.md says how to reserve the range.
func ExposedPorts(r PortRange) (int, error) {
	e, err := readEphemeralPorts()
	if err != nil {
		return 0, err
	}
	return e.exposed(r), nil
}

// exposed is ExposedPorts for the kernel settings e.
func (e *ephemeralPorts) exposed(r PortRange) int {
	n := 0
	for i := range r.Size {
		p := int(r.Base) + i
		if p >= int(e.lo) && p <= int(e.hi) && !e.reserved[uint16(p)] {
			n++
		}
	}
	return n
}
