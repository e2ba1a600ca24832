package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/golang-lru/v2/expirable"
	"go.uber.org/zap"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
	"golang.org/x/sys/unix"

	"github.com/uproxy/uproxy/balancer"
)

// maxDatagram is the largest UDP payload: 65,535 bytes less the 8-byte
// UDP header (IPv4 further subtracts its 20-byte header, to 65,507).
const maxDatagram = 65535 - 8

// flowKey identifies a UDP flow: one client of one listener.
type flowKey struct {
	l      *listener
	client netip.AddrPort
}

// udpFlow is one client's association with one backend: a connected UDP
// socket towards the backend, and a goroutine that relays its replies.
type udpFlow struct {
	key     flowKey
	backend *balancer.Backend
	conn    *net.UDPConn // connected to backend
	// dst is where the client's datagrams arrived: in redirect mode the
	// local address the kernel redirected them to (replies sent from it are
	// mapped back to the service's address and port by conntrack); in
	// tproxy mode the service's address and port themselves. Either way a
	// client with a connected socket (a DNS resolver) accepts the replies.
	dst    netip.AddrPort
	sock   udpSocket
	closed atomic.Bool
	pm     *portMetrics // the metrics of the flow's service port; nil if none
}

func (f *udpFlow) close() {
	if f.closed.CompareAndSwap(false, true) {
		f.conn.Close()
		f.pm.flowClosed()
	}
}

// flowTable holds every UDP flow of a Proxier, bounded in size, each
// expiring after the UDP timeout without traffic. It is an expirable LRU
// from hashicorp/golang-lru; that LRU runs one expiry goroutine that never
// exits, so the table is created once per Proxier, with its first UDP
// listener, and lives as long as the process.
type flowTable struct {
	once sync.Once
	lru  *expirable.LRU[flowKey, *udpFlow]
	// created publishes lru to readers that must not create it (UDPFlows,
	// from any goroutine).
	created atomic.Pointer[expirable.LRU[flowKey, *udpFlow]]
}

func (p *Proxier) flowTable() *expirable.LRU[flowKey, *udpFlow] {
	p.flows.once.Do(func() {
		size, ttl := p.cfg.UDPMaxFlows, p.cfg.UDPTimeout
		if size <= 0 {
			size = 65536
		}
		if ttl <= 0 {
			ttl = 30 * time.Second
		}
		// The callback runs with the LRU's lock held: it only closes the
		// flow's socket, which ends the flow's reply goroutine.
		p.flows.lru = expirable.NewLRU(size, func(_ flowKey, f *udpFlow) { f.close() }, ttl)
		p.flows.created.Store(p.flows.lru)
	})
	return p.flows.lru
}

// UDPFlows returns the number of live UDP flows. Safe for concurrent use.
func (p *Proxier) UDPFlows() int {
	if lru := p.flows.created.Load(); lru != nil {
		return lru.Len()
	}
	return 0
}

func (p *Proxier) listenUDP(ctx context.Context, network, addr string) (*net.UDPConn, error) {
	if p.cfg.ListenUDP != nil {
		return p.cfg.ListenUDP(ctx, network, addr)
	}
	lc := p.listenConfig()
	pc, err := lc.ListenPacket(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return pc.(*net.UDPConn), nil
}

// udpSocket reads datagrams with the address they were sent to, and
// writes replies that appear to come from it, for one listener. read is
// called by one goroutine only; write by any.
type udpSocket interface {
	read(b []byte) (n int, client, dst netip.AddrPort, err error)
	write(b []byte, client, dst netip.AddrPort) error
	close()
}

// udp4 and udp6 are redirect-mode sockets: dst is the local address the
// datagram was redirected to (IP_PKTINFO), and replies are sent from it.
type udp4 struct{ pc *ipv4.PacketConn }

func (u udp4) read(b []byte) (int, netip.AddrPort, netip.AddrPort, error) {
	n, cm, src, err := u.pc.ReadFrom(b)
	if err != nil {
		return 0, netip.AddrPort{}, netip.AddrPort{}, err
	}
	var local netip.Addr
	if cm != nil {
		local, _ = netip.AddrFromSlice(cm.Dst)
	}
	return n, udpAddrPort(src), netip.AddrPortFrom(local.Unmap(), 0), nil
}

func (u udp4) write(b []byte, client, dst netip.AddrPort) error {
	var cm *ipv4.ControlMessage
	if dst.Addr().IsValid() {
		cm = &ipv4.ControlMessage{Src: dst.Addr().AsSlice()}
	}
	_, err := u.pc.WriteTo(b, cm, net.UDPAddrFromAddrPort(client))
	return err
}

func (udp4) close() {}

type udp6 struct{ pc *ipv6.PacketConn }

func (u udp6) read(b []byte) (int, netip.AddrPort, netip.AddrPort, error) {
	n, cm, src, err := u.pc.ReadFrom(b)
	if err != nil {
		return 0, netip.AddrPort{}, netip.AddrPort{}, err
	}
	var local netip.Addr
	if cm != nil {
		local, _ = netip.AddrFromSlice(cm.Dst)
	}
	return n, udpAddrPort(src), netip.AddrPortFrom(local, 0), nil
}

func (u udp6) write(b []byte, client, dst netip.AddrPort) error {
	var cm *ipv6.ControlMessage
	if dst.Addr().IsValid() {
		cm = &ipv6.ControlMessage{Src: dst.Addr().AsSlice()}
	}
	_, err := u.pc.WriteTo(b, cm, net.UDPAddrFromAddrPort(client))
	return err
}

func (udp6) close() {}

func udpAddrPort(a net.Addr) netip.AddrPort {
	if u, ok := a.(*net.UDPAddr); ok {
		ap := u.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	return netip.AddrPort{}
}

func (p *Proxier) udpSocket(l *listener) (udpSocket, error) {
	if p.cfg.Transparent {
		return &tproxySocket{pc: l.pc, v6: l.key.v6, oob: make([]byte, 128)}, nil
	}
	if l.key.v6 {
		pc := ipv6.NewPacketConn(l.pc)
		return udp6{pc}, pc.SetControlMessage(ipv6.FlagDst, true)
	}
	pc := ipv4.NewPacketConn(l.pc)
	return udp4{pc}, pc.SetControlMessage(ipv4.FlagDst, true)
}

// udpLoop reads the listener's datagrams until it is closed, and forwards
// each to its client's flow, creating the flow on the first datagram. It
// is the only goroutine that creates flows for l.
func (p *Proxier) udpLoop(l *listener) {
	defer p.wg.Done()
	sock, err := p.udpSocket(l)
	if sock != nil {
		defer sock.close()
	}
	if err != nil {
		p.log.Error("UDP listener cannot see destination addresses; replies may come from the wrong address",
			zap.Stringer("servicePort", l.key.name), zap.Error(err))
	}
	flows := p.flowTable()
	buf := make([]byte, maxDatagram)
	var delay time.Duration
	for {
		n, client, dst, err := sock.read(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				p.removeFlows(l)
				return
			}
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			p.connLog.Warn("UDP read failed; backing off", zap.Stringer("servicePort", l.key.name), zap.Error(err))
			time.Sleep(delay)
			continue
		}
		delay = 0
		// A backend that answered with ICMP port unreachable makes the send
		// fail: eject it and try the next one, at most DialAttempts times.
		for range p.cfg.dialAttempts() {
			f, err := p.udpFlowFor(l, sock, client, dst)
			if err != nil {
				p.connLog.Warn("no backend for UDP flow", zap.Stringer("servicePort", l.key.name), zap.Error(err))
				break
			}
			if _, err := f.conn.Write(buf[:n]); err != nil {
				p.udpFailed(f, err)
				continue
			}
			f.pm.up(int64(n))
			flows.Add(f.key, f) // refresh the flow's timeout
			break
		}
	}
}

// udpFlowFor returns the live flow of client on l, or creates one. A flow
// whose backend is no longer usable (removed, no longer ready, ejected) is
// replaced, so no client stays blackholed behind a dead endpoint.
func (p *Proxier) udpFlowFor(l *listener, sock udpSocket, client, dst netip.AddrPort) (*udpFlow, error) {
	flows := p.flowTable()
	key := flowKey{l, client}
	snap := l.snap.Load()
	pm := snap.metrics
	// Only tproxy mode knows which of the service's addresses a datagram
	// was sent to; in redirect mode it counts as cluster-IP traffic.
	bal := snap.route(dst, p.cfg.Transparent, client.Addr(), p.internalClient)
	if bal == nil {
		pm.refusedDestination()
		return nil, fmt.Errorf("%s: datagram to %s, not one of the service's addresses", snap.sp.Name, dst)
	}
	set := snap.cluster
	if bal == snap.local {
		set = snap.local
	}
	if f, ok := flows.Peek(key); ok {
		if !f.closed.Load() && !f.backend.Ejected() && snap.serves(set, f.backend) {
			return f, nil
		}
		flows.Remove(key)
	}
	b := bal.Pick(client.Addr())
	if b == nil {
		pm.noEndpoint()
		return nil, fmt.Errorf("%s: %w", snap.sp.Name, errNoEndpoints)
	}
	bm := pm.backend(b)
	bm.picked()
	var from netip.Addr
	if p.cfg.Transparent && snap.sp.PreserveSourceIP {
		from = client.Addr()
	}
	start := pm.dialStart()
	conn, err := p.dialUDP(b.Addr, from)
	pm.dialDone(start, err)
	if err != nil {
		p.health.failure(b)
		bm.failed()
		return nil, fmt.Errorf("dial %s: %w", b.Addr, err)
	}
	bm.connected()
	f := &udpFlow{key: key, backend: b, conn: conn, dst: dst, sock: sock, pm: pm}
	pm.flowOpened()
	b.Acquire()
	flows.Add(key, f)
	p.wg.Add(1)
	go p.udpReplies(f) // ends when the flow's socket is closed
	return f, nil
}

// udpFailed handles an error sending to or receiving from a flow's
// backend: ECONNREFUSED (an ICMP port unreachable) ejects the backend;
// the flow is dropped either way.
func (p *Proxier) udpFailed(f *udpFlow, err error) {
	if errors.Is(err, syscall.ECONNREFUSED) {
		p.health.failure(f.backend)
	}
	if flows := p.flowTable(); flows != nil {
		if cur, ok := flows.Peek(f.key); ok && cur == f {
			flows.Remove(f.key)
		}
	}
	f.close()
}

func (p *Proxier) dialUDP(addr netip.AddrPort, from netip.Addr) (*net.UDPConn, error) {
	return dialAs[*net.UDPConn](p.dial("udp", addr, from))
}

// replyBuffers recycles reply buffers: a flow holds one only while it
// relays a datagram, not while it waits, so idle flows cost no buffer.
var replyBuffers = sync.Pool{New: func() any { b := make([]byte, maxDatagram); return &b }}

// udpReplies relays the backend's datagrams to the client until the
// flow's socket is closed (expiry, eviction, replacement, shutdown).
func (p *Proxier) udpReplies(f *udpFlow) {
	defer p.wg.Done()
	defer f.backend.Release()
	rc, err := f.conn.SyscallConn()
	if err != nil {
		f.close()
		return
	}
	for {
		if err := waitReadable(rc); err != nil {
			p.udpFailed(f, err)
			return
		}
		bp := replyBuffers.Get().(*[]byte)
		n, err := f.conn.Read(*bp)
		if err == nil {
			err = f.sock.write((*bp)[:n], f.key.client, f.dst)
			if err == nil {
				f.pm.down(int64(n))
			}
			if err != nil {
				p.connLog.Warn("UDP reply to client failed", zap.Stringer("client", f.key.client), zap.Error(err))
				err = nil
			}
		}
		replyBuffers.Put(bp)
		if err != nil {
			p.udpFailed(f, err)
			return
		}
		if cur, ok := p.flowTable().Peek(f.key); ok && cur == f {
			p.flowTable().Add(f.key, f) // replies keep the flow alive too
		}
	}
}

// waitReadable blocks, in the netpoller, until a datagram is queued on the
// socket, without taking it: MSG_PEEK with an empty buffer. It returns the
// socket's pending error (ECONNREFUSED after an ICMP port unreachable).
func waitReadable(rc syscall.RawConn) error {
	var serr error
	err := rc.Read(func(fd uintptr) bool {
		_, _, serr = unix.Recvfrom(int(fd), nil, unix.MSG_PEEK|unix.MSG_TRUNC|unix.MSG_DONTWAIT)
		return serr != unix.EAGAIN
	})
	if err != nil {
		return err
	}
	return serr
}

// removeFlows drops every flow of a closed listener.
func (p *Proxier) removeFlows(l *listener) {
	flows := p.flowTable()
	for _, k := range flows.Keys() {
		if k.l == l {
			flows.Remove(k)
		}
	}
}
