// Command testpeer is the backend and client program that the end-to-end
// tests start inside a lab's pods (see package testpeer).
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/uproxy/uproxy/internal/testpeer"
)

func main() {
	root := &cobra.Command{
		Use:           "testpeer",
		Short:         "HTTP and UDP backends and clients for uproxy's namespace lab",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(testpeer.Commands()...)
	if err := root.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "testpeer:", err)
		os.Exit(1)
	}
}
