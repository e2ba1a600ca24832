package upgrade

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/uproxy/uproxy/proxy/listeners"

	"go.uber.org/zap"
)

// Hooks connect the upgrade server to the proxier. A successor's
// upgrader, which hands nothing over, needs only Abort.
type Hooks struct {
	// Sync pauses the sync loop while a handover is in progress.
	Sync Pauser
	// Export returns duplicates of the proxier's listeners, which the
	// upgrader owns from then on and closes once sent. It is called with
	// the sync loop paused.
	Export func() ([]listeners.HandoverSocket, error)
	// Abort ends this process's run with an error: the predecessor took
	// its sockets back before we were ready (not when it died, or
	// stopped, meanwhile: we serve on). Nil means nothing is done.
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
	wg.Go(func() { u.afterFirstSync(ctx, synced) })
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
func (u *Upgrader) afterFirstSync(ctx context.Context, synced <-chan struct{}) {
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
	if u.aborted {
		return
	}
	u.synced = true
	if u.pred != nil {
		if err := Send(u.pred, Message{Type: "ready"}, nil); err != nil {
			// Its end of the connection is closed: it took the handover
			// back, and its abort waits in our queue, or it is gone.
			// watchPredecessor reads which, and ends our run or makes us
			// ready.
			u.log.Info("cannot tell the predecessor we are ready; waiting to learn whether it took the handover back",
				zap.Int("predecessor", u.predPID), zap.Error(err))
			return
		}
		u.pred.Close()
		u.pred = nil
		u.log.Info("serving; the predecessor stops accepting and drains", zap.Int("predecessor", u.predPID))
	}
	u.ready = true
}

// watchPredecessor waits for the predecessor's connection to end before
// we are ready. With an abort, the predecessor gave up waiting for our
// first sync and syncs again itself: two processes must not both program
// the rules, so abort ends our run, and the upgrade socket's path stays
// the predecessor's. Without one, from a predecessor that says it sends
// abort (Message.Aborts), the kernel closed its end as it died, or it
// stopped on a signal: either way it syncs no more, and we serve on, the
// sockets and the path ours. A predecessor of an older version sends no
// abort, so its end means either: we take it for a taken-back handover,
// as that version's successors did.
func (u *Upgrader) watchPredecessor(ctx context.Context, pred *net.UnixConn, abort func(error)) {
	// The predecessor sends nothing after the sockets but abort: any
	// answer to this read ends the handover.
	stop := context.AfterFunc(ctx, func() { pred.SetReadDeadline(time.Now()) })
	defer stop()
	m, files, err := Recv(pred)
	closeFiles(files)
	if ctx.Err() != nil {
		return
	}
	u.mu.Lock()
	if u.pred != pred { // told ready meanwhile
		u.mu.Unlock()
		return
	}
	u.pred.Close()
	u.pred = nil
	// A message, even one we cannot read, comes from a live predecessor;
	// the end of the connection, orderly or with unread data (a reset),
	// from one that is going or gone.
	ended := errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
	tookBack := !ended || !u.predAborts
	if tookBack {
		u.aborted = true
		u.gone = true
	} else {
		u.ready = u.synced // its ready may have failed on the closed connection
	}
	u.mu.Unlock()
	if !tookBack {
		u.log.Warn("the predecessor ended before our first sync completed without taking the handover back (it was killed, or stopped): serving on",
			zap.Int("predecessor", u.predPID), zap.Error(err))
		return
	}
	if abort == nil {
		return
	}
	switch {
	case err == nil && m.Type == "abort":
		abort(fmt.Errorf("hitless upgrade: the predecessor (pid %d) took the handover back before our first sync completed, and serves on", u.predPID))
	case err == nil:
		abort(fmt.Errorf("hitless upgrade: the predecessor (pid %d) sent %q before our first sync completed: taking the handover for taken back", u.predPID, m.Type))
	case !ended:
		abort(fmt.Errorf("hitless upgrade: reading from the predecessor (pid %d) before our first sync completed: taking the handover for taken back: %w", u.predPID, err))
	default:
		if errors.Is(err, io.EOF) {
			err = errors.New("connection closed")
		}
		abort(fmt.Errorf("hitless upgrade: the predecessor (pid %d) ended the handover before our first sync completed; of a version that sends no abort, it may serve on, or have died: %w", u.predPID, err))
	}
}

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
	defer closeFiles(files)
	if err == nil && hello.Type != "hello" {
		err = fmt.Errorf("got %q, want hello", hello.Type)
	}
	if err != nil {
		u.log.Warn("bad handshake on the upgrade socket", zap.Error(err))
		return nil
	}
	log := u.log.With(zap.Int("successor", hello.PID), zap.Int32("peerPID", cred.Pid))
	offer := Message{Type: "offer", PID: os.Getpid(), Netns: u.netns, Mode: u.mode, Aborts: true}
	refuse := func(why string) *Handover {
		offer.Error = why
		if err := Send(c, offer, nil); err != nil {
			log.Warn("answering on the upgrade socket failed", zap.Error(err))
		}
		return nil
	}
	// The namespace the peer is in, not the one its hello names: our
	// sockets would serve another namespace's traffic in it.
	theirs, err := u.netnsOf(cred.Pid, files)
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
			// We stop meanwhile, without an abort: the successor, which
			// then serves on, holds the upgrade socket, so its path stays
			// (gone, if set, stays set).
			return
		}
		// The successor, if it is still there, must stop before we sync
		// again: an abort tells it so, where the connection's end alone
		// would tell it that we died.
		c.SetDeadline(time.Now().Add(u.cfg.handshakeTimeout()))
		if err := Send(c, Message{Type: "abort"}, nil); err == nil {
			log.Info("the handover is taken back: the new process stops; carrying on")
		} else {
			log.Info("the new process went away before it was ready; carrying on")
		}
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
	exported, err := h.Export()
	if err != nil {
		return nil, nil, err
	}
	var socks []Socket
	var files []*os.File
	for _, l := range exported {
		socks = append(socks, Socket{Kind: kindListener, Key: l.Key, Port: l.Port})
		files = append(files, l.File)
	}
	ss, sf, err := u.servers.export()
	if err != nil {
		closeFiles(files)
		return nil, nil, err
	}
	socks, files = append(socks, ss...), append(files, sf...)
	if f, err := listeners.SocketFile(u.ln, u.path); err == nil {
		socks = append(socks, Socket{Kind: kindUpgrade, Key: u.path})
		files = append(files, f)
	} else {
		u.log.Warn("cannot export the upgrade socket; the new process binds its own", zap.Error(err))
	}
	return socks, files, nil
}
