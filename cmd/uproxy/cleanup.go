package main

import (
	"context"
	"errors"
	"fmt"
	"os/exec"

	"github.com/spf13/cobra"

	"github.com/uproxy/uproxy/redirect"
)

func newCleanupCommand(lf *logFlags) *cobra.Command {
	return &cobra.Command{
		Use:   "cleanup",
		Short: "Remove every rule and chain uproxy created, and nothing else",
		Long: `cleanup deletes uproxy's jump rules from the built-in chains, uproxy's own
chains and kernel sets, and tproxy mode's policy rule and route, for IPv4 and
(when ip6tables is installed) IPv6. Running it when nothing is
installed succeeds. Stop uproxy first: a running instance puts its rules back.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := lf.logger()
			if err != nil {
				return err
			}
			defer log.Sync()
			if err := cleanup(cmd.Context()); err != nil {
				return err
			}
			log.Info("removed uproxy's rules")
			return nil
		},
	}
}

// cleanup removes uproxy's rules for every family whose tools exist.
func cleanup(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
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
		if err := redirect.Cleanup(ctx, redirect.Config{Family: f}); err != nil {
			errs = append(errs, err)
		}
		// tproxy mode's policy routing; absent in redirect mode, which is fine.
		if err := redirect.DefaultRouting.Remove(f); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
