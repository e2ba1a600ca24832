// Package paths is the data-path part of the bench: the data paths it
// compares (All: direct, kernel DNAT, kube-proxy, HAProxy, nginx, the
// reference Go proxies and uproxy's modes, each with how to start it in
// the lab), a baseline binary's twin of each uproxy path
// (baselinepaths.go), and Run, which measures every workload through
// every selected path, run after run, interleaved.
package paths
