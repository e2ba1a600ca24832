package testpeer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
)

// NewServeCommand is a backend: an HTTP server that answers every request
// with its name and the client address it sees, so tests can count the
// spread and check which source address reached the pod.
func NewServeCommand() *cobra.Command {
	var name string
	var listen []string
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run an HTTP backend that answers \"<name> <client address>\"",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				fmt.Fprintf(w, "%s %s\n", name, r.RemoteAddr)
			})
			srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
			errc := make(chan error, len(listen))
			for _, addr := range listen {
				ln, err := net.Listen("tcp", addr)
				if err != nil {
					return err
				}
				go func() { errc <- srv.Serve(ln) }() // ends when srv is shut down
			}
			fmt.Fprintf(os.Stderr, "serving as %s on %v\n", name, listen)
			select {
			case <-ctx.Done():
			case err := <-errc:
				return err
			}
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			return srv.Shutdown(sctx)
		},
	}
	cmd.Flags().StringVar(&name, "name", "backend", "Name to answer with.")
	cmd.Flags().StringSliceVar(&listen, "listen", []string{":8080"}, "Addresses to listen on.")
	return cmd
}

// GetResult is what `get` prints, as JSON.
type GetResult struct {
	// Counts maps the first word of each answer (a backend's name) to how
	// many answers it gave.
	Counts map[string]int `json:"counts"`
	// Peers maps the second word (the client address the backend saw,
	// without the port) to a count.
	Peers  map[string]int `json:"peers"`
	Errors int            `json:"errors"`
	// FirstError describes the first failure, if any.
	FirstError string `json:"firstError,omitempty"`
}

// NewGetCommand is a client: it sends n requests, each on a new
// connection, and prints how the answers spread.
func NewGetCommand() *cobra.Command {
	var (
		n, conc int
		timeout time.Duration
		source  string
	)
	cmd := &cobra.Command{
		Use:   "get URL",
		Short: "Send n HTTP requests, one connection each, and print the answers' spread as JSON",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			d := &net.Dialer{Timeout: timeout}
			if source != "" {
				ip := net.ParseIP(source)
				if ip == nil {
					return fmt.Errorf("--source: %q is not an IP", source)
				}
				d.LocalAddr = &net.TCPAddr{IP: ip}
			}
			client := &http.Client{
				Timeout:   timeout,
				Transport: &http.Transport{DialContext: d.DialContext, DisableKeepAlives: true},
			}
			res := GetResult{Counts: map[string]int{}, Peers: map[string]int{}}
			var mu sync.Mutex
			work := make(chan struct{})
			var wg sync.WaitGroup
			for range max(conc, 1) {
				wg.Go(func() { // exits when work is closed
					for range work {
						name, peer, err := getOnce(client, args[0])
						mu.Lock()
						if err != nil {
							res.Errors++
							if res.FirstError == "" {
								res.FirstError = err.Error()
							}
						} else {
							res.Counts[name]++
							res.Peers[peer]++
						}
						mu.Unlock()
					}
				})
			}
			for range n {
				work <- struct{}{}
			}
			close(work)
			wg.Wait()
			return json.NewEncoder(cmd.OutOrStdout()).Encode(res)
		},
	}
	cmd.Flags().IntVarP(&n, "requests", "n", 1, "Number of requests.")
	cmd.Flags().IntVarP(&conc, "concurrency", "c", 1, "Requests in flight at once.")
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Second, "Timeout of each request.")
	cmd.Flags().StringVar(&source, "source", "", "Local address to connect from.")
	return cmd
}

func getOnce(c *http.Client, url string) (name, peer string, err error) {
	resp, err := c.Get(url)
	if err != nil {
		return "", "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", "", fmt.Errorf("status %s", resp.Status)
	}
	f := strings.Fields(string(body))
	if len(f) != 2 {
		return "", "", errors.New("unexpected answer " + string(body))
	}
	host, _, err := net.SplitHostPort(f[1])
	if err != nil {
		host = f[1]
	}
	return f[0], host, nil
}
