// Command pause is the dev cluster's pod sandbox: the process that holds a
// pod's namespaces open while its containers come and go, as Kubernetes'
// pause image does. cluster/images.sh packs it as registry.k8s.io/pause.
//
// As a pod's PID 1 (with a shared process namespace) it reaps the orphans
// the kernel re-parents to it, and it exits on SIGINT or SIGTERM, which
// the runtime sends when it stops the sandbox.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		os.Stdout.WriteString("pause (uproxy dev cluster)\n")
		return
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		reap()
	}
}

// reap collects every exited child without blocking: one SIGCHLD may stand
// for several exits, since the kernel does not queue standard signals.
func reap() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}
