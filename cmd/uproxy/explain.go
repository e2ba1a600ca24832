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
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/proxy"
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
		ex.KernelRules = kernelRulesFor(ctx, dst, proto, from, tproxy)
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

// kernelRulesFor returns uproxy's iptables-save lines that match traffic
// to dst over proto from client (invalid: any client): the intercepts
// (nat REDIRECT or mangle TPROXY) and the firewall's drops.
func kernelRulesFor(ctx context.Context, dst netip.AddrPort, proto v1.Protocol, client netip.Addr, tproxy bool) []string {
	save, bits := "iptables-save", 32
	if dst.Addr().Is6() {
		save, bits = "ip6tables-save", 128
	}
	tables := []string{"nat", "filter"}
	if tproxy {
		tables = []string{"mangle", "filter"}
	}
	p := strings.ToLower(string(proto))
	dstMatch := "-d " + netip.PrefixFrom(dst.Addr(), bits).String() + " "
	// In the shared layout (--listener=shared) a rule matches a set of
	// destinations: it catches dst when dst is a member, which ipset test
	// answers (exit status 0), once per set.
	inSet := map[string]bool{}
	member := func(set, dir string) bool {
		m := strconv.Itoa(int(dst.Port())) // bitmap:port: "dst"
		if dir == "dst,dst" {
			m = dst.Addr().String() + "," + p + ":" + m // hash:ip,port
		}
		key := set + " " + m
		if v, ok := inSet[key]; ok {
			return v
		}
		v := exec.CommandContext(ctx, "ipset", "test", set, m).Run() == nil
		inSet[key] = v
		return v
	}
	var out []string
	for _, table := range tables {
		text, err := exec.CommandContext(ctx, save, "-t", table).Output()
		if err != nil {
			out = append(out, fmt.Sprintf("# %s -t %s: %v", save, table, err))
			continue
		}
		for _, line := range strings.Split(string(text), "\n") {
			if !strings.HasPrefix(line, "-A UPROXY") || !strings.Contains(line, "-p "+p+" ") {
				continue
			}
			if !strings.Contains(line, "--dport "+strconv.Itoa(int(dst.Port()))+" ") {
				set, ok := flagValue(line, "--match-set")
				if !ok || !strings.HasPrefix(set, "uproxy-services") && !strings.HasPrefix(set, "uproxy-nodeports") {
					continue
				}
				f := strings.Fields(line[strings.Index(line, "--match-set "+set):])
				if len(f) < 3 || !member(set, f[2]) {
					continue
				}
			}
			// Address rules name the address; node-port rules name none.
			if !strings.Contains(line, dstMatch) && strings.Contains(line, "-d ") {
				continue
			}
			if src, ok := flagValue(line, "-s"); ok && client.IsValid() {
				if pfx, err := netip.ParsePrefix(src); err == nil && !pfx.Contains(client) {
					continue
				}
			}
			out = append(out, "["+table+"] "+line)
		}
	}
	return out
}

// flagValue returns the value following flag in an iptables-save line.
func flagValue(line, flag string) (string, bool) {
	f := strings.Fields(line)
	for i := 0; i+1 < len(f); i++ {
		if f[i] == flag && (i == 0 || f[i-1] != "!") {
			return f[i+1], true
		}
	}
	return "", false
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
			var ex proxy.Explanation
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

func printExplanation(w io.Writer, ex *proxy.Explanation) {
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
