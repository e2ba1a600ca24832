package upgrade

import (
	"context"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"

	"github.com/uproxy/uproxy/proxy/listeners"

	"go.uber.org/zap"

	"github.com/uproxy/uproxy/proxy/healthcheck"
)

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
		f, err := listeners.SocketFile(sc, l.key)
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
