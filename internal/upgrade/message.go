package upgrade

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

const (
	// ProtocolVersion is the version of the handover messages.
	ProtocolVersion = 1
	// defaultHandshakeTimeout bounds the handshake up to the sockets'
	// arrival (not the wait for ready, which lasts the new process's
	// first sync).
	defaultHandshakeTimeout = 10 * time.Second
	// defaultReleaseTimeout bounds the wait for released: the old process
	// stops its servers, source and sync loop first.
	defaultReleaseTimeout = 30 * time.Second
	// fdsPerMessage is how many descriptors a packet carries, well
	// below the kernel's SCM_MAX_FD (253).
	fdsPerMessage = 64
	// maxMessage bounds a packet's JSON.
	maxMessage = 1 << 16
	// maxSockets bounds an offer's count: more listeners than a
	// process can hold descriptors.
	maxSockets = 1 << 22
	// DefaultReadyTimeout bounds the old process's wait for
	// ready: its sync loop is paused meanwhile.
	DefaultReadyTimeout = 2 * time.Minute
)

// Socket kinds in Socket.Kind.
const (
	kindListener = "listener"
	kindServer   = "server"
	kindUpgrade  = "upgrade"
)

// ErrHandedOver is the cause of the run context's end when a successor
// has taken the sockets over.
var ErrHandedOver = errors.New("handed over to a new process")

// Message is one packet of the handover protocol.
type Message struct {
	Type    string   `json:"type"`
	Version int      `json:"version"`
	PID     int      `json:"pid,omitempty"`
	Netns   string   `json:"netns,omitempty"`
	Mode    string   `json:"mode,omitempty"`
	Count   int      `json:"count,omitempty"`
	Error   string   `json:"error,omitempty"`
	Sockets []Socket `json:"sockets,omitempty"`
	// Aborts, in an offer, says that the sender sends abort before it
	// takes a handover back: the connection's end without one then means
	// that the sender died or stopped, and the successor serves on. An
	// older sender leaves it out, and its successor can tell neither
	// apart, so it stops either way. Older receivers ignore it.
	Aborts bool `json:"aborts,omitempty"`
}

// Socket describes one descriptor of a sockets message.
type Socket struct {
	Kind string `json:"kind"`
	Key  string `json:"key"`
	Port uint16 `json:"port,omitempty"`
}

// Send sends m with files' descriptors. The files must be
// ones whose Fd leaves the socket's mode alone (listeners.SocketFile's).
func Send(c *net.UnixConn, m Message, files []*os.File) error {
	m.Version = ProtocolVersion
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	var oob []byte
	if len(files) > 0 {
		fds := make([]int, len(files))
		for i, f := range files {
			fds[i] = int(f.Fd())
		}
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.WriteMsgUnix(b, oob, nil); err != nil {
		return fmt.Errorf("sending %s: %w", m.Type, err)
	}
	return nil
}

// Recv reads one message and the descriptors it carries,
// which the caller closes (also when an error is returned).
func Recv(c *net.UnixConn) (Message, []*os.File, error) {
	var m Message
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(4*fdsPerMessage))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return m, nil, err
	}
	var files []*os.File
	if oobn > 0 {
		cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return m, nil, fmt.Errorf("control message: %w", err)
		}
		for i := range cmsgs {
			fds, err := unix.ParseUnixRights(&cmsgs[i])
			if err != nil {
				continue
			}
			for _, fd := range fds {
				files = append(files, os.NewFile(uintptr(fd), "inherited socket"))
			}
		}
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		return m, files, errors.New("message truncated")
	}
	if n == 0 {
		return m, files, io.EOF // the peer closed the connection
	}
	m, err = decode(buf[:n])
	return m, files, err
}

// decode decodes one packet. Unknown fields are ignored, as
// a newer version may add some; fields that no version can send are
// refused, so that the handshake never acts on them.
func decode(b []byte) (Message, error) {
	var m Message
	if err := json.Unmarshal(b, &m); err != nil {
		return Message{}, fmt.Errorf("decoding a message: %w", err)
	}
	switch {
	case m.Type == "":
		return Message{}, errors.New("decoding a message: no type")
	case m.PID < 0:
		return Message{}, fmt.Errorf("decoding a %s message: pid %d", m.Type, m.PID)
	case m.Count < 0 || m.Count > maxSockets:
		return Message{}, fmt.Errorf("decoding a %s message: count %d is not within 0-%d", m.Type, m.Count, maxSockets)
	case len(m.Sockets) > fdsPerMessage:
		return Message{}, fmt.Errorf("decoding a %s message: %d sockets, more than the %d a packet carries", m.Type, len(m.Sockets), fdsPerMessage)
	}
	return m, nil
}

func closeFiles(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

// netnsID identifies this process's network namespace.
func netnsID() (string, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &st); err != nil {
		return "", fmt.Errorf("identifying the network namespace: %w", err)
	}
	return fmt.Sprintf("%d:%d", st.Dev, st.Ino), nil
}

// Errors of an offer that the new process handles differently.
const (
	OfferBusy     = "another upgrade is in progress"
	OfferNotReady = "not serving yet: its first sync has not completed"
	OfferForeign  = "another network namespace"
)
