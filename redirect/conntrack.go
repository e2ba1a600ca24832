package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// ErrNoConntrackEntry is the error (wrapped) of ConntrackLookup.OriginalDst
// when conntrack has no entry with the given reply tuple: the datagram was
// not redirected, or its entry has expired.
var ErrNoConntrackEntry = errors.New("no conntrack entry")

// conntrackSockets is the most netlink sockets a ConntrackLookup keeps
// open, and so the most lookups it runs at once; others wait for a socket.
// A lookup is one request and one reply, answered by the kernel within the
// sendmsg call, so a few sockets keep up with many flows.
const conntrackSockets = 4

// conntrackTimeout bounds each send and receive on a netlink socket. The
// kernel answers a conntrack GET synchronously, so it only ends a lookup
// that something has gone badly wrong with.
const conntrackTimeout = 2 * time.Second

// ctnetlinkGet is the netlink message type of a conntrack GET request
// (<linux/netfilter/nfnetlink.h>: subsystem << 8 | message).
const ctnetlinkGet = unix.NFNL_SUBSYS_CTNETLINK<<8 | nl.IPCTNL_MSG_CT_GET

// ConntrackLookup finds the original destination of redirected traffic in
// the kernel's conntrack table over ctnetlink (NETLINK_NETFILTER). It is
// what a UDP listener has instead of SO_ORIGINAL_DST: the kernel's
// getorigdst (net/netfilter/nf_conntrack_proto.c) answers only TCP and
// SCTP sockets, and IP_ORIGDSTADDR reports the destination REDIRECT has
// already rewritten to the listener.
//
// It keeps up to conntrackSockets netlink sockets open and reuses them, one
// lookup at a time each, the most recently used first. It is safe for
// concurrent use. Close releases the sockets.
type ConntrackLookup struct {
	// running holds a token for each lookup in progress: at most
	// conntrackSockets run at once.
	running chan struct{}
	// done is closed by Close.
	done chan struct{}

	mu sync.Mutex
	// idle holds the slots with an open socket that no lookup uses, the
	// most recently used last.
	idle []*conntrackSlot
	// closed is set by Close.
	closed bool
}

// conntrackSlot is one socket of a ConntrackLookup, used by one lookup at
// a time.
type conntrackSlot struct {
	// sock is the socket, or nil while the slot has none open.
	sock *nl.NetlinkSocket
	// pid is sock's netlink port id, which the kernel's answers carry.
	pid uint32
	// seq is the sequence number of the last request sent on sock.
	seq uint32
}

// NewConntrackLookup returns a ConntrackLookup for the network namespace
// of the calling thread. It opens one netlink socket at once, so that a
// kernel without NETLINK_NETFILTER fails here rather than on the first
// lookup.
func NewConntrackLookup() (*ConntrackLookup, error) {
	first := &conntrackSlot{}
	if err := first.open(); err != nil {
		return nil, fmt.Errorf("redirect: conntrack lookup: %w", err)
	}
	return &ConntrackLookup{
		running: make(chan struct{}, conntrackSockets),
		done:    make(chan struct{}),
		idle:    []*conntrackSlot{first},
	}, nil
}

// open opens the slot's socket.
func (s *conntrackSlot) open() error {
	// Subscribe with no groups is a plain bound netlink socket that,
	// unlike the ones of nl's package-level requests, can be kept.
	sock, err := nl.Subscribe(unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("opening NETLINK_NETFILTER socket: %w", err)
	}
	tv := unix.NsecToTimeval(conntrackTimeout.Nanoseconds())
	if err := sock.SetSendTimeout(&tv); err != nil {
		sock.Close()
		return fmt.Errorf("netlink send timeout: %w", err)
	}
	if err := sock.SetReceiveTimeout(&tv); err != nil {
		sock.Close()
		return fmt.Errorf("netlink receive timeout: %w", err)
	}
	pid, err := sock.GetPid()
	if err != nil {
		sock.Close()
		return fmt.Errorf("netlink port id: %w", err)
	}
	s.sock, s.pid = sock, pid
	return nil
}

// close closes the slot's socket, if open.
func (s *conntrackSlot) close() {
	if s.sock != nil {
		s.sock.Close()
	}
	s.sock = nil
}

// OriginalDst returns the original destination (the service VIP and port)
// of the proto flow from client that REDIRECT delivered to local, the
// address the listener received it at: 127.0.0.1 or ::1 and the listener
// port for traffic from the node itself (nat OUTPUT), the primary address
// of the incoming interface for traffic from elsewhere (nat PREROUTING).
// IPv4-mapped IPv6 addresses are unmapped; client and local must then be
// of the same family.
//
// REDIRECT is DNAT to local: conntrack's entry for the flow has the
// ORIGINAL tuple client → VIP:port and the REPLY tuple local → client, and
// it is confirmed (nf_conntrack_confirm, at NF_INET_LOCAL_IN) before the
// datagram is queued to the socket, so the entry exists by the time the
// listener reads it. OriginalDst sends one IPCTNL_MSG_CT_GET for the REPLY
// tuple and returns the destination of the ORIGINAL one.
//
// It fails with an error wrapping ErrNoConntrackEntry when there is no such
// entry, and with one wrapping net.ErrClosed after Close.
func (l *ConntrackLookup) OriginalDst(proto Protocol, client, local netip.AddrPort) (netip.AddrPort, error) {
	family, protoNum, payload, err := conntrackGetPayload(proto, client, local)
	if err != nil {
		return netip.AddrPort{}, originalDstErr(proto, client, local, err)
	}
	slot, err := l.acquire()
	if err != nil {
		return netip.AddrPort{}, originalDstErr(proto, client, local, err)
	}
	defer l.release(slot)
	dst, err := slot.get(family, protoNum, payload)
	switch {
	case errors.Is(err, unix.ENOENT):
		return netip.AddrPort{}, originalDstErr(proto, client, local, ErrNoConntrackEntry)
	case err != nil:
		return netip.AddrPort{}, originalDstErr(proto, client, local, err)
	}
	return dst, nil
}

// originalDstErr wraps err, OriginalDst's failure, with the tuple it
// looked up. It is formatted only on failure: a lookup that succeeds runs
// once per new UDP flow, and formats nothing.
func originalDstErr(proto Protocol, client, local netip.AddrPort, err error) error {
	return fmt.Errorf("redirect: conntrack original destination of %s reply tuple %s -> %s: %w", proto, local, client, err)
}

// acquire takes the most recently used idle slot, or a new one without a
// socket, waiting while conntrackSockets lookups are running. It fails with
// net.ErrClosed after Close.
func (l *ConntrackLookup) acquire() (*conntrackSlot, error) {
	select {
	case l.running <- struct{}{}:
	case <-l.done:
		return nil, net.ErrClosed
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		<-l.running
		return nil, net.ErrClosed
	}
	if n := len(l.idle); n > 0 {
		s := l.idle[n-1]
		l.idle = l.idle[:n-1]
		return s, nil
	}
	return &conntrackSlot{}, nil
}

// release returns a slot that acquire gave out: it keeps its socket for
// the next lookup, or closes it if Close has been called meanwhile.
func (l *ConntrackLookup) release(s *conntrackSlot) {
	l.mu.Lock()
	if l.closed || s.sock == nil {
		s.close()
	} else {
		l.idle = append(l.idle, s)
	}
	l.mu.Unlock()
	<-l.running
}

// get runs one GET exchange on the slot's socket, opening it first if
// needed. It sends and receives itself rather than with nl's
// NetlinkRequest.Execute: ctnetlink_fill_info (net/netfilter/
// nf_conntrack_netlink.c) flags every message to a user socket
// NLM_F_MULTI, also the single answer to a GET, which is followed by no
// NLMSG_DONE, and Execute waits for one until it times out.
//
// The socket is closed, to be reopened by the next lookup, when sending or
// receiving fails; answers to earlier requests that come late are skipped
// by their sequence number.
func (s *conntrackSlot) get(family, protoNum uint8, payload []byte) (netip.AddrPort, error) {
	if s.sock == nil {
		if err := s.open(); err != nil {
			return netip.AddrPort{}, err
		}
	}
	s.seq++
	// No NLM_F_ACK: the kernel answers a GET with the entry alone, or with
	// an NLMSG_ERROR.
	req := &nl.NetlinkRequest{NlMsghdr: unix.NlMsghdr{Type: ctnetlinkGet, Flags: unix.NLM_F_REQUEST, Seq: s.seq}}
	req.AddRawData(payload)
	if err := s.sock.Send(req); err != nil {
		s.close()
		return netip.AddrPort{}, fmt.Errorf("sending ctnetlink GET: %w", err)
	}
	for {
		msgs, from, err := s.sock.Receive()
		if err != nil {
			s.close()
			return netip.AddrPort{}, fmt.Errorf("receiving the answer to ctnetlink GET: %w", err)
		}
		if from.Pid != nl.PidKernel {
			continue
		}
		if dst, done, err := conntrackAnswer(msgs, s.pid, s.seq, family, protoNum); done {
			return dst, err
		}
	}
}

// conntrackAnswer looks in msgs, read from the netlink socket with port id
// pid, for the answer to the GET request with sequence number seq, for an
// entry of the given family and protocol number. It reports done when it
// found one: the entry's original destination, or the error the kernel
// answered with (an unix.Errno: ENOENT when there is no entry) or that
// parsing the entry met.
func conntrackAnswer(msgs []syscall.NetlinkMessage, pid, seq uint32, family, protoNum uint8) (dst netip.AddrPort, done bool, err error) {
	for _, m := range msgs {
		if m.Header.Seq != seq || m.Header.Pid != pid {
			continue // a late answer to an earlier request
		}
		switch m.Header.Type {
		case unix.NLMSG_NOOP, unix.NLMSG_DONE:
			continue
		case unix.NLMSG_ERROR:
			// struct nlmsgerr: a negative errno, then the request.
			if len(m.Data) < 4 {
				return netip.AddrPort{}, true, fmt.Errorf("ctnetlink GET: error message of %d bytes", len(m.Data))
			}
			code := int32(binary.NativeEndian.Uint32(m.Data[:4]))
			if code >= 0 {
				return netip.AddrPort{}, true, fmt.Errorf("ctnetlink GET: answered with error code %d and no entry", code)
			}
			return netip.AddrPort{}, true, fmt.Errorf("ctnetlink GET: %w", unix.Errno(-code))
		}
		dst, err := parseConntrackOriginalDst(m.Data, family, protoNum)
		if err != nil {
			return netip.AddrPort{}, true, fmt.Errorf("ctnetlink GET: %w", err)
		}
		return dst, true, nil
	}
	return netip.AddrPort{}, false, nil
}

// Close closes the idle netlink sockets; the lookups in progress close
// theirs when they end. Lookups after Close fail with net.ErrClosed.
// Closing twice is harmless.
func (l *ConntrackLookup) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	close(l.done)
	idle := l.idle
	l.idle = nil
	l.mu.Unlock()
	for _, s := range idle {
		s.close()
	}
	return nil
}

// conntrackGetPayload returns the address family, the protocol number and
// the message payload (nfgenmsg and attributes) of the IPCTNL_MSG_CT_GET
// request for the conntrack entry whose REPLY tuple is local → client.
func conntrackGetPayload(proto Protocol, client, local netip.AddrPort) (family, protoNum uint8, payload []byte, err error) {
	switch proto {
	case TCP:
		protoNum = unix.IPPROTO_TCP
	case UDP:
		protoNum = unix.IPPROTO_UDP
	default:
		return 0, 0, nil, fmt.Errorf("protocol %q is not %q or %q", proto, TCP, UDP)
	}
	ca, la := client.Addr().Unmap().WithZone(""), local.Addr().Unmap().WithZone("")
	if !ca.IsValid() || !la.IsValid() {
		return 0, 0, nil, errors.New("an address is missing")
	}
	src, dst := nl.CTA_IP_V6_SRC, nl.CTA_IP_V6_DST
	family = unix.AF_INET6
	switch {
	case ca.Is4() && la.Is4():
		src, dst = nl.CTA_IP_V4_SRC, nl.CTA_IP_V4_DST
		family = unix.AF_INET
	case ca.Is4() || la.Is4():
		return 0, 0, nil, errors.New("client and local address are of different families")
	}
	reply := nl.NewRtAttr(nl.CTA_TUPLE_REPLY|unix.NLA_F_NESTED, nil)
	ip := reply.AddRtAttr(nl.CTA_TUPLE_IP|unix.NLA_F_NESTED, nil)
	ip.AddRtAttr(src, la.AsSlice())
	ip.AddRtAttr(dst, ca.AsSlice())
	l4 := reply.AddRtAttr(nl.CTA_TUPLE_PROTO|unix.NLA_F_NESTED, nil)
	l4.AddRtAttr(nl.CTA_PROTO_NUM, []byte{protoNum})
	l4.AddRtAttr(nl.CTA_PROTO_SRC_PORT, nl.BEUint16Attr(local.Port()))
	l4.AddRtAttr(nl.CTA_PROTO_DST_PORT, nl.BEUint16Attr(client.Port()))
	// struct nfgenmsg: family, version, resource id (zero).
	payload = append([]byte{family, nl.NFNETLINK_V0, 0, 0}, reply.Serialize()...)
	return family, protoNum, payload, nil
}

// parseConntrackOriginalDst returns the destination of the ORIGINAL tuple
// in msg, a ctnetlink entry (nfgenmsg and attributes, after the netlink
// header) that must be of the given family and protocol number.
func parseConntrackOriginalDst(msg []byte, family, protoNum uint8) (netip.AddrPort, error) {
	if len(msg) < nl.SizeofNfgenmsg {
		return netip.AddrPort{}, fmt.Errorf("entry of %d bytes, shorter than its nfgenmsg header", len(msg))
	}
	if msg[0] != family {
		return netip.AddrPort{}, fmt.Errorf("entry of address family %d, want %d", msg[0], family)
	}
	attrs, err := conntrackAttrs(msg[nl.SizeofNfgenmsg:])
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("entry: %w", err)
	}
	orig, ok := attrs[nl.CTA_TUPLE_ORIG]
	if !ok {
		return netip.AddrPort{}, errors.New("entry has no original tuple")
	}
	tuple, err := conntrackAttrs(orig)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("original tuple: %w", err)
	}
	ipAttrs, err := conntrackAttrs(tuple[nl.CTA_TUPLE_IP])
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("original tuple addresses: %w", err)
	}
	l4Attrs, err := conntrackAttrs(tuple[nl.CTA_TUPLE_PROTO])
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("original tuple protocol: %w", err)
	}
	dstType, size := uint16(nl.CTA_IP_V6_DST), 16
	if family == unix.AF_INET {
		dstType, size = nl.CTA_IP_V4_DST, 4
	}
	raw := ipAttrs[dstType]
	if len(raw) != size {
		return netip.AddrPort{}, fmt.Errorf("original tuple destination address of %d bytes, want %d", len(raw), size)
	}
	addr, _ := netip.AddrFromSlice(raw)
	if num := l4Attrs[nl.CTA_PROTO_NUM]; len(num) != 1 || num[0] != protoNum {
		return netip.AddrPort{}, fmt.Errorf("original tuple protocol %v, want %d", num, protoNum)
	}
	port := l4Attrs[nl.CTA_PROTO_DST_PORT]
	if len(port) != 2 {
		return netip.AddrPort{}, fmt.Errorf("original tuple destination port of %d bytes, want 2", len(port))
	}
	// Ports in ctnetlink tuples are big-endian (nla_put_be16).
	return netip.AddrPortFrom(addr, binary.BigEndian.Uint16(port)), nil
}

// conntrackAttrs splits b into netlink attributes by type, with the
// NLA_F_NESTED and NLA_F_NET_BYTEORDER flags masked out of the type (the
// kernel sets NLA_F_NESTED on ctnetlink's nested attributes). It is
// written out rather than nl.ParseRouteAttr because that slices past the
// end of b, and panics, when the last attribute is not padded.
func conntrackAttrs(b []byte) (map[uint16][]byte, error) {
	attrs := map[uint16][]byte{}
	for len(b) > 0 {
		if len(b) < unix.SizeofNlAttr {
			return nil, fmt.Errorf("%d trailing bytes, shorter than an attribute header", len(b))
		}
		n := int(binary.NativeEndian.Uint16(b[0:2]))
		typ := binary.NativeEndian.Uint16(b[2:4]) & nl.NLA_TYPE_MASK
		if n < unix.SizeofNlAttr || n > len(b) {
			return nil, fmt.Errorf("attribute %d of length %d in %d bytes", typ, n, len(b))
		}
		attrs[typ] = b[unix.SizeofNlAttr:n]
		b = b[min((n+unix.NLA_ALIGNTO-1)&^(unix.NLA_ALIGNTO-1), len(b)):]
	}
	return attrs, nil
}
