package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"
)

// clientOptions are the flags of the commands that ask a running uproxy.
type clientOptions struct {
	address string
	output  string
}

func (o *clientOptions) register(cmd *cobra.Command, def, outputs string) {
	cmd.Flags().StringVar(&o.address, "address", defaultDebugAddress, "The running uproxy's --debug-bind-address.")
	cmd.Flags().StringVarP(&o.output, "output", "o", def, "Output format: "+outputs+".")
}

func (o *clientOptions) checkOutput(valid ...string) error {
	for _, v := range valid {
		if o.output == v {
			return nil
		}
	}
	return fmt.Errorf("--output: %q is not one of %s", o.output, strings.Join(valid, ", "))
}

// get fetches path (with query q) from the running instance, decoding
// its JSON answer into v and returning the raw body.
func (o *clientOptions) get(ctx context.Context, path string, q url.Values, v any) ([]byte, error) {
	u := url.URL{Scheme: "http", Host: o.address, Path: path, RawQuery: q.Encode()}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var resp *http.Response
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
		if err != nil {
			return nil, err
		}
		resp, err = http.DefaultClient.Do(req)
		if err != nil {
			return nil, fmt.Errorf("asking uproxy at %s (is it running, with this --debug-bind-address?): %w", o.address, err)
		}
		if resp.StatusCode != http.StatusTooManyRequests {
			break
		}
		// uproxy runs one /explain at a time, a few a second: wait
		// for our turn, within the timeout.
		resp.Body.Close()
		wait := time.Second
		if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
			wait = time.Duration(s) * time.Second
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%s: uproxy is busy (429 Too Many Requests): %w", u.String(), ctx.Err())
		case <-time.After(wait):
		}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s: %s", u.String(), resp.Status, strings.TrimSpace(string(body)))
	}
	if err := json.Unmarshal(body, v); err != nil {
		return nil, fmt.Errorf("decoding %s: %w", u.String(), err)
	}
	return body, nil
}

// printRaw prints a JSON body as JSON or YAML; false for other formats.
func printRaw(w io.Writer, format string, body []byte) (bool, error) {
	switch format {
	case "json":
		_, err := w.Write(body)
		return true, err
	case "yaml":
		y, err := yaml.JSONToYAML(body)
		if err != nil {
			return true, err
		}
		_, err = w.Write(y)
		return true, err
	}
	return false, nil
}

func newStatusCommand() *cobra.Command {
	var o clientOptions
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show what a running uproxy serves: listeners, balancers and endpoints",
		Long: `status asks the uproxy running on this node (at its --debug-bind-address, path /status)
for every service port it listens for: its addresses, listener port, address family, mode,
balancer and session affinity, and for each endpoint its conditions, active connections,
whether it is ejected, and its recent dial errors.`,
		Example: `  uproxy status
  uproxy status --address 127.0.0.1:10262 -o yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := o.checkOutput("table", "json", "yaml"); err != nil {
				return err
			}
			var st introspect.Status
			body, err := o.get(cmd.Context(), "/status", nil, &st)
			if err != nil {
				return err
			}
			if ok, err := printRaw(cmd.OutOrStdout(), o.output, body); ok {
				return err
			}
			return printStatus(cmd.OutOrStdout(), &st)
		},
	}
	o.register(cmd, "table", "table, json or yaml")
	return cmd
}

// dataPathSummary says what carries the connections: "2 event loops on
// io_uring", "1 event loop on epoll", "no event loops (goroutines)"; empty for an older
// uproxy, whose status has neither field.
func dataPathSummary(st *introspect.Status) string {
	switch {
	case st.IO == "":
		return ""
	case st.EventLoops == 0:
		return "no event loops (" + st.IO + ")"
	case st.EventLoops == 1:
		return "1 event loop on " + st.IO
	}
	return fmt.Sprintf("%d event loops on %s", st.EventLoops, st.IO)
}

// printStatus prints st as two tables: service ports, then endpoints.
func printStatus(w io.Writer, st *introspect.Status) error {
	last := "never"
	if !st.LastSync.IsZero() {
		last = st.LastSync.Format(time.RFC3339) + " (" + time.Since(st.LastSync).Round(time.Second).String() + " ago)"
	}
	mode := st.Mode
	if dp := dataPathSummary(st); dp != "" {
		mode += ", " + dp
	}
	fmt.Fprintf(w, "mode %s, last sync %s, %d active connections, %d UDP flows\n\n", mode, last, st.ActiveConnections, st.UDPFlows)
	if len(st.Ports) == 0 {
		fmt.Fprintln(w, "no service ports")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SERVICE\tPORT\tPROTO\tFAMILY\tADDRESSES\tLISTENER\tMODE\tBALANCER\tAFFINITY\tPOLICY (INT/EXT)\tENDPOINTS")
	for _, p := range st.Ports {
		aff := p.Affinity
		if p.AffinityTimeoutSeconds > 0 {
			aff += " (" + strconv.Itoa(p.AffinityTimeoutSeconds) + "s)"
		}
		policy := p.InternalTrafficPolicy + "/" + dash(p.ExternalTrafficPolicy)
		ready := 0
		for _, e := range p.Endpoints {
			if e.Ready {
				ready++
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d/%d ready\n", p.Service, dash(p.Port), p.Protocol, p.Family,
			strings.Join(p.Addresses, ", "), p.ListenPorts(), p.Mode, p.Balancer, aff, policy, ready, len(p.Endpoints))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SERVICE\tPORT\tENDPOINT\tCONDITIONS\tSETS\tACTIVE\tEJECTED\tRECENT DIAL ERRORS")
	for _, p := range st.Ports {
		for _, e := range p.Endpoints {
			var cond, sets []string
			for _, c := range []struct {
				on   bool
				name string
			}{{e.Ready, "ready"}, {e.Serving, "serving"}, {e.Terminating, "terminating"}} {
				if c.on {
					cond = append(cond, c.name)
				}
			}
			if e.Cluster {
				sets = append(sets, "cluster")
			}
			if e.Local {
				sets = append(sets, "local")
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%v\t%d\n", p.Service, dash(p.Port), e.Address,
				dash(strings.Join(cond, ",")), dash(strings.Join(sets, ",")), e.Active, e.Ejected, e.RecentDialErrors)
		}
	}
	return tw.Flush()
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
