// Command bench is uproxy's lab tool: the network-namespace lab, the
// backends and load generators that run inside it, the demo, and the
// side-by-side benchmarks.
//
//	cd bench && go run . <part> [flags]
//
// This package is the command (commands.go wires the parts); the parts
// and what they share are packages under internal/ (README.md maps them).
//
// It measures uproxy from outside, as a binary, and imports none of its
// packages but the test fixtures it shares with uproxy's own tests
// (internal/testlab, testkube, testpeer) and internal/uring, the ring
// that its io_uring yardstick (`bench uring`) is built on.
package main

import (
	"fmt"
	"os"

	"github.com/uproxy/uproxy/bench/internal/load"

	"github.com/spf13/cobra"

	"github.com/uproxy/uproxy/internal/testpeer"
)

func main() {
	root := &cobra.Command{
		Use:           "bench",
		Short:         "uproxy's lab: backends, clients, the demo and the benchmarks, in network namespaces",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(testpeer.Commands()...)
	root.AddCommand(newDemoCommand())
	root.AddCommand(load.NewBackendCommand(), load.NewLoadCommand(), load.NewIOCopyCommand(), load.NewURingCommand())
	root.AddCommand(newPartCommands()...)
	if err := root.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}
