package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"

	"github.com/uproxy/uproxy/balancer"
	"github.com/uproxy/uproxy/proxy"
	"github.com/uproxy/uproxy/redirect"
)

// runOptions are the flags of `uproxy run`. Names follow kube-proxy's
// where the concept is the same.
type runOptions struct {
	config         string
	mode           string
	portRange      string
	balancer       string
	syncPeriod     time.Duration
	minSyncPeriod  time.Duration
	drainTimeout   time.Duration
	tcpIdleTimeout time.Duration
	dialTimeout    time.Duration
	dialAttempts   int
	iptablesWait   time.Duration
	cleanupAndExit bool

	// Parsed by validate.
	ports       proxy.PortRange
	balancerKnd balancer.Kind
}

func (o *runOptions) register(fs *pflag.FlagSet) {
	fs.StringVar(&o.config, "config", "", "A manifest file, or a folder of them, holding v1 Services and discovery.k8s.io/v1 EndpointSlices (YAML or JSON, multi-document). Reloaded when it changes.")
	fs.StringVar(&o.mode, "mode", "redirect", "How traffic reaches the listeners: redirect (iptables REDIRECT in the nat table).")
	fs.StringVar(&o.portRange, "proxy-port-range", "", "Local ports for the listeners: begin-end, begin+offset or a single port. Empty means kernel-assigned ports.")
	fs.StringVar(&o.balancer, "balancer", string(balancer.RoundRobin), fmt.Sprintf("Default balancer for services without the %s annotation: one of %v.", proxy.AnnotationBalancer, balancer.Kinds))
	fs.DurationVar(&o.syncPeriod, "iptables-sync-period", 30*time.Second, "The longest time between two full syncs: rules deleted or changed by someone else are repaired within this period.")
	fs.DurationVar(&o.minSyncPeriod, "iptables-min-sync-period", time.Second, "The shortest time between two syncs: changes arriving faster are applied together.")
	fs.DurationVar(&o.drainTimeout, "drain-timeout", 25*time.Second, "On SIGTERM or SIGINT, how long established connections may take to finish before they are closed.")
	fs.DurationVar(&o.tcpIdleTimeout, "tcp-idle-timeout", time.Hour, "Close a proxied TCP connection after it has been idle in both directions for this long (detected within twice the period). 0 disables.")
	fs.DurationVar(&o.dialTimeout, "endpoint-dial-timeout", time.Second, "How long one connection attempt to an endpoint may take before the next endpoint is tried.")
	fs.IntVar(&o.dialAttempts, "endpoint-dial-attempts", 3, "How many endpoints a new connection tries before it is refused.")
	fs.DurationVar(&o.iptablesWait, "iptables-wait", 5*time.Second, "How long iptables commands wait for the xtables lock.")
	fs.BoolVar(&o.cleanupAndExit, "cleanup", false, "Remove uproxy's rules and exit (the same as `uproxy cleanup`, named as in kube-proxy).")
}

// validate checks the options once and parses what needs parsing.
func (o *runOptions) validate() error {
	if o.cleanupAndExit {
		return nil
	}
	var errs []error
	if o.config == "" {
		errs = append(errs, errors.New("--config is required: a manifest file or folder"))
	}
	if o.mode != "redirect" {
		errs = append(errs, fmt.Errorf("--mode: %q is not supported (want redirect)", o.mode))
	}
	var err error
	if o.ports, err = proxy.ParsePortRange(o.portRange); err != nil {
		errs = append(errs, fmt.Errorf("--proxy-port-range: %w", err))
	}
	if o.balancerKnd, err = balancer.ParseKind(o.balancer); err != nil {
		errs = append(errs, fmt.Errorf("--balancer: %w", err))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
		zero bool // zero allowed
	}{
		{"--iptables-sync-period", o.syncPeriod, false},
		{"--iptables-min-sync-period", o.minSyncPeriod, true},
		{"--drain-timeout", o.drainTimeout, true},
		{"--tcp-idle-timeout", o.tcpIdleTimeout, true},
		{"--endpoint-dial-timeout", o.dialTimeout, false},
		{"--iptables-wait", o.iptablesWait, false},
	} {
		if d.v < 0 || (d.v == 0 && !d.zero) {
			errs = append(errs, fmt.Errorf("%s: %v must be positive", d.name, d.v))
		}
	}
	if o.minSyncPeriod > o.syncPeriod && o.syncPeriod > 0 {
		errs = append(errs, fmt.Errorf("--iptables-min-sync-period (%v) is longer than --iptables-sync-period (%v)", o.minSyncPeriod, o.syncPeriod))
	}
	if o.dialAttempts < 1 {
		errs = append(errs, fmt.Errorf("--endpoint-dial-attempts: %d must be at least 1", o.dialAttempts))
	}
	return errors.Join(errs...)
}

func newRunCommand(lf *logFlags) *cobra.Command {
	var o runOptions
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Proxy the Services found in manifests",
		Long: `run installs iptables REDIRECT rules for every ClusterIP Service port and serves each
on its own local listener, balancing new connections over the ready endpoints of the
Service's EndpointSlices.

On SIGTERM or SIGINT it stops accepting, lets established connections finish for up to
--drain-timeout, and leaves the rules in place for the next instance to adopt
(remove them with 'uproxy cleanup').`,
		Example: `  uproxy run --config deploy/examples/
  uproxy run --config services.yaml --balancer least-conn --proxy-port-range 40000-40999`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := o.validate(); err != nil {
				return err
			}
			log, err := lf.logger()
			if err != nil {
				return err
			}
			defer log.Sync()
			if o.cleanupAndExit {
				return cleanup(context.Background())
			}
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			return run(ctx, &o, log)
		},
	}
	o.register(cmd.Flags())
	return cmd
}

// run wires the proxier to its source and the kernel, and runs until ctx
// is done; then it drains.
func run(ctx context.Context, o *runOptions, log *zap.Logger) error {
	// Read the manifests before touching the kernel: a typo must stop us
	// with the file and document named, not after half a setup.
	rules := &kernelRules{log: log.Named("rules")}
	p := proxy.NewProxier(proxy.Config{
		Rules:        rules,
		OriginalDst:  redirect.OriginalDst,
		PortRange:    o.ports,
		Defaults:     proxy.ServiceDefaults{Balancer: o.balancerKnd},
		Sync:         proxy.RunnerConfig{MinInterval: o.minSyncPeriod, MaxInterval: o.syncPeriod},
		DialTimeout:  o.dialTimeout,
		DialAttempts: o.dialAttempts,
		IdleTimeout:  o.tcpIdleTimeout,
		Logger:       log.Named("proxy"),
	})
	src := &proxy.FileSource{Path: o.config, Tracker: p.Tracker(), Logger: log.Named("manifests")}
	if err := src.Load(); err != nil {
		return fmt.Errorf("loading manifests: %w", err)
	}
	if err := rules.init(redirect.Config{Wait: o.iptablesWait}); err != nil {
		return err
	}

	// Goroutines owned here: the sync loop and the file watcher. Both
	// return when ctx is done; wg waits for them before the drain.
	var wg sync.WaitGroup
	wg.Go(func() { p.Run(ctx) })
	wg.Go(func() {
		if err := src.Watch(ctx); err != nil {
			log.Error("not watching manifests for changes", zap.Error(err))
		}
	})
	log.Info("uproxy started", zap.String("config", o.config), zap.String("mode", o.mode), zap.Int("pid", os.Getpid()))
	<-ctx.Done()
	wg.Wait()

	log.Info("stopping: draining connections", zap.Int("active", p.ActiveConnections()), zap.Duration("timeout", o.drainTimeout))
	dctx, cancel := context.WithTimeout(context.Background(), o.drainTimeout)
	defer cancel()
	if err := p.Shutdown(dctx); err != nil {
		log.Warn("drain incomplete", zap.Error(err))
	}
	log.Info("stopped; rules left in place for the next instance")
	return nil
}
