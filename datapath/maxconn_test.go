package datapath

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testwait"
)

// TestMaxConnections checks Config.MaxConnections on every TCP data path:
// the event loops on epoll and with io_uring, and the goroutines that
// carry a listener whose dialer is the caller's. Past the bound a
// connection is reset before any backend is dialled, and counted; a
// closed connection makes room. Before, nothing bounded the connections
// but the open-files limit, whose last descriptors iptables-restore needs.
func TestMaxConnections(t *testing.T) {
	eachDataPath(t, func(t *testing.T, dp dataPath) {
		checkMaxConnections(t, Config{IOURing: dp.ring})
	})
	t.Run("goroutines", func(t *testing.T) {
		checkMaxConnections(t, Config{Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		}})
	})
}

func checkMaxConnections(t *testing.T, cfg Config) {
	const limit = 3
	var accepted atomic.Int64
	be := startBackend(t, func(c net.Conn) {
		accepted.Add(1)
		io.Copy(c, c)
	})
	cfg.MaxConnections = limit
	p, port := proxyWeb(t, cfg, be)
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for i := range limit {
		held = append(held, echoOnce(t, port, i))
	}
	if err := resetOnce(port); err != nil {
		t.Fatalf("connection %d with a bound of %d: %v", limit+1, limit, err)
	}
	if n := p.ConnectionsOverMax(); n != 1 {
		t.Errorf("ConnectionsOverMax() = %d, want 1", n)
	}
	if n := accepted.Load(); n != limit {
		t.Errorf("the backend accepted %d connections, want %d: the refused one must not be dialled", n, limit)
	}
	held[0].Close()
	testwait.Until(t, 5*time.Second, "the closed connection's session ends", func() bool { return p.ActiveConnections() == limit-1 })
	held[0] = echoOnce(t, port, limit)
	if err := resetOnce(port); err != nil {
		t.Fatalf("full again: %v", err)
	}
	if n := p.ConnectionsOverMax(); n != 2 {
		t.Errorf("ConnectionsOverMax() = %d, want 2", n)
	}
}

// resetOnce connects to the listener on port and returns nil if the proxy
// resets the connection, or an error saying what happened instead.
func resetOnce(port int) error {
	// The kernel completes the handshake before the proxy accepts, so
	// the connection is made; the reset ends its first read or write.
	c, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", port), 2*time.Second)
	if errors.Is(err, syscall.ECONNRESET) {
		return nil
	}
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	_, err = c.Write([]byte("x"))
	if err == nil {
		_, err = io.ReadFull(c, make([]byte, 1))
	}
	switch {
	case err == nil:
		return errors.New("the connection was proxied")
	case !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.EPIPE):
		return fmt.Errorf("the connection ended with %w, want a reset", err)
	}
	return nil
}
