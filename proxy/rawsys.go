package proxy

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// The data path's system calls on non-blocking sockets and pipes are made
// with RawSyscall6, which does not tell the scheduler that the goroutine
// entered a system call. With Syscall, a P whose goroutine has been in a
// system call for one sysmon tick (20 µs or more) is handed to another
// thread when other work is waiting (runtime/proc.go: retake), and the
// goroutine must find a P again when the call returns (exitsyscall). On
// a loaded machine a send that delivers a packet through the stack takes
// that long: in a profile of UDP requests, 13% of the proxy's CPU went to
// sysmon itself, and more to handing Ps around
// (bench/results/2026-11-30-udp-loops.md). These calls never wait: the
// descriptors are non-blocking, or the call says MSG_DONTWAIT, so the P
// is busy with the call, not idle in it. Blocking calls (epoll_wait with
// a timeout) keep using Syscall.

// rawCall makes a non-blocking system call with RawSyscall6, repeated on
// EINTR.
func rawCall(trap, a1, a2, a3, a4, a5, a6 uintptr) (uintptr, error) {
	for {
		r, _, e := unix.RawSyscall6(trap, a1, a2, a3, a4, a5, a6)
		switch e {
		case 0:
			return r, nil
		case unix.EINTR:
			continue
		}
		return 0, e
	}
}

// readRetry is read(2) on a non-blocking descriptor.
func readRetry(fd int, b []byte) (int, error) {
	n, err := rawCall(unix.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)), 0, 0, 0)
	return int(n), err
}

// writeRetry is write(2) on a non-blocking descriptor.
func writeRetry(fd int, b []byte) (int, error) {
	n, err := rawCall(unix.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)), 0, 0, 0)
	return int(n), err
}

// sendRetry is one send(2) of b to a non-blocking socket, with flags and
// MSG_NOSIGNAL.
func sendRetry(fd int, b []byte, flags int) (int, error) {
	n, err := rawCall(unix.SYS_SENDTO, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)), uintptr(flags|unix.MSG_NOSIGNAL), 0, 0)
	return int(n), err
}

// spliceRetry is one splice(2) from in to out of at most n bytes, both
// non-blocking (spliceFlags).
func spliceRetry(in, out, n int) (int, error) {
	m, err := rawCall(unix.SYS_SPLICE, uintptr(in), 0, uintptr(out), 0, uintptr(n), spliceFlags)
	return int(m), err
}
