package datapath

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/balancer"
)

// tcpDial is one connection's way to a backend: the service port and
// balancer admitTCP found, then the dial attempts, made by serveTCP's
// goroutine (dialBackend) or by an event loop (eventLoop.connect): next
// picks a backend, then connected or failed reports the attempt, until
// next returns an error; done ends it all. One owner at a time; not safe
// for concurrent use.
//
// A backend that refuses or times out is ejected for a while (health), so
// the balancers steer the next picks, this connection's and everyone
// else's, away from it. A backend at the per-endpoint connection limit is
// not dialled: the least busy one with room is, and when none has room
// the connection fails.
type tcpDial struct {
	p           *Engine
	name        fmt.Stringer
	snap        *Snapshot
	bal         balancer.Balancer
	client, dst netip.AddrPort // dst: the original destination, if known
	from        netip.AddrPort // valid: dial from this address and port (the client's)
	src         srcAttempt     // whether from keeps the client's address
	// loop and ls, when set, are the event loop that dials and the
	// session it dials for, which hear the routes a source choice waited
	// for (chooseSource); nil for a goroutine's dial.
	loop *eventLoop
	ls   *loopSession

	tries int
	errs  []error
	last  *BackendMetrics
	// b is the backend being dialled or connected, Acquired; ok once
	// connected.
	b     *balancer.Backend
	bm    *BackendMetrics
	ok    bool
	start time.Time
}

// errSourcePending: the attempt's backend is picked, and the address it
// dials from waits for route lookups (chooseSource).
var errSourcePending = errors.New("the source address waits for route lookups")

// next picks the backend of the next attempt and Acquires it; an error
// when there is none, or no attempt left. On an event loop, the error
// errSourcePending says that the attempt's backend is picked but its
// source address waits for the routes, which the loop hears
// (tcpDial.routed) before it dials d.b.
func (d *tcpDial) next() (netip.AddrPort, error) {
	if addr, ok := d.retryFromNode(); ok {
		return addr, nil
	}
	pm := d.snap.Metrics
	if d.tries >= d.p.cfg.dialAttempts() {
		d.last.failed()
		return netip.AddrPort{}, errors.Join(d.errs...)
	}
	d.tries++
	limit := int64(d.snap.MaxConnectionsPerEndpoint)
	b := d.bal.Pick(d.client.Addr())
	if b == nil {
		if d.last == nil {
			pm.noEndpoint()
		} else {
			d.last.failed()
		}
		return netip.AddrPort{}, fmt.Errorf("%s: %w", d.snap.Name, errNoEndpoints)
	}
	if !b.TryAcquire(limit) {
		if b = d.snap.spare(d.bal, limit); b == nil {
			if d.last == nil {
				pm.endpointsFull()
			} else {
				d.last.failed()
			}
			return netip.AddrPort{}, errors.Join(append(d.errs, fmt.Errorf("%s: %w (%d)", d.snap.Name, errEndpointsFull, limit))...)
		}
	}
	d.b, d.bm = b, pm.backend(b)
	d.bm.picked()
	d.start = pm.dialStart()
	if !d.chooseSource() {
		return netip.AddrPort{}, errSourcePending
	}
	return b.Addr, nil
}

// failed reports that the attempt at next's backend failed. A failure
// of the node's own (localDialFailure) does not eject the backend.
// Neither a timeout nor a refusal tells a dead backend from a
// NetworkPolicy that drops or rejects this client alone; either counts,
// since an ejection steers the balancers away for a while but never
// takes the last usable backends from anyone (balancer.Health).
func (d *tcpDial) failed(err error) {
	if d.fallBack(err) {
		return
	}
	d.snap.Metrics.dialDone(d.start, err)
	d.b.Release()
	if !localDialFailure(err) {
		d.p.health.Failure(d.b)
	}
	d.last = d.bm
	d.errs = append(d.errs, fmt.Errorf("dial %s: %w", d.b.Addr, err))
	d.b, d.bm = nil, nil
}

// connected reports that next's backend accepted the connection.
func (d *tcpDial) connected() {
	pm := d.snap.Metrics
	pm.dialDone(d.start, nil)
	d.p.health.Success(d.b)
	d.bm.connected()
	d.sourceConnected()
	d.ok = true
	pm.connStart()
}

// refused logs why the connection got no backend.
func (d *tcpDial) refused(err error) {
	d.p.connLog.Warn("no backend for connection", zap.Stringer("servicePort", d.name), zap.Error(err))
}

// header returns the PROXY protocol header to send the backend first, if
// the service port asks for one.
func (d *tcpDial) header() ([]byte, error) {
	v := d.snap.ProxyProtocol
	if v == 0 {
		return nil, nil
	}
	dst := d.dst
	if !dst.IsValid() {
		dst = d.snap.VIP
	}
	return proxyHeader(v, d.client, dst)
}

// done releases what the connection held, and counts the bytes it
// carried each way.
func (d *tcpDial) done(up, down int64) {
	pm := d.snap.Metrics
	if d.ok {
		pm.up(up)
		pm.down(down)
		pm.connEnd()
	}
	if d.b != nil {
		d.b.Release()
		d.b = nil
	}
	d.snap.Slots.release()
}

// rawDial opens a non-blocking socket of type sotype (SOCK_STREAM or
// SOCK_DGRAM) connected to addr, from the address from when it is valid
// (a client's: IP_TRANSPARENT, then bind), carrying mark when it is not
// zero (setOwnMark). A TCP socket gets TCP_NODELAY; its keep-alive comes
// later from its event loop (eventLoop.armKeepAlive), once the connection
// has lasted. Its connection completes, or fails, when the socket turns
// writable (connect(2): EINPROGRESS, then SO_ERROR). A UDP socket is
// connected on return. A port of from's that another of the proxy's
// connections to addr holds already fails the connect with
// EADDRNOTAVAIL, which tcpDial.fallBack retries from another port.
func rawDial(sotype int, addr netip.AddrPort, from netip.AddrPort, mark uint32) (fd int, err error) {
	if fd, err = rawSocket(sotype, addr, from, mark); err != nil {
		return -1, err
	}
	a := addr.Addr().Unmap()
	switch err = connectFD(fd, netip.AddrPortFrom(a, addr.Port()), a.Is6()); err {
	case nil, unix.EINPROGRESS, unix.EINTR:
		// EINTR: the connection goes on asynchronously, as after
		// EINPROGRESS (connect(2)).
		return fd, nil
	}
	unix.Close(fd)
	return -1, os.NewSyscallError("connect", err)
}

// rawSocket is rawDial without the connect: a socket of addr's family,
// bound to from if that is valid, marked with mark if that is not zero,
// to connect to addr. A port in from is the client's own, which the
// socket shares (SO_REUSEADDR) with the proxy's other connections from
// that client and port, as the client's own kernel shares it between
// destinations; one the node holds otherwise (a listener on every
// address) gives way to one the kernel picks.
func rawSocket(sotype int, addr netip.AddrPort, from netip.AddrPort, mark uint32) (fd int, err error) {
	a := addr.Addr().Unmap()
	family := unix.AF_INET
	if a.Is6() {
		family = unix.AF_INET6
	}
	if from.IsValid() {
		fd, err = clientSocket(family, sotype)
	} else {
		fd, err = unix.Socket(family, sotype|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	}
	if err != nil {
		return -1, os.NewSyscallError("socket", err)
	}
	defer func() {
		if err != nil {
			unix.Close(fd)
			fd = -1
		}
	}()
	if sotype == unix.SOCK_STREAM {
		if err = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1); err != nil {
			return fd, os.NewSyscallError("setsockopt", err)
		}
	}
	if err = setOwnMark(fd, mark); err != nil {
		return fd, err
	}
	if from.IsValid() {
		src := from.Addr().Unmap()
		if family == unix.AF_INET6 {
			err = unix.SetsockoptInt(fd, unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
		} else {
			err = unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1)
		}
		if err != nil {
			return fd, fmt.Errorf("setting IP_TRANSPARENT: %w", err)
		}
		if from.Port() != 0 {
			if err = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
				return fd, os.NewSyscallError("setsockopt SO_REUSEADDR", err)
			}
			if err = bindFD(fd, netip.AddrPortFrom(src, from.Port()), src.Is6()); err == nil {
				return fd, nil
			}
		}
		if err = bindFD(fd, netip.AddrPortFrom(src, 0), src.Is6()); err != nil {
			return fd, os.NewSyscallError("bind", err)
		}
	}
	return fd, nil
}

// clientSocketUID owns the sockets that dial from a client's address:
// the overflow uid (nobody), not root.
const clientSocketUID = 65534

// clientSocket opens a non-blocking socket owned by clientSocketUID,
// which it takes from the thread's filesystem uid when the socket is
// created (sock_alloc, net/socket.c). A dial from a client's address is
// the client's traffic, and policy engines that let the node's own root
// sockets pass unchecked (kube-network-policies accepts "meta skuid 0"
// in POSTROUTING) must police it as the client's. setfsuid(2) changes
// the calling thread only, and only the filesystem capabilities with
// it, so the thread is held for the two calls; the socket's other
// operations need CAP_NET_ADMIN, which it keeps. Without the privilege
// to change it, the socket is the process's own.
func clientSocket(family, sotype int) (fd int, err error) {
	err = asClientSocketOwner(func() error {
		fd, err = unix.Socket(family, sotype|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		return err
	})
	return fd, err
}

// asClientSocketOwner runs f, which creates a socket on the calling
// goroutine (a net.Dialer's dial does, before it waits), with the
// thread's filesystem uid set to clientSocketUID (clientSocket).
func asClientSocketOwner(f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// setfsuid returns the previous filesystem uid whether it changed
	// it or not.
	prev, _ := unix.SetfsuidRetUid(clientSocketUID)
	defer unix.SetfsuidRetUid(prev)
	return f()
}

// setOwnMark puts mark (Config.OwnMark) on the socket fd, unless it is
// zero: the kernel's rules let the socket's packets past every
// interception, so that a backend whose address and port a Service
// intercepts is reached, not the proxy again. SO_MARK takes
// CAP_NET_ADMIN (or CAP_NET_RAW since Linux 5.17).
func setOwnMark(fd int, mark uint32) error {
	if mark == 0 {
		return nil
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(mark)); err != nil {
		return os.NewSyscallError("setsockopt SO_MARK", err)
	}
	return nil
}

// errConnectTimeout is a backend connection attempt that took longer than
// the dial timeout.
var errConnectTimeout = fmt.Errorf("connect: %w", os.ErrDeadlineExceeded)
