package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap/zaptest"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/uproxy/uproxy/proxy"
)

// fakePredecessor listens on path and answers the first connection with
// answer, which returns the types of the messages it received.
func fakePredecessor(t *testing.T, path string, answer func(c *net.UnixConn) []string) <-chan []string {
	t.Helper()
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	got := make(chan []string, 1)
	go func() { // ends after one connection, or when the test closes ln
		defer close(got)
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		got <- answer(c)
	}()
	t.Cleanup(func() { ln.Close() })
	return got
}

// rawSend writes m as is, without the version sendUpgradeMessage sets.
func rawSend(t *testing.T, c *net.UnixConn, m map[string]any) {
	b, _ := json.Marshal(m)
	if _, err := c.Write(b); err != nil {
		t.Error(err)
	}
}

// TestUpgraderStart checks what a starting process does with what it
// finds at the upgrade socket's path, short of a handover.
func TestUpgraderStart(t *testing.T) {
	netns, err := netnsID()
	if err != nil {
		t.Skip(err)
	}
	type outcome struct {
		Err      bool
		Disabled bool     // no upgrade socket for this process
		Bound    bool     // a socket of its own at the path
		Received []string // what the predecessor got
	}
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, path string) <-chan []string
		want  outcome
	}{
		{"nothing there", func(*testing.T, string) <-chan []string { return nil }, outcome{Bound: true}},
		{"stale socket file", func(t *testing.T, path string) <-chan []string {
			ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
			if err != nil {
				t.Fatal(err)
			}
			ln.SetUnlinkOnClose(false)
			ln.Close()
			return nil
		}, outcome{Bound: true}},
		{"another network namespace", func(t *testing.T, path string) <-chan []string {
			return fakePredecessor(t, path, func(c *net.UnixConn) []string {
				m, _, _ := recvUpgradeMessage(c)
				sendUpgradeMessage(c, upgradeMessage{Type: "offer", Netns: "1:2", Error: offerForeign}, nil)
				return []string{m.Type}
			})
		}, outcome{Disabled: true, Received: []string{"hello"}}},
		{"busy", func(t *testing.T, path string) <-chan []string {
			return fakePredecessor(t, path, func(c *net.UnixConn) []string {
				m, _, _ := recvUpgradeMessage(c)
				sendUpgradeMessage(c, upgradeMessage{Type: "offer", Netns: netns, Mode: "redirect", Error: offerBusy}, nil)
				return []string{m.Type}
			})
		}, outcome{Err: true, Received: []string{"hello"}}},
		{"another protocol version", func(t *testing.T, path string) <-chan []string {
			return fakePredecessor(t, path, func(c *net.UnixConn) []string {
				hello, _, _ := recvUpgradeMessage(c)
				rawSend(t, c, map[string]any{"type": "offer", "version": upgradeProtocolVersion + 1, "netns": netns, "mode": "redirect", "somethingNew": true})
				release, _, _ := recvUpgradeMessage(c)
				rawSend(t, c, map[string]any{"type": "released", "version": upgradeProtocolVersion + 1})
				return []string{hello.Type, release.Type}
			})
		}, outcome{Bound: true, Received: []string{"hello", "release"}}},
		{"another mode", func(t *testing.T, path string) <-chan []string {
			return fakePredecessor(t, path, func(c *net.UnixConn) []string {
				hello, _, _ := recvUpgradeMessage(c)
				sendUpgradeMessage(c, upgradeMessage{Type: "offer", Netns: netns, Mode: "tproxy"}, nil)
				release, _, _ := recvUpgradeMessage(c)
				sendUpgradeMessage(c, upgradeMessage{Type: "released"}, nil)
				return []string{hello.Type, release.Type}
			})
		}, outcome{Bound: true, Received: []string{"hello", "release"}}},
		{"not serving yet", func(t *testing.T, path string) <-chan []string {
			return fakePredecessor(t, path, func(c *net.UnixConn) []string {
				hello, _, _ := recvUpgradeMessage(c)
				sendUpgradeMessage(c, upgradeMessage{Type: "offer", Netns: netns, Mode: "redirect", Error: offerNotReady}, nil)
				release, _, _ := recvUpgradeMessage(c)
				sendUpgradeMessage(c, upgradeMessage{Type: "released"}, nil)
				return []string{hello.Type, release.Type}
			})
		}, outcome{Bound: true, Received: []string{"hello", "release"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "upgrade.sock")
			received := tc.setup(t, path)
			before := pathID(path)
			u := newUpgrader(path, "redirect", zaptest.NewLogger(t))
			err := u.start()
			defer u.close()
			got := outcome{Err: err != nil, Disabled: u.path == "", Bound: u.ln != nil && pathID(path) != before}
			if received != nil {
				got.Received = <-received
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("(-want +got):\n%s (error %v)", diff, err)
			}
			if got.Disabled && pathID(path) != before {
				t.Error("the socket file of a process of another namespace was touched")
			}
		})
	}
}

// TestUpgradeHandsOverInProcess runs both sides of a handover in one
// process: the successor receives the proxier's listener, a server's
// socket and the upgrade socket, and the predecessor hands over when it
// is told the successor is ready.
func TestUpgradeHandsOverInProcess(t *testing.T) {
	path := filepath.Join(t.TempDir(), "upgrade.sock")
	log := zaptest.NewLogger(t)
	old := newUpgrader(path, "redirect", log.Named("old"))
	if err := old.start(); err != nil || old.ln == nil {
		t.Fatalf("start: %v, socket %v", err, old.ln)
	}
	defer old.close()

	oldSynced := make(chan struct{})
	p := proxy.NewProxier(proxy.Config{Sync: proxy.RunnerConfig{MinInterval: 10 * time.Millisecond}, OnSync: sync.OnceFunc(func() { close(oldSynced) })})
	p.Tracker().Replace([]*v1.Service{{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web"},
		Spec: v1.ServiceSpec{Type: v1.ServiceTypeClusterIP, ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10"},
			Ports: []v1.ServicePort{{Name: "http", Port: 80, Protocol: v1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)}}},
	}}, nil)
	metricsLn, err := old.servers.listen("metrics")("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer metricsLn.Close()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	syncLoop := newPausableRun(p)
	syncDone := make(chan struct{})
	go func() { syncLoop.run(ctx); close(syncDone) }() // ends with cancel
	handed := make(chan *handover, 1)
	go func() { handed <- old.serve(ctx, oldSynced, upgradeHooks{sync: syncLoop, export: p.ExportListeners}) }() // ends with a handover or cancel

	// A predecessor whose first sync has not completed has nothing worth
	// handing over (it answers "not serving yet"): wait for it, and for
	// its upgrader to have seen it (afterFirstSync sets ready after the
	// sync, on a goroutine of its own).
	select {
	case <-oldSynced:
	case <-time.After(10 * time.Second):
		t.Fatal("the predecessor did not sync")
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		old.mu.Lock()
		ready := old.ready
		old.mu.Unlock()
		if ready {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the predecessor's upgrader did not see its first sync")
		}
	}
	next := newUpgrader(path, "redirect", log.Named("new"))
	if err := next.start(); err != nil {
		t.Fatal(err)
	}
	defer next.close()
	var keys []string
	for _, l := range next.listeners {
		keys = append(keys, fmt.Sprintf("%s %s", kindListener, l.Key))
	}
	for key := range next.servers.inherited {
		keys = append(keys, fmt.Sprintf("%s %s", kindServer, key))
	}
	if next.ln != nil {
		keys = append(keys, kindUpgrade)
	}
	want := []string{"listener tcp4 default/web:http", "server metrics tcp4 127.0.0.1:0", "upgrade"}
	if diff := cmp.Diff(want, keys); diff != "" {
		t.Errorf("inherited sockets (-want +got):\n%s", diff)
	}
	// The successor's metrics server adopts the very socket.
	adopted, err := next.servers.listen("metrics")("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if adopted.Addr().String() != metricsLn.Addr().String() {
		t.Errorf("the successor's metrics socket is %s, the predecessor's %s", adopted.Addr(), metricsLn.Addr())
	}
	adopted.Close()

	select {
	case h := <-handed:
		t.Fatalf("handed over before the successor was ready: %+v", h)
	case <-time.After(100 * time.Millisecond):
	}
	nextSynced := make(chan struct{})
	close(nextSynced)
	nctx, ncancel := context.WithCancel(context.Background())
	nextDone := make(chan struct{})
	go func() { next.serve(nctx, nextSynced, upgradeHooks{}); close(nextDone) }() // ends with ncancel
	select {
	case h := <-handed:
		if h == nil || h.pid != os.Getpid() || h.conn != nil {
			t.Errorf("handover = %+v, want one to pid %d after ready", h, os.Getpid())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no handover after ready")
	}
	if !old.gone || old.ln != nil {
		t.Error("the predecessor still owns the upgrade socket")
	}
	if _, err := os.Stat(path); err != nil {
		t.Errorf("the upgrade socket file is gone: %v", err)
	}
	ncancel()
	<-nextDone
	cancel()
	<-syncDone
	p.StopListening()
	if err := p.Drain(context.Background()); err != nil {
		t.Error(err)
	}
}
