package source

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/uproxy/uproxy/proxy/changes"
)

// TestFileSourceLoadNothingToServe checks that manifests without a
// Service or an EndpointSlice fail to load, naming what they hold, and
// that kube-proxy's configuration file is pointed to --config.
func TestFileSourceLoadNothingToServe(t *testing.T) {
	const kubeProxyConfig = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: \"\"\n"
	const deployment = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n"
	const configMap = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
	tests := []struct {
		name    string
		files   map[string]string
		file    string // Path is this file of the folder; empty means the folder
		wantErr string // with DIR for the folder; empty means it loads
	}{
		{"empty folder", nil, "", "DIR: no manifest files (*.yaml, *.yml, *.json): no Service and no EndpointSlice to serve"},
		{"empty documents", map[string]string{"a.yaml": "# nothing\n"}, "", "DIR: 1 manifest files, no Service and no EndpointSlice in them (every document is empty)"},
		{"other kinds", map[string]string{"a.yaml": deployment, "b.yaml": configMap}, "",
			"DIR: no Service and no EndpointSlice, only apps/v1/Deployment in DIR/a.yaml, v1/ConfigMap in DIR/b.yaml"},
		{"kubeadm's config.conf", map[string]string{"config.conf": kubeProxyConfig}, "config.conf",
			"DIR/config.conf: no Service and no EndpointSlice, only kubeproxy.config.k8s.io/v1alpha1/KubeProxyConfiguration in DIR/config.conf: a KubeProxyConfiguration is kube-proxy's configuration file; pass it with --config, and Service manifests with --manifests"},
		{"a service among other kinds", map[string]string{"a.yaml": deployment, "b.yaml": webYAML}, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			for name, content := range tt.files {
				writeFile(t, filepath.Join(dir, name), content)
			}
			fs := &FileSource{Path: filepath.Join(dir, tt.file), Tracker: changes.NewTracker(nil, nil)}
			got := ""
			if err := fs.Load(); err != nil {
				got = strings.ReplaceAll(err.Error(), dir, "DIR")
			}
			if diff := cmp.Diff(tt.wantErr, got); diff != "" {
				t.Errorf("Load() error (-want +got):\n%s", diff)
			}
		})
	}
}
