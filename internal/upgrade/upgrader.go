package upgrade

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/uproxy/uproxy/proxy/listeners"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/proxy/healthcheck"
)

// Config configures an Upgrader. Its zero value disables hitless
// upgrades (no Path); any other field left zero takes the default its
// comment gives.
type Config struct {
	// Path is the upgrade socket's path. Empty disables upgrades: Start
	// neither connects nor binds, and Serve only waits for its context.
	Path string
	// Mode is the proxy mode (redirect, tproxy). Sockets pass only
	// between processes of the same mode; it is compared as is.
	Mode string
	// ReadyTimeout bounds how long, after handing its sockets over, the
	// old process waits for ready with its sync loop paused; past it the
	// handover is aborted and the old process syncs again. Zero means
	// DefaultReadyTimeout.
	ReadyTimeout time.Duration
	// HandshakeTimeout bounds the handshake from the connection to the
	// sockets' arrival, on both sides (not the wait for ready, which
	// lasts the new process's first sync). Zero means 10s.
	HandshakeTimeout time.Duration
	// ReleaseTimeout bounds a starting process's wait for released: the
	// old process stops its servers, source and sync loop first. Zero
	// means 30s.
	ReleaseTimeout time.Duration
	// UID is the only user whose processes may take the sockets over,
	// or hand theirs to us. Nil means our own effective uid (root,
	// normally). The socket's mode alone does not do: a process of
	// another user that holds an open descriptor of it, or a socket file
	// created by another user at the path, would pass.
	UID *uint32
	// PeerCred returns a connection's peer credentials. Nil means
	// SO_PEERCRED, which the kernel fills in at connect(2) and the peer
	// cannot forge.
	PeerCred func(c *net.UnixConn) (*unix.Ucred, error)
	// PeerNetns identifies the network namespace of the process pid, as
	// "dev:ino". Nil means the device and inode of /proc/<pid>/ns/net.
	PeerNetns func(pid int32) (string, error)
	// Logger receives the handshakes' progress and failures. Nil means
	// none.
	Logger *zap.Logger
}

// Upgrader is this process's side of the hitless upgrade: taking the
// sockets over from a predecessor when it starts, and handing them to a
// successor later. The goroutine that runs the process calls Start,
// Inherited, TookOver, Close and the Handover's methods; Serve runs on a
// goroutine of its own, which that goroutine owns. Listen and Expect are
// safe for concurrent use.
type Upgrader struct {
	path  string // empty: disabled
	mode  string
	netns string
	log   *zap.Logger

	cfg Config // its seams and time-outs, through the accessors

	servers   *serverSockets
	listeners []listeners.HandoverSocket // inherited; passed on by Inherited()

	ln      *net.UnixListener // the upgrade socket; nil when there is none
	lnFile  fileID            // the socket file we own
	predPID int

	mu   sync.Mutex
	pred *net.UnixConn // the predecessor, until it is told we are ready or its connection ends
	// predAborts: the predecessor's offer said it sends abort before it
	// takes the handover back (Message.Aborts).
	predAborts bool
	synced     bool // the first sync is done, ready told or not
	aborted    bool // the predecessor took the handover back: our run ends
	ready      bool // the first sync is done and the predecessor told or gone: we can hand over
	handing    bool // a handover is in progress, or done
	gone       bool // handed over: the path is the successor's
}

// New returns the Upgrader that cfg describes. It does nothing until
// Start.
func New(cfg Config) *Upgrader {
	log := cfg.logger()
	return &Upgrader{path: cfg.Path, mode: cfg.Mode, log: log, cfg: cfg, servers: newServerSockets(log)}
}

func (c Config) logger() *zap.Logger {
	if c.Logger == nil {
		return zap.NewNop()
	}
	return c.Logger
}

func (c Config) uid() uint32 {
	if c.UID == nil {
		return uint32(os.Geteuid())
	}
	return *c.UID
}

func (c Config) readyTimeout() time.Duration {
	if c.ReadyTimeout <= 0 {
		return DefaultReadyTimeout
	}
	return c.ReadyTimeout
}

func (c Config) handshakeTimeout() time.Duration {
	if c.HandshakeTimeout <= 0 {
		return defaultHandshakeTimeout
	}
	return c.HandshakeTimeout
}

func (c Config) releaseTimeout() time.Duration {
	if c.ReleaseTimeout <= 0 {
		return defaultReleaseTimeout
	}
	return c.ReleaseTimeout
}

// Listen returns the Listen function of the server called role (healthz,
// metrics, healthcheck, debug): it adopts the inherited socket of the
// same role, network and address, or binds, and it hands the socket to a
// successor later.
func (u *Upgrader) Listen(role string) healthcheck.ListenFunc { return u.servers.listen(role) }

// Expect announces that the server called role will Listen: the
// predecessor is told ready only once it has, so that the inherited
// server sockets left then are the unclaimed ones.
func (u *Upgrader) Expect(role string) { u.servers.expect(role) }

// TookOver tells whether Start took the sockets over from a predecessor
// that has not been told ready yet.
func (u *Upgrader) TookOver() bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.pred != nil
}

// credentials returns the peer credentials of c.
func (u *Upgrader) credentials(c *net.UnixConn) (*unix.Ucred, error) {
	if u.cfg.PeerCred != nil {
		return u.cfg.PeerCred(c)
	}
	return peerCred(c)
}

// peerCred reads the kernel's credentials of c's peer (SO_PEERCRED).
func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("reading the peer's credentials: %w", err)
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, fmt.Errorf("reading the peer's credentials: %w", err)
	}
	if serr != nil {
		return nil, fmt.Errorf("reading the peer's credentials (SO_PEERCRED): %w", serr)
	}
	return cred, nil
}

// checkUID refuses a peer that runs as another user than Config.UID.
func (u *Upgrader) checkUID(cred *unix.Ucred) error {
	if cred.Uid != u.cfg.uid() {
		return fmt.Errorf("the peer (pid %d) runs as uid %d, not %d", cred.Pid, cred.Uid, u.cfg.uid())
	}
	return nil
}

// netnsOf identifies the network namespace that the process pid is in
// now: what the peer is, not what it says it is.
func (u *Upgrader) netnsOf(pid int32, sent []*os.File) (string, error) {
	if u.cfg.PeerNetns != nil {
		return u.cfg.PeerNetns(pid)
	}
	if pid <= 0 {
		// A peer of another PID namespace, which ours cannot name (the
		// kernel's SO_PEERCRED gives 0): it proves its namespace by
		// sending a descriptor of it with its hello.
		if len(sent) != 1 {
			return "", fmt.Errorf("the peer's pid %d is not in our PID namespace, and its hello carries no network namespace", pid)
		}
		var st unix.Stat_t
		if err := unix.Fstat(int(sent[0].Fd()), &st); err != nil {
			return "", fmt.Errorf("identifying the network namespace the peer sent: %w", err)
		}
		if err := isNetns(sent[0]); err != nil {
			return "", err
		}
		return fmt.Sprintf("%d:%d", st.Dev, st.Ino), nil
	}
	var st unix.Stat_t
	path := fmt.Sprintf("/proc/%d/ns/net", pid)
	if err := unix.Stat(path, &st); err != nil {
		return "", fmt.Errorf("identifying the peer's network namespace: %s: %w", path, err)
	}
	return fmt.Sprintf("%d:%d", st.Dev, st.Ino), nil
}

// Start takes the sockets over from the process behind the upgrade
// socket, if there is one and it is compatible, and otherwise gets the
// upgrade socket ready for a successor. It fails only when a predecessor
// answers but the handover breaks off, or does not answer at all: a cold
// start would then fight it over the rules.
func (u *Upgrader) Start() error {
	if u.path == "" {
		return nil
	}
	var err error
	if u.netns, err = netnsID(); err != nil {
		u.log.Warn("hitless upgrades disabled", zap.Error(err))
		u.path = ""
		return nil
	}
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: u.path, Net: "unixpacket"})
	switch {
	case err == nil:
		return u.takeOver(c)
	case errors.Is(err, fs.ErrNotExist):
	case errors.Is(err, syscall.ECONNREFUSED):
		// A socket file nobody listens on: its process died without
		// removing it.
		u.log.Info("removing a stale upgrade socket", zap.String("path", u.path))
		if err := os.Remove(u.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			u.log.Warn("cannot remove the stale upgrade socket; hitless upgrades of this process are disabled", zap.Error(err))
			u.path = ""
			return nil
		}
	default:
		u.log.Warn("cannot connect to the upgrade socket; starting cold, and hitless upgrades of this process are disabled",
			zap.String("path", u.path), zap.Error(err))
		u.path = ""
		return nil
	}
	u.bind()
	return nil
}

// takeOver runs the new process's side of the handshake up to the
// sockets' arrival.
func (u *Upgrader) takeOver(c *net.UnixConn) (err error) {
	defer func() {
		if err != nil {
			c.Close() // the predecessor carries on
		}
	}()
	// The predecessor's uid, which the kernel recorded when the upgrade
	// socket was bound (by it or by one of its predecessors). Its pid is
	// that binder's too, possibly long gone, so its netns cannot be read
	// from it: the offer's is believed, which only makes us start cold.
	cred, err := u.credentials(c)
	if err == nil {
		err = u.checkUID(cred)
	}
	if err != nil {
		u.log.Warn("refusing the process behind the upgrade socket: starting cold, and hitless upgrades of this process are disabled",
			zap.String("path", u.path), zap.Error(err))
		c.Close()
		u.path = ""
		return nil
	}
	c.SetDeadline(time.Now().Add(u.cfg.handshakeTimeout()))
	// Our network namespace goes along as a descriptor: a predecessor in
	// another PID namespace (another pod's container) sees our pid as 0
	// and cannot look the namespace up by it.
	var ns []*os.File
	if f, err := os.Open("/proc/self/ns/net"); err == nil {
		ns = append(ns, f)
		defer f.Close()
	}
	if err := Send(c, Message{Type: "hello", PID: os.Getpid(), Netns: u.netns, Mode: u.mode}, ns); err != nil {
		return fmt.Errorf("hitless upgrade through %s: %w", u.path, err)
	}
	offer, files, err := Recv(c)
	closeFiles(files)
	if err == nil && offer.Type != "offer" {
		err = fmt.Errorf("got %q, want an offer", offer.Type)
	}
	if err != nil {
		return fmt.Errorf("hitless upgrade: the process behind %s does not answer (is another upgrade in progress?): %w", u.path, err)
	}
	log := u.log.With(zap.Int("predecessor", offer.PID))
	if offer.Netns != u.netns {
		// Not ours to take over, nor to remove.
		log.Warn("the process behind the upgrade socket serves another network namespace: starting cold, and hitless upgrades of this process are disabled",
			zap.String("path", u.path), zap.String("reason", offer.Error))
		c.Close()
		u.path = ""
		return nil
	}
	if offer.Error == OfferBusy {
		return fmt.Errorf("hitless upgrade: the running uproxy (pid %d) is in another upgrade; start again when it is over", offer.PID)
	}
	if offer.Version != ProtocolVersion || offer.Mode != u.mode || offer.Error != "" {
		u.release(c, log, offer)
		return nil
	}
	for received := 0; received < offer.Count; {
		m, files, err := Recv(c)
		if err == nil && (m.Type != "sockets" || len(files) == 0 || len(m.Sockets) != len(files)) {
			err = fmt.Errorf("got %q with %d entries and %d descriptors, want sockets", m.Type, len(m.Sockets), len(files))
		}
		if err != nil {
			closeFiles(files)
			u.closeInherited()
			return fmt.Errorf("hitless upgrade: receiving the sockets from pid %d: %w", offer.PID, err)
		}
		for i, s := range m.Sockets {
			u.keep(s, files[i])
		}
		received += len(files)
	}
	c.SetDeadline(time.Time{})
	u.pred, u.predPID, u.predAborts = c, offer.PID, offer.Aborts
	if u.ln == nil {
		log.Warn("the predecessor did not hand its upgrade socket over: hitless upgrades of this process are disabled")
	}
	log.Info("took the sockets over; the predecessor serves until our first sync",
		zap.Int("listeners", len(u.listeners)), zap.Int("servers", u.servers.inheritedCount()))
	return nil
}

// keep files an inherited socket by kind; it owns f.
func (u *Upgrader) keep(s Socket, f *os.File) {
	switch s.Kind {
	case kindListener:
		u.listeners = append(u.listeners, listeners.HandoverSocket{Key: s.Key, Port: s.Port, File: f})
	case kindServer:
		u.servers.inherit(s.Key, f)
	case kindUpgrade:
		ln, err := net.FileListener(f)
		f.Close()
		ul, ok := ln.(*net.UnixListener)
		if err != nil || !ok || s.Key != u.path {
			if ln != nil {
				ln.Close()
			}
			u.log.Warn("cannot adopt the inherited upgrade socket; binding a new one", zap.String("key", s.Key), zap.Error(err))
			return
		}
		ul.SetUnlinkOnClose(false)
		u.ln, u.lnFile = ul, pathID(u.path)
	default:
		u.log.Warn("ignoring an inherited socket of an unknown kind", zap.String("kind", s.Kind), zap.String("key", s.Key))
		f.Close()
	}
}

// release asks an incompatible predecessor to close its sockets, then
// takes the upgrade socket's path over for a cold start.
func (u *Upgrader) release(c *net.UnixConn, log *zap.Logger, offer Message) {
	defer c.Close()
	log.Warn("cannot take the running uproxy's sockets over (another upgrade protocol version, another mode, or it failed to export them): asking it to release them and starting cold (new listener ports; fixed ports it still holds fail to bind)",
		zap.Int("theirVersion", offer.Version), zap.Int("ourVersion", ProtocolVersion),
		zap.String("theirMode", offer.Mode), zap.String("ourMode", u.mode), zap.String("theirError", offer.Error))
	c.SetDeadline(time.Now().Add(u.cfg.releaseTimeout()))
	err := Send(c, Message{Type: "release"}, nil)
	if err == nil {
		var m Message
		var files []*os.File
		m, files, err = Recv(c)
		closeFiles(files)
		if err == nil && m.Type != "released" {
			err = fmt.Errorf("got %q, want released", m.Type)
		}
	}
	if err != nil {
		log.Warn("the running uproxy did not confirm that it released its sockets", zap.Error(err))
	}
	if err := os.Remove(u.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		log.Warn("cannot remove the old upgrade socket; hitless upgrades of this process are disabled", zap.Error(err))
		u.path = ""
		return
	}
	u.bind()
}

// bind creates the upgrade socket. Failing is not fatal: the process
// runs, without hitless upgrades.
func (u *Upgrader) bind() {
	if err := os.MkdirAll(filepath.Dir(u.path), 0o700); err != nil {
		u.log.Warn("cannot create the upgrade socket's folder; hitless upgrades of this process are disabled", zap.Error(err))
		return
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: u.path, Net: "unixpacket"})
	if err != nil {
		u.log.Warn("cannot listen on the upgrade socket; hitless upgrades of this process are disabled", zap.Error(err))
		return
	}
	// We remove the file ourselves, and only while it is still ours: after
	// a handover or a release it belongs to the successor.
	ln.SetUnlinkOnClose(false)
	if err := os.Chmod(u.path, 0o600); err != nil {
		u.log.Warn("cannot restrict the upgrade socket's mode", zap.Error(err))
	}
	u.ln, u.lnFile = ln, pathID(u.path)
}

// fileID tells a file from another one created at the same path later:
// tmpfs (/run) reuses the inode numbers of removed files, so the inode
// alone does not.
type fileID struct {
	ino   uint64
	ctime unix.Timespec
}

// pathID identifies the file at path; zero if there is none.
func pathID(path string) fileID {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fileID{}
	}
	return fileID{st.Ino, st.Ctim}
}

// Inherited returns the listeners to adopt, for proxy.Config.Inherited;
// nil after a cold start. The proxier owns them from then on.
func (u *Upgrader) Inherited() *listeners.Inherited {
	if u.pred == nil {
		return nil
	}
	in := listeners.NewInherited(u.listeners)
	u.listeners = nil
	return in
}

// closeInherited closes what was inherited and not passed on.
func (u *Upgrader) closeInherited() {
	listeners.CloseHandoverSockets(u.listeners)
	u.listeners = nil
	u.servers.closeInherited()
}

// Close ends the Upgrader when the process stops: a predecessor not yet
// told we are ready carries on; the upgrade socket is closed, and its
// file removed unless a successor owns it now.
func (u *Upgrader) Close() {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.pred != nil {
		u.pred.Close()
		u.pred = nil
	}
	u.closeInherited()
	if u.ln != nil {
		u.ln.Close()
		if !u.gone && u.lnFile != (fileID{}) && pathID(u.path) == u.lnFile {
			os.Remove(u.path)
		}
		u.ln = nil
	}
}

// isNetns reports an error unless f is a network namespace (nsfs answers
// NS_GET_NSTYPE with CLONE_NEWNET), so that a descriptor of anything else
// that happened to share its device and inode numbers cannot pass.
func isNetns(f *os.File) error {
	t, err := unix.IoctlRetInt(int(f.Fd()), unix.NS_GET_NSTYPE)
	if err != nil {
		return fmt.Errorf("the descriptor the peer sent is not a namespace: %w", err)
	}
	if t != unix.CLONE_NEWNET {
		return fmt.Errorf("the namespace the peer sent is not a network namespace (type %#x)", t)
	}
	return nil
}
