package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/vishvananda/netlink"

	"github.com/uproxy/uproxy/internal/testlab"
)

// fakeExec records the commands cleanupKubeProxyIPVS runs.
type fakeExec struct{ calls []string }

func (f *fakeExec) Run(_ context.Context, name string, args []string, _ []byte) ([]byte, error) {
	f.calls = append(f.calls, name+" "+strings.Join(args, " "))
	return nil, nil
}

// TestCleanupKubeProxyIPVS checks the IPVS part of kube-proxy's cleanup
// in a namespace of its own: the kube-ipvs0 link goes whether or not the
// kernel has IPVS; where it has (the /proc file exists), the virtual
// servers are flushed with ipvsadm, and without ipvsadm the error says
// what remains.
func TestCleanupKubeProxyIPVS(t *testing.T) {
	if !testlab.RunInNetns(t) {
		return
	}
	dir := t.TempDir()
	proc := filepath.Join(dir, "ip_vs")
	bin := filepath.Join(dir, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	addLink := func() {
		t.Helper()
		// Dummy links may be missing from the kernel; the cleanup
		// deletes the link by name, whatever its kind.
		if out, err := exec.Command("ip", "link", "add", kubeIPVSLink, "type", "veth", "peer", "name", "kipvs-peer").CombinedOutput(); err != nil {
			t.Fatalf("ip link add: %v: %s", err, out)
		}
	}
	for _, tt := range []struct {
		name       string
		kernelIPVS bool
		ipvsadm    bool
		wantCalls  []string
		wantN      int
		wantErr    string
	}{
		{"no IPVS in the kernel", false, false, nil, 1, ""},
		{"IPVS and ipvsadm", true, true, []string{"ipvsadm --clear"}, 2, ""},
		{"IPVS without ipvsadm", true, false, nil, 1, "ipvsadm is not installed"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			addLink()
			os.Remove(proc)
			if tt.kernelIPVS {
				if err := os.WriteFile(proc, nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			os.Remove(filepath.Join(bin, "ipvsadm"))
			if tt.ipvsadm {
				if err := os.WriteFile(filepath.Join(bin, "ipvsadm"), []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			t.Setenv("PATH", bin+":"+os.Getenv("PATH"))
			x := &fakeExec{}
			n, err := cleanupKubeProxyIPVS(t.Context(), x, proc)
			if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Errorf("error %v, want %q", err, tt.wantErr)
			}
			if n != tt.wantN {
				t.Errorf("removed %d, want %d", n, tt.wantN)
			}
			if diff := cmp.Diff(tt.wantCalls, x.calls); diff != "" {
				t.Errorf("commands (-want +got):\n%s", diff)
			}
			if _, err := netlink.LinkByName(kubeIPVSLink); err == nil {
				t.Errorf("%s is still there", kubeIPVSLink)
			}
		})
	}
}
