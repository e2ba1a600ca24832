// Package testpeer owns the programs that run inside a lab's pods: HTTP and
// UDP backends that answer with who they are and who asked, and their clients.
//
// A backend answers with its name and the client address it sees; a
// client counts how the answers spread.
//
// The end-to-end tests run them as the testpeer command (cmd/testpeer,
// built by testlab.BuildBinaries); the bench tool serves the same
// subcommands, so its demo and harness run themselves as peers.
package testpeer

import "github.com/spf13/cobra"

// Commands returns a fresh set of the peer subcommands: serve, get,
// udp-serve and udp-query.
func Commands() []*cobra.Command {
	return []*cobra.Command{NewServeCommand(), NewGetCommand(), NewUDPServeCommand(), NewUDPQueryCommand()}
}
