package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"

	"github.com/vishvananda/netlink"

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

With --kube-proxy it removes kube-proxy's state instead, and leaves uproxy's,
as kube-proxy --cleanup does: the chains of its iptables and IPVS modes and
the jumps to them (kubelet's KUBE-IPTABLES-HINT, KUBE-KUBELET-CANARY and
KUBE-FIREWALL stay), its IPVS mode's ipsets, and, when nft is installed, the
kube-proxy tables of its nftables mode; where the kernel has IPVS, every IPVS
virtual server (with ipvsadm) and the kube-ipvs0 link. Run it once kube-proxy
has stopped on the node, while uproxy runs. 'uproxy run --cleanup' (kube-proxy's
own flag) removes both uproxy's state and kube-proxy's.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := lf.logger()
			if err != nil {
				return err
			}
			defer log.Sync()
			if kubeProxy {
				n, err := cleanupKubeProxy(cmd.Context(), redirect.OSExec{}, procIPVS)
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
	cmd.Flags().BoolVar(&kubeProxy, "kube-proxy", false, "Remove kube-proxy's leftover state (its iptables, IPVS and nftables modes') instead of uproxy's, which is safe while uproxy runs.")
	return cmd
}

// procIPVS exists when the kernel has IPVS (the ip_vs module loaded).
const procIPVS = "/proc/net/ip_vs"

// cleanupKubeProxy removes what kube-proxy's --cleanup removes: its
// iptables and IPVS modes' chains for every family whose tools exist,
// its IPVS mode's ipsets, its nftables-mode tables when nft is installed,
// and, where the kernel has IPVS (ipvsProc exists), every IPVS virtual
// server and the kube-ipvs0 link. It returns how many chains, sets,
// tables and links it removed. x runs nft, ipset and ipvsadm.
func cleanupKubeProxy(ctx context.Context, x redirect.Exec, ipvsProc string) (int, error) {
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
	// The sets go once no rule refers to them.
	if _, err := exec.LookPath("ipset"); err == nil {
		n, err := redirect.CleanupKubeProxySets(ctx, x)
		total += n
		if err != nil {
			errs = append(errs, err)
		}
	}
	n, err := cleanupKubeProxyIPVS(ctx, x, ipvsProc)
	total += n
	if err != nil {
		errs = append(errs, err)
	}
	return total, errors.Join(errs...)
}

// kubeIPVSLink is the dummy link kube-proxy's IPVS mode binds service
// addresses to.
const kubeIPVSLink = "kube-ipvs0"

// cleanupKubeProxyIPVS flushes every IPVS virtual server, as kube-proxy's
// cleanup does (uproxy uses none), and deletes the kube-ipvs0 link, when
// the kernel has IPVS (ipvsProc exists); it returns how many of the two it
// removed.
func cleanupKubeProxyIPVS(ctx context.Context, x redirect.Exec, ipvsProc string) (int, error) {
	n := 0
	var errs []error
	if l, err := netlink.LinkByName(kubeIPVSLink); err == nil {
		if err := netlink.LinkDel(l); err != nil {
			errs = append(errs, fmt.Errorf("deleting kube-proxy's %s link: %w", kubeIPVSLink, err))
		} else {
			n++
		}
	}
	if _, err := os.Stat(ipvsProc); err != nil {
		return n, errors.Join(errs...)
	}
	if _, err := exec.LookPath("ipvsadm"); err != nil {
		errs = append(errs, errors.New("the kernel has IPVS but ipvsadm is not installed: kube-proxy's IPVS virtual servers, if any, remain (install ipvsadm, or run kube-proxy --cleanup from kube-proxy's image)"))
		return n, errors.Join(errs...)
	}
	if _, err := x.Run(ctx, "ipvsadm", []string{"--clear"}, nil); err != nil {
		errs = append(errs, fmt.Errorf("flushing IPVS virtual servers: %w", err))
	} else {
		n++
	}
	return n, errors.Join(errs...)
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
