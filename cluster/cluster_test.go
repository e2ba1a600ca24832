// Package cluster holds the dev cluster's scripts (cluster.sh, images.sh,
// conformance.sh) and their test; see docs/dev-cluster.md.
package cluster

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testlab"
)

// cachedBuilds are the files `make cluster-build` leaves in bench/.cache
// that the cluster runs.
var cachedBuilds = []string{
	"bin/kube-apiserver", "bin/kube-controller-manager", "bin/kube-scheduler", "bin/kubelet",
	"bin/kubectl", "bin/coredns", "bin/pause", "bin/agnhost", "bin/uproxy", "images/pause.tar", "images/coredns.tar", "images/agnhost.tar",
	"images/uproxy.tar",
}

// TestDevClusterInNamespace starts the dev cluster (a real kubelet,
// containerd, CoreDNS and uproxy's DaemonSet) in a network namespace of its
// own, lets cluster.sh up check that a pod resolves kubernetes.default and
// reaches it through uproxy, in redirect and then tproxy mode, and that
// down stops all of it and leaves the host's mounts and paths as they
// were. It runs only when the builds are cached (make cluster-build),
// since building them takes many minutes, and says so when it skips.
func TestDevClusterInNamespace(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping: starts a Kubernetes node (not -short)")
	}
	testlab.RequireRoot(t, "containerd", "runc", "ctr", "nsenter", "openssl", "etcd", "iptables")
	cache, err := filepath.Abs(filepath.Join("..", "bench", ".cache"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range cachedBuilds {
		if _, err := os.Stat(filepath.Join(cache, f)); err != nil {
			t.Skipf("skipping: the dev cluster's builds are not cached (%s is missing): `make cluster-build` makes them", filepath.Join(cache, f))
		}
	}
	if _, err := os.Stat("/usr/lib/cni/bridge"); err != nil {
		t.Skip("skipping: the CNI plugins are not installed (`make deps-cluster` installs them)")
	}
	ns := testlab.UniqueName("upcl-")
	env := append(os.Environ(),
		"CLUSTER_NETNS="+ns,
		"CLUSTER_STATE=/var/lib/"+ns,
		"CLUSTER_CACHE="+cache,
		"CLUSTER_NODE_NAME="+ns,
	)
	// Each command has its own limit, so that the cleanup's down runs
	// whatever happened before.
	script := func(args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "bash", append([]string{"cluster.sh"}, args...)...)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	t.Cleanup(func() {
		// Down again is harmless, and stops whatever a failed up left.
		if out, err := script("down"); err != nil {
			t.Errorf("cluster.sh down (cleanup): %v\n%s", err, out)
		}
	})
	out, err := script("up")
	if err != nil {
		t.Fatalf("cluster.sh up: %v\n%s", err, out)
	}
	if !strings.Contains(out, "check: a pod resolved kubernetes.default to 10.96.0.1 over UDP and TCP and connected to it") {
		t.Errorf("cluster.sh up did not report the pod's check:\n%s", out)
	}
	if out, err := script("up"); err != nil || !strings.Contains(out, "already running") {
		t.Errorf("a second cluster.sh up: %v, want it to find the cluster running:\n%s", err, out)
	}
	// tproxy mode answers DNS from port 53 of the kube-dns address, which
	// the DaemonSet's capabilities must allow.
	if out, err := script("mode", "tproxy"); err != nil {
		t.Fatalf("cluster.sh mode tproxy: %v\n%s", err, out)
	}
	if out, err := script("check"); err != nil || !strings.Contains(out, "check: a pod resolved kubernetes.default") {
		t.Errorf("the check in tproxy mode: %v\n%s", err, out)
	}
	out, err = script("down")
	if err != nil {
		t.Fatalf("cluster.sh down: %v\n%s", err, out)
	}
	if !strings.Contains(out, "the host is as before") {
		t.Errorf("cluster.sh down did not find the host as before:\n%s", out)
	}
	if _, err := os.Stat("/run/netns/" + ns); err == nil {
		t.Errorf("the namespace %s is still there after down", ns)
	}
}
