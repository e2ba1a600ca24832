// Package datapath owns the data path: the event loops (epoll, io_uring),
// TCP sessions and UDP flows, routed by the snapshots the proxier publishes.
//
// The control plane (package proxy) binds each listener, hands it to an
// Engine and publishes its routing in it: a Snapshot, immutable, replaced
// whole, which the data path reads without locks and decides with
// (Snapshot.Route). The package imports nothing of Kubernetes.
//
// # Event loops
//
// A loop accepts connections on the TCP listeners, dials their backends
// and moves the bytes of both sockets, on its own epoll instance, as they
// become readable and writable, the way HAProxy and nginx do. Compared
// with a goroutine per direction (session.pipe, kept for
// Config.EventLoops < 0):
//   - an idle connection holds no goroutine and no stack, only its two
//     descriptors and a few hundred bytes of state, where a goroutine per
//     direction keeps two stacks per idle connection;
//   - a request wakes no goroutine: one epoll_wait returns the readiness
//     of many sockets, which the loop serves in turn, with no trip through
//     the scheduler, the runtime's poller or a futex.
//
// Without the loops' accept (a dialer of the caller's, Config.Dial), a
// session whose backend is connected hands both sockets over: they are
// dup(2)licated out of their *net.TCPConn, which is then closed. Close
// takes the descriptor out of the runtime's epoll (runtime_pollClose),
// which would otherwise wake for every event on it too. The duplicate is
// the only descriptor of the socket from then on, and closing it takes
// the socket out of the loop's epoll as well (epoll(7): a file leaves
// every epoll set once all its descriptors are closed).
//
// A UDP listener's socket is read by one loop (loopPacketListener), which
// writes each datagram to its flow's socket. The flow's socket is opened
// for the same loop, which relays the backend's replies to the client
// (addFlow, flowReady), so that a request and its reply stay on one
// thread, with no goroutine per listener or per flow. A port in request-reply
// mode (Snapshot.UDPMode; DNS by default) sends each query through a
// socket the loop keeps in a pool per endpoint instead of a flow of its
// own (udppool.go).
//
// # Accepting on the loops
//
// A TCP listener's socket joins the epoll set of every loop, and a loop
// that finds it readable accepts the connection itself, checks it
// (admitTCP), dials its backend and carries the session, all on its own
// thread. An accept goroutine per listener, posting each connection to a
// loop, would cost every connection a wake-up of a second thread (the
// runtime's netpoll), an eventfd write and read to hand the connection
// over, an accept4 that finds EAGAIN and the futex wake-ups of the
// hand-over, and would keep a goroutine and its stack per listener.
//
// The socket is registered level-triggered with EPOLLEXCLUSIVE, the way
// nginx shares its listeners between workers: a connection wakes one of
// the loops waiting, not all of them. A loop accepts until accept4 finds
// EAGAIN, at most acceptBatch connections per readiness, as HAProxy's
// tune.maxaccept and nginx's multi_accept do: one accept per readiness
// saves the accept that finds EAGAIN, but serves a queue one epoll_wait
// round per connection, and carried fewer short connections.
//
// # The loops' io_uring
//
// With Config.IOURing, a loop waits in an io_uring instead of in
// epoll_wait, and the ring carries the small messages of its TCP
// sessions: a session's two directions each keep one receive in the
// ring, which takes a buffer from a provided-buffer ring when data comes
// and completes with it; the loop then sends the buffer on with a ring
// send, and receives again once the send has completed. A send that finds
// its destination full does not wait with the buffer: what it could not
// send moves to the session's own memory, and the session to epoll, so a
// slow reader holds none of the loop's buffers. Every turn of the loop
// submits all the operations the last completions called for, and waits
// for the next, in one io_uring_enter, where an epoll loop makes several
// system calls per request.
//
// What the ring does not carry stays on the loop's epoll set, which the
// ring polls (one multishot poll of the epoll descriptor): the listeners,
// UDP flows and sessions in bulk transfer. A receive that fills a whole
// buffer marks a bulk transfer; its session then leaves the ring for
// good, once its operations in flight have completed, and splices on the
// epoll path as any other: io_uring runs every splice on a blocking
// worker thread (io_uring/splice.c), and copying bulk through buffers
// cannot keep up with splicing. A session whose backend takes a PROXY
// protocol header stays on epoll from the start. Backends are connected,
// and sockets closed, on the ring (ringConnect, ringCloseFD); the EOF's
// shutdown is not (ringReceived).
//
// An operation's user data holds its session's ring id, the backend
// connection attempt it makes, its direction and its kind (ringTag). A
// session stays known by its id until its last operation has completed,
// even after it ended: a buffer that a receive took, or a send still
// reads from, is given back only then.
//
// The figures behind these choices are in docs/performance.md.
package datapath
