package datapath

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// localDialFailure reports whether err, why an attempt at a backend
// failed, is the node's own doing rather than the backend's: the process
// or the system out of descriptors (EMFILE, ENFILE) or of memory
// (ENOBUFS, ENOMEM), or any failure before the connect itself (socket,
// setsockopt, bind, or adding the socket to an event loop). Such a
// failure says nothing of the backend, and ejecting it would, under
// descriptor pressure, eject every backend of every Service in turn:
// only what connect(2) or the connection's completion says about
// the backend counts against it.
func localDialFailure(err error) bool {
	for _, local := range []error{unix.EMFILE, unix.ENFILE, unix.ENOBUFS, unix.ENOMEM} {
		if errors.Is(err, local) {
			return true
		}
	}
	var se *os.SyscallError
	return errors.As(err, &se) && se.Syscall != "connect"
}
