package upgrade

import (
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

// TestUpgradeSuccessorStopsWhenAborted checks that a successor whose
// predecessor ends the handover before ready (its ready timeout) stops,
// and leaves the predecessor's upgrade socket file alone.
func TestUpgradeSuccessorStopsWhenAborted(t *testing.T) {
	netns, err := netnsID()
	if err != nil {
		t.Skip(err)
	}
	path := filepath.Join(t.TempDir(), "upgrade.sock")
	abortNow := make(chan struct{})
	received := fakePredecessor(t, path, func(c *net.UnixConn) []string {
		m, _, _ := Recv(c)
		Send(c, Message{Type: "offer", PID: 1, Netns: netns, Mode: "redirect"}, nil)
		<-abortNow
		return []string{m.Type} // closes the connection: the ready timeout
	})
	next := New(Config{Path: path, Mode: "redirect", Logger: zaptest.NewLogger(t).Named("new")})
	if err := next.Start(); err != nil {
		t.Fatal(err)
	}
	defer next.Close()
	if next.pred == nil {
		t.Fatal("no handover in progress")
	}
	aborted := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	never := make(chan struct{}) // the first sync never completes
	done := make(chan struct{})
	go func() { // ends with cancel
		next.Serve(ctx, never, Hooks{Abort: func(err error) { aborted <- err }})
		close(done)
	}()
	select {
	case err := <-aborted:
		t.Fatalf("aborted before the predecessor ended the handover: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(abortNow)
	<-received
	select {
	case err := <-aborted:
		t.Logf("aborted: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("the successor carries on after its predecessor ended the handover")
	}
	cancel()
	<-done
	next.Close()
	if _, err := os.Stat(path); err != nil {
		t.Errorf("the predecessor's upgrade socket file was removed: %v", err)
	}
}

func TestMain(m *testing.M) {
	if path := os.Getenv(upgradePeerEnv); path != "" {
		os.Exit(upgradePeerMain(path)) // the test binary as a peer
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
