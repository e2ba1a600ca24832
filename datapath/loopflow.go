package datapath

import (
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A UDP flow on an event loop: the loop relays the backend's replies
// from the flow's socket to the client.

// addFlow watches a UDP flow's socket for the backend's replies. Runs on
// the loop, before any dropFlow of the flow (connectFlow).
func (lf *loopFlows) addFlow(f *udpFlow) {
	l := lf.loop
	if lf.recv == nil {
		lf.recv = newFlowReceiver()
		lf.replies = newReplyQueue(func(f *udpFlow, n int, err error) { f.p.replied(f, n, err) })
	}
	lf.flows[f] = struct{}{}
	f.side = loopSide{flow: f, fd: f.fd}
	if err := l.watch(&f.side, unix.EPOLLIN|unix.EPOLLET); err != nil {
		f.p.udpFailed(f, err)
	}
}

// flowBudget bounds the replies one wake-up relays for one flow, so that
// a backend that floods its client cannot hold the loop.
const flowBudget = 64

// flowReady relays the replies queued on f's socket to its client. A
// receive error (ECONNREFUSED after an ICMP port unreachable: udp(7))
// ends the flow. Runs on the loop.
func (lf *loopFlows) flowReady(f *udpFlow) {
	l := lf.loop
	if f.slot != nil {
		lf.slotReady(f)
		return
	}
	r := lf.recv
	for relayed := 0; relayed < flowBudget; {
		if f.closed.Load() {
			return
		}
		n, err := r.receive(f.fd)
		switch {
		case err == unix.EAGAIN:
			return
		case err != nil:
			f.p.udpFailed(f, os.NewSyscallError("recvmmsg", err))
			return
		}
		for i := range n {
			f.p.queueReply(f, lf.replies, r.datagram(i))
		}
		if n < len(r.hdrs) {
			// The socket had no more: the next datagram will raise a new
			// edge (epoll(7)), so no read is needed to find EAGAIN.
			return
		}
		relayed += n
	}
	// Edge-triggered: no new event comes for what is left. Relay it after
	// the other ready sockets had their turn.
	l.post(func() { lf.flowReady(f) })
}

// dropFlow closes a closed flow's socket, which takes it out of the
// epoll set, and lets go of its backend. Runs on the loop, after the flow
// was closed; at most once per flow.
func (lf *loopFlows) dropFlow(f *udpFlow) {
	l := lf.loop
	if _, ok := lf.flows[f]; !ok {
		return
	}
	delete(lf.flows, f)
	if f.fd < len(l.sides) && l.sides[f.fd] == &f.side {
		l.sides[f.fd] = nil
	}
	_ = closeFD(f.fd)
	f.release()
}

// flowReceiver reads a flow's replies for a loop, two at a time with
// recvmmsg(2): when the call returns one, the socket's queue was empty
// after it, and no further read that would find EAGAIN is needed (a UDP
// socket has no TCP_INQ hint).
type flowReceiver struct {
	hdrs [2]unix.Mmsghdr
	iovs [2]unix.Iovec
	bufs [2][]byte
}

func newFlowReceiver() *flowReceiver {
	r := &flowReceiver{}
	for i := range r.hdrs {
		r.bufs[i] = make([]byte, maxDatagram)
		r.iovs[i].Base = &r.bufs[i][0]
		r.iovs[i].SetLen(maxDatagram)
		r.hdrs[i].Hdr.Iov = &r.iovs[i]
		r.hdrs[i].Hdr.SetIovlen(1)
	}
	return r
}

// receive reads up to two datagrams from fd, without waiting.
func (r *flowReceiver) receive(fd int) (int, error) {
	n, err := rawCallP(unix.SYS_RECVMMSG, uintptr(fd), unsafe.Pointer(&r.hdrs[0]), uintptr(len(r.hdrs)), unix.MSG_DONTWAIT, 0, 0)
	return int(n), err
}

// datagram returns the i-th datagram the last receive read.
func (r *flowReceiver) datagram(i int) []byte { return r.bufs[i][:r.hdrs[i].Len] }
