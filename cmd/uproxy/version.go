package main

import (
	"fmt"
	"runtime/debug"

	"github.com/spf13/cobra"
)

func newVersionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version and build information",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			fmt.Fprintln(cmd.OutOrStdout(), "uproxy", buildVersion())
			return nil
		},
	}
}

// version is the release the binary was built as, stamped by the
// Makefile from git (-ldflags -X main.version=...): a tag, or the
// commits since one and the revision, with -dirty for a modified tree.
// Empty means an unstamped build (go build, go install), which reports
// the module's version, "(devel)" in a checkout.
var version string

// buildVersion returns the version, VCS revision and Go version the
// binary was built with.
func buildVersion() string {
	return formatVersion(version, debug.ReadBuildInfo)
}

// formatVersion is buildVersion, with the stamp and the build information
// given.
func formatVersion(stamp string, read func() (*debug.BuildInfo, bool)) string {
	bi, ok := read()
	if !ok {
		if stamp == "" {
			return "(unknown)"
		}
		return stamp
	}
	v := stamp
	if v == "" {
		v = bi.Main.Version
	}
	for _, s := range bi.Settings {
		if s.Key == "vcs.revision" {
			v += " " + s.Value
		}
	}
	return v + " " + bi.GoVersion
}
