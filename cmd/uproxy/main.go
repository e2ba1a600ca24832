// Command uproxy owns the flags, the environment and the wiring of uproxy,
// and the clients of a running one (status, explain, cleanup).
//
// uproxy is a userspace Kubernetes service proxy: it watches Services and
// EndpointSlices (or a folder of their manifests), installs iptables rules
// that send each Service's virtual IP to a local listener, and carries the
// connections to endpoints chosen by pluggable balancers. This is the only
// package that reads flags and the environment and wires concrete types
// together.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

func main() {
	root := newRootCommand()
	// Run as kube-proxy, or with flags and no subcommand, uproxy is
	// `uproxy run`, so that kube-proxy's DaemonSets run it unchanged.
	root.SetArgs(kubeProxyArgs(os.Args[0], os.Args[1:], subcommandNames(root)))
	if err := root.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "uproxy:", err)
		os.Exit(1)
	}
}

func newRootCommand() *cobra.Command {
	var lf logFlags
	root := &cobra.Command{
		Use:   "uproxy",
		Short: "A userspace Kubernetes service proxy: iptables REDIRECT into spliced Go listeners",
		Long: `uproxy proxies Kubernetes Services on a node. iptables rules send each Service's
virtual IP and port to a local listener; the listener carries the connection to an
endpoint picked by the Service's balancer, copying with splice(2).`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	lf.register(root.PersistentFlags())
	root.AddCommand(newRunCommand(&lf), newCleanupCommand(&lf), newStatusCommand(), newExplainCommand(), newVersionCommand())
	return root
}
