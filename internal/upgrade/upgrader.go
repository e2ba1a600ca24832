package upgrade

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/proxy"
	"github.com/uproxy/uproxy/proxy/healthcheck"
)

// Hitless upgrade: a new `uproxy run` takes the listening sockets over
// from the running one, as HAProxy's -x and Envoy's hot restart do, so
// that no connection attempt is refused while the binary changes. The
// handover protocol (its messages, versions and failure handling) is
// described in docs/upgrade-protocol.md, which changes with this file.

const (
	// ProtocolVersion is the version of the handover messages.
	ProtocolVersion = 1
	// defaultHandshakeTimeout bounds each step of the handshake (not the
	// wait for ready, which lasts the new process's first sync).
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
	// ready: its sync loop is paused meanwhile (#30).
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
}

// Socket describes one descriptor of a sockets message.
type Socket struct {
	Kind string `json:"kind"`
	Key  string `json:"key"`
	Port uint16 `json:"port,omitempty"`
}

// Send sends m with files' descriptors. The files must be
// ones whose Fd leaves the socket's mode alone (proxy.SocketFile's).
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
	// HandshakeTimeout bounds each step of the handshake before the
	// sockets have arrived, on both sides (not the wait for ready,
	// which lasts the new process's first sync). Zero means 10s.
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
	listeners []proxy.HandoffSocket // inherited; passed on by Inherited()

	ln      *net.UnixListener // the upgrade socket; nil when there is none
	lnFile  fileID            // the socket file we own
	predPID int

	mu      sync.Mutex
	pred    *net.UnixConn // the predecessor, until it is told we are ready
	ready   bool          // the first sync is done: we can hand over
	handing bool          // a handover is in progress, or done
	gone    bool          // handed over: the path is the successor's
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
func (u *Upgrader) netnsOf(pid int32) (string, error) {
	if u.cfg.PeerNetns != nil {
		return u.cfg.PeerNetns(pid)
	}
	if pid <= 0 {
		// A peer of another PID namespace that ours cannot name.
		return "", fmt.Errorf("the peer's pid %d is not in our PID namespace", pid)
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
	if err := Send(c, Message{Type: "hello", PID: os.Getpid(), Netns: u.netns, Mode: u.mode}, nil); err != nil {
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
	u.pred, u.predPID = c, offer.PID
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
		u.listeners = append(u.listeners, proxy.HandoffSocket{Key: s.Key, Port: s.Port, File: f})
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
func (u *Upgrader) Inherited() *proxy.Inherited {
	if u.pred == nil {
		return nil
	}
	in := proxy.NewInherited(u.listeners)
	u.listeners = nil
	return in
}

// closeInherited closes what was inherited and not passed on.
func (u *Upgrader) closeInherited() {
	proxy.CloseHandoffSockets(u.listeners)
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

// Hooks connect the upgrade server to the proxier. A successor's
// upgrader, which hands nothing over, needs only Abort.
type Hooks struct {
	// Sync pauses the sync loop while a handover is in progress.
	Sync Pauser
	// Export duplicates the proxier's listeners, which the caller owns
	// (the upgrader closes them once sent). It is called with the sync
	// loop paused.
	Export func() ([]proxy.HandoffSocket, error)
	// Abort ends this process's run with an error: the predecessor took
	// its sockets back before we were ready. Nil means nothing is done.
	Abort func(error)
}

// Pauser stops and restarts the sync loop, so that the set of listeners
// stays the one exported while a handover is in progress. Serve calls
// it from one handshake's goroutine at a time; SyncLoop implements it.
type Pauser interface {
	// Pause stops the sync loop and returns once no sync runs; false if
	// ctx ended first.
	Pause(ctx context.Context) bool
	// Resume starts the sync loop again after Pause.
	Resume(ctx context.Context)
}

// Handover is a finished handshake with a successor: it has taken the
// sockets over, or asked for their release.
type Handover struct {
	PID  int           // the successor's, as its hello gives it
	conn *net.UnixConn // for released; nil after ready
}

// Done tells a successor that asked for a release that every socket is
// closed; the caller has closed them. It does nothing after a handover
// on ready.
func (h *Handover) Done(log *zap.Logger) {
	if h.conn == nil {
		return
	}
	if err := Send(h.conn, Message{Type: "released"}, nil); err != nil {
		log.Warn("cannot confirm the release to the new process", zap.Error(err))
	}
	h.conn.Close()
}

// Serve serves successors on the upgrade socket, and once the first sync
// is done (synced is closed) tells the predecessor we are ready. It
// returns when ctx is done, or when a successor has taken the sockets
// over (or asked for a release), which it returns. It runs on a
// goroutine of its own, owned by the caller;
// the goroutines it starts (one per connection, one for the first sync)
// end before it returns.
func (u *Upgrader) Serve(ctx context.Context, synced <-chan struct{}, h Hooks) *Handover {
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { u.afterFirstSync(ctx, synced, h.Abort) })
	u.mu.Lock()
	pred := u.pred
	u.mu.Unlock()
	if pred != nil {
		wg.Go(func() { u.watchPredecessor(ctx, pred, h.Abort) })
	}
	if u.ln == nil {
		<-ctx.Done()
		return nil
	}
	ln := u.ln
	result := make(chan *Handover, 1)
	wg.Go(func() { <-ctx.Done(); ln.Close() })
	var delay time.Duration
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				break
			}
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			u.log.Warn("accepting on the upgrade socket failed; backing off", zap.Duration("delay", delay), zap.Error(err))
			time.Sleep(delay)
			continue
		}
		delay = 0
		// Each connection on its own, so that a process of another
		// namespace (sharing the path) is answered at once even while a
		// handover waits for its successor's first sync.
		wg.Go(func() {
			if ho := u.handle(ctx, c, h); ho != nil {
				result <- ho // at most one: handle hands over once
				stop()
			}
		})
	}
	stop()
	wg.Wait()
	select {
	case ho := <-result:
		return ho
	default:
		return nil
	}
}

// afterFirstSync waits for the first successful sync, closes the
// inherited server sockets nothing claimed, and tells the predecessor we
// are ready.
func (u *Upgrader) afterFirstSync(ctx context.Context, synced <-chan struct{}, abort func(error)) {
	select {
	case <-ctx.Done():
		return
	case <-synced:
	}
	if !u.servers.settled(ctx) {
		return
	}
	u.servers.closeInherited()
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.pred != nil {
		if err := Send(u.pred, Message{Type: "ready"}, nil); err != nil {
			// It gave up on us (the ready timeout) and syncs again.
			u.pred.Close()
			u.pred = nil
			u.gone = true
			if abort != nil {
				abort(fmt.Errorf("hitless upgrade: cannot tell the predecessor (pid %d) we are ready; it serves on: %w", u.predPID, err))
			}
			return
		}
		u.pred.Close()
		u.pred = nil
		u.log.Info("serving; the predecessor stops accepting and drains", zap.Int("predecessor", u.predPID))
	}
	u.ready = true
}

// watchPredecessor ends our run, through abort, should the predecessor
// end the handover before we are ready: it gave up waiting for our first
// sync and syncs again itself, and two processes must not both program
// the rules. The upgrade socket's path stays the predecessor's.
func (u *Upgrader) watchPredecessor(ctx context.Context, pred *net.UnixConn, abort func(error)) {
	// The predecessor sends nothing after the sockets: any answer to this
	// read is its end of the connection.
	stop := context.AfterFunc(ctx, func() { pred.SetReadDeadline(time.Now()) })
	defer stop()
	_, files, err := Recv(pred)
	closeFiles(files)
	if ctx.Err() != nil {
		return
	}
	u.mu.Lock()
	aborted := u.pred == pred // not told ready yet
	if aborted {
		u.pred.Close()
		u.pred = nil
		u.gone = true
	}
	u.mu.Unlock()
	if aborted && abort != nil {
		abort(fmt.Errorf("hitless upgrade: the predecessor (pid %d) ended the handover before our first sync completed, and serves on: %w", u.predPID, errPredecessorResumed(err)))
	}
}

// errPredecessorResumed is the cause given when the predecessor's
// connection ended: the read's error, or a plain one at EOF.
func errPredecessorResumed(err error) error {
	if err == nil || errors.Is(err, io.EOF) {
		return errors.New("connection closed")
	}
	return err
}

// Errors of an offer that the new process handles differently.
const (
	OfferBusy     = "another upgrade is in progress"
	OfferNotReady = "not serving yet: its first sync has not completed"
	OfferForeign  = "another network namespace"
)

// handle runs the old process's side of one handshake; it returns the
// handover if the successor took the sockets over or asked for a release.
func (u *Upgrader) handle(ctx context.Context, c *net.UnixConn, h Hooks) *Handover {
	keep := false
	defer func() {
		if !keep {
			c.Close()
		}
	}()
	// A signal meanwhile ends the handshake: we stop as usual, and the
	// successor keeps whatever it already holds.
	stopClose := context.AfterFunc(ctx, func() { c.Close() })
	defer stopClose()
	// Who the peer is, from the kernel: a process of another user gets
	// no answer at all.
	cred, err := u.credentials(c)
	if err == nil {
		err = u.checkUID(cred)
	}
	if err != nil {
		u.log.Warn("refusing a connection on the upgrade socket", zap.Error(err))
		return nil
	}
	c.SetDeadline(time.Now().Add(u.cfg.handshakeTimeout()))
	hello, files, err := Recv(c)
	closeFiles(files)
	if err == nil && hello.Type != "hello" {
		err = fmt.Errorf("got %q, want hello", hello.Type)
	}
	if err != nil {
		u.log.Warn("bad handshake on the upgrade socket", zap.Error(err))
		return nil
	}
	log := u.log.With(zap.Int("successor", hello.PID), zap.Int32("peerPID", cred.Pid))
	offer := Message{Type: "offer", PID: os.Getpid(), Netns: u.netns, Mode: u.mode}
	refuse := func(why string) *Handover {
		offer.Error = why
		if err := Send(c, offer, nil); err != nil {
			log.Warn("answering on the upgrade socket failed", zap.Error(err))
		}
		return nil
	}
	// The namespace the peer is in, not the one its hello names: our
	// sockets would serve another namespace's traffic in it.
	theirs, err := u.netnsOf(cred.Pid)
	if err != nil || theirs != u.netns || hello.Netns != u.netns {
		log.Info("refusing a handover to a process in another network namespace",
			zap.String("theirs", theirs), zap.String("claimed", hello.Netns), zap.String("ours", u.netns), zap.Error(err))
		return refuse(OfferForeign)
	}
	u.mu.Lock()
	state := ""
	switch {
	case u.handing || u.pred != nil:
		state = OfferBusy
	case !u.ready:
		state = OfferNotReady
	default:
		u.handing = true
	}
	u.mu.Unlock()
	switch state {
	case OfferBusy:
		log.Warn("refusing a handover: another upgrade is in progress")
		return refuse(OfferBusy)
	case OfferNotReady:
		// Nothing worth keeping yet: the new process asks us to release
		// and starts cold.
		refuse(OfferNotReady)
		return u.awaitRelease(c, log, hello.PID, &keep)
	}
	handedOver := false
	defer func() {
		if !handedOver {
			u.mu.Lock()
			u.handing = false
			u.mu.Unlock()
		}
	}()
	if !h.Sync.Pause(ctx) {
		return nil
	}
	defer func() {
		if handedOver {
			return
		}
		if ctx.Err() != nil {
			// We stop meanwhile: the successor, if it lives on, holds the
			// upgrade socket, so its path stays (gone, if set, stays set).
			return
		}
		log.Info("the new process went away before it was ready; carrying on")
		u.mu.Lock()
		u.gone = false
		u.mu.Unlock()
		h.Sync.Resume(ctx)
	}()
	var socks []Socket
	var out []*os.File
	defer func() { closeFiles(out) }() // ours: the successor got duplicates
	if hello.Version == ProtocolVersion && hello.Mode == u.mode {
		if socks, out, err = u.export(h); err != nil {
			log.Error("cannot export the sockets; the new process starts cold", zap.Error(err))
			offer.Error = err.Error()
		}
		offer.Count = len(out)
	}
	if err := Send(c, offer, nil); err != nil {
		log.Warn("handover failed", zap.Error(err))
		return nil
	}
	for i := 0; i < len(out); i += fdsPerMessage {
		j := min(i+fdsPerMessage, len(out))
		if err := Send(c, Message{Type: "sockets", Sockets: socks[i:j]}, out[i:j]); err != nil {
			log.Warn("handover failed", zap.Error(err))
			return nil
		}
	}
	if len(out) > 0 {
		log.Info("sockets handed to a new process; serving until it is ready", zap.Int("sockets", len(out)))
		u.mu.Lock()
		u.gone = true // should we stop before it is ready, the path is its own
		u.mu.Unlock()
	}
	// The successor's first sync may take a while (an API server's
	// initial lists), but our sync loop is paused meanwhile: past the
	// ready timeout we close the connection, which tells the successor
	// to stop, and sync again.
	c.SetDeadline(time.Now().Add(u.cfg.readyTimeout()))
	m, files, err := Recv(c)
	closeFiles(files)
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		log.Warn("the new process did not become ready in time: aborting the handover and syncing again", zap.Duration("timeout", u.cfg.readyTimeout()))
		return nil
	case err != nil:
		log.Info("handover aborted", zap.Error(err))
		return nil
	case m.Type == "ready":
		handedOver = true
		log.Info("the new process is ready: handing over")
		u.mu.Lock()
		u.handOver()
		u.mu.Unlock()
		return &Handover{PID: hello.PID}
	case m.Type == "release":
		handedOver, keep = true, true
		log.Info("the new process starts cold: releasing every socket")
		u.mu.Lock()
		u.handOver()
		u.mu.Unlock()
		return &Handover{PID: hello.PID, conn: c}
	default:
		log.Warn("unexpected message on the upgrade socket", zap.String("type", m.Type))
		return nil
	}
}

// awaitRelease waits, after an offer it cannot follow with sockets, for
// the new process to ask for a release.
func (u *Upgrader) awaitRelease(c *net.UnixConn, log *zap.Logger, pid int, keep *bool) *Handover {
	m, files, err := Recv(c)
	closeFiles(files)
	if err != nil || m.Type != "release" {
		return nil
	}
	log.Info("a new process starts cold: releasing every socket")
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.handing {
		return nil
	}
	u.handing = true
	*keep = true
	u.handOver()
	return &Handover{PID: pid, conn: c}
}

// handOver closes our descriptor of the upgrade socket, whose path is the
// successor's now. u.mu is held.
func (u *Upgrader) handOver() {
	u.gone = true
	u.ln.Close()
	u.ln = nil
}

// export duplicates every socket to hand over: the proxier's listeners,
// the servers' and the upgrade socket itself.
func (u *Upgrader) export(h Hooks) ([]Socket, []*os.File, error) {
	listeners, err := h.Export()
	if err != nil {
		return nil, nil, err
	}
	var socks []Socket
	var files []*os.File
	for _, l := range listeners {
		socks = append(socks, Socket{Kind: kindListener, Key: l.Key, Port: l.Port})
		files = append(files, l.File)
	}
	ss, sf, err := u.servers.export()
	if err != nil {
		closeFiles(files)
		return nil, nil, err
	}
	socks, files = append(socks, ss...), append(files, sf...)
	if f, err := proxy.SocketFile(u.ln, u.path); err == nil {
		socks = append(socks, Socket{Kind: kindUpgrade, Key: u.path})
		files = append(files, f)
	} else {
		u.log.Warn("cannot export the upgrade socket; the new process binds its own", zap.Error(err))
	}
	return socks, files, nil
}

// serverSockets are the HTTP servers' listening sockets (healthz, metrics,
// health-check node ports): those inherited from a predecessor, which the
// servers adopt when they listen on the same address, and those open, to
// hand to a successor. Safe for concurrent use.
type serverSockets struct {
	log       *zap.Logger
	mu        sync.Mutex
	inherited map[string]*os.File
	open      map[*serverListener]bool
	expected  map[string]chan struct{} // by role: closed once it has listened
}

func newServerSockets(log *zap.Logger) *serverSockets {
	return &serverSockets{log: log, inherited: map[string]*os.File{}, open: map[*serverListener]bool{}, expected: map[string]chan struct{}{}}
}

// expect announces that the server called role will listen, before it
// starts: settled waits for it.
func (s *serverSockets) expect(role string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expected[role] = make(chan struct{})
}

// settled waits until every expected server has listened (or failed to),
// so that the inherited sockets left are the unclaimed ones; false if ctx
// ended first.
func (s *serverSockets) settled(ctx context.Context) bool {
	s.mu.Lock()
	var waits []chan struct{}
	for _, ch := range s.expected {
		waits = append(waits, ch)
	}
	s.mu.Unlock()
	for _, ch := range waits {
		select {
		case <-ch:
		case <-ctx.Done():
			return false
		}
	}
	return true
}

func (s *serverSockets) inherit(key string, f *os.File) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old := s.inherited[key]; old != nil {
		old.Close()
	}
	s.inherited[key] = f
}

func (s *serverSockets) inheritedCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.inherited)
}

// closeInherited closes the inherited sockets no server has claimed.
func (s *serverSockets) closeInherited() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for key, f := range s.inherited {
		s.log.Info("closing an inherited server socket nothing listens on any more", zap.String("key", key))
		f.Close()
		delete(s.inherited, key)
	}
}

// listen returns the Listen function of the server called role: it adopts
// the inherited socket of the same role, network and address, or binds.
func (s *serverSockets) listen(role string) healthcheck.ListenFunc {
	return func(network, addr string) (net.Listener, error) {
		key := role + " " + network + " " + addr
		s.mu.Lock()
		f := s.inherited[key]
		delete(s.inherited, key)
		if ch := s.expected[role]; ch != nil {
			close(ch)
			delete(s.expected, role)
		}
		s.mu.Unlock()
		var ln net.Listener
		if f != nil {
			var err error
			ln, err = net.FileListener(f)
			f.Close()
			if err != nil {
				s.log.Warn("cannot adopt an inherited server socket; binding a new one", zap.String("key", key), zap.Error(err))
				ln = nil
			}
		}
		if ln == nil {
			var err error
			if ln, err = net.Listen(network, addr); err != nil {
				return nil, err
			}
		}
		sl := &serverListener{Listener: ln, key: key, s: s}
		s.mu.Lock()
		s.open[sl] = true
		s.mu.Unlock()
		return sl, nil
	}
}

// export duplicates the open server sockets.
func (s *serverSockets) export() ([]Socket, []*os.File, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var socks []Socket
	var files []*os.File
	for l := range s.open {
		sc, ok := l.Listener.(syscall.Conn)
		if !ok {
			continue
		}
		f, err := proxy.SocketFile(sc, l.key)
		if err != nil {
			closeFiles(files)
			return nil, nil, fmt.Errorf("exporting %s: %w", l.key, err)
		}
		socks = append(socks, Socket{Kind: kindServer, Key: l.key})
		files = append(files, f)
	}
	return socks, files, nil
}

// serverListener is a server's listener, known to serverSockets until it
// is closed.
type serverListener struct {
	net.Listener
	key  string
	s    *serverSockets
	once sync.Once
}

func (l *serverListener) Close() error {
	l.once.Do(func() {
		l.s.mu.Lock()
		delete(l.s.open, l)
		l.s.mu.Unlock()
	})
	return l.Listener.Close()
}

// SyncLoop runs the proxier's sync loop, and lets the upgrade server
// stop it while it exports the listeners (the sync goroutine owns them)
// and start it again if the handover fails.
type SyncLoop struct {
	p       Syncer
	pauses  chan chan struct{}
	resumes chan struct{}
}

// Syncer is the sync loop that SyncLoop runs: the proxier. Run syncs
// until its context ends; Resync asks for a full sync at once. SyncLoop
// calls both from the goroutine it owns.
type Syncer interface {
	Run(ctx context.Context)
	Resync()
}

// NewSyncLoop returns the SyncLoop of p; it syncs once Run is called.
func NewSyncLoop(p Syncer) *SyncLoop {
	return &SyncLoop{p: p, pauses: make(chan chan struct{}), resumes: make(chan struct{})}
}

// Run syncs until ctx is done. It owns the goroutine that runs p.Run,
// which it ends on Pause and on ctx's end.
func (r *SyncLoop) Run(ctx context.Context) {
	for {
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { r.p.Run(rctx); close(done) }() // ends with cancel, below
		var ack chan struct{}
		select {
		case <-ctx.Done():
		case ack = <-r.pauses:
		}
		cancel()
		<-done
		if ack == nil {
			return
		}
		close(ack)
		select {
		case <-ctx.Done():
			return
		case <-r.resumes:
			r.p.Resync()
		}
	}
}

// Pause stops the sync loop and returns once no sync runs; false if ctx
// ended first.
func (r *SyncLoop) Pause(ctx context.Context) bool {
	ack := make(chan struct{})
	select {
	case r.pauses <- ack:
		<-ack
		return true
	case <-ctx.Done():
		return false
	}
}

// Resume starts the sync loop again after Pause.
func (r *SyncLoop) Resume(ctx context.Context) {
	select {
	case r.resumes <- struct{}{}:
	case <-ctx.Done():
	}
}
