package redirect

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"sync"
	"time"

	"go.uber.org/zap"
)

// DefaultStaleConntrackLimit is StaleConntrackConfig.Limit's default.
const DefaultStaleConntrackLimit = 10000

// ConntrackTuple is one direction of a conntrack entry: the source and
// destination its packets carry. Addresses are unmapped.
type ConntrackTuple struct {
	Src, Dst netip.AddrPort
}

// ConntrackEntry is a conntrack entry as StaleConntrack judges it.
type ConntrackEntry struct {
	// Original is the tuple of the flow's first packet: the client and
	// the address it sent to.
	Original ConntrackTuple
	// Reply is the tuple the kernel expects the replies with. Its source
	// is where a destination NAT sent the flow: the listener for
	// REDIRECT (a local address and the listener's port), a pod for
	// kube-proxy's DNAT; without a destination NAT (TPROXY) it is
	// Original's destination.
	Reply ConntrackTuple
}

// ConntrackTable is the node's conntrack table as StaleConntrack uses it
// (NetlinkConntrack is the kernel's). StaleConntrack calls it from one
// goroutine at a time.
type ConntrackTable interface {
	// DeleteUDP deletes the UDP entries of family f for which stale
	// reports true, at most limit of them, and returns how many it
	// deleted. It calls stale on its own goroutine, before it returns.
	DeleteUDP(f Family, stale func(ConntrackEntry) bool, limit int) (int, error)
	// LocalAddrs returns the node's addresses of family f, loopback's
	// included: REDIRECT sends a flow to one of them.
	LocalAddrs(f Family) ([]netip.Addr, error)
}

// StaleConntrackConfig configures NewStaleConntrack.
type StaleConntrackConfig struct {
	// Table is the conntrack table to clean. Required.
	Table ConntrackTable
	// NodePortAddresses are ServiceOptions.NodePortAddresses: the local
	// addresses whose node ports the rules intercept. Empty means every
	// local address but loopback, as in Rules.
	NodePortAddresses []netip.Prefix
	// Limit is the most entries one clean deletes per family; the rest
	// wait for the next. Zero means DefaultStaleConntrackLimit.
	Limit int
	// Deleted, when not nil, is called with the number of entries each
	// clean deleted, when it deleted some, from Run's goroutine.
	Deleted func(n int)
	// Logger logs each clean's counts at debug level, and its failures;
	// nil logs nothing.
	Logger *zap.Logger
}

// StaleConntrack deletes the UDP conntrack entries that keep flows away
// from the proxy's rules. The kernel looks at the nat table only for a
// flow's first packet: later packets follow the flow's conntrack entry,
// which a UDP client that keeps sending keeps alive. A flow that someone
// else's DNAT (kube-proxy's, before the proxy took over) sent to a pod
// keeps going to that pod, gone or not, and never meets the proxy's
// rules; and one that the proxy's REDIRECT sent to a listener keeps going
// to that listener's port after its service is removed (and after a
// restart that moved the listener). StaleConntrack deletes the entries of
// both kinds, so that the next datagram is a new flow that meets the
// rules as they are.
//
// Trigger, from the proxier's sync goroutine after each successful rules
// sync, hands it the claims; Run, on a goroutine of its own, cleans, so
// that dumping the conntrack table never holds a sync. Trigger and Run
// may be called concurrently.
type StaleConntrack struct {
	cfg StaleConntrackConfig
	log *zap.Logger
	// wake holds a token while a clean is pending.
	wake chan struct{}

	mu sync.Mutex
	// pending is the clean to run next; nil when there is none.
	pending *staleRequest
	// triggered are the UDP claims of the last Trigger, nil before the
	// first.
	triggered map[claimKey]portRange
	// removed are the UDP claims that Triggers dropped since the last
	// clean took them, and that no later Trigger has claimed again.
	removed map[claimKey]bool
}

// portRange is a listener's ports, lo to hi.
type portRange struct{ lo, hi uint16 }

// staleRequest is the state one clean works from.
type staleRequest struct {
	families []Family
	claims   map[claimKey]portRange
}

// NewStaleConntrack returns the StaleConntrack for cfg.
func NewStaleConntrack(cfg StaleConntrackConfig) (*StaleConntrack, error) {
	if cfg.Table == nil {
		return nil, errors.New("redirect: stale conntrack: no table")
	}
	if cfg.Limit == 0 {
		cfg.Limit = DefaultStaleConntrackLimit
	}
	if cfg.Limit < 0 {
		return nil, fmt.Errorf("redirect: stale conntrack: limit %d is negative", cfg.Limit)
	}
	s := &StaleConntrack{cfg: cfg, log: cfg.Logger, wake: make(chan struct{}, 1), removed: map[claimKey]bool{}}
	if s.log == nil {
		s.log = zap.NewNop()
	}
	return s, nil
}

// Trigger asks Run to clean the conntrack tables of families, whose rules
// a sync has just made those of claims. It returns at once, and does not
// keep claims. Only the
// latest Trigger's claims count when several wait for one clean; the
// claims that any of them dropped are cleaned as removed.
//
// Trigger asks for no clean when the UDP claims (their destinations and
// listener ports) are those of the last Trigger, unless full is set (a
// periodic sync): the entries a clean deletes are made by someone else's
// rules, which a periodic clean catches, or follow from a change of the
// claims. The first Trigger always asks for one.
func (s *StaleConntrack) Trigger(claims []Intercept, families []Family, full bool) {
	current := udpClaims(claims)
	s.mu.Lock()
	defer s.mu.Unlock()
	first := s.triggered == nil
	changed := first || !maps.Equal(current, s.triggered)
	for k := range s.triggered {
		if _, ok := current[k]; !ok {
			s.removed[k] = true
		}
	}
	for k := range current {
		delete(s.removed, k)
	}
	s.triggered = current
	if !changed && !full {
		return
	}
	s.pending = &staleRequest{families: families, claims: current}
	select {
	case s.wake <- struct{}{}:
	default: // a clean is pending already; it will take this request
	}
}

// Run cleans after each Trigger until ctx is done. One clean runs at a
// time; it ends within the table's timeouts, and Run returns once the
// clean in progress has.
func (s *StaleConntrack) Run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.wake:
		}
		s.cleanPending()
	}
}

// cleanPending runs the pending clean, if any, and returns the number of
// entries it deleted.
func (s *StaleConntrack) cleanPending() int {
	s.mu.Lock()
	req := s.pending
	s.pending = nil
	removed := s.removed
	s.removed = map[claimKey]bool{}
	s.mu.Unlock()
	if req == nil {
		return 0
	}
	start := time.Now()
	total := 0
	capped := false
	var errs []error
	for _, f := range req.families {
		n, err := s.cleanFamily(f, req.claims, removed)
		total += n
		capped = capped || n >= s.cfg.Limit
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", f, err))
		}
	}
	if total > 0 && s.cfg.Deleted != nil {
		s.cfg.Deleted(total)
	}
	if err := errors.Join(errs...); err != nil {
		// The removed claims are cleaned again with the next request:
		// entries for them may remain.
		s.mu.Lock()
		for k := range removed {
			if _, ok := s.triggered[k]; !ok {
				s.removed[k] = true
			}
		}
		s.mu.Unlock()
		s.log.Warn("cannot delete stale UDP conntrack entries; the next periodic sync tries again", zap.Int("deleted", total), zap.Error(err))
		return total
	}
	s.log.Debug("deleted stale UDP conntrack entries", zap.Int("deleted", total), zap.Int("udpClaims", len(req.claims)),
		zap.Int("removedClaims", len(removed)), zap.Duration("took", time.Since(start)))
	if capped {
		s.log.Info("deleted as many stale UDP conntrack entries as one clean may; the next periodic sync deletes more", zap.Int("deleted", total), zap.Int("limitPerFamily", s.cfg.Limit))
	}
	return total
}

// cleanFamily deletes the stale entries of family f: see staleJudge.
func (s *StaleConntrack) cleanFamily(f Family, claims map[claimKey]portRange, removed map[claimKey]bool) (int, error) {
	local, err := s.cfg.Table.LocalAddrs(f)
	if err != nil {
		return 0, fmt.Errorf("listing the node's addresses: %w", err)
	}
	j := newStaleJudge(f, claims, removed, local, s.cfg.NodePortAddresses)
	if j.empty() {
		return 0, nil
	}
	n, err := s.cfg.Table.DeleteUDP(f, j.stale, s.cfg.Limit)
	if err != nil {
		return n, fmt.Errorf("deleting conntrack entries: %w", err)
	}
	return n, nil
}

// udpClaims returns the UDP claims among claims, by key, with their
// listener ports; the first of two claims with one key wins, as in
// ServiceRules.
func udpClaims(claims []Intercept) map[claimKey]portRange {
	out := map[claimKey]portRange{}
	for _, c := range claims {
		if c.Protocol != UDP {
			continue
		}
		k := c.key()
		if _, ok := out[k]; ok {
			continue
		}
		out[k] = portRange{c.ToPort, max(c.ToPort, c.ToPortEnd)}
	}
	return out
}

// staleJudge tells the stale entries of one family from the others.
type staleJudge struct {
	// exact are the claimed exact destinations, nodePorts the claimed
	// node ports, with their listeners' ports.
	exact     map[netip.AddrPort]portRange
	nodePorts map[uint16]portRange
	// removedExact and removedNodePorts were claimed, and are no longer.
	removedExact     map[netip.AddrPort]bool
	removedNodePorts map[uint16]bool
	// local are the node's addresses.
	local map[netip.Addr]bool
	// nodePortPrefixes are the family's node-port addresses; nil means
	// every local address but loopback.
	nodePortPrefixes []netip.Prefix
}

func newStaleJudge(f Family, claims map[claimKey]portRange, removed map[claimKey]bool, local []netip.Addr, nodePortAddresses []netip.Prefix) *staleJudge {
	j := &staleJudge{
		exact: map[netip.AddrPort]portRange{}, nodePorts: map[uint16]portRange{},
		removedExact: map[netip.AddrPort]bool{}, removedNodePorts: map[uint16]bool{},
		local: map[netip.Addr]bool{},
	}
	for k, ports := range claims {
		if familyOf(k.addr) != f {
			continue
		}
		if k.nodePort {
			j.nodePorts[k.port] = ports
		} else {
			j.exact[netip.AddrPortFrom(k.addr, k.port)] = ports
		}
	}
	for k := range removed {
		if k.proto != UDP || familyOf(k.addr) != f {
			continue
		}
		if k.nodePort {
			j.removedNodePorts[k.port] = true
		} else {
			j.removedExact[netip.AddrPortFrom(k.addr, k.port)] = true
		}
	}
	for _, a := range local {
		j.local[a.Unmap().WithZone("")] = true
	}
	if len(nodePortAddresses) > 0 {
		j.nodePortPrefixes = prefixesOf(f, nodePortAddresses)
	}
	return j
}

// empty reports whether no entry can be stale: nothing is claimed or
// removed.
func (j *staleJudge) empty() bool {
	return len(j.exact)+len(j.nodePorts)+len(j.removedExact)+len(j.removedNodePorts) == 0
}

// stale reports whether the UDP entry e keeps a flow from the rules:
//
//   - its original destination is claimed (the claim's exact destination,
//     or its node port on a node-port address), and a destination NAT that
//     is not the claim's REDIRECT sent it elsewhere: its reply comes
//     neither from that destination (no NAT: TPROXY, or nothing) nor from
//     one of the node's addresses at one of the claim's listener ports
//     (REDIRECT to the listener). This is kube-proxy's DNAT to a pod, or
//     a REDIRECT to a listener port that no longer serves the claim.
//   - or its original destination was claimed and is no longer, and a
//     destination NAT sent it elsewhere: to a listener that is gone, or to
//     a pod by someone else's rules.
//
// Entries to destinations that were never claimed are not stale,
// whatever they are: they are not the proxy's to judge.
func (j *staleJudge) stale(e ConntrackEntry) bool {
	dst := netip.AddrPortFrom(e.Original.Dst.Addr().Unmap().WithZone(""), e.Original.Dst.Port())
	reply := netip.AddrPortFrom(e.Reply.Src.Addr().Unmap().WithZone(""), e.Reply.Src.Port())
	natted := reply != dst
	// An exact destination comes before a node port, as in the rules.
	if ports, ok := j.exact[dst]; ok {
		return natted && !j.redirected(reply, ports)
	}
	if ports, ok := j.nodePorts[dst.Port()]; ok && j.nodePortAddr(dst.Addr()) {
		return natted && !j.redirected(reply, ports)
	}
	if j.removedExact[dst] {
		return natted
	}
	return j.removedNodePorts[dst.Port()] && j.nodePortAddr(dst.Addr()) && natted
}

// redirected reports whether reply, an entry's reply source, is a
// REDIRECT's to a listener on ports: one of the node's addresses (the
// incoming interface's, or loopback's for the node's own traffic) and
// one of the ports.
func (j *staleJudge) redirected(reply netip.AddrPort, ports portRange) bool {
	return j.local[reply.Addr()] && reply.Port() >= ports.lo && reply.Port() <= ports.hi
}

// nodePortAddr reports whether the rules intercept node ports sent to a.
func (j *staleJudge) nodePortAddr(a netip.Addr) bool {
	if !j.local[a] {
		return false
	}
	if j.nodePortPrefixes == nil {
		return !a.IsLoopback()
	}
	for _, p := range j.nodePortPrefixes {
		if p.Contains(a) {
			return true
		}
	}
	return false
}
