package main

// Reliability end-to-end tests: a SIGKILLed uproxy restarts and serves
// within a second, adopting its rules; ten thousand concurrent and sixty
// thousand (on demand a million) sequential connections through
// one VIP, every byte checked, leave no descriptor or goroutine behind;
// a backend killed mid-transfer or blackholed costs no new connection
// while a healthy endpoint exists, one that accepts and never answers
// costs only the connections it holds, which uproxy closes at its idle
// timeout; each is used again once it heals.
//
// Clients and backends are Go code of this test, running in the lab's pod
// namespaces (inNetnsThread), so they can check every byte and be counted
// exactly.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/testwait"
)

// The reliability tests' backends speak a request/response protocol: the
// client sends a 4-byte big-endian length and that many bytes, at most
// echoMaxPayload; the server sends the bytes back and closes first.
// Closing first keeps TIME_WAIT on the servers' side: a client making a
// million connections to one address would otherwise run out of ports.
const echoMaxPayload = 1 << 20

// echoServer is a backend in a pod namespace, speaking that protocol, until
// the test ends. It can be killed (its listener closed and every
// connection reset, as the kernel does for a SIGKILLed process), healed
// (listening again on the same port), and made to stop reading.
type echoServer struct {
	t        *testing.T
	name     string
	ns       string
	addr     string
	open     atomic.Int64 // connections accepted and not yet ended
	accepted atomic.Int64 // connections accepted
	served   atomic.Int64 // exchanges completed

	mu      sync.Mutex
	ln      net.Listener
	conns   map[net.Conn]struct{}
	stalled chan struct{}  // while not nil: accept, but never read nor answer, until it is closed
	wg      sync.WaitGroup // accept loops and connections
}

// stall makes the server accept connections but never read from them nor
// answer, like a process stuck after accept(2), until unstall.
func (s *echoServer) stall() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stalled == nil {
		s.stalled = make(chan struct{})
	}
}

// unstall makes the server answer again; the connections it stalled are
// closed.
func (s *echoServer) unstall() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stalled != nil {
		close(s.stalled)
		s.stalled = nil
	}
}

// startEcho starts an echoServer on port in namespace ns; it is killed
// when the test ends.
func startEcho(t *testing.T, name, ns string, port int) *echoServer {
	t.Helper()
	s := &echoServer{t: t, name: name, ns: ns, addr: fmt.Sprintf(":%d", port), conns: map[net.Conn]struct{}{}}
	if err := s.listen(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.kill(); s.wg.Wait() })
	return s
}

// listen opens the listener in the pod's namespace and starts its accept
// loop, which ends when the listener is closed (kill).
func (s *echoServer) listen() error {
	var ln net.Listener
	err := testlab.DoInNetns(s.ns, func() error {
		var err error
		ln, err = net.Listen("tcp4", s.addr)
		return err
	})
	if err != nil {
		return fmt.Errorf("%s: listening: %w", s.name, err)
	}
	s.mu.Lock()
	s.ln = ln
	s.mu.Unlock()
	s.wg.Go(func() { // ends when kill closes ln
		for {
			c, err := ln.Accept()
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				time.Sleep(5 * time.Millisecond) // EMFILE: the client sees the failure
				continue
			}
			s.mu.Lock()
			s.conns[c] = struct{}{}
			stalled := s.stalled
			s.mu.Unlock()
			s.open.Add(1)
			s.accepted.Add(1)
			s.wg.Go(func() { // ends when the connection does (or kill resets it)
				defer func() {
					s.mu.Lock()
					delete(s.conns, c)
					s.mu.Unlock()
					c.Close()
					s.open.Add(-1)
				}()
				if stalled != nil {
					<-stalled // unstall or kill
					return
				}
				s.handle(c)
			})
		}
	})
	return nil
}

// handle answers one request, then returns (the caller closes c).
func (s *echoServer) handle(c net.Conn) {
	var hdr [4]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > echoMaxPayload {
		return
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(c, buf); err != nil {
		return
	}
	if _, err := c.Write(buf); err != nil {
		return
	}
	s.served.Add(1)
}

// kill closes the listener (new connections are refused) and resets every
// connection, as the kernel does when the server process is killed.
func (s *echoServer) kill() {
	s.mu.Lock()
	ln, conns := s.ln, s.conns
	s.ln, s.conns = nil, map[net.Conn]struct{}{}
	if s.stalled != nil {
		close(s.stalled)
		s.stalled = nil
	}
	s.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
	for c := range conns {
		_ = c.(*net.TCPConn).SetLinger(0)
		c.Close()
	}
}

// exchange sends payload on c to an echoServer, reads the answer to its end
// and checks that its SHA-256 is the payload's.
func exchange(c net.Conn, payload []byte, timeout time.Duration) error {
	if timeout > 0 {
		_ = c.SetDeadline(time.Now().Add(timeout))
	}
	msg := make([]byte, 4+len(payload))
	binary.BigEndian.PutUint32(msg, uint32(len(payload)))
	copy(msg[4:], payload)
	if _, err := c.Write(msg); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	h := sha256.New()
	n, err := io.Copy(h, io.LimitReader(c, echoMaxPayload+1))
	if err != nil {
		return fmt.Errorf("read after %d bytes: %w", n, err)
	}
	want := sha256.Sum256(payload)
	if !bytes.Equal(h.Sum(nil), want[:]) {
		return fmt.Errorf("checksum mismatch: sent %d bytes, got %d back", len(payload), n)
	}
	return nil
}

// dialVIP connects to addr; it must run inside a pod's namespace.
func dialVIP(addr string, timeout time.Duration) (*net.TCPConn, error) {
	c, err := net.DialTimeout("tcp4", addr, timeout)
	if err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

// payloadFor returns a random payload of 1 to max bytes, reproducible from
// seed.
func payloadFor(seed uint64, max int) []byte {
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	return randomBytes(rng, 1+rng.IntN(max))
}

// randomBytes returns n bytes from rng.
func randomBytes(rng *rand.Rand, n int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(rng.Uint32())
	}
	return p
}

// echoServiceYAML is a Service with one port, 80, whose endpoints are the
// pods' echo servers on port 9000.
func echoServiceYAML(name, vip string, annotations map[string]string, c *cluster) string {
	return strings.Replace(serviceYAML(name, vip, 80, annotations, false, c.pods...), "  port: 8080\n", "  port: 9000\n", 1)
}

// ---------- uproxy process introspection ----------

// upPID returns the running uproxy's pid (ip netns exec executes it in
// place, so the lab's process is uproxy itself).
func (c *cluster) upPID() int {
	c.t.Helper()
	pid := c.up.Cmd.Process.Pid
	comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil || strings.TrimSpace(string(comm)) != "uproxy" {
		c.t.Fatalf("process %d is %q, not uproxy (%v)", pid, comm, err)
	}
	return pid
}

// countFDs returns the number of open file descriptors of process pid.
func countFDs(t *testing.T, pid int) int {
	t.Helper()
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(entries)
}

// fdLimit returns the soft and hard RLIMIT_NOFILE of process pid (the Go
// runtime raises its soft limit to the hard one at start).
func fdLimit(t *testing.T, pid int) (soft, hard int) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
	if err != nil {
		t.Fatal(err)
	}
	num := func(s string) int {
		n, err := strconv.Atoi(s)
		if err != nil {
			return 1 << 30 // unlimited
		}
		return n
	}
	for line := range strings.Lines(string(b)) {
		if f := strings.Fields(strings.TrimPrefix(line, "Max open files")); strings.HasPrefix(line, "Max open files") && len(f) >= 2 {
			return num(f[0]), num(f[1])
		}
	}
	t.Fatalf("no open files limit in /proc/%d/limits", pid)
	return 0, 0
}

// pprof fetches a pprof path from uproxy's debug address inside the node
// namespace (uproxy runs with --profiling).
func (c *cluster) pprof(path string) string {
	c.t.Helper()
	out, err := c.lab.Exec(context.Background(), c.lab.Node, "curl", "-sS", "--max-time", "10", "http://"+debugAddr+"/debug/pprof/"+path)
	if err != nil {
		c.t.Fatal(err)
	}
	return out
}

var goroutineTotal = regexp.MustCompile(`^goroutine profile: total (\d+)`)

// goroutines returns uproxy's goroutine count, from its pprof endpoint.
func (c *cluster) goroutines() int {
	c.t.Helper()
	out := c.pprof("goroutine?debug=1")
	m := goroutineTotal.FindStringSubmatch(out)
	if m == nil {
		c.t.Fatalf("unexpected goroutine profile: %.200s", out)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// collectGarbage runs a garbage collection in uproxy (the heap profile's
// gc=1), which lets the runtime close the kernel pipes its splice pool
// keeps: pooled objects are dropped after two collections, and the
// pipes' finalizers close them.
func (c *cluster) collectGarbage() {
	c.t.Helper()
	c.pprof("heap?gc=1&debug=0")
}

// status fetches uproxy's /status.
func (c *cluster) status() statusJSON {
	c.t.Helper()
	out, err := c.lab.Exec(context.Background(), c.lab.Node, "curl", "-sS", "--max-time", "5", "http://"+debugAddr+"/status")
	if err != nil {
		c.t.Fatal(err)
	}
	var st statusJSON
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		c.t.Fatalf("decoding /status: %v\n%s", err, out)
	}
	return st
}

type statusJSON struct {
	ActiveConnections int `json:"activeConnections"`
	Ports             []struct {
		Service    string `json:"service"`
		ListenPort uint16 `json:"listenPort"`
		Endpoints  []struct {
			Address string `json:"address"`
			Active  int64  `json:"activeConnections"`
			Ejected bool   `json:"ejected"`
		} `json:"endpoints"`
	} `json:"ports"`
}

// ---------- SIGKILL and restart ----------

var (
	saveCounters = regexp.MustCompile(`\[\d+:\d+\]`)
	toPorts      = regexp.MustCompile(`--to-ports \d+`)
	setMember    = regexp.MustCompile(`^(add uproxy-\S+) \d+$`)
)

// ourRules returns uproxy's rules, chains and set members in the node
// namespace, both families, one per line, with the chain counters zeroed.
func (c *cluster) ourRules() []string {
	c.t.Helper()
	var out []string
	for _, cmd := range []string{"iptables-save", "ip6tables-save"} {
		save, err := c.lab.Exec(context.Background(), c.lab.Node, cmd)
		if err != nil {
			c.t.Fatal(err)
		}
		table := ""
		for line := range strings.Lines(save) {
			line = strings.TrimSpace(line)
			if strings.HasPrefix(line, "*") {
				table = line
			}
			if strings.Contains(line, "UPROXY") || strings.Contains(line, "uproxy") {
				out = append(out, cmd+" "+table+" "+saveCounters.ReplaceAllString(line, "[0:0]"))
			}
		}
	}
	sets, err := c.lab.Exec(context.Background(), c.lab.Node, "ipset", "save")
	if err != nil {
		c.t.Fatal(err)
	}
	for line := range strings.Lines(sets) {
		if line = strings.TrimSpace(line); strings.Contains(line, "uproxy-") {
			out = append(out, "ipset "+line)
		}
	}
	return out
}

// withoutPorts replaces the listener ports in rules with N.
func withoutPorts(rules []string) []string {
	out := make([]string, len(rules))
	for i, r := range rules {
		r = toPorts.ReplaceAllString(r, "--to-ports N")
		if m := setMember.FindStringSubmatch(strings.TrimPrefix(r, "ipset ")); m != nil {
			r = "ipset " + m[1] + " N"
		}
		out[i] = r
	}
	slices.Sort(out)
	return out
}

// firstSuccess requests http://addr/ from namespace ns every 10ms until a
// request succeeds or the deadline passes, and returns when it succeeded.
func firstSuccess(ns, addr string, deadline time.Time) (time.Time, error) {
	var ok time.Time
	err := testlab.DoInNetns(ns, func() error {
		var last error
		for time.Now().Before(deadline) {
			if last = getOnce(addr); last == nil {
				ok = time.Now()
				return nil
			}
			time.Sleep(10 * time.Millisecond) // the measurement's resolution
		}
		return fmt.Errorf("no request to %s succeeded by the deadline; last error: %w", addr, last)
	})
	return ok, err
}

// getOnce sends one HTTP request to the lab's web backends through addr.
func getOnce(addr string) error {
	c, err := net.DialTimeout("tcp4", addr, 200*time.Millisecond)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\nHost: web\r\n\r\n"); err != nil {
		return err
	}
	resp, err := io.ReadAll(c)
	if err != nil {
		return err
	}
	if !bytes.HasPrefix(resp, []byte("HTTP/1.0 200")) || !bytes.Contains(resp, []byte("\r\n\r\nweb-")) {
		return fmt.Errorf("unexpected answer %.100q", resp)
	}
	return nil
}

// TestE2ERelSIGKILLRestart kills uproxy with SIGKILL (nothing is cleaned
// up), starts it again, and checks that a request through the VIP
// succeeds within a second of the start, and that the new process adopted
// the rules: the same rules and set members as before, each once, only
// the listener port changed.
//
// With --listener=shared the one rule names the shared listener's port,
// which the restarted process rebinds the same way.
func TestE2ERelSIGKILLRestart(t *testing.T) {
	for _, layout := range []string{"per-service", "shared"} {
		t.Run(layout, func(t *testing.T) { testSIGKILLRestart(t, layout) })
	}
}

func testSIGKILLRestart(t *testing.T, layout string) {
	c := newCluster(t, 2)
	c.write("web.yaml", serviceYAML("web", "10.96.0.10", 80, nil, false, c.pods...))
	argv := []string{"--manifests", c.dir, "--iptables-min-sync-period", "50ms", "--metrics-bind-address", metricsAddr, "--listener", layout}
	c.start(1, argv[6:]...)
	c.waitSynced()
	if r := c.get(c.client.NS, "http://10.96.0.10/", 10); r.Errors > 0 || len(r.Counts) != 2 {
		t.Fatalf("before the kill: %+v", r)
	}
	installed := c.ourRules()
	for round := 1; round <= 2; round++ {
		oldPort := c.status().Ports[0].ListenPort
		if err := c.up.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		c.up.Wait(5 * time.Second)
		if got := c.ourRules(); !slices.Equal(got, installed) {
			t.Fatalf("round %d: the rules changed when uproxy was killed:\nbefore:\n%s\nafter:\n%s", round, strings.Join(installed, "\n"), strings.Join(got, "\n"))
		}

		start := time.Now()
		var err error
		if c.up, err = c.run("uproxy", argv...); err != nil {
			t.Fatal(err)
		}
		ok, err := firstSuccess(c.client.NS, "10.96.0.10:80", start.Add(10*time.Second))
		if err != nil {
			t.Fatalf("round %d: %v\nuproxy output:\n%s", round, err, c.up.Output())
		}
		took := ok.Sub(start)
		t.Logf("round %d: the first request through the VIP succeeded %v after uproxy was started", round, took.Round(time.Millisecond))
		if took > time.Second {
			t.Errorf("round %d: the first request succeeded %v after the start, want at most 1s; uproxy output:\n%s", round, took, c.up.Output())
		}

		c.waitSynced()
		got := c.ourRules()
		if diff := cmpLines(withoutPorts(installed), withoutPorts(got)); diff != "" {
			t.Errorf("round %d: the rules after the restart differ from the ones installed first (listener ports aside):\n%s", round, diff)
		}
		seen := map[string]int{}
		for _, r := range got {
			seen[r]++
		}
		for r, n := range seen {
			if n > 1 {
				t.Errorf("round %d: %d copies of %q", round, n, r)
			}
		}
		newPort := c.status().Ports[0].ListenPort
		if newPort != oldPort {
			// Nothing else in the lab's namespace takes ports: the
			// restarted process must have rebound the one the rules name.
			t.Errorf("round %d: the listener moved from port %d to %d; the rules left behind named %d", round, oldPort, newPort, oldPort)
		}
		joined := strings.Join(got, "\n")
		if !strings.Contains(joined, fmt.Sprintf("--to-ports %d", newPort)) || !strings.Contains(joined, fmt.Sprintf("add uproxy-listeners-tcp4 %d", newPort)) {
			t.Errorf("round %d: the rules do not send the VIP to the new listener port %d:\n%s", round, newPort, joined)
		}
		if newPort != oldPort && (strings.Contains(joined, fmt.Sprintf("--to-ports %d", oldPort)) || strings.Contains(joined, fmt.Sprintf("add uproxy-listeners-tcp4 %d", oldPort))) {
			t.Errorf("round %d: a stale rule or set member for the old listener port %d is left:\n%s", round, oldPort, joined)
		}
		if r := c.get(c.client.NS, "http://10.96.0.10/", 10); r.Errors > 0 || len(r.Counts) != 2 {
			t.Errorf("round %d: after the restart: %+v", round, r)
		}
		installed = got
	}
}

// cmpLines returns the lines only in want ("-") or only in got ("+"), or
// "" when both hold the same lines.
func cmpLines(want, got []string) string {
	count := map[string]int{}
	for _, l := range want {
		count[l]++
	}
	for _, l := range got {
		count[l]--
	}
	var b strings.Builder
	for _, l := range slices.Sorted(func(yield func(string) bool) {
		for l := range count {
			if !yield(l) {
				return
			}
		}
	}) {
		for n := count[l]; n > 0; n-- {
			fmt.Fprintf(&b, "- %s\n", l)
		}
		for n := count[l]; n < 0; n++ {
			fmt.Fprintf(&b, "+ %s\n", l)
		}
	}
	return b.String()
}

// ---------- load ----------

const (
	// loadConcurrent is the number of connections held open at once
	// through one VIP, unless the descriptor limits cannot hold them (the
	// test then says so and uses the most that fit).
	loadConcurrent = 10_000
	// loadWorkers is the number of sequential clients.
	loadWorkers = 8
)

// loadSequential is the number of connections TestE2ERelLoad makes one
// after another (loadWorkers clients, each strictly sequential). A
// million take several minutes, nearly all of uproxy's share in the
// kernel's TCP and splice calls, and the race detector slows the test's
// own clients and backends further: too long for the suite, which
// makes 60,000: more than twice the client's 28,232 ephemeral ports, so
// ports are used again while the other side still holds the previous
// connection's TIME_WAIT. `go test ./cmd/uproxy -run
// TestE2ERelLoad -args -e2e.sequential=1000000` makes them all.
var loadSequential = flag.Int("e2e.sequential", 60_000, "connections TestE2ERelLoad makes one after another")

// TestE2ERelLoad holds ten thousand connections open at once through one
// VIP, then makes a million sequential ones, each exchanging a random
// payload that comes back with the same SHA-256; then checks that
// uproxy's file descriptors and goroutines are back to where they were.
func TestE2ERelLoad(t *testing.T) {
	c := newCluster(t, 2)
	var servers []*echoServer
	for _, p := range c.pods {
		servers = append(servers, startEcho(t, p.Name, p.NS, 9000))
	}
	c.write("echo.yaml", echoServiceYAML("echo", "10.96.0.20", nil, c))
	// The test fills uproxy's descriptors up to its limit through one
	// VIP: the bounds that keep a reserve below the limit
	// (--max-connections, and a quarter of it per service port) are off.
	c.start(1, "--metrics-bind-address", metricsAddr, "--profiling", "--max-connections", "-1", "--max-connections-per-service-port", "-1")
	c.waitSynced()
	const vip = "10.96.0.20:80"
	pid := c.upPID()
	open := func() int64 {
		var n int64
		for _, s := range servers {
			n += s.open.Load()
		}
		return n
	}

	// Warm up (the first connections grow uproxy's pools), then take the
	// baseline.
	if errs := sequential(t, c.client.NS, vip, 2, 200, 0); errs.n > 0 {
		t.Fatalf("warm-up: %d of 400 exchanges failed; first: %v", errs.n, errs.first)
	}
	c.collectGarbage()
	c.collectGarbage()
	baseFDs, baseG := countFDs(t, pid), c.goroutines()
	t.Logf("baseline: uproxy has %d file descriptors and %d goroutines", baseFDs, baseG)

	t.Run("concurrent", func(t *testing.T) {
		// What a connection costs uproxy in descriptors, from a sample.
		const sample = 200
		held := holdConnections(t, c.client.NS, vip, sample)
		testwait.Until(t, 20*time.Second, "the sample to reach the backends", func() bool { return open() == sample })
		perConn := float64(countFDs(t, pid)-baseFDs) / sample
		closeAll(held)
		testwait.Until(t, 20*time.Second, "the sample to end", func() bool { return open() == 0 && c.status().ActiveConnections == 0 })

		// Both limits are the soft RLIMIT_NOFILE, which the Go runtime
		// raised to the hard one; a process cannot go past the hard one.
		n := loadConcurrent
		upSoft, upHard := fdLimit(t, pid)
		selfSoft, selfHard := fdLimit(t, os.Getpid())
		selfFDs := countFDs(t, os.Getpid())
		const margin = 64 // uproxy's metrics and status requests, the test's own files
		if fit := int(float64(upSoft-baseFDs-margin) / perConn); fit < n {
			t.Logf("NOTE: uproxy's descriptor limit (RLIMIT_NOFILE soft %d, hard %d) holds only %d connections at %.1f descriptors each on top of the %d it has idle: using %d concurrent connections instead of %d",
				upSoft, upHard, fit, perConn, baseFDs, fit, loadConcurrent)
			n = fit
		}
		// This process holds both ends: the clients and the backends.
		if fit := (selfSoft - selfFDs - margin) / 2; fit < n {
			t.Logf("NOTE: the test's descriptor limit (RLIMIT_NOFILE soft %d, hard %d) holds only %d client and backend pairs on top of its %d: using %d concurrent connections instead of %d",
				selfSoft, selfHard, fit, selfFDs, fit, loadConcurrent)
			n = fit
		}

		start := time.Now()
		conns := holdConnections(t, c.client.NS, vip, n)
		testwait.Until(t, time.Minute, fmt.Sprintf("all %d connections to reach the backends", n), func() bool { return open() == int64(n) })
		if st := c.status(); st.ActiveConnections != n {
			t.Errorf("uproxy reports %d active connections, want %d", st.ActiveConnections, n)
		}
		t.Logf("%d connections open at once through %s after %v; uproxy holds %d descriptors", n, vip, time.Since(start).Round(time.Millisecond), countFDs(t, pid))
		// Every connection exchanges its payload, with all of them open.
		var (
			wg   sync.WaitGroup
			errs errCount
		)
		for w := range 64 {
			wg.Go(func() {
				for i := w; i < n; i += 64 {
					if err := exchange(conns[i], payloadFor(uint64(i), 4096), 30*time.Second); err != nil {
						errs.add(fmt.Errorf("connection %d: %w", i, err))
					}
					conns[i].Close()
				}
			})
		}
		wg.Wait()
		if errs.n > 0 {
			t.Fatalf("%d of %d concurrent exchanges failed; first: %v", errs.n, n, errs.first)
		}
	})

	t.Run("sequential", func(t *testing.T) {
		start := time.Now()
		cpu0 := procCPU(t, pid)
		self0 := procCPU(t, os.Getpid())
		total := *loadSequential / loadWorkers * loadWorkers
		errs := sequential(t, c.client.NS, vip, loadWorkers, total/loadWorkers, 1<<32)
		took := time.Since(start)
		t.Logf("CPU: uproxy %v, test process (clients and backends) %v", procCPU(t, pid)-cpu0, procCPU(t, os.Getpid())-self0)
		t.Logf("%d sequential connections (%d clients, one connection at a time each) in %v: %.0f connections/s",
			total, loadWorkers, took.Round(time.Millisecond), float64(total)/took.Seconds())
		if errs.n > 0 {
			t.Fatalf("%d of %d sequential exchanges failed; first: %v", errs.n, total, errs.first)
		}
	})

	t.Run("nothing leaked", func(t *testing.T) {
		// A few descriptors and goroutines may come and go (the metrics
		// server's own connections, the runtime's helpers); the pipes the
		// splice pool keeps are closed by the collections.
		const slack = 8
		var fds, g int
		testwait.Until(t, 30*time.Second, "uproxy's descriptors and goroutines to return to the baseline", func() bool {
			c.collectGarbage()
			fds, g = countFDs(t, pid), c.goroutines()
			return fds <= baseFDs+slack && g <= baseG+slack
		})
		t.Logf("after the load: %d file descriptors (baseline %d), %d goroutines (baseline %d)", fds, baseFDs, g, baseG)
		if st := c.status(); st.ActiveConnections != 0 {
			t.Errorf("uproxy still reports %d active connections", st.ActiveConnections)
		}
	})
}

// errCount counts errors and keeps the first, for concurrent use.
type errCount struct {
	mu    sync.Mutex
	n     int
	first error
}

func (e *errCount) add(err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n == 0 {
		e.first = err
	}
	e.n++
}

// holdConnections opens n connections to addr from namespace ns, without
// sending anything, and closes them when the test ends.
func holdConnections(t *testing.T, ns, addr string, n int) []*net.TCPConn {
	t.Helper()
	conns := make([]*net.TCPConn, n)
	const openers = 4
	var errs errCount
	var wg sync.WaitGroup
	for w := range openers {
		wg.Go(func() {
			err := testlab.DoInNetns(ns, func() error {
				for i := w; i < n; i += openers {
					c, err := dialVIP(addr, 10*time.Second)
					if err != nil {
						return fmt.Errorf("connection %d: %w", i, err)
					}
					conns[i] = c
				}
				return nil
			})
			if err != nil {
				errs.add(err)
			}
		})
	}
	wg.Wait()
	t.Cleanup(func() { closeAll(conns) })
	if errs.n > 0 {
		closeAll(conns)
		t.Fatalf("opening %d connections: %v", n, errs.first)
	}
	return conns
}

func closeAll(conns []*net.TCPConn) {
	for _, c := range conns {
		if c != nil {
			c.Close()
		}
	}
}

// sequential runs workers clients in namespace ns, each making perWorker
// connections to addr strictly one after another: connect, exchange a
// random payload (its seed from seedBase and the connection's number),
// check it, close. It returns the failures.
func sequential(t *testing.T, ns, addr string, workers, perWorker int, seedBase uint64) *errCount {
	t.Helper()
	var errs errCount
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			err := testlab.DoInNetns(ns, func() error {
				for i := range perWorker {
					seed := seedBase + uint64(w*perWorker+i)
					c, err := dialVIP(addr, 10*time.Second)
					if err != nil {
						errs.add(fmt.Errorf("client %d, connection %d: %w", w, i, err))
						continue
					}
					if err := exchange(c, payloadFor(seed, 512), 10*time.Second); err != nil {
						errs.add(fmt.Errorf("client %d, connection %d: %w", w, i, err))
					}
					c.Close()
				}
				return nil
			})
			if err != nil {
				errs.add(err)
			}
		})
	}
	wg.Wait()
	return &errs
}

// procCPU returns the user and system CPU time process pid has used.
func procCPU(t *testing.T, pid int) time.Duration {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// The fields after the command name, which is in parentheses.
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+2:]))
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * 10 * time.Millisecond // USER_HZ is 100
}

// ---------- backend faults ----------

// heal makes a killed server listen again on its port.
func (s *echoServer) heal() {
	s.t.Helper()
	if err := s.listen(); err != nil {
		s.t.Fatal(err)
	}
}

// slowExchange is exchange with the payload written in 16 KiB pieces,
// pause apart, so that the transfer is still going on when a fault hits.
func slowExchange(c net.Conn, payload []byte, pause, timeout time.Duration) error {
	_ = c.SetDeadline(time.Now().Add(timeout))
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], uint32(len(payload)))
	if _, err := c.Write(hdr[:]); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	for rest := payload; len(rest) > 0; {
		k := min(len(rest), 16<<10)
		if _, err := c.Write(rest[:k]); err != nil {
			return fmt.Errorf("write, %d bytes left: %w", len(rest), err)
		}
		rest = rest[k:]
		time.Sleep(pause) // a slow sender is the point: the transfer outlasts the kill
	}
	h := sha256.New()
	n, err := io.Copy(h, c)
	if err != nil {
		return fmt.Errorf("read after %d bytes: %w", n, err)
	}
	if want := sha256.Sum256(payload); !bytes.Equal(h.Sum(nil), want[:]) {
		return fmt.Errorf("checksum mismatch: sent %d bytes, got %d back", len(payload), n)
	}
	return nil
}

// TestE2ERelBackendFaults checks what clients see when a backend fails in
// the ways the other tests do not cover: killed in the middle of
// transfers, blackholed and then back, and stuck after accepting. New
// connections see no error while a healthy endpoint exists, except those
// that a backend accepts and never answers, which no proxy that does not
// parse the protocol can tell from a slow answer; uproxy then closes
// them at its idle timeout. Every failed endpoint gets traffic again once
// it heals.
func TestE2ERelBackendFaults(t *testing.T) {
	c := newCluster(t, 3)
	var srv []*echoServer
	for _, p := range c.pods {
		srv = append(srv, startEcho(t, p.Name, p.NS, 9000))
	}
	healthy, victim, stuck := srv[0], srv[1], srv[2]
	c.write("echo.yaml", echoServiceYAML("echo", "10.96.0.30", nil, c))
	// An idle timeout short enough for the test to see it, long enough
	// that a client starved of CPU for a moment (the race detector, a busy
	// machine) does not look idle.
	const idle = 3 * time.Second
	c.start(1, "--metrics-bind-address", metricsAddr, "--endpoint-dial-timeout", "300ms", "--tcp-idle-timeout", idle.String())
	c.waitSynced()
	const vip = "10.96.0.30:80"
	var seed atomic.Uint64
	run := func(what string, n int) {
		t.Helper()
		if errs := sequential(t, c.client.NS, vip, 1, n, seed.Add(uint64(n))); errs.n > 0 {
			t.Fatalf("%s: %d of %d connections failed; first: %v", what, errs.n, n, errs.first)
		}
	}
	// recovers makes connections, all of which must succeed, until s has
	// served one.
	recovers := func(what string, s *echoServer) {
		t.Helper()
		before := s.served.Load()
		start := time.Now()
		for s.served.Load() == before {
			if time.Since(start) > 20*time.Second {
				t.Fatalf("%s: %s got no connection in %v after it healed", what, s.name, time.Since(start))
			}
			run(what+": while it heals", 5)
			time.Sleep(50 * time.Millisecond) // paces the batches; each must succeed
		}
		t.Logf("%s: %s served again %v after it healed", what, s.name, time.Since(start).Round(time.Millisecond))
	}
	run("all healthy", 30)
	for _, s := range srv {
		if s.served.Load() == 0 {
			t.Fatalf("%s got none of the first 30 connections", s.name)
		}
	}

	t.Run("killed mid-transfer", func(t *testing.T) {
		const transfers = 6
		conns := holdConnections(t, c.client.NS, vip, transfers)
		testwait.Until(t, 10*time.Second, "the transfers to reach the backends", func() bool {
			return healthy.open.Load()+victim.open.Load()+stuck.open.Load() == transfers
		})
		onVictim := victim.open.Load()
		if onVictim == 0 {
			t.Fatalf("no transfer went to %s", victim.name)
		}
		type result struct {
			err error
			at  time.Time
		}
		results := make(chan result, transfers)
		for i, conn := range conns {
			go func() { // ends with the transfer, within its deadline
				// 1 MiB in 64 pieces 20ms apart, of which the kill,
				// 300ms in, leaves most to go.
				payload := randomBytes(rand.New(rand.NewPCG(uint64(i), 1)), 1<<20)
				err := slowExchange(conn, payload, 20*time.Millisecond, 20*time.Second)
				results <- result{err, time.Now()}
			}()
		}
		time.Sleep(300 * time.Millisecond) // the kill comes mid-transfer, by design
		killed := time.Now()
		victim.kill()
		var (
			failed        int64
			errs          []string
			lastFailure   time.Time
			firstComplete time.Time
		)
		for range transfers {
			r := <-results
			if r.err == nil {
				if firstComplete.IsZero() {
					firstComplete = r.at
				}
				continue
			}
			failed++
			lastFailure = r.at
			errs = append(errs, fmt.Sprintf("%v after the kill: %v", r.at.Sub(killed).Round(time.Millisecond), r.err))
		}
		if failed != onVictim {
			t.Errorf("%d transfers failed, want the %d in flight to %s; the others must complete:\n%s", failed, onVictim, victim.name, strings.Join(errs, "\n"))
		}
		// The reset is passed on at once: the cut transfers fail while the
		// others, which had a second to go, are still running (this holds
		// however slowly the test runs), and long before their deadline.
		if failed > 0 && (lastFailure.After(firstComplete) && !firstComplete.IsZero() || lastFailure.Sub(killed) > 10*time.Second) {
			t.Errorf("the transfers cut by the kill failed too late (the first complete transfer ended %v after the kill):\n%s",
				firstComplete.Sub(killed).Round(time.Millisecond), strings.Join(errs, "\n"))
		}
		accepted := victim.accepted.Load()
		run("after the kill", 30)
		if n := victim.accepted.Load(); n != accepted {
			t.Errorf("%s accepted %d connections while it was dead", victim.name, n-accepted)
		}
		victim.heal()
		recovers("killed", victim)
	})

	t.Run("blackholed and back", func(t *testing.T) {
		ctx := context.Background()
		rule := []string{"INPUT", "-p", "tcp", "--dport", "9000", "-j", "DROP"}
		if _, err := c.lab.Exec(ctx, c.pods[1].NS, append([]string{"iptables", "-A"}, rule...)...); err != nil {
			t.Fatal(err)
		}
		before := victim.accepted.Load()
		run("blackholed", 30)
		if n := victim.accepted.Load(); n != before {
			t.Fatalf("%s accepted %d connections through the blackhole", victim.name, n-before)
		}
		if _, err := c.lab.Exec(ctx, c.pods[1].NS, append([]string{"iptables", "-D"}, rule...)...); err != nil {
			t.Fatal(err)
		}
		recovers("blackholed", victim)
	})

	t.Run("accepts but never reads", func(t *testing.T) {
		stuck.stall()
		const n = 9
		conns := holdConnections(t, c.client.NS, vip, n)
		testwait.Until(t, 10*time.Second, "the connections to reach the backends", func() bool {
			return healthy.open.Load()+victim.open.Load()+stuck.open.Load() == n
		})
		onStuck := stuck.open.Load()
		if onStuck == 0 {
			t.Fatalf("no connection went to %s", stuck.name)
		}
		var wg sync.WaitGroup
		var timedOut, failed atomic.Int64
		for i, conn := range conns {
			wg.Go(func() {
				// Shorter than the idle timeout: the client gives up first.
				err := exchange(conn, payloadFor(uint64(i), 4096), 2*time.Second)
				if err != nil {
					failed.Add(1)
					if ne, ok := errors.Unwrap(err).(net.Error); ok && ne.Timeout() {
						timedOut.Add(1)
					}
				}
				conn.Close()
			})
		}
		wg.Wait()
		// The ones on the stuck backend wait for an answer that never
		// comes; the others are unaffected.
		if failed.Load() != onStuck || timedOut.Load() != onStuck {
			t.Errorf("%d exchanges failed (%d timed out), want exactly the %d sent to %s to time out", failed.Load(), timedOut.Load(), onStuck, stuck.name)
		}
		// The clients gave up; the backend neither reads nor closes. uproxy
		// closes the idle sessions within two periods of its idle timeout.
		start := time.Now()
		testwait.Until(t, 3*idle, "uproxy to close the sessions stuck on the backend", func() bool { return c.status().ActiveConnections == 0 })
		t.Logf("uproxy closed the %d stuck sessions %v after the clients gave up", onStuck, time.Since(start).Round(time.Millisecond))
		stuck.unstall()
		recovers("stuck", stuck)
	})
}
