package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"

	"golang.org/x/sys/unix"
)

// OriginalDst returns the destination a REDIRECTed TCP connection was
// originally sent to: the service VIP and port, before the kernel rewrote
// it to the proxy listener. It asks conntrack with getsockopt
// SO_ORIGINAL_DST (level SOL_IP) when the connection is IPv4, also on a
// dual-stack IPv6 socket, or IP6T_SO_ORIGINAL_DST (level SOL_IPV6) when it
// is IPv6. An IPv4 destination is returned unmapped.
//
// It only reads the socket through c.SyscallConn: it does not wrap,
// duplicate, close or change c. It fails with an error wrapping ENOENT when
// conntrack has no entry for the connection.
func OriginalDst(c *net.TCPConn) (netip.AddrPort, error) {
	local, ok := c.LocalAddr().(*net.TCPAddr)
	if !ok {
		return netip.AddrPort{}, errors.New("redirect: original destination: connection has no TCP local address")
	}
	v4 := local.AddrPort().Addr().Unmap().Is4()
	rc, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("redirect: original destination of %s: %w", c.RemoteAddr(), err)
	}
	var (
		dst  netip.AddrPort
		serr error
	)
	err = rc.Control(func(fd uintptr) {
		if v4 {
			dst, serr = originalDst4(int(fd))
		} else {
			dst, serr = originalDst6(int(fd))
		}
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("redirect: original destination of %s: %w", c.RemoteAddr(), err)
	}
	return dst, nil
}

// originalDst4 reads SO_ORIGINAL_DST, a struct sockaddr_in. The kernel
// writes it into the buffer of an IPv6Mreq (20 bytes, at least the 16 of a
// sockaddr_in), the one getsockopt helper of x/sys/unix with room for it.
func originalDst4(fd int) (netip.AddrPort, error) {
	mreq, err := unix.GetsockoptIPv6Mreq(fd, unix.SOL_IP, unix.SO_ORIGINAL_DST)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("getsockopt SO_ORIGINAL_DST: %w", err)
	}
	// struct sockaddr_in: family (host order), port (network order), address.
	b := mreq.Multiaddr[:]
	if family := binary.NativeEndian.Uint16(b[0:2]); family != unix.AF_INET {
		return netip.AddrPort{}, fmt.Errorf("getsockopt SO_ORIGINAL_DST: address family %d, not AF_INET", family)
	}
	port := binary.BigEndian.Uint16(b[2:4])
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), port), nil
}

// ip6tSOOriginalDst is IP6T_SO_ORIGINAL_DST from
// <linux/netfilter_ipv6/ip6_tables.h>, which x/sys/unix does not define.
const ip6tSOOriginalDst = 80

// originalDst6 reads IP6T_SO_ORIGINAL_DST, a struct sockaddr_in6. The
// kernel writes it into the Addr field of an IPv6MTUInfo (a
// RawSockaddrInet6 and the MTU), the one getsockopt helper of x/sys/unix
// whose buffer starts with a sockaddr_in6.
func originalDst6(fd int) (netip.AddrPort, error) {
	info, err := unix.GetsockoptIPv6MTUInfo(fd, unix.SOL_IPV6, ip6tSOOriginalDst)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("getsockopt IP6T_SO_ORIGINAL_DST: %w", err)
	}
	sa := info.Addr
	if sa.Family != unix.AF_INET6 {
		return netip.AddrPort{}, fmt.Errorf("getsockopt IP6T_SO_ORIGINAL_DST: address family %d, not AF_INET6", sa.Family)
	}
	// RawSockaddrInet6.Port holds the port's bytes in network order.
	var port [2]byte
	binary.NativeEndian.PutUint16(port[:], sa.Port)
	return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), binary.BigEndian.Uint16(port[:])), nil
}
