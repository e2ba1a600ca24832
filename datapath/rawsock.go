package datapath

import (
	"net"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// rawSock is a non-blocking socket that is in no epoll set of the
// runtime's: an event loop's UDP listener (loopListener), or a tproxy
// reply socket (tproxySocket). Its methods are safe for concurrent use.
//
// Control, Read and Write make it a syscall.RawConn: each runs f once,
// under mu, so that no call reaches a descriptor that close has closed
// and whose number may belong to another socket by then. None waits: Read
// and Write return EAGAIN when f asks to wait for the socket (returns
// false), and every method net.ErrClosed once the socket is closed.
type rawSock struct {
	mu sync.Mutex
	fd int // -1 once closed
}

var _ syscall.RawConn = (*rawSock)(nil)

func (s *rawSock) Control(f func(fd uintptr)) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fd < 0 {
		return net.ErrClosed
	}
	f(uintptr(s.fd))
	return nil
}

func (s *rawSock) Read(f func(fd uintptr) bool) error { return s.once(f) }

func (s *rawSock) Write(f func(fd uintptr) bool) error { return s.once(f) }

func (s *rawSock) once(f func(fd uintptr) bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fd < 0 {
		return net.ErrClosed
	}
	if !f(uintptr(s.fd)) {
		return unix.EAGAIN
	}
	return nil
}

// closeSock closes the socket, once; later calls do nothing.
func (s *rawSock) closeSock() {
	s.mu.Lock()
	fd := s.fd
	s.fd = -1
	s.mu.Unlock()
	if fd >= 0 {
		_ = closeFD(fd)
	}
}
