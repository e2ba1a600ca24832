package load

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
)

// The request/response protocol of the benchmarks: the client sends
// requests of exactly rrRequestSize bytes, the server answers each with
// exactly rrResponseSize bytes that start with the address the server
// accepted the connection on (so a client can tell which endpoint
// answered). A request whose first byte is rrClose asks the server to
// close the connection after answering, as HTTP's "Connection: close"
// does: the server closes first, so the TIME_WAIT states stay on the
// server side and a short-connection load does not run out of ports.
const (
	rrRequestSize  = 64
	rrResponseSize = 128
	rrKeepAlive    = 'K'
	rrClose        = 'C'
	// bulkBufferSize is the bulk sender's and sink's read/write size.
	bulkBufferSize = 256 << 10
	udpPayloadSize = 64
)

// NewBackendCommand is the benchmarks' backend: request/response, bulk
// sink and UDP echo servers in one process (one per pod).
func NewBackendCommand() *cobra.Command {
	var rr, sink, udp []string
	cmd := &cobra.Command{
		Use:   "backend",
		Short: "Run the benchmark servers: request/response (--rr), bulk sink (--sink), UDP echo (--udp)",
		Long: `backend serves the benchmarks' workloads until SIGTERM or SIGINT:

  --rr ADDR    fixed-size request/response over TCP: 64-byte requests, 128-byte answers
               that start with the address the connection was accepted on
  --sink ADDR  reads a TCP stream to its end, then answers with the byte count (8 bytes,
               big-endian) and closes
  --udp ADDR   echoes every datagram to its sender`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			return runBackend(ctx, rr, sink, udp)
		},
	}
	cmd.Flags().StringSliceVar(&rr, "rr", nil, "Addresses of request/response listeners (e.g. :8080).")
	cmd.Flags().StringSliceVar(&sink, "sink", nil, "Addresses of bulk sink listeners (e.g. :5001).")
	cmd.Flags().StringSliceVar(&udp, "udp", nil, "Addresses of UDP echo sockets (e.g. :9000).")
	return cmd
}

// connSet tracks open connections so that shutdown can close them, which
// ends their goroutines.
type connSet struct {
	mu     sync.Mutex
	conns  map[io.Closer]struct{}
	closed bool
}

func (s *connSet) add(c io.Closer) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	if s.conns == nil {
		s.conns = map[io.Closer]struct{}{}
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *connSet) remove(c io.Closer) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
}

func (s *connSet) closeAll() {
	s.mu.Lock()
	s.closed = true
	conns := s.conns
	s.conns = nil
	s.mu.Unlock()
	for c := range conns {
		c.Close()
	}
}

func runBackend(ctx context.Context, rr, sink, udp []string) error {
	if len(rr)+len(sink)+len(udp) == 0 {
		return errors.New("nothing to serve: give --rr, --sink or --udp")
	}
	var open connSet // listeners, sockets and connections
	var wg sync.WaitGroup
	defer func() {
		open.closeAll() // ends every loop and connection goroutine
		wg.Wait()
	}()
	serve := func(addr string, handle func(net.Conn)) error {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("backend: %w", err)
		}
		open.add(ln)
		wg.Go(func() { // ends when ln is closed
			for {
				c, err := ln.Accept()
				if err != nil {
					if errors.Is(err, net.ErrClosed) {
						return
					}
					time.Sleep(10 * time.Millisecond) // EMFILE and the like: the client sees a failure
					continue
				}
				if !open.add(c) {
					c.Close()
					return
				}
				wg.Go(func() { // ends when the connection does
					defer open.remove(c)
					defer c.Close()
					handle(c)
				})
			}
		})
		return nil
	}
	for _, a := range rr {
		if err := serve(a, serveRR); err != nil {
			return err
		}
	}
	for _, a := range sink {
		if err := serve(a, serveSink); err != nil {
			return err
		}
	}
	for _, a := range udp {
		pc, err := net.ListenPacket("udp", a)
		if err != nil {
			return fmt.Errorf("backend: %w", err)
		}
		open.add(pc)
		wg.Go(func() { serveUDPEcho(pc) }) // ends when pc is closed
	}
	fmt.Fprintf(os.Stderr, "backend: rr %v, sink %v, udp %v\n", rr, sink, udp)
	<-ctx.Done()
	return nil
}

// rrAnswer is the response the server sends on c.
func rrAnswer(c net.Conn) []byte {
	resp := make([]byte, rrResponseSize)
	for i := range resp {
		resp[i] = ' '
	}
	copy(resp, c.LocalAddr().String())
	resp[len(resp)-1] = '\n'
	return resp
}

func serveRR(c net.Conn) {
	resp := rrAnswer(c)
	req := make([]byte, rrRequestSize)
	for {
		if _, err := io.ReadFull(c, req); err != nil {
			return
		}
		if _, err := c.Write(resp); err != nil {
			return
		}
		if req[0] == rrClose {
			return
		}
	}
}

func serveSink(c net.Conn) {
	buf := make([]byte, bulkBufferSize)
	var n uint64
	for {
		k, err := c.Read(buf)
		n += uint64(k)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return
		}
	}
	var count [8]byte
	binary.BigEndian.PutUint64(count[:], n)
	_, _ = c.Write(count[:])
}

func serveUDPEcho(pc net.PacketConn) {
	buf := make([]byte, 64<<10)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		_, _ = pc.WriteTo(buf[:n], from)
	}
}
