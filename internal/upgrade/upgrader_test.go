package upgrade

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/proxy"
	"github.com/uproxy/uproxy/proxy/changes"
	"github.com/uproxy/uproxy/proxy/listeners"
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

// rawSend writes m as is, without the version Send sets.
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
				m, _, _ := Recv(c)
				Send(c, Message{Type: "offer", Netns: "1:2", Error: OfferForeign}, nil)
				return []string{m.Type}
			})
		}, outcome{Disabled: true, Received: []string{"hello"}}},
		{"busy", func(t *testing.T, path string) <-chan []string {
			return fakePredecessor(t, path, func(c *net.UnixConn) []string {
				m, _, _ := Recv(c)
				Send(c, Message{Type: "offer", Netns: netns, Mode: "redirect", Error: OfferBusy}, nil)
				return []string{m.Type}
			})
		}, outcome{Err: true, Received: []string{"hello"}}},
		{"another protocol version", func(t *testing.T, path string) <-chan []string {
			return fakePredecessor(t, path, func(c *net.UnixConn) []string {
				hello, _, _ := Recv(c)
				rawSend(t, c, map[string]any{"type": "offer", "version": ProtocolVersion + 1, "netns": netns, "mode": "redirect", "somethingNew": true})
				release, _, _ := Recv(c)
				rawSend(t, c, map[string]any{"type": "released", "version": ProtocolVersion + 1})
				return []string{hello.Type, release.Type}
			})
		}, outcome{Bound: true, Received: []string{"hello", "release"}}},
		{"another mode", func(t *testing.T, path string) <-chan []string {
			return fakePredecessor(t, path, func(c *net.UnixConn) []string {
				hello, _, _ := Recv(c)
				Send(c, Message{Type: "offer", Netns: netns, Mode: "tproxy"}, nil)
				release, _, _ := Recv(c)
				Send(c, Message{Type: "released"}, nil)
				return []string{hello.Type, release.Type}
			})
		}, outcome{Bound: true, Received: []string{"hello", "release"}}},
		{"not serving yet", func(t *testing.T, path string) <-chan []string {
			return fakePredecessor(t, path, func(c *net.UnixConn) []string {
				hello, _, _ := Recv(c)
				Send(c, Message{Type: "offer", Netns: netns, Mode: "redirect", Error: OfferNotReady}, nil)
				release, _, _ := Recv(c)
				Send(c, Message{Type: "released"}, nil)
				return []string{hello.Type, release.Type}
			})
		}, outcome{Bound: true, Received: []string{"hello", "release"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "upgrade.sock")
			received := tc.setup(t, path)
			before := pathID(path)
			u := New(Config{Path: path, Mode: "redirect", Logger: zaptest.NewLogger(t)})
			err := u.Start()
			defer u.Close()
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
	old := New(Config{Path: path, Mode: "redirect", Logger: log.Named("old")})
	if err := old.Start(); err != nil || old.ln == nil {
		t.Fatalf("start: %v, socket %v", err, old.ln)
	}
	defer old.Close()

	oldSynced := make(chan struct{})
	p := proxy.NewProxier(proxy.Config{Sync: changes.RunnerConfig{MinInterval: 10 * time.Millisecond}, OnSync: sync.OnceFunc(func() { close(oldSynced) })})
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
	syncLoop := NewSyncLoop(p)
	syncDone := make(chan struct{})
	go func() { syncLoop.Run(ctx); close(syncDone) }() // ends with cancel
	handed := make(chan *Handover, 1)
	go func() { handed <- old.Serve(ctx, oldSynced, Hooks{Sync: syncLoop, Export: p.ExportListeners}) }() // ends with a handover or cancel

	// A predecessor whose first sync has not completed has nothing worth
	// handing over (it answers "not serving yet"): wait for it, and for
	// its Upgrader to have seen it (afterFirstSync sets ready after the
	// sync, on a goroutine of its own).
	select {
	case <-oldSynced:
	case <-time.After(10 * time.Second):
		t.Fatal("the predecessor did not sync")
	}
	testwait.Until(t, 10*time.Second, "the predecessor's Upgrader to see its first sync", func() bool {
		old.mu.Lock()
		defer old.mu.Unlock()
		return old.ready
	})
	next := New(Config{Path: path, Mode: "redirect", Logger: log.Named("new")})
	if err := next.Start(); err != nil {
		t.Fatal(err)
	}
	defer next.Close()
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
	go func() { next.Serve(nctx, nextSynced, Hooks{}); close(nextDone) }() // ends with ncancel
	select {
	case h := <-handed:
		if h == nil || h.PID != os.Getpid() || h.conn != nil {
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

// predecessor is a running process's side of the handover, in this
// process: an Upgrader that has synced once and serves the upgrade
// socket, over a proxier with one service.
type predecessor struct {
	u     *Upgrader
	path  string
	syncs atomic.Int32 // successful syncs of its proxier
}

// startPredecessor starts a predecessor; configure adjusts its
// upgrader's configuration. Everything ends with the test.
func startPredecessor(t *testing.T, configure func(c *Config)) *predecessor {
	t.Helper()
	pr := &predecessor{path: filepath.Join(t.TempDir(), "upgrade.sock")}
	cfg := Config{Path: pr.path, Mode: "redirect", Logger: zaptest.NewLogger(t).Named("old")}
	if configure != nil {
		configure(&cfg)
	}
	pr.u = New(cfg)
	if err := pr.u.Start(); err != nil || pr.u.ln == nil {
		t.Fatalf("start: %v, socket %v", err, pr.u.ln)
	}
	synced := make(chan struct{})
	firstSync := sync.OnceFunc(func() { close(synced) })
	p := proxy.NewProxier(proxy.Config{Sync: changes.RunnerConfig{MinInterval: 10 * time.Millisecond},
		OnSync: func() { pr.syncs.Add(1); firstSync() }})
	p.Tracker().Replace([]*v1.Service{{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web"},
		Spec: v1.ServiceSpec{Type: v1.ServiceTypeClusterIP, ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10"},
			Ports: []v1.ServicePort{{Name: "http", Port: 80, Protocol: v1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)}}},
	}}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	syncLoop := NewSyncLoop(p)
	var wg sync.WaitGroup
	wg.Go(func() { syncLoop.Run(ctx) })
	wg.Go(func() { pr.u.Serve(ctx, synced, Hooks{Sync: syncLoop, Export: p.ExportListeners}) })
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		pr.u.Close()
		p.StopListening()
		p.Drain(context.Background())
	})
	testwait.Until(t, 10*time.Second, "the predecessor's first sync", func() bool {
		pr.u.mu.Lock()
		defer pr.u.mu.Unlock()
		return pr.u.ready
	})
	return pr
}

// dialPredecessor connects to the upgrade socket at path and sends a
// hello that claims netns.
func dialPredecessor(t *testing.T, path, netns string) *net.UnixConn {
	t.Helper()
	c, err := sayHello(t, path, netns)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// sayHello connects to the predecessor at path and sends a hello claiming
// netns; the error is the hello's. A predecessor that refuses the peer
// closes the connection when it accepts it, so the hello itself may find
// the connection closed.
func sayHello(t *testing.T, path, netns string) (*net.UnixConn, error) {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	return c, Send(c, Message{Type: "hello", PID: os.Getpid(), Netns: netns, Mode: "redirect"}, nil)
}

// TestUpgradeRefusesPeers checks that the old process hands nothing to a
// peer of another user or another network namespace, whatever its hello
// claims.
func TestUpgradeRefusesPeers(t *testing.T) {
	netns, err := netnsID()
	if err != nil {
		t.Skip(err)
	}
	for _, tc := range []struct {
		name      string
		configure func(c *Config)
		wantOffer bool // an offer (refusing) rather than no answer
	}{
		{"another uid, as the kernel tells", func(c *Config) { c.UID = ptr(uint32(os.Geteuid()) + 1) }, false},
		{"another uid, injected", func(c *Config) {
			c.PeerCred = func(*net.UnixConn) (*unix.Ucred, error) {
				return &unix.Ucred{Pid: int32(os.Getpid()), Uid: 1000, Gid: 1000}, nil
			}
		}, false},
		{"credentials unreadable", func(c *Config) {
			c.PeerCred = func(*net.UnixConn) (*unix.Ucred, error) { return nil, errors.New("injected") }
		}, false},
		{"another network namespace than claimed", func(c *Config) {
			c.PeerNetns = func(int32) (string, error) { return "1:2", nil }
		}, true},
		{"network namespace unknown", func(c *Config) {
			c.PeerNetns = func(int32) (string, error) { return "", errors.New("injected") }
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pr := startPredecessor(t, tc.configure)
			c, err := sayHello(t, pr.path, netns) // claims the right netns
			var m Message
			var files []*os.File
			if err == nil {
				m, files, err = Recv(c)
				closeFiles(files)
			}
			if len(files) > 0 {
				t.Errorf("got %d descriptors", len(files))
			}
			if !tc.wantOffer {
				if !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.EPIPE) {
					t.Errorf("got %+v, %v; want the connection closed unanswered", m, err)
				}
			} else if err != nil || m.Type != "offer" || m.Error != OfferForeign || m.Count != 0 {
				t.Errorf("got %+v, %v; want an offer refusing with %q", m, err, OfferForeign)
			}
			// No handover started: the sync loop was not paused.
			pr.u.mu.Lock()
			handing := pr.u.handing
			pr.u.mu.Unlock()
			if handing {
				t.Error("a handover is in progress")
			}
		})
	}
}

// idleSync is a sync loop with nothing to pause, and noListeners a
// proxier without listeners: an Upgrader over them hands over its
// servers' sockets and the upgrade socket only.
type idleSync struct{}

func (idleSync) Pause(context.Context) bool { return true }
func (idleSync) Resume(context.Context)     {}

func noListeners() ([]listeners.HandoverSocket, error) { return nil, nil }

// fakeEnding starts, at path, a predecessor that offers no socket and
// ends the handover when told: with an abort if sendAbort is set, else
// by closing the connection. aborts is what its offer says of its aborts
// (an older version's says nothing).
func fakeEnding(aborts, sendAbort bool) func(t *testing.T, path, netns string) func() {
	return func(t *testing.T, path, netns string) func() {
		end := make(chan struct{})
		fakePredecessor(t, path, func(c *net.UnixConn) []string {
			m, files, _ := Recv(c)
			closeFiles(files)
			Send(c, Message{Type: "offer", PID: os.Getpid(), Netns: netns, Mode: "redirect", Aborts: aborts}, nil)
			<-end
			if sendAbort {
				Send(c, Message{Type: "abort"}, nil)
			}
			return []string{m.Type} // closes the connection
		})
		endOnce := sync.OnceFunc(func() { close(end) })
		t.Cleanup(endOnce)
		return endOnce
	}
}

// killedPredecessor runs the test binary as a predecessor of this version
// (upgradePredecessorMain) at path, and returns what kills it: SIGKILL,
// to its pid.
func killedPredecessor(t *testing.T, path, _ string) func() {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), upgradePredecessorEnv+"="+path)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe() // it serves until this closes, or it is killed
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	kill := sync.OnceFunc(func() {
		cmd.Process.Signal(syscall.SIGKILL)
		cmd.Wait()
	})
	t.Cleanup(func() { stdin.Close(); kill() })
	line, err := bufio.NewReader(stdout).ReadString('\n') // it exits, closing stdout, if it fails
	if err != nil || line != "ready\n" {
		t.Fatalf("the predecessor process said %q, %v; want ready", line, err)
	}
	return kill
}

// TestUpgradeSuccessorWhenPredecessorEnds checks what a successor does
// when its predecessor's connection ends before the successor's first
// sync. A predecessor that takes the handover back (its ready timeout)
// says abort, and the successor stops, leaving the socket file to it. One
// that ends without an abort, killed or stopping, syncs no more: the
// successor serves on, becomes ready after its first sync, and hands its
// sockets to a successor of its own. A predecessor of an older version
// sends no abort, so its end is taken for a handover taken back.
func TestUpgradeSuccessorWhenPredecessorEnds(t *testing.T) {
	netns, err := netnsID()
	if err != nil {
		t.Skip(err)
	}
	type outcome struct {
		Aborted bool // the successor's run ended
		Ready   bool // it may hand over
		Serving bool // it offers the sockets to a successor of its own
	}
	for _, tc := range []struct {
		name string
		// start starts a predecessor at path that answers with netns, and
		// returns what ends its handover.
		start func(t *testing.T, path, netns string) func()
		want  outcome
	}{
		{"takes the handover back", fakeEnding(true, true), outcome{Aborted: true}},
		{"is killed", killedPredecessor, outcome{Ready: true, Serving: true}},
		{"closes without an abort, stopping", fakeEnding(true, false), outcome{Ready: true}},
		{"of an older version, closes", fakeEnding(false, false), outcome{Aborted: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "upgrade.sock")
			end := tc.start(t, path, netns)
			next := New(Config{Path: path, Mode: "redirect", Logger: zaptest.NewLogger(t).Named("new")})
			if err := next.Start(); err != nil {
				t.Fatal(err)
			}
			defer next.Close()
			if !next.TookOver() {
				t.Fatal("no handover in progress")
			}
			aborted := make(chan error, 1)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			synced := make(chan struct{})
			done := make(chan struct{})
			go func() { // ends with cancel
				next.Serve(ctx, synced, Hooks{Sync: idleSync{}, Export: noListeners, Abort: func(err error) { aborted <- err }})
				close(done)
			}()
			end()
			testwait.Until(t, 10*time.Second, "the successor to see its predecessor's end", func() bool {
				next.mu.Lock()
				defer next.mu.Unlock()
				return next.pred == nil
			})
			close(synced)
			var got outcome
			if !tc.want.Aborted {
				testwait.Until(t, 10*time.Second, "the successor to be ready", func() bool {
					next.mu.Lock()
					defer next.mu.Unlock()
					return next.ready
				})
				if next.ln != nil {
					// The upgrade socket came along (from a real
					// predecessor): the successor serves it.
					c := dialPredecessor(t, path, netns)
					offer, files, err := Recv(c)
					closeFiles(files)
					got.Serving = err == nil && offer.Type == "offer" && offer.Error == "" && offer.Count > 0 && offer.Aborts
					t.Logf("a successor of the successor got %+v, %v", offer, err)
				}
			}
			cancel()
			<-done // Serve has waited for watchPredecessor, which calls Abort
			select {
			case err := <-aborted:
				got.Aborted = true
				t.Logf("aborted: %v", err)
			default:
			}
			next.mu.Lock()
			got.Ready = next.ready
			next.mu.Unlock()
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
			if tc.want.Aborted {
				next.Close()
				if _, err := os.Stat(path); err != nil {
					t.Errorf("the predecessor's upgrade socket file was removed: %v", err)
				}
			}
		})
	}
}

// TestUpgradeReadyAfterPredecessorDied checks a successor whose first
// sync completes after its predecessor has died but before it has read
// the connection's end: its ready fails on the closed connection, and it
// waits for the connection's end to tell a death from a handover taken
// back, then is ready.
func TestUpgradeReadyAfterPredecessorDied(t *testing.T) {
	netns, err := netnsID()
	if err != nil {
		t.Skip(err)
	}
	path := filepath.Join(t.TempDir(), "upgrade.sock")
	end := make(chan struct{})
	received := fakePredecessor(t, path, func(c *net.UnixConn) []string {
		m, files, _ := Recv(c)
		closeFiles(files)
		Send(c, Message{Type: "offer", PID: os.Getpid(), Netns: netns, Mode: "redirect", Aborts: true}, nil)
		<-end
		return []string{m.Type}
	})
	next := New(Config{Path: path, Mode: "redirect", Logger: zaptest.NewLogger(t).Named("new")})
	if err := next.Start(); err != nil {
		t.Fatal(err)
	}
	defer next.Close()
	pred := next.pred
	if pred == nil {
		t.Fatal("no handover in progress")
	}
	close(end)
	for range received { // closed once the predecessor's end is
	}
	// The two halves of Serve, in this order.
	synced := make(chan struct{})
	close(synced)
	next.afterFirstSync(context.Background(), synced)
	if next.ready || next.pred == nil {
		t.Fatalf("ready %v, predecessor %v: want the verdict left to the connection's end", next.ready, next.pred)
	}
	var aborted error
	next.watchPredecessor(context.Background(), pred, func(err error) { aborted = err })
	if aborted != nil || !next.ready || next.pred != nil {
		t.Errorf("aborted %v, ready %v, predecessor %v: want the successor ready, serving on", aborted, next.ready, next.pred)
	}
}

func TestMain(m *testing.M) {
	if path := os.Getenv(upgradePeerEnv); path != "" {
		os.Exit(upgradePeerMain(path)) // the test binary as a peer
	}
	if path := os.Getenv(upgradePredecessorEnv); path != "" {
		os.Exit(upgradePredecessorMain(path)) // the test binary as a predecessor
	}
	os.Exit(m.Run())
}

func ptr[T any](v T) *T { return &v }

// upgradePeerEnv names, in the environment of the test binary run as a
// peer, the upgrade socket to connect to (see TestMain).
const upgradePeerEnv = "UPROXY_TEST_UPGRADE_PEER"

// upgradePeerMain is the test binary run as a peer in a network namespace
// of its own: it says hello claiming UPROXY_TEST_UPGRADE_NETNS, and
// prints the answer as JSON.
func upgradePeerMain(path string) int {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	// With UPROXY_TEST_UPGRADE_SENDNS set, the hello carries the
	// peer's network namespace, as Start's does.
	var ns []*os.File
	if os.Getenv("UPROXY_TEST_UPGRADE_SENDNS") != "" {
		f, err := os.Open("/proc/self/ns/net")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer f.Close()
		ns = append(ns, f)
	}
	if err := Send(c, Message{Type: "hello", PID: os.Getpid(), Netns: os.Getenv("UPROXY_TEST_UPGRADE_NETNS"), Mode: "redirect"}, ns); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	m, files, err := Recv(c)
	closeFiles(files)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	m.Sockets = make([]Socket, len(files)) // what it got
	json.NewEncoder(os.Stdout).Encode(m)
	return 0
}

// upgradePredecessorEnv names, in the environment of the test binary run
// as a predecessor, its upgrade socket (see TestMain).
const upgradePredecessorEnv = "UPROXY_TEST_UPGRADE_PREDECESSOR"

// upgradePredecessorMain is the test binary run as a running uproxy: an
// Upgrader that has synced, over no listeners, and serves the upgrade
// socket at path. It prints "ready" once it would hand over, and serves
// until its stdin closes, or it is killed.
func upgradePredecessorMain(path string) int {
	u := New(Config{Path: path, Mode: "redirect"})
	if err := u.Start(); err != nil || u.ln == nil {
		fmt.Fprintf(os.Stderr, "start: %v, socket %v\n", err, u.ln)
		return 1
	}
	synced := make(chan struct{})
	close(synced)
	go u.Serve(context.Background(), synced, Hooks{Sync: idleSync{}, Export: noListeners}) // ends with the process
	if !testwait.Poll(10*time.Second, func() bool {
		u.mu.Lock()
		defer u.mu.Unlock()
		return u.ready
	}) {
		fmt.Fprintln(os.Stderr, "not ready")
		return 1
	}
	fmt.Println("ready")
	io.Copy(io.Discard, os.Stdin)
	return 0
}

// runPeer runs the test binary as a peer (upgradePeerMain) of the upgrade
// socket path, in the namespaces that flags create, claiming netns, with
// its own namespace's descriptor in its hello when sendNetns is set, and
// returns the answer it got.
func runPeer(t *testing.T, path, netns string, flags uintptr, sendNetns bool) Message {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), upgradePeerEnv+"="+path, "UPROXY_TEST_UPGRADE_NETNS="+netns)
	if sendNetns {
		cmd.Env = append(cmd.Env, "UPROXY_TEST_UPGRADE_SENDNS=1")
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: flags}
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("the peer: %v", err)
	}
	var m Message
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatalf("the peer's answer %q: %v", out, err)
	}
	return m
}

// TestUpgradeRefusesPeerInAnotherNetns runs a real peer in a network
// namespace of its own that claims ours: the old process reads the
// peer's namespace from /proc and refuses it.
func TestUpgradeRefusesPeerInAnotherNetns(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for a network namespace")
	}
	netns, err := netnsID()
	if err != nil {
		t.Skip(err)
	}
	pr := startPredecessor(t, nil)
	m := runPeer(t, pr.path, netns, syscall.CLONE_NEWNET, false)
	if m.Type != "offer" || m.Error != OfferForeign || len(m.Sockets) != 0 {
		t.Errorf("the peer got %+v; want an offer refusing with %q and no descriptors", m, OfferForeign)
	}
}

// TestUpgradePeerInAnotherPIDNamespace runs a real peer as the new pod of
// a DaemonSet's rolling update is: in a PID namespace that is neither the
// old process's nor nested in it (each container has its own), so the
// kernel gives the old process its pid as 0 (SO_PEERCRED), as the
// PeerCred hook here does. The old process then knows the peer's network
// namespace only from the descriptor its hello carries: with ours the
// peer is offered the sockets; with another, or with none, it is refused.
func TestUpgradePeerInAnotherPIDNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for a network namespace")
	}
	netns, err := netnsID()
	if err != nil {
		t.Skip(err)
	}
	siblingPID := func(c *Config) {
		c.PeerCred = func(conn *net.UnixConn) (*unix.Ucred, error) {
			cred, err := peerCred(conn)
			if err == nil {
				cred.Pid = 0
			}
			return cred, err
		}
	}
	for _, tc := range []struct {
		name      string
		flags     uintptr
		sendNetns bool
		wantError string
	}{
		{"our network namespace, sent", 0, true, ""},
		{"our network namespace, not sent", 0, false, OfferForeign},
		{"another network namespace, sent", syscall.CLONE_NEWNET, true, OfferForeign},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pr := startPredecessor(t, siblingPID)
			m := runPeer(t, pr.path, netns, tc.flags, tc.sendNetns)
			if m.Type != "offer" || m.Error != tc.wantError {
				t.Errorf("the peer got %+v; want an offer with error %q", m, tc.wantError)
			}
			if tc.wantError == "" && m.Count == 0 {
				t.Errorf("the peer was offered no socket: %+v", m)
			}
		})
	}
}

// TestUpgraderRefusesPredecessorOfAnotherUser checks that a starting
// process sends no hello to, and takes no socket from, a process of
// another user behind the upgrade socket: it starts cold, leaving that
// socket alone.
func TestUpgraderRefusesPredecessorOfAnotherUser(t *testing.T) {
	path := filepath.Join(t.TempDir(), "upgrade.sock")
	received := fakePredecessor(t, path, func(c *net.UnixConn) []string {
		m, _, err := Recv(c)
		if err != nil {
			return nil
		}
		return []string{m.Type}
	})
	before := pathID(path)
	u := New(Config{Path: path, Mode: "redirect", Logger: zaptest.NewLogger(t), UID: ptr(uint32(os.Geteuid()) + 1)})
	if err := u.Start(); err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	if u.path != "" || u.pred != nil || u.ln != nil {
		t.Errorf("path %q, predecessor %v, socket %v: want a cold start without the upgrade socket", u.path, u.pred, u.ln)
	}
	if got := <-received; got != nil {
		t.Errorf("the process of another user received %v", got)
	}
	if pathID(path) != before {
		t.Error("its socket file was touched")
	}
}
