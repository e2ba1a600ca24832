package load

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spf13/cobra"
)

// NewIOCopyCommand is the reference Go proxy of the benchmarks: the
// 30-line proxy any Go programmer would write, so that the report can show
// what uproxy adds over it, measured in the same run.
func NewIOCopyCommand() *cobra.Command {
	return newRouteProxyCommand("iocopy",
		"Run the reference Go proxy: accept, dial a backend round-robin, io.Copy each way",
		`iocopy proxies TCP until SIGTERM or SIGINT. Each --route LISTEN=BACKEND[,BACKEND…]
listens on LISTEN; every accepted connection dials the next backend in turn, and one goroutine
per direction copies with io.Copy (which Go carries with splice(2) between TCP sockets), passing
EOF on with CloseWrite.`, runIOCopy)
}

// newRouteProxyCommand is the command of a benchmark proxy configured by
// --route flags, which run serves until SIGTERM or SIGINT.
func newRouteProxyCommand(use, short, long string, run func(context.Context, []ioRoute) error) *cobra.Command {
	var routes []string
	cmd := &cobra.Command{
		Use:   use,
		Short: short,
		Long:  long,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			rs, err := parseRoutes(routes)
			if err != nil {
				return err
			}
			return run(ctx, rs)
		},
	}
	cmd.Flags().StringArrayVar(&routes, "route", nil, "LISTEN=BACKEND[,BACKEND…], e.g. 0.0.0.0:18080=10.244.1.2:8080,10.244.2.2:8080 (repeatable).")
	return cmd
}

// ioRoute is one listener of the reference proxy and its backends.
type ioRoute struct {
	listen   string
	backends []string
}

// parseRoutes parses --route values.
func parseRoutes(vals []string) ([]ioRoute, error) {
	if len(vals) == 0 {
		return nil, errors.New("nothing to proxy: give --route LISTEN=BACKEND[,BACKEND…]")
	}
	var out []ioRoute
	for _, v := range vals {
		listen, bes, ok := strings.Cut(v, "=")
		if !ok || listen == "" || bes == "" {
			return nil, fmt.Errorf("--route %q: want LISTEN=BACKEND[,BACKEND…]", v)
		}
		out = append(out, ioRoute{listen: listen, backends: strings.Split(bes, ",")})
	}
	return out, nil
}

// runIOCopy serves routes until ctx ends, then closes every listener and
// connection and waits for their goroutines.
func runIOCopy(ctx context.Context, routes []ioRoute) error {
	var open connSet // listeners and connections
	var wg sync.WaitGroup
	defer func() {
		open.closeAll() // ends every accept loop and copy goroutine
		wg.Wait()
	}()
	for _, r := range routes {
		ln, err := net.Listen("tcp", r.listen)
		if err != nil {
			return fmt.Errorf("iocopy: %w", err)
		}
		open.add(ln)
		wg.Go(func() { acceptIOCopy(ln, r.backends, &open, &wg) }) // ends when ln is closed
	}
	fmt.Fprintf(os.Stderr, "iocopy: %d routes\n", len(routes))
	<-ctx.Done()
	return nil
}

// acceptIOCopy accepts on ln until it is closed, and proxies each
// connection to the next of backends in its own goroutine.
func acceptIOCopy(ln net.Listener, backends []string, open *connSet, wg *sync.WaitGroup) {
	var next atomic.Uint64
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // EMFILE and the like
			continue
		}
		be := backends[(next.Add(1)-1)%uint64(len(backends))]
		wg.Go(func() { proxyIOCopy(c, be, open) }) // ends when both directions have
	}
}

// proxyIOCopy carries c to a new connection to backend until both
// directions have ended.
func proxyIOCopy(c net.Conn, backend string, open *connSet) {
	defer c.Close()
	if !open.add(c) {
		return
	}
	defer open.remove(c)
	b, err := net.DialTimeout("tcp", backend, 2*time.Second)
	if err != nil {
		return
	}
	defer b.Close()
	if !open.add(b) {
		return
	}
	defer open.remove(b)
	done := make(chan struct{})
	go func() { // ends when c's reading side does
		copyHalf(b, c)
		close(done)
	}()
	copyHalf(c, b)
	<-done
}

// copyHalf copies src to dst until src's EOF or an error, then passes the
// EOF on (or, after an error, closes dst so that the other direction ends
// too).
func copyHalf(dst, src net.Conn) {
	_, err := io.Copy(dst, src)
	if err == nil {
		if err = dst.(*net.TCPConn).CloseWrite(); err == nil {
			return
		}
	}
	dst.Close()
}
