package proxy

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// PortRange is the range of local ports listeners may use, as given to
// --proxy-port-range. The zero value means kernel-assigned ports.
type PortRange struct {
	Base uint16 // first port
	Size int    // number of ports; zero means kernel-assigned
}

// ParsePortRange parses kube-proxy's --proxy-port-range syntax:
// "begin-end" (inclusive), "begin+offset", a single port, or "" for
// kernel-assigned ports.
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

// String returns the range in "begin-end" form, or "" when kernel-assigned.
func (r PortRange) String() string {
	if r.Size == 0 {
		return ""
	}
	return fmt.Sprintf("%d-%d", r.Base, int(r.Base)+r.Size-1)
}

// errRangeExhausted says that every port of the range is taken.
var errRangeExhausted = errors.New("proxy port range exhausted")

// errOutsideRange says that a port is not in the range.
var errOutsideRange = errors.New("outside the proxy port range")

// portAllocator hands out ports from a PortRange, round-robin so a port
// that was just freed is reused last (its old connections may linger in
// TIME_WAIT). It is used only by the sync goroutine.
type portAllocator struct {
	r    PortRange
	next int
	used map[string]map[uint16]bool // by network ("tcp4", "udp6", …)
}

// allocate calls try with candidate ports until it succeeds, and returns
// the port it succeeded with. With a zero range it calls try(0) once.
// allocatePreferred tries want first, when it is in the range (any port
// is, with no range) and not in use, then falls back to allocate.
func (a *portAllocator) allocatePreferred(network string, want uint16, try func(port uint16) (uint16, error)) (uint16, error) {
	if a.r.Size == 0 {
		if got, err := try(want); err == nil {
			return got, nil
		}
		return try(0)
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
	if a.r.Size > 0 {
		a.mark(network, got)
	}
	return got, nil
}

// mark records port as in use.
func (a *portAllocator) mark(network string, port uint16) {
	if a.used == nil {
		a.used = map[string]map[uint16]bool{}
	}
	if a.used[network] == nil {
		a.used[network] = map[uint16]bool{}
	}
	a.used[network][port] = true
}

func (a *portAllocator) allocate(network string, try func(port uint16) (uint16, error)) (uint16, error) {
	if a.r.Size == 0 {
		return try(0)
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

// release returns a port to the range.
func (a *portAllocator) release(network string, port uint16) {
	if a.used != nil && a.used[network] != nil {
		delete(a.used[network], port)
	}
}
