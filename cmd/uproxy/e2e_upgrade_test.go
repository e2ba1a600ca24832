package main

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/testwait"
	"github.com/uproxy/uproxy/internal/upgrade"
)

// TestE2EUpgrade replaces a running uproxy by a second one started with
// the same flags, under load: new connections from a pod and from the
// node all along, and one long-lived connection that streams data across
// the upgrade. No connection attempt may fail, the long-lived connection
// must deliver every byte, the old process must drain and exit by itself,
// the new one must serve the same listener ports (the kernel's rules,
// sets and routes stay exactly as they were) and the servers' ports, and
// `uproxy cleanup` must find the usual state afterwards.
func TestE2EUpgrade(t *testing.T) {
	for _, mode := range []string{"redirect", "tproxy"} {
		t.Run(mode, func(t *testing.T) { testUpgrade(t, mode) })
	}
}

func testUpgrade(t *testing.T, mode string) {
	c := newCluster(t, 2)
	c.serveUDP(c.pods...)
	echoInNetns(t, c.pods[0].NS, ":9000")
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
	c.write("stream.yaml", fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: stream}
spec:
  clusterIP: 10.96.0.20
  ports: [{name: echo, port: 9000, targetPort: 9000}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: stream-1, labels: {kubernetes.io/service-name: stream}}
addressType: IPv4
ports: [{name: echo, port: 9000}]
endpoints: [{addresses: [%q]}]
`, c.pods[0].IP))
	c.write("dns.yaml", dnsService(0, c.pods[0], c.pods[1]))
	rules := 3 // REDIRECT rules: web, stream, dns
	if mode == "tproxy" {
		rules = 0
		// See TestE2EModes: the lab stands for a routed CNI.
		if _, err := c.lab.Exec(t.Context(), c.lab.Node, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0", "net.bridge.bridge-nf-call-ip6tables=0"); err != nil {
			t.Logf("cannot turn bridge-nf-call-iptables off (br_netfilter not loaded?): %v", err)
		}
	}
	sock := filepath.Join(t.TempDir(), "upgrade.sock")
	args := []string{"--mode", mode, "--upgrade-socket", sock, "--drain-timeout", "20s", "--iptables-sync-period", "1s"}
	c.start(rules, args...)
	c.waitSynced()
	old := c.up
	var next *testlab.Proc
	t.Cleanup(func() {
		if next != nil {
			t.Logf("new uproxy output:\n%s", next.Output())
		}
	})
	if r := c.get(c.client.NS, "http://10.96.0.10/", 4); r.Errors > 0 {
		t.Fatalf("before the upgrade: %+v", r)
	}
	if r := c.query(c.client.NS, "10.96.0.53:53", 4); r.Errors > 0 {
		t.Fatalf("UDP before the upgrade: %+v", r)
	}
	before := c.kernelState()

	stream := startStream(t, c.client.NS, "10.96.0.20:9000")
	loops := []*getLoop{c.startGetLoop(c.client.NS, "http://10.96.0.10/"), c.startGetLoop(c.lab.Node, "http://10.96.0.10/")}
	time.Sleep(time.Second) // load on the old process alone

	argv := append([]string{"--manifests", c.dir, "--iptables-min-sync-period", "50ms"}, args...)
	var err error
	if next, err = c.run("uproxy-new", argv...); err != nil {
		t.Fatal(err)
	}
	upgradeStart := time.Now()
	waitOutput(t, old, "the new process is ready: handing over", old, next)
	time.Sleep(time.Second) // load on the new process; the stream still through the old one
	sent, received := stream.finish(t)
	if sent.n < 1<<20 || sent != received {
		t.Errorf("long-lived connection: sent %d bytes (sha256 %x), received %d bytes (sha256 %x)", sent.n, sent.sum, received.n, received.sum)
	}
	if err := old.Wait(25 * time.Second); err != nil {
		t.Fatalf("the old uproxy did not exit by itself after draining: %v\n%s", err, old.Output())
	}
	upgradeEnd := time.Now()
	time.Sleep(500 * time.Millisecond) // load on the new process alone
	for _, l := range loops {
		r := l.stop()
		during := r.during(upgradeStart, upgradeEnd)
		t.Logf("from %s: %d requests, %d during the upgrade (%v), %d failed", l.ns, r.ok+r.failed, during, upgradeEnd.Sub(upgradeStart).Round(time.Millisecond), r.failed)
		if r.failed > 0 {
			t.Errorf("from %s: %d of %d requests failed across the upgrade; first: %s", l.ns, r.failed, r.ok+r.failed, r.firstError)
		}
		if during == 0 {
			t.Errorf("from %s: no request ran during the upgrade: the test proves nothing", l.ns)
		}
	}
	for _, want := range []string{"handed over: draining connections", "stopped; the new process serves"} {
		if !strings.Contains(old.Output(), want) {
			t.Errorf("the old uproxy did not log %q", want)
		}
	}

	// The new process serves the same ports: nothing in the kernel moved.
	if diff := cmp.Diff(before, c.kernelState()); diff != "" {
		t.Errorf("the kernel's rules changed across the upgrade (-before +after):\n%s", diff)
	}
	if n := strings.Count(next.Output(), "adopted an inherited socket"); n != 3 {
		t.Errorf("the new uproxy adopted %d listeners, want 3 (web, stream, dns)", n)
	}
	c.up = next
	if r := c.get(c.client.NS, "http://10.96.0.10/", 10); r.Errors > 0 || len(r.Counts) != 2 {
		t.Errorf("after the upgrade: %+v", r)
	}
	if r := c.query(c.client.NS, "10.96.0.53:53", 4); r.Errors > 0 || len(r.Counts) != 2 {
		t.Errorf("UDP after the upgrade: %+v", r)
	}
	for _, url := range []string{"http://127.0.0.1:10256/healthz", "http://127.0.0.1:10249/metrics"} {
		if out, err := c.lab.Exec(t.Context(), c.lab.Node, "curl", "-sSf", "-o", "/dev/null", "--max-time", "5", url); err != nil {
			t.Errorf("after the upgrade, %s: %v %s", url, err, out)
		}
	}
	if fi, err := os.Stat(sock); err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Errorf("the upgrade socket is gone after the upgrade: %v", err)
	}

	// The next upgrade would find the socket served by the new process;
	// stopping it removes it, and cleanup removes the rules as usual.
	if err := next.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := next.Wait(25 * time.Second); err != nil {
		t.Fatalf("the new uproxy did not stop cleanly: %v", err)
	}
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the upgrade socket outlives its process: %v", err)
	}
	if diff := cmp.Diff(before, c.kernelState()); diff != "" {
		t.Errorf("the rules changed on SIGTERM (-before +after):\n%s", diff)
	}
	if out, err := c.lab.Exec(t.Context(), c.lab.Node, c.uproxy, "cleanup"); err != nil {
		t.Fatalf("cleanup: %v\n%s", err, out)
	}
	if s := c.kernelState(); strings.Contains(strings.ToLower(s), "uproxy") || strings.Contains(s, "lookup 117") {
		t.Errorf("cleanup left uproxy's state behind:\n%s", s)
	}
}

// TestE2EUpgradeStaleSocket starts uproxy over a socket file that no
// process serves (its owner was killed): the file is replaced, and the
// start goes on.
func TestE2EUpgradeStaleSocket(t *testing.T) {
	c := newCluster(t, 1)
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
	sock := filepath.Join(t.TempDir(), "upgrade.sock")
	c.start(1, "--upgrade-socket", sock)
	c.waitSynced()
	if err := c.up.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	c.up.Wait(5 * time.Second)
	if _, err := os.Stat(sock); err != nil {
		t.Fatalf("want the killed process's socket file left behind: %v", err)
	}
	c.start(1, "--upgrade-socket", sock)
	c.waitSynced()
	if !strings.Contains(c.up.Output(), "removing a stale upgrade socket") {
		t.Errorf("the stale socket was not noticed:\n%s", c.up.Output())
	}
	if r := c.get(c.client.NS, "http://10.96.0.10/", 4); r.Errors > 0 {
		t.Errorf("after a start over a stale socket: %+v", r)
	}
	// The new socket is live: a process asking for the sockets would be
	// answered (here: refused, as it comes from another namespace).
	conn, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		t.Fatalf("the upgrade socket does not answer: %v", err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	if err := upgrade.Send(conn, upgrade.Message{Type: "hello", PID: os.Getpid(), Netns: "0:0", Mode: "redirect"}, nil); err != nil {
		t.Fatal(err)
	}
	offer, files, err := upgrade.Recv(conn)
	for _, f := range files {
		f.Close()
	}
	if err != nil || offer.Type != "offer" || offer.Error != upgrade.OfferForeign || len(files) != 0 {
		t.Errorf("hello from another namespace: %+v, %d descriptors, %v; want a refusal", offer, len(files), err)
	}
	if r := c.get(c.client.NS, "http://10.96.0.10/", 4); r.Errors > 0 {
		t.Errorf("after a refused handover: %+v", r)
	}
}

// kernelState returns what uproxy programs in the node's namespace, with
// packet counters and timestamps removed: iptables and ip6tables rules,
// ipsets, and policy routing.
func (c *cluster) kernelState() string {
	c.t.Helper()
	counters := regexp.MustCompile(`\[\d+:\d+\]`)
	var b strings.Builder
	for _, cmd := range [][]string{{"iptables-save"}, {"ip6tables-save"}, {"ipset", "save"}, {"ip", "rule"}, {"ip", "-6", "rule"}, {"ip", "route", "show", "table", "117"}} {
		if _, err := exec.LookPath(cmd[0]); err != nil {
			continue
		}
		// A missing table (tproxy's routes in redirect mode) is a state
		// too: its error message is recorded like any output.
		out, err := c.lab.Exec(context.Background(), c.lab.Node, cmd...)
		fmt.Fprintf(&b, "$ %s (failed: %t)\n", strings.Join(cmd, " "), err != nil)
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, "#") {
				continue
			}
			b.WriteString(counters.ReplaceAllString(line, "") + "\n")
		}
	}
	return b.String()
}

// waitOutput waits until p has written want, failing if any of procs
// exits meanwhile.
func waitOutput(t *testing.T, p *testlab.Proc, want string, procs ...*testlab.Proc) {
	t.Helper()
	testwait.UntilOK(t, 30*time.Second, fmt.Sprintf("%s to log %q", p.Name, want), func() (bool, string) {
		for _, q := range procs {
			if q.Exited() {
				t.Fatalf("%s exited while waiting for %q:\n%s", q.Name, want, q.Output())
			}
		}
		return strings.Contains(p.Output(), want), p.Output()
	})
}

// getLoop runs `bench get` batches (each request on a new connection)
// from a namespace until stopped.
type getLoop struct {
	ns      string
	done    chan struct{}
	stopped chan struct{}
	res     loopResult
}

type loopResult struct {
	ok, failed int
	firstError string
	batches    []batch
}

type batch struct {
	start, end time.Time
	n          int
}

// during counts the requests of the batches that ran entirely between
// from and to.
func (r loopResult) during(from, to time.Time) int {
	n := 0
	for _, b := range r.batches {
		if !b.start.Before(from) && !b.end.After(to) {
			n += b.n
		}
	}
	return n
}

func (c *cluster) startGetLoop(ns, url string) *getLoop {
	l := &getLoop{ns: ns, done: make(chan struct{}), stopped: make(chan struct{})}
	go func() { // ends when stop is called
		defer close(l.stopped)
		for {
			select {
			case <-l.done:
				return
			default:
			}
			start := time.Now()
			out, err := c.lab.Exec(context.Background(), ns, c.bench, "get", "-n", "40", "-c", "2", "--timeout", "5s", url)
			var r getResult
			if err == nil {
				err = json.Unmarshal([]byte(out), &r)
			}
			if err != nil {
				r = getResult{Errors: 1, FirstError: err.Error()}
			}
			ok := 0
			for _, n := range r.Counts {
				ok += n
			}
			l.res.ok += ok
			l.res.failed += r.Errors
			if l.res.firstError == "" && r.FirstError != "" {
				l.res.firstError = r.FirstError
			}
			l.res.batches = append(l.res.batches, batch{start: start, end: time.Now(), n: ok + r.Errors})
		}
	}()
	return l
}

func (l *getLoop) stop() loopResult {
	close(l.done)
	<-l.stopped
	return l.res
}

// digest is a byte count and a SHA-256 of a stream.
type digest struct {
	n   int64
	sum [sha256.Size]byte
}

// stream is a long-lived connection that sends pseudo-random data at a
// steady pace and reads the echo back.
type stream struct {
	conn     *net.TCPConn
	stopSend chan struct{}
	sent     chan digest
	received chan digest
}

// startStream connects from namespace ns to addr, an echo service.
func startStream(t *testing.T, ns, addr string) *stream {
	t.Helper()
	var c net.Conn
	if err := testlab.DoInNetns(ns, func() (err error) {
		c, err = net.DialTimeout("tcp4", addr, 5*time.Second)
		return err
	}); err != nil {
		t.Fatalf("connecting to %s from %s: %v", addr, ns, err)
	}
	s := &stream{conn: c.(*net.TCPConn), stopSend: make(chan struct{}), sent: make(chan digest, 1), received: make(chan digest, 1)}
	t.Cleanup(func() { s.conn.Close() })
	go func() { // ends when stopSend is closed, or on a write error
		h := sha256.New()
		rng := rand.NewChaCha8([32]byte{1})
		buf := make([]byte, 32<<10)
		var n int64
		defer func() {
			s.conn.CloseWrite()
			d := digest{n: n}
			copy(d.sum[:], h.Sum(nil))
			s.sent <- d
		}()
		for {
			select {
			case <-s.stopSend:
				return
			case <-time.After(5 * time.Millisecond):
			}
			rng.Read(buf)
			w, err := s.conn.Write(buf)
			h.Write(buf[:w])
			n += int64(w)
			if err != nil {
				return
			}
		}
	}()
	go func() { // ends at EOF or on an error (the connection is closed at the latest by Cleanup)
		h := sha256.New()
		n, _ := io.Copy(h, s.conn)
		d := digest{n: n}
		copy(d.sum[:], h.Sum(nil))
		s.received <- d
	}()
	return s
}

// finish ends the sending and waits for the echo to end.
func (s *stream) finish(t *testing.T) (sent, received digest) {
	t.Helper()
	close(s.stopSend)
	sent = <-s.sent
	select {
	case received = <-s.received:
	case <-time.After(15 * time.Second):
		t.Fatalf("the long-lived connection did not end after %d bytes were sent", sent.n)
	}
	return sent, received
}

// echoInNetns serves TCP echo on addr in namespace ns from this process
// until the test ends: each connection gets back what it sends, and EOF
// after it.
func echoInNetns(t *testing.T, ns, addr string) {
	t.Helper()
	var ln net.Listener
	if err := testlab.DoInNetns(ns, func() (err error) {
		ln, err = net.Listen("tcp4", addr)
		return err
	}); err != nil {
		t.Fatalf("echo server in %s: %v", ns, err)
	}
	var wg sync.WaitGroup
	wg.Go(func() { // ends when ln is closed
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { // ends when the client or the test ends
				defer c.Close()
				io.Copy(c, c)
				c.(*net.TCPConn).CloseWrite()
				io.Copy(io.Discard, c)
			})
		}
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
}
