package upgrade

import (
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/uproxy/uproxy/internal/testwait"
	"go.uber.org/zap/zaptest"
)

// A peer that goes silent must not hold the other side for longer than
// the time-out of the phase it stopped in: the old process's sync loop is
// paused during a handover, and a starting process that waits forever
// never serves.

// TestUpgradeSilentSuccessor checks that a successor which says hello and
// never says ready does not stop the old process's syncing for good:
// past the ready timeout the old process says abort, closes the
// connection and syncs again, serving its upgrade socket as before.
func TestUpgradeSilentSuccessor(t *testing.T) {
	netns, err := netnsID()
	if err != nil {
		t.Skip(err)
	}
	for _, tc := range []struct {
		name string
		// readSockets: the successor reads the offer and the sockets
		// before it goes silent; otherwise it reads nothing after hello.
		readSockets bool
	}{
		{"silent after the sockets", true},
		{"silent after hello", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pr := startPredecessor(t, func(c *Config) { c.ReadyTimeout = 300 * time.Millisecond })
			c := dialPredecessor(t, pr.path, netns)
			readAll := func() int {
				offer, files, err := Recv(c)
				closeFiles(files)
				if err != nil || offer.Type != "offer" || offer.Error != "" || offer.Count == 0 {
					t.Fatalf("got %+v, %v; want an offer of sockets", offer, err)
				}
				for received := 0; received < offer.Count; {
					m, files, err := Recv(c)
					closeFiles(files)
					if err != nil || m.Type != "sockets" {
						t.Fatalf("got %+v, %v; want sockets", m, err)
					}
					received += len(files)
				}
				return offer.Count
			}
			if tc.readSockets {
				readAll()
			}
			// The old process has paused its sync loop and sent the
			// sockets (gone is set once they are sent); now say nothing.
			testwait.Until(t, 10*time.Second, "the sockets sent", func() bool {
				pr.u.mu.Lock()
				defer pr.u.mu.Unlock()
				return pr.u.gone
			})
			paused := pr.syncs.Load()
			start := time.Now()
			testwait.Until(t, 10*time.Second, "the handover aborted", func() bool {
				pr.u.mu.Lock()
				defer pr.u.mu.Unlock()
				return !pr.u.handing
			})
			if waited := time.Since(start); waited > 5*time.Second {
				t.Errorf("the old process waited %v", waited)
			}
			testwait.Until(t, 10*time.Second, "a sync after the aborted handover", func() bool { return pr.syncs.Load() > paused })
			if !tc.readSockets {
				readAll() // what was queued before the old process gave up
			}
			// An abort tells the successor that the old process syncs
			// again, where the connection's end alone would tell it that
			// the old process died.
			if m, _, err := Recv(c); err != nil || m.Type != "abort" {
				t.Fatalf("got %+v, %v; want the old process to take the handover back with abort", m, err)
			}
			if m, _, err := Recv(c); !errors.Is(err, io.EOF) {
				t.Fatalf("got %+v, %v; want the old process to have closed the connection", m, err)
			}
			pr.u.mu.Lock()
			defer pr.u.mu.Unlock()
			if pr.u.handing || pr.u.gone || pr.u.ln == nil {
				t.Errorf("after the aborted handover: handing %v, gone %v, socket %v; want it serving its upgrade socket", pr.u.handing, pr.u.gone, pr.u.ln)
			}
		})
	}
}

// TestUpgradeSilentPeerBeforeHello checks that a peer which connects and
// never says hello is dropped after the handshake time-out, without
// pausing the old process's sync loop, and that the next successor is
// served.
func TestUpgradeSilentPeerBeforeHello(t *testing.T) {
	netns, err := netnsID()
	if err != nil {
		t.Skip(err)
	}
	pr := startPredecessor(t, func(c *Config) { c.HandshakeTimeout = 300 * time.Millisecond })
	silent, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: pr.path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	silent.SetDeadline(time.Now().Add(10 * time.Second))
	start := time.Now()
	if m, files, err := Recv(silent); !errors.Is(err, io.EOF) {
		closeFiles(files)
		t.Fatalf("got %+v, %v; want the old process to close the connection", m, err)
	}
	if waited := time.Since(start); waited > 5*time.Second {
		t.Errorf("the old process waited %v", waited)
	}
	pr.u.mu.Lock()
	handing := pr.u.handing
	pr.u.mu.Unlock()
	if handing {
		t.Error("a handover is in progress")
	}
	// Still serving: a successor that says hello gets the sockets.
	c := dialPredecessor(t, pr.path, netns)
	offer, files, err := Recv(c)
	closeFiles(files)
	if err != nil || offer.Type != "offer" || offer.Error != "" || offer.Count == 0 {
		t.Errorf("after the silent peer: got %+v, %v; want an offer of sockets", offer, err)
	}
}

// TestUpgradeSilentPredecessor checks what a starting process does when
// the process behind the upgrade socket stops answering: before the
// sockets have arrived it gives up after the handshake time-out, with an
// error (a cold start would fight that process over the rules); a release
// it asked for and that is never confirmed it gives up on after the
// release time-out, and starts cold.
func TestUpgradeSilentPredecessor(t *testing.T) {
	netns, err := netnsID()
	if err != nil {
		t.Skip(err)
	}
	type outcome struct {
		Err      bool
		Bound    bool     // a socket of its own at the path
		Received []string // what the predecessor got
	}
	for _, tc := range []struct {
		name   string
		answer func(c *net.UnixConn, quiet <-chan struct{}) []string // nil: never accepts
		// handshake is the handshake time-out when not the 300ms the
		// release time-out is: longer, the release's own time-out shows.
		handshake time.Duration
		want      outcome
	}{
		{"listens, never accepts", nil, 0, outcome{Err: true}},
		{"silent after hello", func(c *net.UnixConn, quiet <-chan struct{}) []string {
			hello, _, _ := Recv(c)
			<-quiet
			return []string{hello.Type}
		}, 0, outcome{Err: true, Received: []string{"hello"}}},
		{"silent after the offer", func(c *net.UnixConn, quiet <-chan struct{}) []string {
			hello, _, _ := Recv(c)
			Send(c, Message{Type: "offer", PID: 1, Netns: netns, Mode: "redirect", Count: 2}, nil)
			<-quiet
			return []string{hello.Type}
		}, 0, outcome{Err: true, Received: []string{"hello"}}},
		{"silent after some sockets", func(c *net.UnixConn, quiet <-chan struct{}) []string {
			hello, _, _ := Recv(c)
			Send(c, Message{Type: "offer", PID: 1, Netns: netns, Mode: "redirect", Count: 2}, nil)
			f, err := os.Open(os.DevNull)
			if err == nil {
				Send(c, Message{Type: "sockets", Sockets: []Socket{{Kind: "unknown", Key: "one"}}}, []*os.File{f})
				f.Close()
			}
			<-quiet
			return []string{hello.Type}
		}, 0, outcome{Err: true, Received: []string{"hello"}}},
		{"never confirms a release", func(c *net.UnixConn, quiet <-chan struct{}) []string {
			hello, _, _ := Recv(c)
			Send(c, Message{Type: "offer", PID: 1, Netns: netns, Mode: "tproxy"}, nil)
			release, _, _ := Recv(c)
			<-quiet
			return []string{hello.Type, release.Type}
		}, time.Minute, outcome{Bound: true, Received: []string{"hello", "release"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "upgrade.sock")
			quiet := make(chan struct{})
			var received <-chan []string
			if tc.answer != nil {
				received = fakePredecessor(t, path, func(c *net.UnixConn) []string { return tc.answer(c, quiet) })
			} else {
				ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
				if err != nil {
					t.Fatal(err)
				}
				ln.SetUnlinkOnClose(false)
				defer ln.Close()
			}
			before := pathID(path)
			handshake := 300 * time.Millisecond
			if tc.handshake != 0 {
				handshake = tc.handshake
			}
			u := New(Config{Path: path, Mode: "redirect", Logger: zaptest.NewLogger(t),
				HandshakeTimeout: handshake, ReleaseTimeout: 300 * time.Millisecond})
			start := time.Now()
			err := u.Start()
			waited := time.Since(start)
			close(quiet)
			defer u.Close()
			got := outcome{Err: err != nil, Bound: u.ln != nil && pathID(path) != before}
			if received != nil {
				got.Received = <-received
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("(-want +got):\n%s (error %v)", diff, err)
			}
			if waited > 5*time.Second {
				t.Errorf("the starting process waited %v", waited)
			}
			if u.pred != nil || len(u.listeners) != 0 || u.servers.inheritedCount() != 0 {
				t.Errorf("predecessor %v, %d listeners, %d server sockets: want nothing taken over", u.pred, len(u.listeners), u.servers.inheritedCount())
			}
			if got.Err && pathID(path) != before {
				t.Error("the silent process's socket file was touched")
			}
		})
	}
}
