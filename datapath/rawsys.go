package datapath

import (
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The data path's system calls on non-blocking sockets and pipes are made
// with RawSyscall6, which does not tell the scheduler that the goroutine
// entered a system call. With Syscall, a P whose goroutine has been in a
// system call for one sysmon tick is handed to another thread when other
// work is waiting (runtime/proc.go: retake), and the goroutine must find a P
// again when the call returns (exitsyscall). On a loaded machine a send that
// delivers a packet through the stack takes that long, and each such
// hand-over costs the proxy CPU per request. These calls never wait: the
// descriptors are non-blocking, or the call says MSG_DONTWAIT, so the P is
// busy with the call, not idle in it. Blocking calls (epoll_wait with a
// timeout) keep using Syscall, and sysmon still retakes the P of a loop
// blocked in one.

// rawCall makes a non-blocking system call with RawSyscall6, repeated on
// EINTR. Its arguments are integers: a call that passes memory is made
// with rawCallP, or with RawSyscall6 itself.
//
// No pointer may reach rawCall as a uintptr (TestRawCallsPassNoPointer):
// converted in the argument list of a Go function, a pointer to a stack
// variable is not updated when that function's stack grows and is moved,
// and keeps no heap object alive, so the kernel could read or write
// memory the variable no longer occupies. Only in the argument list
// of a function implemented in assembly, such as RawSyscall6, does the
// compiler keep the object alive and in place until the call returns
// (unsafe.Pointer's rule 4).
func rawCall(trap, a1, a2, a3, a4, a5, a6 uintptr) (uintptr, error) {
	for {
		r, e := rawResult(unix.RawSyscall6(trap, a1, a2, a3, a4, a5, a6))
		if e != unix.EINTR {
			return rawReturn(r, e)
		}
	}
}

// rawCallP is rawCall for a system call whose second argument, p, points
// to memory: a buffer, a sockaddr, a msghdr. p is a pointer, which the
// runtime moves with the stack, until its conversion in the call of
// RawSyscall6.
func rawCallP(trap, a1 uintptr, p unsafe.Pointer, a3, a4, a5, a6 uintptr) (uintptr, error) {
	for {
		r, e := rawResult(unix.RawSyscall6(trap, a1, uintptr(p), a3, a4, a5, a6))
		if e != unix.EINTR {
			return rawReturn(r, e)
		}
	}
}

// rawResult keeps what rawCall's callers use of RawSyscall6's results.
func rawResult(r, _ uintptr, e unix.Errno) (uintptr, unix.Errno) { return r, e }

// rawReturn is what rawCall returns for RawSyscall6's r and e: r and
// no error, or 0 and e.
func rawReturn(r uintptr, e unix.Errno) (uintptr, error) {
	if e != 0 {
		return 0, e
	}
	return r, nil
}

// readRetry is read(2) on a non-blocking descriptor.
func readRetry(fd int, b []byte) (int, error) {
	n, err := rawCallP(unix.SYS_READ, uintptr(fd), unsafe.Pointer(unsafe.SliceData(b)), uintptr(len(b)), 0, 0, 0)
	return int(n), err
}

// writeRetry is write(2) on a non-blocking descriptor.
func writeRetry(fd int, b []byte) (int, error) {
	n, err := rawCallP(unix.SYS_WRITE, uintptr(fd), unsafe.Pointer(unsafe.SliceData(b)), uintptr(len(b)), 0, 0, 0)
	return int(n), err
}

// sendRetry is one send(2) of b to a non-blocking socket, with flags and
// MSG_NOSIGNAL.
func sendRetry(fd int, b []byte, flags int) (int, error) {
	n, err := rawCallP(unix.SYS_SENDTO, uintptr(fd), unsafe.Pointer(unsafe.SliceData(b)), uintptr(len(b)), uintptr(flags|unix.MSG_NOSIGNAL), 0, 0)
	return int(n), err
}

// spliceRetry is one splice(2) from in to out of at most n bytes, both
// non-blocking (spliceFlags).
func spliceRetry(in, out, n int) (int, error) {
	m, err := rawCall(unix.SYS_SPLICE, uintptr(in), 0, uintptr(out), 0, uintptr(n), spliceFlags)
	return int(m), err
}

// closeFD is close(2) of a socket the data path owns. Closing a TCP socket
// sends its FIN or reset through the stack, which on a loaded machine can
// take as long as a send.
func closeFD(fd int) error {
	_, err := rawCall(unix.SYS_CLOSE, uintptr(fd), 0, 0, 0, 0, 0)
	return err
}

// shutdownWrite is shutdown(2) with SHUT_WR: it sends the FIN.
func shutdownWrite(fd int) error {
	_, err := rawCall(unix.SYS_SHUTDOWN, uintptr(fd), unix.SHUT_WR, 0, 0, 0, 0)
	return err
}

// epollAdd adds fd to the epoll set epfd for ev.
func epollAdd(epfd, fd int, ev *unix.EpollEvent) error {
	for {
		_, e := rawResult(unix.RawSyscall6(unix.SYS_EPOLL_CTL, uintptr(epfd), unix.EPOLL_CTL_ADD, uintptr(fd), uintptr(unsafe.Pointer(ev)), 0, 0))
		if e != unix.EINTR {
			_, err := rawReturn(0, e)
			return err
		}
	}
}

// connectFD is connect(2) of a non-blocking socket to ap, and bindFD
// bind(2), in the socket's family (v6 sockets take IPv4 addresses
// mapped). Connecting a TCP socket sends the SYN, and on loopback
// processes the answer, before it returns.
func connectFD(fd int, ap netip.AddrPort, v6 bool) error {
	return addrCall(unix.SYS_CONNECT, fd, ap, v6)
}

func bindFD(fd int, ap netip.AddrPort, v6 bool) error {
	return addrCall(unix.SYS_BIND, fd, ap, v6)
}

// addrCall makes a system call that takes a socket and an address.
func addrCall(trap uintptr, fd int, ap netip.AddrPort, v6 bool) error {
	var sa unix.RawSockaddrInet6
	n := putSockaddr(&sa, ap, v6)
	_, err := rawCallP(trap, uintptr(fd), unsafe.Pointer(&sa), uintptr(n), 0, 0, 0)
	return err
}

// putSockaddr writes ap into sa as a sockaddr_in6 (v6; IPv4 addresses
// mapped) or a sockaddr_in (IPv4 addresses unmapped), the inverse of
// sockaddrAddrPort, and returns its length.
func putSockaddr(sa *unix.RawSockaddrInet6, ap netip.AddrPort, v6 bool) uint32 {
	if v6 {
		*sa = unix.RawSockaddrInet6{Family: unix.AF_INET6, Port: ntohs(ap.Port()), Addr: ap.Addr().As16()}
		return unix.SizeofSockaddrInet6
	}
	sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
	*sa4 = unix.RawSockaddrInet4{Family: unix.AF_INET, Port: ntohs(ap.Port()), Addr: ap.Addr().Unmap().As4()}
	return unix.SizeofSockaddrInet4
}

// accept4 accepts a connection on the non-blocking listening socket fd,
// non-blocking and close-on-exec, and writes the peer's address to sa
// (unix.Accept4 would allocate a Sockaddr for it).
func accept4(fd int, sa *unix.RawSockaddrInet6) (int, error) {
	n := uint32(unix.SizeofSockaddrInet6)
	for {
		nfd, e := rawResult(unix.RawSyscall6(unix.SYS_ACCEPT4, uintptr(fd), uintptr(unsafe.Pointer(sa)), uintptr(unsafe.Pointer(&n)), unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0))
		if e != unix.EINTR {
			r, err := rawReturn(nfd, e)
			return int(r), err
		}
	}
}
