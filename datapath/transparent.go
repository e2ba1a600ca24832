package datapath

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// setTransparent sets IP_TRANSPARENT (or IPV6_TRANSPARENT), which lets a
// socket accept connections TPROXY hands it for addresses that are not the
// node's, and bind to such an address to dial from a client's IP or send
// from a service VIP (ip(7); needs CAP_NET_ADMIN or CAP_NET_RAW).
func setTransparent(network string, c syscall.RawConn, origDst bool) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		if is6(network) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
			if serr == nil && origDst {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_RECVORIGDSTADDR, 1)
			}
			return
		}
		serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
		if serr == nil && origDst {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_RECVORIGDSTADDR, 1)
		}
	})
	if err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("setting IP_TRANSPARENT: %w", serr)
	}
	return nil
}

func is6(network string) bool { return network[len(network)-1] == '6' }

// transparentListenConfig returns a ListenConfig for tproxy-mode
// listeners: transparent, and for UDP reporting each datagram's original
// destination.
func transparentListenConfig() net.ListenConfig {
	return net.ListenConfig{Control: func(network, _ string, c syscall.RawConn) error {
		return setTransparent(network, c, network[:3] == "udp")
	}}
}

// transparentDialer returns a Dialer that connects from addr, which need
// not be the node's: with IP_TRANSPARENT the backend sees the client's
// own address. The replies reach us because the kernel's rules mark
// packets of transparent sockets for local delivery.
func transparentDialer(from netip.Addr, udp bool, mark uint32) *net.Dialer {
	marked := markControl(mark)
	d := &net.Dialer{Control: func(network, address string, c syscall.RawConn) error {
		if err := setTransparent(network, c, false); err != nil {
			return err
		}
		if marked != nil {
			return marked(network, address, c)
		}
		return nil
	}}
	if udp {
		d.LocalAddr = &net.UDPAddr{IP: from.AsSlice()}
	} else {
		d.LocalAddr = &net.TCPAddr{IP: from.AsSlice()}
	}
	return d
}

// markControl returns a Dialer's Control that marks the socket with mark
// (setOwnMark), or nil for a zero mark.
func markControl(mark uint32) func(network, address string, c syscall.RawConn) error {
	if mark == 0 {
		return nil
	}
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = setOwnMark(int(fd), mark) }); err != nil {
			return err
		}
		return serr
	}
}

// tproxySocket is a tproxy-mode UDP listener: each datagram carries its
// original destination (IP_RECVORIGDSTADDR), and replies go out from
// transparent sockets bound to that destination, so the client sees them
// come from the service's address and port.
type tproxySocket struct {
	*listenSocket // reads, with IP_ORIGDSTADDR

	mu      sync.Mutex
	replies map[netip.AddrPort]*rawSock
	closed  bool
}

var _ udpSocket = (*tproxySocket)(nil)

// replyPath sends a reply from the transparent socket bound to dst, the
// service's own address and port.
func (t *tproxySocket) replyPath(dst netip.AddrPort) (replyPath, error) {
	c, err := t.replySocket(dst)
	if err != nil {
		return replyPath{}, err
	}
	return replyPath{rc: c, v6: t.v6}, nil
}

// replySocket returns the transparent socket bound to dst, opening it on
// first use. It only sends: TPROXY hands datagrams to the listener, and
// the kernel never delivers to an unconnected socket a datagram that
// TPROXY assigned elsewhere.
//
// It is opened raw, out of the runtime's poller: the runtime registers a
// socket for writability too, edge-triggered, and a UDP socket signals
// writability each time the kernel frees a datagram it sent (sock_wfree),
// which would wake the runtime's poller for every reply.
func (t *tproxySocket) replySocket(dst netip.AddrPort) (*rawSock, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, net.ErrClosed
	}
	if c, ok := t.replies[dst]; ok {
		return c, nil
	}
	c, err := openReplySocket(dst, t.v6)
	if err != nil {
		return nil, fmt.Errorf("opening a reply socket on %s: %w", dst, err)
	}
	if t.replies == nil {
		t.replies = map[netip.AddrPort]*rawSock{}
	}
	t.replies[dst] = c
	return c, nil
}

// openReplySocket opens a transparent UDP socket bound to dst, which may
// be an address of no local interface, and shares its port with the
// other reply sockets and the clients' flows (SO_REUSEADDR).
func openReplySocket(dst netip.AddrPort, v6 bool) (*rawSock, error) {
	family, network := unix.AF_INET, "udp4"
	if v6 {
		family, network = unix.AF_INET6, "udp6"
	}
	fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	c := &rawSock{fd: fd}
	if err := setTransparent(network, c, false); err != nil {
		c.closeSock()
		return nil, err
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
		c.closeSock()
		return nil, os.NewSyscallError("setsockopt SO_REUSEADDR", err)
	}
	var name unix.RawSockaddrInet6
	n := putSockaddr(&name, dst, v6)
	if _, _, errno := unix.Syscall(unix.SYS_BIND, uintptr(fd), uintptr(unsafe.Pointer(&name)), uintptr(n)); errno != 0 {
		c.closeSock()
		return nil, os.NewSyscallError("bind", errno)
	}
	return c, nil
}

// close closes the reply sockets; the listener is closed by its owner.
func (t *tproxySocket) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	for _, c := range t.replies {
		c.closeSock()
	}
	t.replies = nil
}
