package testpeer

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
)

// NewUDPServeCommand is a UDP backend, like a DNS server: it answers each
// datagram with "<name> <client address> <size>".
func NewUDPServeCommand() *cobra.Command {
	var name, listen string
	cmd := &cobra.Command{
		Use:   "udp-serve",
		Short: "Run a UDP backend that answers \"<name> <client address> <bytes received>\"",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			pc, err := net.ListenPacket("udp", listen)
			if err != nil {
				return err
			}
			go func() { <-ctx.Done(); pc.Close() }() // ends the loop below
			fmt.Fprintf(os.Stderr, "serving UDP as %s on %s\n", name, listen)
			buf := make([]byte, 65535)
			for {
				n, from, err := pc.ReadFrom(buf)
				if err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return err
				}
				host, _, _ := net.SplitHostPort(from.String())
				pc.WriteTo(fmt.Appendf(nil, "%s %s %d", name, host, n), from)
			}
		},
	}
	cmd.Flags().StringVar(&name, "name", "backend", "Name to answer with.")
	cmd.Flags().StringVar(&listen, "listen", ":5353", "Address to listen on.")
	return cmd
}

// UDPQueryResult is what `udp-query` prints, as JSON.
type UDPQueryResult struct {
	Counts     map[string]int `json:"counts"`
	Peers      map[string]int `json:"peers"`
	Errors     int            `json:"errors"`
	FirstError string         `json:"firstError,omitempty"`
}

// NewUDPQueryCommand is a UDP client like a stub resolver: each query is
// sent from a new connected socket, which accepts only replies whose
// source is the address it sent to.
func NewUDPQueryCommand() *cobra.Command {
	var (
		n, size int
		timeout time.Duration
	)
	cmd := &cobra.Command{
		Use:   "udp-query HOST:PORT",
		Short: "Send n queries, one connected UDP socket each, and print the answers' spread as JSON",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			res := UDPQueryResult{Counts: map[string]int{}, Peers: map[string]int{}}
			payload := make([]byte, max(size, 1))
			for range n {
				answer, err := queryOnce(args[0], payload, timeout)
				if err == nil {
					f := strings.Fields(answer)
					if len(f) != 3 || f[2] != fmt.Sprint(len(payload)) {
						err = fmt.Errorf("unexpected answer %q to %d bytes", answer, len(payload))
					} else {
						res.Counts[f[0]]++
						res.Peers[f[1]]++
					}
				}
				if err != nil {
					res.Errors++
					if res.FirstError == "" {
						res.FirstError = err.Error()
					}
				}
			}
			return json.NewEncoder(cmd.OutOrStdout()).Encode(res)
		},
	}
	cmd.Flags().IntVarP(&n, "queries", "n", 1, "Number of queries.")
	cmd.Flags().IntVar(&size, "size", 16, "Query size in bytes (up to 65507).")
	cmd.Flags().DurationVar(&timeout, "timeout", 2*time.Second, "Timeout of each query.")
	return cmd
}

func queryOnce(addr string, payload []byte, timeout time.Duration) (string, error) {
	c, err := net.Dial("udp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write(payload); err != nil {
		return "", err
	}
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}
