package datapath

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// udpSocket reads a listener's datagrams with the address each was sent
// to, and says how replies go out so that they appear to come from it.
// readBatch is called by one goroutine only; replyPath by any.
type udpSocket interface {
	// readBatch blocks until at least one datagram is queued, then reads
	// up to len(out) of them (fewer while the socket has no backlog; see
	// listenSocket). The caller returns each out[i].buf to listenBuffers.
	// Over an event loop's socket (loopListener) it does not wait: it
	// returns EAGAIN when nothing is queued.
	readBatch(out []datagram) (int, error)
	// replyPath returns how a reply to a datagram that arrived at dst
	// goes out (a replySender or a replyQueue sends it).
	replyPath(dst netip.AddrPort) (replyPath, error)
	close()
}

// replyPath is how a reply goes out: through rc's socket, of family v6
// or not, from src's address when it is valid (IP_PKTINFO,
// IPV6_PKTINFO), else from the socket's own.
type replyPath struct {
	rc  syscall.RawConn
	v6  bool
	src netip.Addr
}

// datagram is one datagram read from a listener.
type datagram struct {
	buf         *[]byte // from listenBuffers; the payload is (*buf)[:n]
	n           int
	client, dst netip.AddrPort
}

// listenBuffers recycles the listeners' datagram buffers: a listener
// holds buffers only while it reads and forwards, never while it waits,
// so a thousand idle UDP services cost no 64 KiB each.
var listenBuffers bufferPool

// cmsgSpace is room for the one control message a listener asks for: an
// in6_pktinfo (20 bytes) or a sockaddr_in6 (28), with its header.
var cmsgSpace = unix.CmsgSpace(unix.SizeofSockaddrInet6)

// maxReadBatch is the largest batch a listener reads with one recvmmsg.
const maxReadBatch = 16

// listenSocket is a UDP listener's socket, of either family, that learns
// each datagram's destination from a control message: IP_PKTINFO or
// IPV6_PKTINFO in redirect mode (the local address REDIRECT rewrote the
// destination to), IP_ORIGDSTADDR or IPV6_ORIGDSTADDR in tproxy mode (the
// service's own address and port; see tproxySocket for the replies).
//
// It reads with recvmmsg(2), in batches that adapt to the backlog: one
// datagram at a time while each read finds one, doubling (up to the
// configured batch) while reads fill the batch, halving when they do not.
// recvmmsg is called directly rather than through x/net's ReadBatch,
// which needs its buffers before it waits: this way the buffers are taken
// from listenBuffers only once datagrams are queued.
type listenSocket struct {
	rc       syscall.RawConn
	v6       bool
	maxBatch int
	minBatch int // 1, or 2 after seesEmpty
	batch    int // current batch size, minBatch..maxBatch

	// recvmmsg's arguments and results, reused by the one reader; readFn
	// is recvmmsg, bound once (a func literal passed to RawConn.Read would
	// be allocated at every read).
	readFn func(fd uintptr) bool
	out    []datagram
	n      int
	asked  int // how many datagrams the last recvmmsg asked for
	serr   syscall.Errno
	hdrs   []unix.Mmsghdr
	iovs   []unix.Iovec
	names  []unix.RawSockaddrInet6 // big enough for either family
	oob    []byte                  // cmsgSpace per message
}

// newListenSocket asks the kernel for each datagram's destination address
// (IP_PKTINFO, IPV6_RECVPKTINFO). tproxy-mode listeners ask for the
// original destination when they are opened (transparentListenConfig).
func newListenSocket(rc syscall.RawConn, v6, pktinfo bool, maxBatch int) (*listenSocket, error) {
	maxBatch = min(max(maxBatch, 1), maxReadBatch)
	s := &listenSocket{
		v6: v6, maxBatch: maxBatch, minBatch: 1, batch: 1,
		hdrs:  make([]unix.Mmsghdr, maxBatch),
		iovs:  make([]unix.Iovec, maxBatch),
		names: make([]unix.RawSockaddrInet6, maxBatch),
		oob:   make([]byte, maxBatch*cmsgSpace),
	}
	s.readFn = s.recvmmsg
	s.rc = rc
	if !pktinfo {
		return s, nil
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		if v6 {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1)
		} else {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_PKTINFO, 1)
		}
	}); err != nil {
		return s, err
	}
	if serr != nil {
		return s, fmt.Errorf("asking for datagrams' destination addresses: %w", serr)
	}
	return s, nil
}

var _ udpSocket = (*listenSocket)(nil)

// drained says whether the last read left the socket's queue empty:
// recvmmsg returned fewer datagrams than it asked for.
func (s *listenSocket) drained() bool { return s.n < s.asked }

// seesEmpty makes every read ask for two datagrams at least (if the
// batch may hold two), so that a read that finds one also tells that the
// queue is empty after it (drained), where a read of one would need a
// further read to find EAGAIN, as flowReceiver does for replies.
func (s *listenSocket) seesEmpty() {
	s.minBatch = min(2, s.maxBatch)
	s.batch = max(s.batch, s.minBatch)
}

func (s *listenSocket) readBatch(out []datagram) (int, error) {
	s.out, s.n, s.serr = out, 0, 0
	err := s.rc.Read(s.readFn)
	n, serr := s.n, s.serr
	s.out = nil
	if err == nil && serr != 0 {
		err = serr
	}
	if err != nil {
		return 0, err
	}
	m := 0
	for i := range n {
		h := &s.hdrs[i]
		dst, derr := destFromControl(s.oob[i*cmsgSpace : i*cmsgSpace+int(h.Hdr.Controllen)])
		client := sockaddrAddrPort(&s.names[i])
		if derr != nil || !client.IsValid() {
			listenBuffers.put(out[i].buf) // not delivered by our rules: dropped
			continue
		}
		out[m] = datagram{buf: out[i].buf, n: int(h.Len), client: client, dst: dst}
		m++
	}
	for i := m; i < n; i++ {
		out[i] = datagram{}
	}
	if m == 0 {
		return 0, errNoDestination
	}
	return m, nil
}

// recvmmsg is RawConn.Read's function for readBatch: one recvmmsg(2) into
// s.out that does not wait, with buffers taken only for it; false when
// nothing is queued (EAGAIN).
func (s *listenSocket) recvmmsg(fd uintptr) bool {
	out := s.out
	k := min(s.batch, len(out))
	for i := range k {
		bp := listenBuffers.get()
		out[i].buf = bp
		s.iovs[i].Base = &(*bp)[0]
		s.iovs[i].SetLen(len(*bp))
		h := &s.hdrs[i]
		*h = unix.Mmsghdr{}
		h.Hdr.Name = (*byte)(unsafe.Pointer(&s.names[i]))
		h.Hdr.Namelen = unix.SizeofSockaddrInet6
		h.Hdr.Iov = &s.iovs[i]
		h.Hdr.SetIovlen(1)
		h.Hdr.Control = &s.oob[i*cmsgSpace]
		h.Hdr.SetControllen(cmsgSpace)
	}
	r, err := rawCallP(unix.SYS_RECVMMSG, fd, unsafe.Pointer(&s.hdrs[0]), uintptr(k), unix.MSG_DONTWAIT, 0, 0)
	n := max(int(r), 0)
	errno, _ := err.(syscall.Errno)
	for i := n; i < k; i++ {
		listenBuffers.put(out[i].buf)
		out[i].buf = nil
	}
	if errno == unix.EAGAIN {
		return false // wait in the netpoller, holding no buffer
	}
	s.n, s.asked, s.serr = n, k, errno
	// Adapt the batch to the backlog this read found.
	switch {
	case n == k && k < s.maxBatch:
		s.batch = min(2*k, s.maxBatch)
	case n < k:
		s.batch = max(k/2, s.minBatch)
	}
	return true
}

// errNoDestination: no datagram of a read carried its destination.
var errNoDestination = errors.New("datagram without its destination address")

// sockaddrAddrPort decodes the sockaddr_in or sockaddr_in6 recvmmsg
// wrote.
func sockaddrAddrPort(sa *unix.RawSockaddrInet6) netip.AddrPort {
	switch sa.Family {
	case unix.AF_INET:
		sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
		return netip.AddrPortFrom(netip.AddrFrom4(sa4.Addr), ntohs(sa4.Port))
	case unix.AF_INET6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), ntohs(sa.Port))
	}
	return netip.AddrPort{}
}

// replyPath sends a reply from dst's address (IP_PKTINFO's ipi_spec_dst,
// or IPV6_PKTINFO's ipi6_addr: ip(7), ipv6(7)), so that conntrack maps
// it back to the service's address the client sent to. An invalid dst
// sends from whatever address the kernel picks.
func (s *listenSocket) replyPath(dst netip.AddrPort) (replyPath, error) {
	return replyPath{rc: s.rc, v6: s.v6, src: dst.Addr()}, nil
}

func (*listenSocket) close() {}

// pktinfo appends an IP_PKTINFO or IPV6_PKTINFO control message that sets
// a datagram's source address to src.
func pktinfo(b []byte, src netip.Addr, v6 bool) []byte {
	if v6 {
		var pi unix.Inet6Pktinfo
		pi.Addr = src.As16()
		return appendCmsg(b, unix.IPPROTO_IPV6, unix.IPV6_PKTINFO, unsafe.Slice((*byte)(unsafe.Pointer(&pi)), unix.SizeofInet6Pktinfo))
	}
	var pi unix.Inet4Pktinfo
	pi.Spec_dst = src.Unmap().As4()
	return appendCmsg(b, unix.IPPROTO_IP, unix.IP_PKTINFO, unsafe.Slice((*byte)(unsafe.Pointer(&pi)), unix.SizeofInet4Pktinfo))
}

func appendCmsg(b []byte, level, typ int, data []byte) []byte {
	start := len(b)
	b = append(b, make([]byte, unix.CmsgSpace(len(data)))...)
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b[start]))
	h.Level, h.Type = int32(level), int32(typ)
	h.SetLen(unix.CmsgLen(len(data)))
	copy(b[start+unix.CmsgLen(0):], data)
	return b
}

// destFromControl finds a datagram's destination in its control messages:
// IP_ORIGDSTADDR or IPV6_ORIGDSTADDR (address and port), or IP_PKTINFO or
// IPV6_PKTINFO (address only, port 0). It walks the buffer in place:
// unix.ParseSocketControlMessage would allocate for every datagram.
func destFromControl(oob []byte) (netip.AddrPort, error) {
	for len(oob) >= unix.CmsgLen(0) {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
		l := int(h.Len)
		if l < unix.CmsgLen(0) || l > len(oob) {
			return netip.AddrPort{}, errors.New("malformed control message")
		}
		data := oob[unix.CmsgLen(0):l]
		switch {
		case h.Level == unix.SOL_IP && h.Type == unix.IP_ORIGDSTADDR && len(data) >= unix.SizeofSockaddrInet4:
			sa := (*unix.RawSockaddrInet4)(unsafe.Pointer(&data[0]))
			return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), ntohs(sa.Port)), nil
		case h.Level == unix.SOL_IPV6 && h.Type == unix.IPV6_ORIGDSTADDR && len(data) >= unix.SizeofSockaddrInet6:
			sa := (*unix.RawSockaddrInet6)(unsafe.Pointer(&data[0]))
			return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), ntohs(sa.Port)), nil
		case h.Level == unix.IPPROTO_IP && h.Type == unix.IP_PKTINFO && len(data) >= unix.SizeofInet4Pktinfo:
			pi := (*unix.Inet4Pktinfo)(unsafe.Pointer(&data[0]))
			return netip.AddrPortFrom(netip.AddrFrom4(pi.Addr), 0), nil
		case h.Level == unix.IPPROTO_IPV6 && h.Type == unix.IPV6_PKTINFO && len(data) >= unix.SizeofInet6Pktinfo:
			pi := (*unix.Inet6Pktinfo)(unsafe.Pointer(&data[0]))
			return netip.AddrPortFrom(netip.AddrFrom16(pi.Addr).Unmap(), 0), nil
		}
		oob = oob[min(unix.CmsgSpace(l-unix.CmsgLen(0)), len(oob)):]
	}
	return netip.AddrPort{}, errNoDestination
}

// ntohs converts a port from the network byte order a sockaddr holds,
// and, being its own inverse, to it.
func ntohs(p uint16) uint16 {
	var b [2]byte
	binary.NativeEndian.PutUint16(b[:], p)
	return binary.BigEndian.Uint16(b[:])
}

// readDatagram reads one datagram from a connected socket into a buffer
// taken from pool only once one is queued, so that a waiting reader holds
// no buffer: one read(2) per datagram (the socket is non-blocking), and
// the netpoller's wait when none is queued. The caller returns the buffer
// to pool. err is the socket's pending error (ECONNREFUSED after an ICMP
// port unreachable: udp(7)) or net.ErrClosed.
func readDatagram(rc syscall.RawConn, pool *bufferPool) (bp *[]byte, n int, err error) {
	var serr error
	rerr := rc.Read(func(fd uintptr) bool {
		bp = pool.get()
		n, serr = readRetry(int(fd), *bp)
		if serr == unix.EAGAIN {
			pool.put(bp)
			bp = nil
			return false
		}
		return true
	})
	switch {
	case rerr != nil:
		if bp != nil {
			pool.put(bp)
		}
		return nil, 0, rerr
	case serr != nil:
		pool.put(bp)
		return nil, 0, serr
	}
	return bp, n, nil
}

// replySender sends replies through listener sockets for one goroutine
// at a time (a flow's reply goroutine, or an event loop), from scratch
// space of its own: RawConn.Write takes a func, and a func literal that
// captured the arguments would be allocated at every call.
type replySender struct {
	msg  unix.Msghdr
	iov  unix.Iovec
	name unix.RawSockaddrInet6 // big enough for either family
	oob  [64]byte
	err  syscall.Errno
	fn   func(fd uintptr) bool // sendmsg, bound once
}

func newReplySender() *replySender {
	s := &replySender{}
	s.fn = s.sendmsg
	return s
}

// errReplyDropped: a reply found its socket's send buffer full.
var errReplyDropped = errors.New("reply dropped: the listener's send buffer is full")

// send sends b to client along path, without waiting for room in the
// send buffer: a full one drops the datagram (errReplyDropped), as the
// kernel drops what a full receive buffer cannot take.
func (s *replySender) send(path replyPath, b []byte, client netip.AddrPort) error {
	setReply(&s.msg, &s.iov, &s.name, &s.oob, path, b, client)
	s.err = 0
	if err := path.rc.Write(s.fn); err != nil {
		return err
	}
	return replyError("sendmsg", s.err)
}

// setReply fills msg, and the iovec, address and control message it
// points to, for a reply b to client along path.
func setReply(msg *unix.Msghdr, iov *unix.Iovec, name *unix.RawSockaddrInet6, oob *[64]byte, path replyPath, b []byte, client netip.AddrPort) {
	*msg = unix.Msghdr{Name: (*byte)(unsafe.Pointer(name)), Iov: iov}
	msg.SetIovlen(1)
	*iov = unix.Iovec{}
	if len(b) > 0 {
		iov.Base = &b[0]
		iov.SetLen(len(b))
	}
	msg.Namelen = putSockaddr(name, client, path.v6)
	if path.src.IsValid() {
		n := len(pktinfo(oob[:0], path.src, path.v6))
		msg.Control = &oob[0]
		msg.SetControllen(n)
	}
}

// replyError is the error of a reply that call failed with errno (0:
// none).
func replyError(call string, errno syscall.Errno) error {
	switch errno {
	case 0:
		return nil
	case unix.EAGAIN:
		return errReplyDropped
	}
	return os.NewSyscallError(call, errno)
}

// maxReplyBatch is the most replies a replyQueue sends with one
// sendmmsg(2).
const maxReplyBatch = 16

// replyQueue holds an event loop's replies to its flows' clients until
// the loop has handled what one epoll_wait returned, then sends those
// that go out through the same socket with one sendmmsg(2): the flows of
// a service share their listener's socket (or, in tproxy mode, the
// reply socket of the service's address). With many flows a sendmmsg
// carries several replies, each of which would otherwise have a
// sendmsg(2) of its own. It belongs to the loop, and is used by it alone.
type replyQueue struct {
	path  replyPath // of every queued reply
	n     int
	hdrs  [maxReplyBatch]unix.Mmsghdr
	iovs  [maxReplyBatch]unix.Iovec
	names [maxReplyBatch]unix.RawSockaddrInet6
	oobs  [maxReplyBatch][64]byte
	flows [maxReplyBatch]*udpFlow
	// data holds copies of the queued payloads: a flow's receive buffer
	// is reused for its next datagram before the queue is flushed.
	data []byte
	// done reports each reply's outcome: the bytes sent, or why none.
	done func(f *udpFlow, n int, err error)
	// sendmmsg's arguments and results, for fn.
	from, sent int
	err        syscall.Errno
	fn         func(fd uintptr) bool
}

func newReplyQueue(done func(f *udpFlow, n int, err error)) *replyQueue {
	q := &replyQueue{data: make([]byte, 0, maxDatagram), done: done}
	q.fn = q.sendmmsg
	return q
}

// add queues b, a reply of f's backend, to f's client along path. The
// queue is flushed first if it is full, if b does not fit in what is
// left of its copies, or if path goes out through another socket.
func (q *replyQueue) add(path replyPath, b []byte, f *udpFlow) {
	if q.n > 0 && (q.n == maxReplyBatch || len(q.data)+len(b) > cap(q.data) || q.path != path) {
		q.flush()
	}
	q.path = path
	start := len(q.data)
	q.data = append(q.data, b...)
	setReply(&q.hdrs[q.n].Hdr, &q.iovs[q.n], &q.names[q.n], &q.oobs[q.n], path, q.data[start:], f.key.client)
	q.flows[q.n] = f
	q.n++
}

// flush sends the queued replies and reports each one's outcome. A reply
// that fails is skipped, and those after it are sent with the next call:
// sendmmsg stops at the first message it cannot send.
func (q *replyQueue) flush() {
	for i := 0; i < q.n; {
		q.from, q.sent, q.err = i, 0, 0
		if err := q.path.rc.Write(q.fn); err != nil {
			for ; i < q.n; i++ { // the socket is closed
				q.done(q.flows[i], 0, err)
			}
			break
		}
		for end := i + q.sent; i < end; i++ {
			q.done(q.flows[i], int(q.iovs[i].Len), nil)
		}
		if q.sent == 0 {
			if q.err == 0 {
				q.err = unix.EIO // no progress and no error: never loop
			}
			q.done(q.flows[i], 0, replyError("sendmmsg", q.err))
			i++
		}
	}
	clear(q.flows[:q.n])
	q.n, q.data = 0, q.data[:0]
}

// sendmmsg is RawConn.Write's function: one sendmmsg(2) of the queued
// replies from q.from on, that does not wait.
func (q *replyQueue) sendmmsg(fd uintptr) bool {
	n, err := rawCallP(unix.SYS_SENDMMSG, fd, unsafe.Pointer(&q.hdrs[q.from]), uintptr(q.n-q.from), unix.MSG_DONTWAIT, 0, 0)
	q.sent, q.err = 0, 0
	if err != nil {
		q.err, _ = err.(syscall.Errno)
		if q.err == 0 {
			q.err = unix.EIO
		}
		return true
	}
	q.sent = int(n)
	return true
}

// sendmsg is RawConn.Write's function: one sendmsg(2) that does not wait.
func (s *replySender) sendmsg(fd uintptr) bool {
	_, err := rawCallP(unix.SYS_SENDMSG, fd, unsafe.Pointer(&s.msg), unix.MSG_DONTWAIT, 0, 0, 0)
	s.err, _ = err.(syscall.Errno)
	return true
}

// bufferPool recycles datagram buffers of the largest size.
type bufferPool struct{ p sync.Pool }

func (b *bufferPool) get() *[]byte {
	if v, ok := b.p.Get().(*[]byte); ok {
		return v
	}
	buf := make([]byte, maxDatagram)
	return &buf
}

func (b *bufferPool) put(bp *[]byte) { b.p.Put(bp) }
