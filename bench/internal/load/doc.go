// Package load is the bench's traffic: the load generators and their
// latency histograms (load.go, hist.go), the backends they talk to
// (backend.go), and the two reference proxies that the data-path table
// measures beside uproxy, a goroutine per direction with io.Copy
// (iocopy.go) and an io_uring event loop (uring.go). Each is also a
// subcommand of bench, which runs in the lab's namespaces.
package load
