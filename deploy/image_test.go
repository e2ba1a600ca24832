// Package deploy owns the tests of deploy/'s image: its iptables backend
// detection, and the image build.sh makes without a container engine.
package deploy

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/uproxy/uproxy/internal/testlab"
)

// backend prepares a namespace's rules through one iptables backend.
type backend struct {
	mode  string // legacy or nft
	rules string // iptables-restore input, for IPv4
}

// iptablesRestore loads each backend's rules into ns.
func iptablesRestore(t *testing.T, ns string, rules []backend) {
	t.Helper()
	for _, b := range rules {
		cmd := exec.Command("ip", "netns", "exec", ns, "iptables-"+b.mode+"-restore", "--noflush")
		cmd.Stdin = strings.NewReader(b.rules)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("iptables-%s-restore: %v\n%s\n%s", b.mode, err, out, b.rules)
		}
	}
}

// kubeletHint is what kubelet leaves in the mangle table of the backend the
// host uses.
const kubeletHint = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n"

// filterRules is a filter table with n rules.
func filterRules(n int) string {
	var b strings.Builder
	b.WriteString("*filter\n:UPROXY-TEST - [0:0]\n")
	for i := range n {
		fmt.Fprintf(&b, "-A UPROXY-TEST -s 192.0.2.%d/32 -j ACCEPT\n", i+1)
	}
	b.WriteString("COMMIT\n")
	return b.String()
}

var detectCases = []struct {
	name  string
	rules []backend
	want  string
}{
	{"nothing", nil, "nft"},
	{"legacy rules", []backend{{"legacy", filterRules(3)}}, "legacy"},
	{"nft rules", []backend{{"nft", filterRules(3)}}, "nft"},
	{"more legacy rules", []backend{{"legacy", filterRules(5)}, {"nft", filterRules(2)}}, "legacy"},
	{"as many", []backend{{"legacy", filterRules(2)}, {"nft", filterRules(2)}}, "nft"},
	// kubelet's hint outweighs any count of rules.
	{"kubelet on legacy", []backend{{"legacy", kubeletHint}, {"nft", filterRules(10)}}, "legacy"},
	{"kubelet on nft", []backend{{"nft", kubeletHint}, {"legacy", filterRules(10)}}, "nft"},
}

// TestDetectIptablesMode runs deploy/image/detect-iptables-mode with the
// host's iptables in namespaces whose rules live in one backend or the
// other.
func TestDetectIptablesMode(t *testing.T) {
	testlab.RequireRoot(t, "iptables-legacy-restore", "iptables-nft-restore")
	script, err := filepath.Abs(filepath.Join("image", "detect-iptables-mode"))
	if err != nil {
		t.Fatal(err)
	}
	got, want := map[string]string{}, map[string]string{}
	for _, tc := range detectCases {
		ns := testlab.NewNetns(t, "upimg-")
		iptablesRestore(t, ns, tc.rules)
		out, err := exec.Command("ip", "netns", "exec", ns, "sh", script).CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", tc.name, err, out)
		}
		got[tc.name], want[tc.name] = strings.TrimSpace(string(out)), tc.want
		testlab.DeleteNetns(ns)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("detected backend (-want +got):\n%s", diff)
	}
}

// ociImage is what TestImage reads of the image layout.
type ociImage struct {
	name       string            // io.containerd.image.name
	entrypoint []string          // config.Entrypoint
	env        []string          // config.Env
	rootfs     string            // the unpacked layer
	files      map[string]string // symlink targets, for the paths that matter
}

// readImage checks the OCI layout in the tar file path (each blob's digest
// and size, the layer's diff ID) and unpacks its one layer into dir.
func readImage(t *testing.T, path, dir string) ociImage {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	files := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if h.Typeflag == tar.TypeReg {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			files[strings.TrimPrefix(h.Name, "./")] = b
		}
	}
	type descriptor struct {
		MediaType   string
		Digest      string
		Size        int64
		Annotations map[string]string
	}
	blob := func(d descriptor, mediaType string) []byte {
		t.Helper()
		if d.MediaType != mediaType {
			t.Fatalf("descriptor %s: media type %q, want %q", d.Digest, d.MediaType, mediaType)
		}
		b, ok := files["blobs/sha256/"+strings.TrimPrefix(d.Digest, "sha256:")]
		if !ok {
			t.Fatalf("no blob %s", d.Digest)
		}
		sum := sha256.Sum256(b)
		if got := "sha256:" + hex.EncodeToString(sum[:]); got != d.Digest || int64(len(b)) != d.Size {
			t.Fatalf("blob %s: digest %s, size %d, want size %d", d.Digest, got, len(b), d.Size)
		}
		return b
	}
	unmarshal := func(b []byte, v any) {
		t.Helper()
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("%v:\n%s", err, b)
		}
	}
	if string(files["oci-layout"]) != `{"imageLayoutVersion":"1.0.0"}` {
		t.Errorf("oci-layout = %q", files["oci-layout"])
	}
	var index struct{ Manifests []descriptor }
	unmarshal(files["index.json"], &index)
	if len(index.Manifests) != 1 {
		t.Fatalf("index.json has %d manifests, want 1", len(index.Manifests))
	}
	var manifest struct {
		Config descriptor
		Layers []descriptor
	}
	unmarshal(blob(index.Manifests[0], "application/vnd.oci.image.manifest.v1+json"), &manifest)
	var config struct {
		Architecture, OS string
		Config           struct{ Entrypoint, Env []string }
		RootFS           struct {
			Type    string
			DiffIDs []string `json:"diff_ids"`
		}
	}
	unmarshal(blob(manifest.Config, "application/vnd.oci.image.config.v1+json"), &config)
	if len(manifest.Layers) != 1 || len(config.RootFS.DiffIDs) != 1 {
		t.Fatalf("%d layers and %d diff IDs, want 1", len(manifest.Layers), len(config.RootFS.DiffIDs))
	}
	zr, err := gzip.NewReader(bytes.NewReader(blob(manifest.Layers[0], "application/vnd.oci.image.layer.v1.tar+gzip")))
	if err != nil {
		t.Fatal(err)
	}
	layer, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	if sum := sha256.Sum256(layer); "sha256:"+hex.EncodeToString(sum[:]) != config.RootFS.DiffIDs[0] {
		t.Errorf("the layer's diff ID is %x, the config says %s", sum, config.RootFS.DiffIDs[0])
	}
	img := ociImage{
		name:       index.Manifests[0].Annotations["io.containerd.image.name"],
		entrypoint: config.Config.Entrypoint,
		env:        config.Config.Env,
		rootfs:     dir,
		files:      map[string]string{},
	}
	// tar can unpack what the kernel will run; Go's archive/tar checks
	// the headers above.
	cmd := exec.Command("tar", "-x", "-C", dir)
	cmd.Stdin = bytes.NewReader(layer)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("unpacking the layer: %v\n%s", err, out)
	}
	for _, p := range []string{"usr/local/bin/kube-proxy", "usr/local/lib/uproxy/kube-proxy", "usr/local/sbin/iptables-restore"} {
		img.files[p], _ = os.Readlink(filepath.Join(dir, p))
	}
	return img
}

// TestImage builds the image with deploy/image/build.sh (Debian packages
// fetched with apt-get download, no container engine), checks its OCI
// layout, and runs it with chroot in namespaces whose rules live in one
// iptables backend or the other: uproxy, started by the entrypoint as a
// container would, removes its chains from the host's backend.
func TestImage(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping: downloads Debian packages and builds an image (not -short)")
	}
	testlab.RequireRoot(t, "apt-get", "dpkg-deb", "chroot", "unshare", "iptables-legacy-restore", "iptables-nft-restore")
	tmp := t.TempDir()
	uproxy := filepath.Join(tmp, "uproxy")
	build := exec.Command("go", "build", "-trimpath", "-o", uproxy, "../cmd/uproxy")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building uproxy: %v\n%s", err, out)
	}
	tarball := filepath.Join(tmp, "uproxy-image.tar")
	if out, err := exec.Command("bash", filepath.Join("image", "build.sh"), uproxy, tarball, "uproxy:test").CombinedOutput(); err != nil {
		if os.Getenv("CI") == "" && bytes.Contains(out, []byte("Failed to fetch")) {
			t.Skipf("skipping: apt-get download failed (no Debian mirror?):\n%s", out)
		}
		t.Fatalf("build.sh: %v\n%s", err, out)
	}
	rootfs := filepath.Join(tmp, "rootfs")
	if err := os.Mkdir(rootfs, 0o755); err != nil {
		t.Fatal(err)
	}
	img := readImage(t, tarball, rootfs)
	type summary struct {
		Name       string
		Entrypoint []string
		Env        []string
		Links      map[string]string
	}
	want := summary{
		Name:       "docker.io/library/uproxy:test",
		Entrypoint: []string{"/usr/local/bin/uproxy-entrypoint"},
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		Links: map[string]string{
			"usr/local/bin/kube-proxy":        "uproxy-entrypoint",
			"usr/local/lib/uproxy/kube-proxy": "../../bin/uproxy",
			"usr/local/sbin/iptables-restore": "iptables-wrapper",
		},
	}
	if diff := cmp.Diff(want, summary{img.name, img.entrypoint, img.env, img.files}); diff != "" {
		t.Errorf("image (-want +got):\n%s", diff)
	}

	// run runs argv in the image, in ns, with the image's environment,
	// the host's /dev as a container runtime gives one, and a /proc of its
	// own (iptables-legacy reads /proc/net), in a mount namespace of its
	// own.
	run := func(ns string, argv ...string) (string, error) {
		script := `mount --rbind /dev "$0/dev" && mount -t proc proc "$0/proc" && exec chroot "$@"`
		cmd := exec.Command("ip", append([]string{"netns", "exec", ns, "unshare", "--mount", "--fork",
			"sh", "-c", script, rootfs, rootfs}, argv...)...)
		cmd.Env = img.env
		out, err := cmd.CombinedOutput()
		return string(out), err
	}

	// The entrypoint runs uproxy, and so does kubeadm's command, under
	// the name kube-proxy: with kube-proxy's --version once uproxy takes
	// kube-proxy's command line under that name, with uproxy's
	// version subcommand before.
	ns := testlab.NewNetns(t, "upimg-")
	if out, err := run(ns, "/usr/local/bin/uproxy-entrypoint", "version"); err != nil || !strings.HasPrefix(out, "uproxy ") {
		t.Errorf("uproxy-entrypoint version: %v\n%s", err, out)
	}
	out, err := run(ns, "/usr/local/bin/kube-proxy", "--version")
	if err != nil {
		out, err = run(ns, "/usr/local/bin/kube-proxy", "version")
	}
	if err != nil || strings.TrimSpace(out) == "" {
		t.Errorf("kube-proxy --version: %v\n%s", err, out)
	}

	// The entrypoint's uproxy works on the host's backend: its cleanup
	// finds a chain of uproxy's where the kubelet hint says the rules are.
	chain := "*nat\n:UPROXY-SERVICES - [0:0]\n-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -j RETURN\nCOMMIT\n"
	for _, host := range []string{"legacy", "nft"} {
		other := map[string]string{"legacy": "nft", "nft": "legacy"}[host]
		ns := testlab.NewNetns(t, "upimg-")
		// The same chain in the other backend, which must be left alone.
		iptablesRestore(t, ns, []backend{{host, kubeletHint + chain}, {other, chain}})
		if out, err := run(ns, "/usr/local/bin/uproxy-entrypoint", "cleanup"); err != nil {
			t.Fatalf("host on %s: uproxy cleanup: %v\n%s", host, err, out)
		}
		for mode, wantChain := range map[string]bool{host: false, other: true} {
			out, err := exec.Command("ip", "netns", "exec", ns, "iptables-"+mode+"-save", "-t", "nat").CombinedOutput()
			if err != nil {
				t.Fatalf("iptables-%s-save: %v\n%s", mode, err, out)
			}
			if got := strings.Contains(string(out), ":UPROXY-SERVICES"); got != wantChain {
				t.Errorf("host on %s: after cleanup, %s has UPROXY-SERVICES: %v, want %v\n%s", host, mode, got, wantChain, out)
			}
		}
		// And a shell in the container, without the entrypoint, detects too.
		out, err := run(ns, "/usr/local/sbin/iptables-save", "-t", "mangle")
		if err != nil || !strings.Contains(out, "KUBE-IPTABLES-HINT") {
			t.Errorf("host on %s: iptables-save in the image does not see kubelet's hint: %v\n%s", host, err, out)
		}
		testlab.DeleteNetns(ns)
	}
}
