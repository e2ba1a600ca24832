package main

import (
	"context"
	"errors"
	"fmt"
	"os/exec"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/uproxy/uproxy/redirect"
)

func newCleanupCommand(lf *logFlags) *cobra.Command {
	var kubeProxy bool
	cmd := &cobra.Command{
		Use:   "cleanup",
		Short: "Remove every rule and chain uproxy created, and nothing else",
		Long: `cleanup deletes uproxy's jump rules from the built-in chains, uproxy's own
chains and kernel sets, and the policy rule and route that bring back replies
(both modes), for IPv4 and
(when ip6tables is installed) IPv6. Running it when nothing is
installed succeeds. Stop uproxy first: a running instance puts its rules back.

With --kube-proxy it removes kube-proxy's rules instead, and leaves uproxy's:
the chains of kube-proxy's iptables mode and the jumps to them, as
kube-proxy --cleanup does (kubelet's KUBE-IPTABLES-HINT, KUBE-KUBELET-CANARY
and KUBE-FIREWALL stay), and, when nft is installed, the kube-proxy tables of
its nftables mode. Run it once kube-proxy has stopped on the node, while
uproxy runs. IPVS mode's virtual servers, sets and kube-ipvs0 link are not
removed: use kube-proxy --cleanup for those.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := lf.logger()
			if err != nil {
				return err
			}
			defer log.Sync()
			if kubeProxy {
				n, err := cleanupKubeProxy(cmd.Context(), redirect.OSExec{})
				if err != nil {
					return err
				}
				log.Info("removed kube-proxy's rules", zap.Int("chains", n))
				return nil
			}
			if err := cleanup(cmd.Context()); err != nil {
				return err
			}
			log.Info("removed uproxy's rules")
			return nil
		},
	}
	cmd.Flags().BoolVar(&kubeProxy, "kube-proxy", false, "Remove kube-proxy's leftover rules (its iptables mode's KUBE-* chains and its nftables mode's tables) instead of uproxy's, which is safe while uproxy runs.")
	return cmd
}

// cleanupKubeProxy removes kube-proxy's iptables-mode chains for every
// family whose tools exist, and its nftables-mode tables when nft is
// installed, and returns how many chains and tables it removed. x runs
// nft.
func cleanupKubeProxy(ctx context.Context, x redirect.Exec) (int, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	total := 0
	errs := eachInstalledFamily(func(f redirect.Family) error {
		n, err := redirect.CleanupKubeProxy(ctx, redirect.Config{Family: f})
		total += n
		return err
	})
	if _, err := exec.LookPath("nft"); err == nil {
		// kube-proxy's nftables mode keeps everything in one table per
		// family, which its own cleanup deletes whole.
		for _, family := range []string{"ip", "ip6"} {
			if _, err := x.Run(ctx, "nft", []string{"list", "table", family, "kube-proxy"}, nil); err != nil {
				continue // no such table
			}
			if _, err := x.Run(ctx, "nft", []string{"delete", "table", family, "kube-proxy"}, nil); err != nil {
				errs = append(errs, fmt.Errorf("deleting kube-proxy's nftables table %s kube-proxy: %w", family, err))
				continue
			}
			total++
		}
	}
	return total, errors.Join(errs...)
}

// cleanup removes uproxy's rules for every family whose tools exist.
func cleanup(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	return errors.Join(eachInstalledFamily(func(f redirect.Family) error {
		// The policy routing may be absent (an instance that never
		// synced), which is fine.
		return errors.Join(redirect.Cleanup(ctx, redirect.Config{Family: f}), redirect.DefaultRouting.Remove(f))
	})...)
}

// eachInstalledFamily calls fn for each IP family whose iptables tool is
// installed, and returns fn's errors; a missing iptables is an error of
// its own, a missing ip6tables only means an IPv4-only node.
func eachInstalledFamily(fn func(redirect.Family) error) []error {
	var errs []error
	for _, f := range []redirect.Family{redirect.IPv4, redirect.IPv6} {
		tool := "iptables"
		if f == redirect.IPv6 {
			tool = "ip6tables"
		}
		if _, err := exec.LookPath(tool); err != nil {
			if f == redirect.IPv4 {
				errs = append(errs, fmt.Errorf("%s is not installed", tool))
			}
			continue
		}
		if err := fn(f); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}
