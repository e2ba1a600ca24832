package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/netip"
	"net/url"
	"os/exec"
	"slices"
	"strings"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/spf13/cobra"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/proxy"
	"github.com/uproxy/uproxy/redirect"
)

// explainHandler answers /explain?dst=IP:PORT&proto=TCP|UDP&from=IP from
// the proxier's state, and adds what only the node's kernel knows: the
// rules that catch the traffic, and the routes to the endpoints.
func explainHandler(p *proxy.Proxier, tproxy bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		dst, err := netip.ParseAddrPort(q.Get("dst"))
		if err != nil {
			http.Error(w, fmt.Sprintf("dst: %v (want IP:PORT)", err), http.StatusBadRequest)
			return
		}
		proto := v1.Protocol(strings.ToUpper(q.Get("proto")))
		if proto == "" {
			proto = v1.ProtocolTCP
		}
		if proto != v1.ProtocolTCP && proto != v1.ProtocolUDP {
			http.Error(w, fmt.Sprintf("proto: %q is not TCP or UDP", proto), http.StatusBadRequest)
			return
		}
		var from netip.Addr
		if f := q.Get("from"); f != "" {
			if from, err = netip.ParseAddr(f); err != nil {
				http.Error(w, fmt.Sprintf("from: %v", err), http.StatusBadRequest)
				return
			}
		}
		ex := p.Explain(dst, proto, from)
		ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
		defer cancel()
		ex.KernelRules = redirect.MatchingRules(ctx, redirect.OSExec{}, dst, redirect.Protocol(strings.ToLower(string(proto))), from, tproxy)
		// The routes to the endpoints are the node's own routing, which
		// redirect neither writes nor reads (it owns uproxy's rules, sets
		// and TPROXY policy routing only), so ip route get stays here.
		var targets []string
		if ex.Backend != "" {
			targets = []string{ex.Backend}
		} else {
			for _, c := range ex.Candidates {
				targets = append(targets, strings.Fields(c)[0])
			}
		}
		for _, t := range targets[:min(len(targets), 8)] {
			ap, err := netip.ParseAddrPort(t)
			if err != nil {
				continue
			}
			out, err := exec.CommandContext(ctx, "ip", "route", "get", ap.Addr().String()).CombinedOutput()
			route := strings.Join(strings.Fields(string(out)), " ")
			if err != nil {
				route = "ip route get: " + err.Error() + ": " + route
			}
			if ex.Routes == nil {
				ex.Routes = map[string]string{}
			}
			ex.Routes[t] = route
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(ex)
	}
}

func newExplainCommand() *cobra.Command {
	var (
		o    clientOptions
		from string
	)
	cmd := &cobra.Command{
		Use:   "explain <VIP>:<port>[/udp]",
		Short: "Explain what a running uproxy does with traffic to an address",
		Long: `explain asks the uproxy running on this node (at its --debug-bind-address, path /explain)
what happens to a connection to the given service address: the kernel rule that intercepts
it, the listener, how the original destination is recovered, the traffic policy, the
balancer and the endpoint it would pick for the client (--from), and the node's route to
that endpoint; or why nothing would catch it. It picks nothing: affinity is looked up,
not refreshed.`,
		Example: `  uproxy explain 10.96.0.10:80
  uproxy explain 10.96.0.53:53/udp --from 10.244.1.7
  uproxy explain '[fd00::10]:80' -o json`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := o.checkOutput("text", "json", "yaml"); err != nil {
				return err
			}
			target, proto := args[0], "TCP"
			if t, p, ok := strings.Cut(target, "/"); ok {
				target, proto = t, strings.ToUpper(p)
			}
			if proto != "TCP" && proto != "UDP" {
				return fmt.Errorf("%q: protocol %q is not tcp or udp", args[0], proto)
			}
			dst, err := netip.ParseAddrPort(target)
			if err != nil {
				return fmt.Errorf("%q is not <IP>:<port>[/udp]: %w", args[0], err)
			}
			q := url.Values{"dst": {dst.String()}, "proto": {proto}}
			if from != "" {
				if _, err := netip.ParseAddr(from); err != nil {
					return fmt.Errorf("--from: %w", err)
				}
				q.Set("from", from)
			}
			var ex introspect.Explanation
			body, err := o.get(cmd.Context(), "/explain", q, &ex)
			if err != nil {
				return err
			}
			if ok, err := printRaw(cmd.OutOrStdout(), o.output, body); ok {
				return err
			}
			printExplanation(cmd.OutOrStdout(), &ex)
			return nil
		},
	}
	o.register(cmd, "text", "text, json or yaml")
	cmd.Flags().StringVar(&from, "from", "", "The client's IP address (for source ranges, traffic policies, affinity and source hashing).")
	return cmd
}

func printExplanation(w io.Writer, ex *introspect.Explanation) {
	client := ex.Client
	if client == "" {
		client = "any client"
	}
	fmt.Fprintf(w, "%s from %s\n", ex.Destination, client)
	line := func(k, v string) {
		if v != "" {
			fmt.Fprintf(w, "  %-21s %s\n", k+":", v)
		}
	}
	if len(ex.KernelRules) > 0 {
		fmt.Fprintln(w, "  kernel rules:")
		for _, r := range ex.KernelRules {
			fmt.Fprintf(w, "    %s\n", r)
		}
	} else {
		line("kernel rules", "none of uproxy's rules match")
	}
	if ex.Service != "" {
		line("service port", fmt.Sprintf("%s:%s (%s)", ex.Service, ex.Port, ex.Kind))
	}
	line("listener", ex.Listener)
	line("mode", ex.Mode)
	line("original destination", ex.OriginalDestination)
	if !ex.Caught {
		line("result", "NOT CAUGHT: "+ex.Reason)
		return
	}
	line("endpoint set", ex.EndpointSet)
	line("backends see", ex.BackendsSee)
	line("balancer", ex.Balancer)
	line("affinity", ex.Affinity)
	if len(ex.Candidates) > 0 {
		fmt.Fprintln(w, "  candidates:")
		for _, c := range ex.Candidates {
			fmt.Fprintf(w, "    %s\n", c)
		}
	}
	line("pick", ex.Pick)
	line("endpoint", ex.Backend)
	for _, t := range slices.Sorted(maps.Keys(ex.Routes)) {
		line("route to "+t, ex.Routes[t])
	}
	if ex.Reason != "" {
		line("result", ex.Reason)
	}
}
