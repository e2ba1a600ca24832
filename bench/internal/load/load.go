package load

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spf13/cobra"
)

// LoadResult is what every `bench load` workload prints, as one JSON line.
// Rates and latencies cover the measured window only (after the warm-up).
type LoadResult struct {
	Workload string `json:"workload"`
	// Seconds is the length of the measured window.
	Seconds float64 `json:"seconds"`
	// Ops counts requests (rr, udp), connections (short) or answered
	// datagrams completed in the window.
	Ops uint64 `json:"ops"`
	// AllOps counts every op completed, warm-up and the window's edges
	// included: what the harness divides the proxy's CPU time over the
	// whole run by.
	AllOps uint64 `json:"allOps,omitempty"`
	// Rate is Ops per second.
	Rate float64 `json:"rate"`
	// Latency quantiles of the ops, in microseconds.
	P50us float64 `json:"p50us"`
	P90us float64 `json:"p90us"`
	P99us float64 `json:"p99us"`
	MaxUs float64 `json:"maxUs"`
	// Bytes and Gbps: bulk only (bytes the sink confirmed it received).
	Bytes uint64  `json:"bytes,omitempty"`
	Gbps  float64 `json:"gbps,omitempty"`
	// Established: idle only.
	Established int `json:"established,omitempty"`
	// Errors counts failed dials, reads and writes (and, for UDP, datagrams
	// that got no answer within the timeout).
	Errors     uint64 `json:"errors"`
	FirstError string `json:"firstError,omitempty"`
}

// loadFlags are the flags every workload shares.
type loadFlags struct {
	targets  []string
	duration time.Duration
	warmup   time.Duration
	conns    int
	timeout  time.Duration
}

func (f *loadFlags) register(cmd *cobra.Command, conns int, timeout time.Duration) {
	cmd.Flags().StringSliceVar(&f.targets, "target", nil, "host:port to load; several spread the connections over them in turn (required)")
	cmd.Flags().DurationVar(&f.duration, "duration", 5*time.Second, "How long to load, warm-up included.")
	cmd.Flags().DurationVar(&f.warmup, "warmup", time.Second, "The first part of the duration, not measured.")
	cmd.Flags().IntVar(&f.conns, "conns", conns, "Connections (or UDP sockets) in parallel.")
	cmd.Flags().DurationVar(&f.timeout, "timeout", timeout, "Timeout of a connect, and of one answer.")
	_ = cmd.MarkFlagRequired("target")
}

func (f *loadFlags) check() error {
	if len(f.targets) == 0 {
		return errors.New("--target is required")
	}
	if f.conns < 1 || f.duration <= 0 || f.warmup < 0 || f.warmup >= f.duration || f.timeout <= 0 {
		return fmt.Errorf("need --conns ≥ 1, --duration > --warmup ≥ 0 and --timeout > 0")
	}
	return nil
}

// NewLoadCommand groups the load generators. Each runs in the client's
// namespace and prints a LoadResult.
func NewLoadCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "load",
		Short: "The benchmarks' load generators (run in a client namespace; print one JSON line)",
	}
	cmd.AddCommand(newLoadRRCommand(), newLoadShortCommand(), newLoadBulkCommand(),
		newLoadUDPCommand(), newLoadIdleCommand(), newLoadProbeCommand(), newLoadSweepCommand())
	return cmd
}

func printJSON(cmd *cobra.Command, v any) error {
	return json.NewEncoder(cmd.OutOrStdout()).Encode(v)
}

// errCounter counts errors and keeps the first.
type errCounter struct {
	n     atomic.Uint64
	mu    sync.Mutex
	first string
}

func (e *errCounter) add(err error) {
	if e.n.Add(1) == 1 {
		e.mu.Lock()
		e.first = err.Error()
		e.mu.Unlock()
	}
}

func (e *errCounter) fill(r *LoadResult) {
	r.Errors = e.n.Load()
	e.mu.Lock()
	r.FirstError = e.first
	e.mu.Unlock()
}

// window is the measured part of a run.
type window struct{ start, end time.Time }

func newWindow(f *loadFlags) window {
	now := time.Now()
	return window{start: now.Add(f.warmup), end: now.Add(f.duration)}
}

// runWorkers runs one worker per connection and merges their histograms
// into a result.
func runWorkers(name string, f *loadFlags, w window, worker func(i int, h *Hist, ops *opCount, errs *errCounter)) LoadResult {
	hs := make([]Hist, f.conns)
	ops := make([]opCount, f.conns)
	var errs errCounter
	var wg sync.WaitGroup
	for i := range f.conns {
		wg.Go(func() { worker(i, &hs[i], &ops[i], &errs) }) // ends at w.end
	}
	wg.Wait()
	var all Hist
	var total, every uint64
	for i := range hs {
		all.merge(&hs[i])
		total += ops[i].window
		every += ops[i].all
	}
	secs := w.end.Sub(w.start).Seconds()
	r := LoadResult{Workload: name, Seconds: secs, Ops: total, AllOps: every, Rate: float64(total) / secs}
	fillLatency(&r, &all)
	errs.fill(&r)
	return r
}

// opCount counts one worker's completed ops: those in the measured
// window, and all of them.
type opCount struct{ window, all uint64 }

// record counts an op that started at t and has just completed, and
// times it if it lies in w.
func (o *opCount) record(w window, h *Hist, t time.Time) {
	o.all++
	if done := time.Now(); t.After(w.start) && done.Before(w.end) {
		h.Record(done.Sub(t))
		o.window++
	}
}

func fillLatency(r *LoadResult, h *Hist) {
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	r.P50us, r.P90us, r.P99us, r.MaxUs = us(h.Quantile(0.50)), us(h.Quantile(0.90)), us(h.Quantile(0.99)), us(time.Duration(h.max))
}

// rrRequest returns a request whose first byte is kind.
func rrRequest(kind byte) []byte {
	req := make([]byte, rrRequestSize)
	for i := range req {
		req[i] = 'x'
	}
	req[0] = kind
	req[len(req)-1] = '\n'
	return req
}

// rrExchange sends one request on c and reads the answer into resp.
func rrExchange(c net.Conn, req, resp []byte) error {
	if _, err := c.Write(req); err != nil {
		return err
	}
	_, err := io.ReadFull(c, resp)
	return err
}

func newLoadRRCommand() *cobra.Command {
	var f loadFlags
	cmd := &cobra.Command{
		Use:   "rr",
		Short: "Keep-alive request/response: each connection sends a request as soon as the previous answer arrived",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := f.check(); err != nil {
				return err
			}
			return printJSON(cmd, loadRR(&f))
		},
	}
	f.register(cmd, 32, 2*time.Second)
	return cmd
}

func loadRR(f *loadFlags) LoadResult {
	w := newWindow(f)
	return runWorkers("rr", f, w, func(i int, h *Hist, ops *opCount, errs *errCounter) {
		req, resp := rrRequest(rrKeepAlive), make([]byte, rrResponseSize)
		d := net.Dialer{Timeout: f.timeout}
		var c net.Conn
		defer func() {
			if c != nil {
				c.Close()
			}
		}()
		for time.Now().Before(w.end) {
			if c == nil {
				var err error
				if c, err = d.Dial("tcp", f.targets[i%len(f.targets)]); err != nil {
					errs.add(err)
					c = nil
					time.Sleep(10 * time.Millisecond)
					continue
				}
				_ = c.SetDeadline(w.end.Add(f.timeout))
			}
			t := time.Now()
			if err := rrExchange(c, req, resp); err != nil {
				if time.Now().Before(w.end) {
					errs.add(err)
				}
				c.Close()
				c = nil
				continue
			}
			ops.record(w, h, t)
		}
	})
}

func newLoadShortCommand() *cobra.Command {
	var f loadFlags
	cmd := &cobra.Command{
		Use:   "short",
		Short: "Short connections: connect, one request, the server closes, close; in a loop per worker",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := f.check(); err != nil {
				return err
			}
			w := newWindow(&f)
			res := runWorkers("short", &f, w, func(i int, h *Hist, ops *opCount, errs *errCounter) {
				req, resp := rrRequest(rrClose), make([]byte, rrResponseSize+1)
				d := net.Dialer{Timeout: f.timeout}
				for n := 0; time.Now().Before(w.end); n++ {
					t := time.Now()
					if err := shortOnce(&d, f.targets[(i+n)%len(f.targets)], req, resp, w.end.Add(f.timeout)); err != nil {
						if time.Now().Before(w.end) {
							errs.add(err)
							time.Sleep(time.Millisecond)
						}
						continue
					}
					ops.record(w, h, t)
				}
			})
			return printJSON(cmd, res)
		},
	}
	f.register(cmd, 32, 2*time.Second)
	return cmd
}

// shortOnce makes one short connection: dial, request, answer, the
// server's close, close.
func shortOnce(d *net.Dialer, target string, req, resp []byte, deadline time.Time) error {
	c, err := d.Dial("tcp", target)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(deadline)
	if err := rrExchange(c, req, resp[:rrResponseSize]); err != nil {
		return err
	}
	if n, err := c.Read(resp[rrResponseSize:]); !errors.Is(err, io.EOF) {
		return fmt.Errorf("expected the server to close after its answer, got %d bytes, %v", n, err)
	}
	return nil
}

func newLoadBulkCommand() *cobra.Command {
	var f loadFlags
	cmd := &cobra.Command{
		Use:   "bulk",
		Short: "Bulk single-stream throughput: send for the duration on one connection, then the sink confirms the byte count",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f.conns, f.warmup = 1, 0
			if err := f.check(); err != nil {
				return err
			}
			return printJSON(cmd, loadBulk(&f))
		},
	}
	f.register(cmd, 1, 2*time.Second)
	return cmd
}

func loadBulk(f *loadFlags) (r LoadResult) {
	r.Workload = "bulk"
	var errs errCounter
	defer errs.fill(&r)
	start := time.Now()
	end := start.Add(f.duration)
	c, err := net.DialTimeout("tcp", f.targets[0], f.timeout)
	if err != nil {
		errs.add(err)
		return r
	}
	defer c.Close()
	_ = c.SetDeadline(end.Add(f.timeout + 5*time.Second))
	buf := make([]byte, bulkBufferSize)
	for time.Now().Before(end) {
		if _, err := c.Write(buf); err != nil {
			errs.add(err)
			return r
		}
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		errs.add(err)
		return r
	}
	var count [8]byte
	if _, err := io.ReadFull(c, count[:]); err != nil {
		errs.add(fmt.Errorf("reading the sink's count: %w", err))
		return r
	}
	secs := time.Since(start).Seconds()
	r.Bytes = binary.BigEndian.Uint64(count[:])
	r.Seconds = secs
	r.Gbps = float64(r.Bytes) * 8 / secs / 1e9
	return r
}

func newLoadUDPCommand() *cobra.Command {
	var f loadFlags
	var newSocket bool
	cmd := &cobra.Command{
		Use:   "udp",
		Short: "UDP request/response: each socket sends a datagram as soon as the previous one was answered (or timed out)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := f.check(); err != nil {
				return err
			}
			return printJSON(cmd, loadUDP(&f, newSocket))
		},
	}
	f.register(cmd, 32, 200*time.Millisecond)
	cmd.Flags().BoolVar(&newSocket, "new-socket", false, "Send each request from a new socket (a new source port), as a DNS stub resolver does, so that every request is a new flow to the proxy.")
	return cmd
}

// loadUDP runs the UDP workload; with newSocket, each request goes out
// from a socket of its own, closed once answered.
func loadUDP(f *loadFlags, newSocket bool) LoadResult {
	w := newWindow(f)
	name := "udp"
	if newSocket {
		name = "udp-new"
	}
	return runWorkers(name, f, w, func(i int, h *Hist, ops *opCount, errs *errCounter) {
		c, err := net.Dial("udp", f.targets[i%len(f.targets)])
		if err != nil {
			errs.add(err)
			return
		}
		defer func() { c.Close() }()
		out, in := make([]byte, udpPayloadSize), make([]byte, 2048)
		for seq := uint64(1); time.Now().Before(w.end); seq++ {
			if newSocket && seq > 1 {
				c.Close()
				if c, err = net.Dial("udp", f.targets[i%len(f.targets)]); err != nil {
					errs.add(err)
					time.Sleep(10 * time.Millisecond)
					continue
				}
			}
			binary.BigEndian.PutUint64(out, seq)
			t := time.Now()
			if _, err := c.Write(out); err != nil {
				errs.add(err)
				time.Sleep(10 * time.Millisecond)
				continue
			}
			_ = c.SetReadDeadline(t.Add(f.timeout))
			for {
				n, err := c.Read(in)
				if err != nil {
					if time.Now().Before(w.end) {
						errs.add(err) // lost, or refused (ICMP)
					}
					break
				}
				if n < 8 || binary.BigEndian.Uint64(in) != seq {
					continue // a late answer to an earlier datagram
				}
				ops.record(w, h, t)
				break
			}
		}
	})
}

func newLoadIdleCommand() *cobra.Command {
	var f loadFlags
	var hold time.Duration
	var maxErrors int
	cmd := &cobra.Command{
		Use:   "idle",
		Short: "Open --conns connections, one request each, print how many are established, then hold them idle",
		Long: `idle opens --conns connections (64 at a time), makes one request/response on each so
that the whole path is established, prints one JSON line, then keeps them open without
traffic until SIGTERM or SIGINT, or --hold has passed. After --max-errors failures it opens
no more.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f.warmup = 0
			f.duration = hold
			if err := f.check(); err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			return loadIdle(ctx, cmd, &f, hold, uint64(max(maxErrors, 1)))
		},
	}
	f.register(cmd, 10000, 2*time.Second)
	cmd.Flags().DurationVar(&hold, "hold", time.Minute, "Longest time to hold the connections.")
	cmd.Flags().IntVar(&maxErrors, "max-errors", 200, "Stop opening connections after this many failed (a proxy out of descriptors fails every further one, slowly).")
	return cmd
}

func loadIdle(ctx context.Context, cmd *cobra.Command, f *loadFlags, hold time.Duration, maxErrors uint64) error {
	conns := make([]net.Conn, f.conns)
	defer func() {
		for _, c := range conns {
			if c != nil {
				c.Close()
			}
		}
	}()
	var errs errCounter
	next := atomic.Int64{}
	start := time.Now()
	var wg sync.WaitGroup
	for range min(64, f.conns) {
		wg.Go(func() { // ends when every index is taken
			req, resp := rrRequest(rrKeepAlive), make([]byte, rrResponseSize)
			d := net.Dialer{Timeout: f.timeout}
			for {
				i := int(next.Add(1)) - 1
				if i >= len(conns) || ctx.Err() != nil || errs.n.Load() >= maxErrors {
					return
				}
				c, err := d.Dial("tcp", f.targets[i%len(f.targets)])
				if err != nil {
					errs.add(err)
					continue
				}
				_ = c.SetDeadline(time.Now().Add(f.timeout))
				if err := rrExchange(c, req, resp); err != nil {
					errs.add(err)
					c.Close()
					continue
				}
				_ = c.SetDeadline(time.Time{})
				conns[i] = c
			}
		})
	}
	wg.Wait()
	r := LoadResult{Workload: "idle", Seconds: time.Since(start).Seconds()}
	for _, c := range conns {
		if c != nil {
			r.Established++
		}
	}
	errs.fill(&r)
	if err := printJSON(cmd, r); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
	case <-time.After(hold):
	}
	return nil
}

// ProbeResult is what `bench load probe` prints.
type ProbeResult struct {
	OK bool `json:"ok"`
	// AtUnixNano is when the awaited answer arrived (wall clock).
	AtUnixNano int64 `json:"atUnixNano"`
	// StartUnixNano is when the attempt that got the awaited answer began,
	// and PrevEndUnixNano when the attempt before it ended (zero if it was
	// the first): they tell a late answer from a late attempt.
	StartUnixNano   int64 `json:"startUnixNano,omitempty"`
	PrevEndUnixNano int64 `json:"prevEndUnixNano,omitempty"`
	// ConnectedUnixNano is when that attempt's connection was established
	// (the handshake with the kernel, before any proxy accepted it).
	ConnectedUnixNano int64 `json:"connectedUnixNano,omitempty"`
	// From is the address the answering endpoint accepted on (TCP only).
	From      string `json:"from,omitempty"`
	Attempts  int    `json:"attempts"`
	LastError string `json:"lastError,omitempty"`
}

func newLoadProbeCommand() *cobra.Command {
	var (
		target, want    string
		udp             bool
		total, interval time.Duration
		attempt         time.Duration
	)
	cmd := &cobra.Command{
		Use:   "probe",
		Short: "Try one request at a time until one is answered (by the --want endpoint, if given); print when",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var wantAddr netip.Addr
			if want != "" {
				var err error
				if wantAddr, err = netip.ParseAddr(want); err != nil {
					return fmt.Errorf("--want: %w", err)
				}
			}
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			ctx, cancel := context.WithTimeout(ctx, total)
			defer cancel()
			res := probe(ctx, target, udp, wantAddr, interval, attempt)
			if err := printJSON(cmd, res); err != nil {
				return err
			}
			if !res.OK {
				return fmt.Errorf("no answer from %s after %d attempts: %s", target, res.Attempts, res.LastError)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&target, "target", "", "host:port to probe (required)")
	cmd.Flags().StringVar(&want, "want", "", "Succeed only when this endpoint IP answers (TCP). Empty means any answer.")
	cmd.Flags().BoolVar(&udp, "udp", false, "Probe the UDP echo instead of the TCP request/response server.")
	cmd.Flags().DurationVar(&total, "timeout", 30*time.Second, "Give up after this long.")
	cmd.Flags().DurationVar(&interval, "interval", 10*time.Millisecond, "Pause between attempts.")
	cmd.Flags().DurationVar(&attempt, "attempt-timeout", 200*time.Millisecond, "Timeout of one attempt.")
	_ = cmd.MarkFlagRequired("target")
	return cmd
}

func probe(ctx context.Context, target string, udp bool, want netip.Addr, interval, attempt time.Duration) ProbeResult {
	var r ProbeResult
	req, resp := rrRequest(rrClose), make([]byte, rrResponseSize)
	for ctx.Err() == nil {
		r.Attempts++
		start := time.Now().UnixNano()
		from, connected, err := probeOnce(ctx, target, udp, req, resp, attempt)
		end := time.Now().UnixNano()
		if err == nil && (!want.IsValid() || from == want) {
			r.OK, r.AtUnixNano, r.StartUnixNano, r.ConnectedUnixNano = true, end, start, connected.UnixNano()
			if from.IsValid() {
				r.From = from.String()
			}
			return r
		}
		if err != nil {
			r.LastError = err.Error()
		} else {
			r.LastError = "answered by " + from.String()
		}
		r.PrevEndUnixNano = end
		select {
		case <-ctx.Done():
		case <-time.After(interval):
		}
	}
	return r
}

// probeOnce makes one attempt and returns the answering endpoint's address
// (TCP; the zero Addr for UDP) and when the connection was established.
func probeOnce(ctx context.Context, target string, udp bool, req, resp []byte, timeout time.Duration) (netip.Addr, time.Time, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	network := "tcp"
	if udp {
		network = "udp"
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, network, target)
	connected := time.Now()
	if err != nil {
		return netip.Addr{}, connected, err
	}
	defer c.Close()
	deadline, _ := ctx.Deadline()
	_ = c.SetDeadline(deadline)
	if udp {
		if _, err := c.Write(req); err != nil {
			return netip.Addr{}, connected, err
		}
		n, err := c.Read(resp)
		if err != nil {
			return netip.Addr{}, connected, err
		}
		if n != len(req) {
			return netip.Addr{}, connected, fmt.Errorf("echo of %d bytes, sent %d", n, len(req))
		}
		return netip.Addr{}, connected, nil
	}
	if err := rrExchange(c, req, resp); err != nil {
		return netip.Addr{}, connected, err
	}
	host, _, err := net.SplitHostPort(string(trimAnswer(resp)))
	if err != nil {
		return netip.Addr{}, connected, fmt.Errorf("answer %q: %w", trimAnswer(resp), err)
	}
	a, err := netip.ParseAddr(host)
	if err != nil {
		return netip.Addr{}, connected, fmt.Errorf("answer %q: %w", trimAnswer(resp), err)
	}
	return a.Unmap(), connected, nil
}

// trimAnswer returns the address at the start of an answer.
func trimAnswer(resp []byte) []byte {
	for i, b := range resp {
		if b == ' ' || b == '\n' {
			return resp[:i]
		}
	}
	return resp
}

// SweepResult is what `bench load sweep` prints.
type SweepResult struct {
	OK bool `json:"ok"`
	// Total targets, and how many answered.
	Total    int `json:"total"`
	Answered int `json:"answered"`
	// Retried counts the targets that did not answer at the first try;
	// Unprogrammed those of them whose first try found no route (the
	// node had no rule for them yet, see `ip route … unreachable`).
	Retried      int `json:"retried"`
	Unprogrammed int `json:"unprogrammed"`
	// Seconds is how long the sweep took.
	Seconds float64 `json:"seconds"`
	// DoneUnixNano is when the last target answered (wall clock).
	DoneUnixNano int64  `json:"doneUnixNano"`
	LastError    string `json:"lastError,omitempty"`
}

func newLoadSweepCommand() *cobra.Command {
	var (
		file           string
		conns          int
		total, attempt time.Duration
	)
	cmd := &cobra.Command{
		Use:   "sweep",
		Short: "Check that every target in --targets-file answers a request, retrying each until it does; print when the last did",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			b, err := os.ReadFile(file)
			if err != nil {
				return err
			}
			targets := strings.Fields(string(b))
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			ctx, cancel := context.WithTimeout(ctx, total)
			defer cancel()
			res := sweep(ctx, targets, max(conns, 1), attempt)
			if err := printJSON(cmd, res); err != nil {
				return err
			}
			if !res.OK {
				return fmt.Errorf("%d of %d targets answered: %s", res.Answered, res.Total, res.LastError)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&file, "targets-file", "", "File of host:port targets, separated by white space (required).")
	cmd.Flags().IntVar(&conns, "conns", 32, "Targets tried at once.")
	cmd.Flags().DurationVar(&total, "timeout", 2*time.Minute, "Give up after this long.")
	cmd.Flags().DurationVar(&attempt, "attempt-timeout", time.Second, "Timeout of one attempt.")
	_ = cmd.MarkFlagRequired("targets-file")
	return cmd
}

func sweep(ctx context.Context, targets []string, conns int, attempt time.Duration) (res SweepResult) {
	res = SweepResult{Total: len(targets)}
	start := time.Now()
	defer func() { res.Seconds = time.Since(start).Seconds() }()
	var mu sync.Mutex
	next := atomic.Int64{}
	var wg sync.WaitGroup
	for range conns {
		wg.Go(func() { // ends when every target is taken, or ctx is done
			req, resp := rrRequest(rrClose), make([]byte, rrResponseSize)
			for {
				i := int(next.Add(1)) - 1
				if i >= len(targets) {
					return
				}
				for try := 0; ctx.Err() == nil; try++ {
					_, _, err := probeOnce(ctx, targets[i], false, req, resp, attempt)
					mu.Lock()
					if err == nil {
						res.Answered++
						res.DoneUnixNano = max(res.DoneUnixNano, time.Now().UnixNano())
						if try > 0 {
							res.Retried++
						}
					} else {
						res.LastError = targets[i] + ": " + err.Error()
						if try == 0 && (errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH)) {
							res.Unprogrammed++
						}
					}
					mu.Unlock()
					if err == nil {
						break
					}
					select {
					case <-ctx.Done():
					case <-time.After(20 * time.Millisecond):
					}
				}
				if ctx.Err() != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	res.OK = res.Answered == res.Total
	return res
}
