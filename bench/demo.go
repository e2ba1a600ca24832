package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/uproxy/uproxy/internal/testkube"
	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/testpeer"
)

// newDemoCommand tells uproxy's story in a throw-away lab: pods, the
// rules uproxy installs, and requests to a ClusterIP spreading over the
// pods, from the node and from a pod.
func newDemoCommand() *cobra.Command {
	var uproxyBin, manifests string
	var keep bool
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Build a namespace lab, run uproxy with the example manifests, and show it working",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			return demo(ctx, cmd.OutOrStdout(), uproxyBin, manifests, keep)
		},
	}
	cmd.Flags().StringVar(&uproxyBin, "uproxy", "", "The uproxy binary to run (default bin/uproxy in the uproxy checkout).")
	cmd.Flags().StringVar(&manifests, "manifests", "", "The manifests uproxy serves (default deploy/examples in the uproxy checkout).")
	cmd.Flags().BoolVar(&keep, "pause", false, "Wait for Ctrl-C before tearing the lab down, to explore it (ip netns exec <node> …).")
	return cmd
}

func demo(ctx context.Context, out io.Writer, uproxyBin, manifests string, pause bool) error {
	say := func(format string, args ...any) { fmt.Fprintf(out, format+"\n", args...) }
	step := func(title string) { say("\n\033[1m== %s\033[0m", title) }
	self, err := os.Executable()
	if err != nil {
		return err
	}
	// The bench is a module of its own, run from bench/ or from the
	// checkout's root: the defaults are found from the checkout's root.
	if uproxyBin == "" || manifests == "" {
		root, err := testkube.ModuleRoot()
		if err != nil {
			return err
		}
		if uproxyBin == "" {
			uproxyBin = filepath.Join(root, "bin", "uproxy")
		}
		if manifests == "" {
			manifests = filepath.Join(root, "deploy", "examples")
		}
	}
	if uproxyBin, err = filepath.Abs(uproxyBin); err != nil {
		return err
	}
	if manifests, err = filepath.Abs(manifests); err != nil {
		return err
	}
	if _, err := os.Stat(uproxyBin); err != nil {
		return fmt.Errorf("%w (run make build first)", err)
	}

	// The demo's uproxy gets an upgrade socket of its own, so that it never
	// meets a uproxy serving the host. Removed after the lab (defers run
	// last first).
	sockDir, err := os.MkdirTemp("", "uproxy-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(sockDir)

	step("1. A node and four pods, each in its own network namespace")
	l, err := testlab.New(testlab.Options{})
	if err != nil {
		return err
	}
	defer func() {
		step("8. Tearing down")
		l.Close()
		say("removed every namespace and process the demo created; the host was never touched")
	}()
	for i := range 3 {
		p, err := l.AddPod(fmt.Sprintf("web-%d", i))
		if err != nil {
			return err
		}
		if _, err := l.Start(p.NS, p.Name, self, "serve", "--name", p.Name, "--listen", ":8080"); err != nil {
			return err
		}
		say("pod %-7s %s  serving HTTP on :8080", p.Name, p.IP)
	}
	client, err := l.AddPod("client")
	if err != nil {
		return err
	}
	say("pod %-7s %s  (sends requests)", client.Name, client.IP)
	say("node namespace: %s (bridge 10.244.0.1/24)", l.Node)

	step("2. uproxy starts with the manifests in " + manifests)
	up, err := l.Start(l.Node, "uproxy", uproxyBin, "run", "--manifests", manifests, "--iptables-min-sync-period", "100ms",
		"--upgrade-socket", filepath.Join(sockDir, "upgrade.sock"))
	if err != nil {
		return err
	}
	if err := waitFirstSync(ctx, up, 30*time.Second); err != nil {
		return err
	}
	if s, _ := l.Exec(ctx, l.Node, "iptables-save", "-t", "nat"); strings.Count(s, "-j REDIRECT") < 3 {
		return fmt.Errorf("uproxy reported a sync, but the node has fewer than 3 REDIRECT rules:\n%s\nuproxy's output:\n%s", s, up.Output())
	}
	for _, line := range strings.Split(strings.TrimSpace(up.Output()), "\n") {
		if strings.Contains(line, "listening") {
			say("  %s", line)
		}
	}

	step("3. The rules it installed (iptables-save -t nat, in the node namespace)")
	rules, err := l.Exec(ctx, l.Node, "iptables-save", "-t", "nat")
	if err != nil {
		return err
	}
	for _, line := range strings.Split(rules, "\n") {
		if strings.Contains(line, "UPROXY") {
			say("  %s", line)
		}
	}
	say("PREROUTING catches pods' traffic, OUTPUT the node's own; each VIP:port is REDIRECTed\n" +
		"to its listener, which reads the original destination back with SO_ORIGINAL_DST.")

	step("4. 30 requests to http://10.96.0.10/ (round-robin), from the client pod and from the node")
	for _, from := range []struct{ name, ns string }{{"client pod", client.NS}, {"node", l.Node}} {
		res, err := get(ctx, l, from.ns, self, "http://10.96.0.10/", 30)
		if err != nil {
			return err
		}
		say("  from the %-10s %s   (the pods saw client %s)", from.name+":", spread(res.Counts), strings.Join(slices.Sorted(maps.Keys(res.Peers)), ", "))
	}
	say("  one of them with curl, from the client pod:")
	if curl, err := l.Exec(ctx, client.NS, "curl", "-sS", "--max-time", "5", "http://10.96.0.10/"); err == nil {
		say("  $ curl http://10.96.0.10/\n  %s", strings.TrimSpace(curl))
	} else {
		say("  (curl is not installed: %v)", err)
	}

	step("5. Other balancers: weighted 3:1:1 (10.96.0.11) and ClientIP affinity (10.96.0.12:8000)")
	for _, s := range []struct{ what, url string }{
		{"weighted-round-robin", "http://10.96.0.11/"},
		{"sessionAffinity ClientIP", "http://10.96.0.12:8000/"},
	} {
		res, err := get(ctx, l, client.NS, self, s.url, 25)
		if err != nil {
			return err
		}
		say("  %-26s %s", s.what+":", spread(res.Counts))
	}
	step("6. uproxy explain: one packet from the client pod to 10.96.0.10:80, step by step")
	say("  $ uproxy explain 10.96.0.10:80 --from %s   (in the node namespace)", client.IP)
	explain, err := l.Exec(ctx, l.Node, uproxyBin, "explain", "10.96.0.10:80", "--from", client.IP.String())
	if err != nil {
		return fmt.Errorf("uproxy explain: %w", err)
	}
	say("%s", indent(explain))

	step("7. uproxy status: what the running instance serves")
	say("  $ uproxy status")
	status, err := l.Exec(ctx, l.Node, uproxyBin, "status")
	if err != nil {
		return fmt.Errorf("uproxy status: %w", err)
	}
	say("%s", indent(status))

	if pause {
		say("\nThe lab is up: try  ip netns exec %s curl http://10.96.0.10/  — Ctrl-C to tear down.", client.NS)
		<-ctx.Done()
	}
	return nil
}

// indent indents every line of s by two spaces.
func indent(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i, l := range lines {
		lines[i] = "  " + l
	}
	return strings.Join(lines, "\n")
}

// get runs `bench get` inside ns and decodes its answer.
func get(ctx context.Context, l *testlab.Lab, ns, self, url string, n int) (testpeer.GetResult, error) {
	var res testpeer.GetResult
	out, err := l.Exec(ctx, ns, self, "get", "-n", fmt.Sprint(n), url)
	if err != nil {
		return res, err
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		return res, fmt.Errorf("decoding %q: %w", out, err)
	}
	if res.Errors > 0 {
		return res, fmt.Errorf("%d of %d requests to %s failed; first: %s", res.Errors, n, url, res.FirstError)
	}
	return res, nil
}

func spread(counts map[string]int) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(counts)) {
		parts = append(parts, fmt.Sprintf("%s=%d", k, counts[k]))
	}
	return strings.Join(parts, " ")
}

// waitFirstSync waits for uproxy's first sync to succeed, and fails as soon
// as it fails or uproxy exits, with uproxy's own error: a newcomer's first
// run must say what is wrong (a missing package, a rule the kernel refused)
// rather than time out.
func waitFirstSync(ctx context.Context, up *testlab.Proc, timeout time.Duration) error {
	var failed string
	err := waitFor(ctx, timeout, func() bool {
		for _, line := range strings.Split(up.Output(), "\n") {
			switch {
			case strings.Contains(line, "\tsynced\t"):
				return true
			case strings.Contains(line, "syncing rules failed"):
				failed = line
				return true
			}
		}
		return up.Exited()
	})
	switch {
	case failed != "":
		return fmt.Errorf("uproxy's first sync failed: %s", logError(failed))
	case up.Exited():
		return fmt.Errorf("uproxy exited before its first sync: %v\n%s", up.Wait(time.Second), up.Output())
	case err != nil:
		return fmt.Errorf("uproxy did not sync within %v: %w\n%s", timeout, err, up.Output())
	}
	return nil
}

// logError returns the "error" field of one of uproxy's console log lines
// (message, tab, JSON fields), or the whole line if it has none.
func logError(line string) string {
	if i := strings.IndexByte(line, '{'); i >= 0 {
		var fields struct{ Error string }
		if json.Unmarshal([]byte(line[i:]), &fields) == nil && fields.Error != "" {
			return fields.Error
		}
	}
	return line
}

func waitFor(ctx context.Context, timeout time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if cond() {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return errors.New("timed out")
}
