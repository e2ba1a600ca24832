package redirect

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"syscall"

	"golang.org/x/sys/unix"
)

// OriginalDst returns the destination a REDIRECTed TCP connection was
// originally sent to: the service VIP and port, before the kernel rewrote
// it to the proxy listener. It asks conntrack with getsockopt
// SO_ORIGINAL_DST (level SOL_IP) when the connection is IPv4, also on a
// dual-stack IPv6 socket, or IP6T_SO_ORIGINAL_DST (level SOL_IPV6) when it
// is IPv6. An IPv4 destination is returned unmapped.
//
// c is the accepted socket, v6 the family of its listener (a tcp6
// listener is IPv6-only). OriginalDst only reads the socket, through
// c.Control: it does not duplicate, close or change it. It fails with an
// error wrapping ENOENT when conntrack has no entry for the connection.
func OriginalDst(c syscall.RawConn, v6 bool) (netip.AddrPort, error) {
	var (
		dst  netip.AddrPort
		serr error
	)
	err := c.Control(func(fd uintptr) {
		if v6 {
			dst, serr = originalDst6(int(fd))
		} else {
			dst, serr = originalDst4(int(fd))
		}
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("redirect: original destination: %w", err)
	}
	return dst, nil
}

// TProxyDst returns the destination of a connection that TPROXY handed to
// a transparent listener: TPROXY leaves it alone, so it is the socket's
// own local address (getsockname). An IPv4 address is returned unmapped.
// The signature is OriginalDst's, so that either can be the proxy's hook.
func TProxyDst(c syscall.RawConn, _ bool) (netip.AddrPort, error) {
	var (
		sa   unix.Sockaddr
		serr error
	)
	err := c.Control(func(fd uintptr) { sa, serr = unix.Getsockname(int(fd)) })
	if err == nil {
		err = serr
	}
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("redirect: local address: %w", err)
	}
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port)), nil
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), uint16(sa.Port)), nil
	}
	return netip.AddrPort{}, fmt.Errorf("redirect: local address: %T is not an IP address", sa)
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
