package datapath

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// A TCP session on an event loop: its two sockets, registered with the
// loop's epoll set (or its ring), and the copying between them.

// loopSession is a session carried by an event loop: side 0 is the
// client, side 1 the backend; direction d copies side d to side 1-d.
type loopSession struct {
	side   [2]loopSide
	dir    [2]loopDir
	closed bool
	// dial, when set, is how the loop connects the backend (connect);
	// connecting while an attempt is in progress, until deadline.
	dial       *tcpDial
	connecting bool
	deadline   time.Time
	// moved: bytes moved since the last idle sweep. progress: the TCP_INFO
	// counters of the two sockets at that sweep (fdProgress).
	moved    bool
	progress [2]uint64
	// keepAlive: the backend's socket has TCP keep-alive on (armKeepAlive).
	keepAlive bool
	// finish runs once, on the loop, after both sockets are closed, with
	// the bytes each direction wrote.
	finish func(up, down int64)
	// onRing: the session's directions run on the loop's ring
	// (loopring.go), under ringID, with ringOps operations in flight;
	// leaving: it goes over to epoll once they have completed.
	// connectArmed: the ring's connect of backend connection attempt
	// number attempt is in flight. ringServed: a ring receive has carried
	// bytes of the session (Stats.RingServed).
	onRing, leaving, connectArmed, ringServed bool
	ringID                                    uint64
	ringOps                                   int
	attempt                                   uint8
	connectAddr                               unix.RawSockaddrInet6 // the ring's connect reads it
}

// loopSide is one of a session's sockets, or a UDP flow's (flow), and
// what epoll last said of it (edge-triggered: a flag stays set until a
// call finds EAGAIN).
type loopSide struct {
	ls                 *loopSession
	flow               *udpFlow
	fd                 int
	gen                int32
	readable, writable bool
}

// loopDir is one direction's state between events.
type loopDir struct {
	h       halfState
	pipe    *kernelPipe // spliced bytes not yet written, if any
	pending []byte      // copied bytes not yet written, if any
	eof     bool        // the source has reached EOF
	done    bool        // and the EOF has been passed on
	total   int64       // bytes written to the destination
	moved   bool        // since the source last had nothing to read
	// On the ring: a receive, or a send, is in flight; rbid is the
	// provided buffer whose bytes rbid[roff:rlen] are being sent.
	recving, sending bool
	rbid             uint16
	roff, rlen       int
}

// add registers a session's sockets, or its client's and starts dialling
// the backend; on failure it ends the session. Runs on the loop.
func (lt *loopTCP) add(ls *loopSession) {
	l := lt.loop
	lt.sessions[ls] = struct{}{}
	// A backend connected before the hand-over was dialled by
	// net.Dialer, with Go's keep-alive, or by Config.Dial, which chooses.
	ls.keepAlive = ls.dial == nil
	eligible := ls.dial == nil || ls.dial.snap.ProxyProtocol == 0
	if eligible && l.stats != nil {
		l.stats.Eligible.Add(1)
	}
	if l.ring != nil && eligible {
		l.ring.add(ls)
		return
	}
	if err := lt.register(ls, 0); err != nil {
		lt.end(ls, true)
		return
	}
	if ls.dial != nil {
		lt.connect(ls)
		return
	}
	if err := lt.register(ls, 1); err != nil {
		lt.end(ls, true)
	}
}

// register adds side i of ls to the epoll set, for reading and writing,
// edge-triggered. Registering reports the socket's current readiness at
// once (ep_insert queues a file that is ready already), so bytes that came
// before the session got here are not missed.
func (lt *loopTCP) register(ls *loopSession, i int) error {
	l := lt.loop
	sd := &ls.side[i]
	sd.ls, sd.readable, sd.writable = ls, false, !ls.connecting
	return l.watch(sd, unix.EPOLLIN|unix.EPOLLOUT|unix.EPOLLRDHUP|unix.EPOLLET)
}

// watch adds sd's socket to the epoll set for events, under a new
// generation.
func (l *eventLoop) watch(sd *loopSide, events uint32) error {
	l.gen++
	if l.gen <= 0 {
		l.gen = 1
	}
	sd.gen = l.gen
	if sd.fd >= len(l.sides) {
		grown := make([]*loopSide, max(sd.fd+1, 2*len(l.sides), 64))
		copy(grown, l.sides)
		l.sides = grown
	}
	l.sides[sd.fd] = sd
	ev := unix.EpollEvent{Events: events, Fd: int32(sd.fd), Pad: sd.gen}
	if err := epollAdd(l.epfd, sd.fd, &ev); err != nil {
		return os.NewSyscallError("epoll_ctl add", err)
	}
	return nil
}

// connect starts the next attempt at a backend for ls (tcpDial.next),
// moving on at once past attempts that fail to start; when none is left
// the session ends. The attempt completes in ready (connected), or fails
// there or at its deadline (expire). An attempt whose source address
// waits for route lookups (errSourcePending) starts in routed instead;
// meanwhile ls counts as connecting, so the client's bytes wait, and the
// idle sweep leaves it alone.
func (lt *loopTCP) connect(ls *loopSession) {
	d := ls.dial
	for {
		addr, err := d.next()
		if err == errSourcePending {
			ls.connecting = true
			return
		}
		if err != nil {
			d.refused(err)
			lt.end(ls, true)
			return
		}
		if lt.dial(ls, addr) {
			return
		}
	}
}

// routed starts ls's attempt at its picked backend once r, the routes
// its source address waited for, are known (tcpDial.routed); a session
// that ended meanwhile is left alone.
func (lt *loopTCP) routed(ls *loopSession, r routePair) {
	if ls.closed {
		return
	}
	ls.connecting = false
	d := ls.dial
	d.sourceRouted(r)
	if !lt.dial(ls, d.b.Addr) {
		lt.connect(ls)
	}
}

// dial starts ls's connection attempt at addr, from d.from; false if it
// failed to start, which the attempt has been told (tcpDial.failed).
func (lt *loopTCP) dial(ls *loopSession, addr netip.AddrPort) bool {
	l := lt.loop
	d := ls.dial
	var fd int
	var err error
	if ls.onRing {
		fd, err = rawSocket(unix.SOCK_STREAM, addr, d.from, d.p.cfg.OwnMark)
	} else {
		fd, err = rawDial(unix.SOCK_STREAM, addr, d.from, d.p.cfg.OwnMark)
	}
	if err != nil {
		d.failed(err)
		return false
	}
	ls.side[1].fd = fd
	ls.connecting = true
	if ls.onRing {
		l.ring.connect(ls, addr)
	} else if err := lt.register(ls, 1); err != nil {
		lt.closeSide(&ls.side[1], false)
		ls.connecting = false
		d.failed(err)
		return false
	}
	ls.deadline = time.Now().Add(lt.dialTimeout)
	lt.connecting[ls] = struct{}{}
	if lt.nextDeadline.IsZero() || ls.deadline.Before(lt.nextDeadline) {
		lt.nextDeadline = ls.deadline
	}
	return true
}

// connectDone ends ls's connection attempt: with err nil the backend is
// connected, and its PROXY header, if any, is the first thing to send it;
// otherwise the next attempt starts. False if the session is over.
func (lt *loopTCP) connectDone(ls *loopSession, err error) bool {
	l := lt.loop
	ls.connecting = false
	delete(lt.connecting, ls)
	d := ls.dial
	if err != nil {
		if ls.connectArmed {
			l.ring.cancel(ringData(ls.ringID, ls.attempt, 0, ringTagConnect))
		}
		lt.closeSide(&ls.side[1], false)
		d.failed(err)
		lt.connect(ls)
		return false
	}
	d.connected()
	hdr, err := d.header()
	if err != nil {
		d.p.connLog.Warn("sending the PROXY protocol header failed", zap.Stringer("servicePort", d.name), zap.Error(err))
		lt.end(ls, true)
		return false
	}
	if len(hdr) > 0 {
		ls.dir[0].pending = hdr
	}
	ls.side[1].writable = true
	return true
}

// expire fails the connection attempts past their deadline, and works
// out the next deadline.
func (lt *loopTCP) expire(now time.Time) {
	lt.nextDeadline = time.Time{}
	for ls := range lt.connecting {
		if !now.Before(ls.deadline) {
			lt.connectDone(ls, errConnectTimeout)
		}
	}
	for ls := range lt.connecting { // connectDone may have added some
		if lt.nextDeadline.IsZero() || ls.deadline.Before(lt.nextDeadline) {
			lt.nextDeadline = ls.deadline
		}
	}
}

// ready handles one epoll event.
func (l *eventLoop) ready(ev unix.EpollEvent) {
	fd := int(ev.Fd)
	if fd < 0 || fd >= len(l.sides) {
		return
	}
	sd := l.sides[fd]
	if sd == nil || sd.gen != ev.Pad {
		return // the side was closed earlier in this batch
	}
	if sd.flow != nil {
		l.flowReady(sd.flow)
		return
	}
	l.sessionReady(sd, ev.Events)
}

// sessionReady handles an epoll event of a session's socket.
func (lt *loopTCP) sessionReady(sd *loopSide, events uint32) {
	if events&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		sd.readable = true
	}
	if events&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		sd.writable = true
	}
	ls := sd.ls
	if ls.connecting {
		if sd != &ls.side[1] {
			return // the client's bytes wait until the backend is connected
		}
		if events&(unix.EPOLLOUT|unix.EPOLLERR|unix.EPOLLHUP) == 0 {
			return
		}
		soerr, err := unix.GetsockoptInt(sd.fd, unix.SOL_SOCKET, unix.SO_ERROR)
		if err == nil && soerr != 0 {
			err = os.NewSyscallError("connect", unix.Errno(soerr))
		}
		if !lt.connectDone(ls, err) {
			return
		}
		// The client may have sent its first bytes already.
	}
	lt.pumpBoth(ls)
}

// pumpBoth pumps both directions of ls in turn, and aborts it on an
// error.
func (lt *loopTCP) pumpBoth(ls *loopSession) {
	for d := range ls.dir {
		if ls.closed {
			return
		}
		if err := lt.pump(ls, d); err != nil {
			lt.end(ls, true)
			return
		}
	}
}

// pump moves direction d's bytes until its source has nothing more, its
// destination is full, or its EOF has been passed on. An error means the
// session must be aborted.
//
// A direction moves small messages through a userspace buffer (the
// loop's own: it is emptied into the destination before the next read)
// and bulk transfers with splice(2) through a pooled pipe, held only
// while it has bytes in it.
func (lt *loopTCP) pump(ls *loopSession, d int) error {
	dir, src, dst := &ls.dir[d], &ls.side[d], &ls.side[1-d]
	for !dir.done {
		if dir.pipe != nil || len(dir.pending) > 0 {
			if !dst.writable {
				return nil
			}
			if err := lt.flush(dir, dst); err != nil {
				return err
			}
			if dir.pipe != nil || len(dir.pending) > 0 {
				dst.writable = false
				return nil
			}
			continue
		}
		if dir.eof {
			dir.done = true
			if ls.dir[1-d].done {
				// Both EOFs passed: close both at once, which sends the
				// last FIN without a shutdown call of its own.
				lt.end(ls, false)
				return nil
			}
			if err := shutdownWrite(dst.fd); err != nil && err != unix.ENOTCONN {
				return fmt.Errorf("shutdown: %w", err)
			}
			return nil
		}
		if !src.readable || !dst.writable {
			return nil
		}
		if err := lt.read(ls, dir, src, dst); err != nil {
			return err
		}
	}
	return nil
}

// read takes what src has, into a pipe or the loop's buffer, and writes
// as much of it as dst takes at once; the rest waits in dir.
func (lt *loopTCP) read(ls *loopSession, dir *loopDir, src, dst *loopSide) error {
	l := lt.loop
	h := &dir.h
	if h.splicing {
		p, err := tcpPipes.get()
		if err == nil {
			n, err := spliceRetry(src.fd, p.w, maxSplice)
			switch {
			case err == unix.EAGAIN:
				tcpPipes.put(p)
				lt.drained(dir, src)
				return nil
			case err != nil:
				tcpPipes.put(p)
				return fmt.Errorf("splice from socket: %w", err)
			case n == 0:
				tcpPipes.put(p)
				dir.eof = true
				return nil
			}
			p.data = n
			dir.pipe = p
			dir.moved, ls.moved = true, true
			if n >= spliceAtLeast {
				h.small = 0
			} else if h.small++; h.small >= smallSplices {
				h.splicing = false
			}
			return nil
		}
		if !errors.Is(err, errNoPipe) {
			return err
		}
		// No pipe to be had: this read goes through the buffer.
	}
	var (
		n, inq int
		err    error
	)
	if h.inq {
		n, inq, err = recvInq(src.fd, lt.buf[:])
	} else {
		n, err = readRetry(src.fd, lt.buf[:])
		inq = 1 // unknown: read again
	}
	switch {
	case err == unix.EAGAIN:
		lt.drained(dir, src)
		return nil
	case err != nil:
		return fmt.Errorf("read from socket: %w", err)
	case n == 0:
		dir.eof = true
		return nil
	}
	dir.moved, ls.moved = true, true
	// Read on until the socket is empty or the buffer full, and only then
	// write: the read that finds the socket empty comes anyway, and when
	// it finds the FIN instead, the bytes go out with MSG_MORE and the
	// shutdown that passes the FIN on joins them in one segment
	// (tcp_send_fin appends the FIN to the last unsent skb), as HAProxy's
	// do: the peer is woken once, not twice.
	empty, eof := inq == 0, false
	for !empty && !eof && n < len(lt.buf) {
		var m int
		if h.inq {
			m, inq, err = recvInq(src.fd, lt.buf[n:])
		} else {
			m, err = readRetry(src.fd, lt.buf[n:])
			inq = 1
		}
		switch {
		case err == unix.EAGAIN:
			empty = true
		case err != nil:
			return fmt.Errorf("read from socket: %w", err)
		case m == 0:
			eof = true
		default:
			n += m
			empty = inq == 0
		}
	}
	if l.stats != nil {
		l.stats.Copied.Add(int64(n))
	}
	full := n == len(lt.buf)
	flags := 0
	if eof {
		flags = unix.MSG_MORE
	}
	w, err := sendRetry(dst.fd, lt.buf[:n], flags)
	if w > 0 {
		dir.total += int64(w)
	}
	switch {
	case err == unix.EAGAIN:
		w = 0
		dst.writable = false
	case err != nil:
		return fmt.Errorf("write to socket: %w", err)
	}
	if w < n {
		dir.pending = append([]byte(nil), lt.buf[w:n]...)
	}
	if full {
		h.splicing = true // a bulk transfer: splice from here on
	}
	if eof {
		dir.eof = true
	} else if empty {
		// Nothing left (EAGAIN, or no FIN and no bytes by TCP_INQ's
		// hint): edge-triggered epoll reports the next bytes that arrive,
		// even ones that came while this ran.
		lt.drained(dir, src)
	}
	return nil
}

// drained notes that src has nothing to read. The second time that
// happens between messages, TCP_INQ is turned on for src (inqAfter).
func (lt *loopTCP) drained(dir *loopDir, src *loopSide) {
	src.readable = false
	if !dir.moved {
		return
	}
	dir.moved = false
	h := &dir.h
	if !h.inq {
		if h.boundaries++; h.boundaries == inqAfter {
			h.inq = unix.SetsockoptInt(src.fd, unix.SOL_TCP, unix.TCP_INQ, 1) == nil
		}
	}
}

// flush writes dir's waiting bytes to dst until they are gone or dst is
// full.
func (lt *loopTCP) flush(dir *loopDir, dst *loopSide) error {
	for len(dir.pending) > 0 {
		w, err := writeRetry(dst.fd, dir.pending)
		if w > 0 {
			dir.total += int64(w)
			dir.pending = dir.pending[w:]
		}
		if err == unix.EAGAIN {
			return nil
		}
		if err != nil {
			return fmt.Errorf("write to socket: %w", err)
		}
	}
	dir.pending = nil
	if p := dir.pipe; p != nil {
		for p.data > 0 {
			n, err := spliceRetry(p.r, dst.fd, p.data)
			if n > 0 {
				p.data -= n
				dir.total += int64(n)
				continue
			}
			if err == unix.EAGAIN {
				return nil
			}
			if err == nil {
				err = io.ErrUnexpectedEOF // the pipe is ours: it cannot be empty here
			}
			return fmt.Errorf("splice to socket: %w", err)
		}
		tcpPipes.put(p)
		dir.pipe = nil
	}
	return nil
}

// end closes the session's sockets (abort: with a reset, as
// session.abort does) and runs its finish. Runs on the loop; once only.
func (lt *loopTCP) end(ls *loopSession, abort bool) {
	l := lt.loop
	if ls.closed {
		return
	}
	ls.closed = true
	delete(lt.sessions, ls)
	delete(lt.connecting, ls)
	if ls.onRing {
		l.ring.cancelAll(ls)
		l.ring.forget(ls)
	}
	for i := range ls.side {
		lt.closeSide(&ls.side[i], abort)
	}
	for i := range ls.dir {
		if p := ls.dir[i].pipe; p != nil {
			tcpPipes.put(p) // closes it: it still holds bytes
			ls.dir[i].pipe = nil
		}
	}
	tcpPipes.leave()
	if l.stats != nil && ls.dir[0].total+ls.dir[1].total > 0 {
		l.stats.Carried.Add(1)
	}
	ls.finish(ls.dir[0].total, ls.dir[1].total)
}

// closeSide closes sd's socket, if it has one (abort: with a reset). Its
// descriptor leaves the epoll set as it closes.
func (lt *loopTCP) closeSide(sd *loopSide, abort bool) {
	l := lt.loop
	if sd.fd < 0 {
		return
	}
	if sd.fd < len(l.sides) && l.sides[sd.fd] == sd {
		l.sides[sd.fd] = nil
	}
	if abort {
		_ = unix.SetsockoptLinger(sd.fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1})
	}
	if l.ring != nil {
		l.ring.closeFD(sd.fd)
	} else {
		_ = closeFD(sd.fd)
	}
	sd.fd = -1
}

// abort ends ls with a reset, if it has not ended. Runs on the loop.
func (lt *loopTCP) abort(ls *loopSession) {
	lt.end(ls, true)
}
