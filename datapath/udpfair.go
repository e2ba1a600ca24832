package datapath

import "sync"

// Fair shares of the engine's UDP bounds.
//
// The pooled sockets (Config.UDPPoolMax) and the flow table
// (Config.UDPMaxFlows) are the engine's, and every service port draws on
// them. Left to first come, first served, one port could hold either: a
// port whose endpoints never answer keeps a pooled socket checked out per
// query for the query timeout, so a modest query rate holds every socket
// and the node's DNS queries find none; and a flood of new source ports
// to one port pushes every other port's flows out of a table that ends
// the least recently used flow first. So each service port (its
// ConnSlots, which its listeners of both families and all its snapshots
// share) counts the pooled sockets its queries hold and its flows, and
// at a bound the largest holder gives way: max-min fairness, as a fair
// queue shares a link.
//
// At UDPPoolMax, a query that needs a socket, and finds no idle one on
// its loop to close (closeIdleSlot), is dropped if its port holds its
// share, the bound divided by the ports with queries out, or more. Else
// the port with the most queries out, if it has two more than the
// query's, gives up its oldest socket: the socket is closed, its query
// counted as dropped, and the new query takes its place. The socket may
// be another loop's, which closes it at its next turn: until then the
// engine holds one socket more than its bound.
//
// At UDPMaxFlows, a new flow ends the least recently used flow of its
// own port if the port holds its share or more, else that of the port
// with the most flows. Within a port, flows leave least recently used
// first, as they left the whole table before.
//
// Without contention the accounting of a checkout, a return, a new flow
// or a refresh is one uncontended lock and a few pointer writes; the
// ports are scanned only at a bound, for the largest holder, and only for
// a port below its share.

// udpShare is a service port's part of the engine's pooled sockets and
// flow table. Guarded by udpFairness.mu.
type udpShare struct {
	// queries are the port's checked-out pooled sockets, oldest first;
	// flows its flows in the table, least recently used first.
	queries, flows flowList
	// links place the port in udpFairness.querying (while it has queries
	// out) and udpFairness.holding (while it has flows).
	links [2]portLink
}

// The links of udpShare.
const (
	queryingLink = iota
	holdingLink
)

type portLink struct{ prev, next *ConnSlots }

// fairLink is a pooled socket's place among its port's checked-out
// sockets, or a flow's among its port's flows. Guarded by
// udpFairness.mu.
type fairLink struct {
	prev, next *udpFlow
	on         *flowList // nil: on neither
}

// flowList is a list of pooled sockets or flows, through their
// fairLinks.
type flowList struct {
	head, tail *udpFlow
	n          int
}

// push appends f, which is on no list.
func (l *flowList) push(f *udpFlow) {
	f.fair = fairLink{prev: l.tail, on: l}
	if l.tail != nil {
		l.tail.fair.next = f
	} else {
		l.head = f
	}
	l.tail = f
	l.n++
}

// remove takes f, which is on l, off it.
func (l *flowList) remove(f *udpFlow) {
	if f.fair.prev != nil {
		f.fair.prev.fair.next = f.fair.next
	} else {
		l.head = f.fair.next
	}
	if f.fair.next != nil {
		f.fair.next.fair.prev = f.fair.prev
	} else {
		l.tail = f.fair.prev
	}
	f.fair = fairLink{}
	l.n--
}

// portList is a list of service ports through their links[link],
// link being queryingLink or holdingLink: a port's queries or flows.
type portList struct {
	head *ConnSlots
	n    int
}

// of returns the list of s that makes it one of l's: its queries or
// its flows.
func of(s *ConnSlots, link int) *flowList {
	if link == queryingLink {
		return &s.udp.queries
	}
	return &s.udp.flows
}

// push adds s, which is not on l.
func (l *portList) push(s *ConnSlots, link int) {
	s.udp.links[link] = portLink{next: l.head}
	if l.head != nil {
		l.head.udp.links[link].prev = s
	}
	l.head = s
	l.n++
}

// remove takes s, which is on l, off it.
func (l *portList) remove(s *ConnSlots, link int) {
	k := &s.udp.links[link]
	if k.prev != nil {
		k.prev.udp.links[link].next = k.next
	} else {
		l.head = k.next
	}
	if k.next != nil {
		k.next.udp.links[link].prev = k.prev
	}
	*k = portLink{}
	l.n--
}

// largest returns the port of l with the most queries or flows, or nil
// if l is empty.
func (l *portList) largest(link int) *ConnSlots {
	var v *ConnSlots
	for s := l.head; s != nil; s = s.udp.links[link].next {
		if v == nil || of(s, link).n > of(v, link).n {
			v = s
		}
	}
	return v
}

// udpFairness is the engine's account of the service ports' pooled
// sockets and flows. Safe for concurrent use: the event loops check
// sockets out and in, and any goroutine adds, refreshes and removes
// flows. mu is the innermost lock: it is taken with the flow table's
// locks held (its eviction callback runs under the LRU's own lock), and
// nothing is called with it held.
type udpFairness struct {
	mu sync.Mutex
	// querying are the ports with queries out; holding those with flows.
	querying, holding portList
	// anon stands for every port whose snapshot has no ConnSlots.
	anon ConnSlots
}

// of returns the share of the port whose snapshot has slots s.
func (u *udpFairness) of(s *ConnSlots) *ConnSlots {
	if s == nil {
		return &u.anon
	}
	return s
}

// checkedOut records that f, a pooled socket, carries a query of port s.
func (u *udpFairness) checkedOut(f *udpFlow, s *ConnSlots) {
	u.mu.Lock()
	f.share = s
	s.udp.queries.push(f)
	if s.udp.queries.n == 1 {
		u.querying.push(s, queryingLink)
	}
	u.mu.Unlock()
}

// returned takes f, a pooled socket, off its port's checked-out sockets,
// as its query ends; false if it was not on them: it carries no query,
// or its place went to another port's query (reclaim), which closes it.
func (u *udpFairness) returned(f *udpFlow) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	s := f.share
	if s == nil || f.fair.on != &s.udp.queries {
		return false
	}
	u.unlinkQuery(s, f)
	return true
}

func (u *udpFairness) unlinkQuery(s *ConnSlots, f *udpFlow) {
	s.udp.queries.remove(f)
	if s.udp.queries.n == 0 {
		u.querying.remove(s, queryingLink)
	}
}

// reclaim chooses the checked-out socket whose place a query of port s
// takes at the engine's bound, limit, and takes it off its port's: the
// oldest of the port with the most queries out. It returns nil, and the
// query is to be dropped, if s holds its share of limit or more, or no
// port holds two queries more than s.
func (u *udpFairness) reclaim(s *ConnSlots, limit int64) *udpFlow {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := s.udp.queries.n
	ports := u.querying.n
	if n == 0 {
		ports++
	}
	if int64(n)*int64(ports) >= limit {
		return nil
	}
	v := u.querying.largest(queryingLink)
	if v == nil || v == s || v.udp.queries.n < n+2 {
		return nil
	}
	f := v.udp.queries.head
	u.unlinkQuery(v, f)
	return f
}

// flowAdded records f, about to go into the table, as a flow of port s,
// its most recently used.
func (u *udpFairness) flowAdded(f *udpFlow, s *ConnSlots) {
	u.mu.Lock()
	f.share = s
	s.udp.flows.push(f)
	if s.udp.flows.n == 1 {
		u.holding.push(s, holdingLink)
	}
	u.mu.Unlock()
}

// flowUsed makes f, a flow in the table, its port's most recently used.
func (u *udpFairness) flowUsed(f *udpFlow) {
	u.mu.Lock()
	if l := f.fair.on; l != nil && l.tail != f {
		l.remove(f)
		l.push(f)
	}
	u.mu.Unlock()
}

// flowRemoved forgets f, a flow leaving the table.
func (u *udpFairness) flowRemoved(f *udpFlow) {
	u.mu.Lock()
	if s := f.share; s != nil && f.fair.on == &s.udp.flows {
		s.udp.flows.remove(f)
		if s.udp.flows.n == 0 {
			u.holding.remove(s, holdingLink)
		}
	}
	u.mu.Unlock()
}

// flowVictim returns the flow that ends to make room, in a table at its
// bound, limit, for a new flow of port s: the least recently used of s,
// if s holds its share of limit or more, else of the port with the most
// flows; nil if the table holds none.
func (u *udpFairness) flowVictim(s *ConnSlots, limit int) *udpFlow {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := s.udp.flows.n
	ports := u.holding.n
	if n == 0 {
		ports++
	}
	if n > 0 && n*ports >= limit {
		return s.udp.flows.head
	}
	if v := u.holding.largest(holdingLink); v != nil {
		return v.udp.flows.head
	}
	return nil
}
