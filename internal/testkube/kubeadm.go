package testkube

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"text/template"
)

// KubeadmProxy is what kubeadm creates for kube-proxy in a new cluster
// (`kubeadm init`'s addon/kube-proxy phase), rendered from the templates and
// constants of the k8s.io/kubernetes release that bench/tools pins, so that
// tests patch or run exactly what a kubeadm cluster holds, not a copy typed
// by hand.
type KubeadmProxy struct {
	// ConfigMap is the kube-proxy ConfigMap's manifest: kubeconfig.conf,
	// whose server is the control-plane endpoint, and ConfigKey, the
	// KubeProxyConfiguration.
	ConfigMap []byte
	// DaemonSet is the kube-proxy DaemonSet's manifest.
	DaemonSet []byte
	// Config is the KubeProxyConfiguration in the ConfigMap.
	Config []byte
	// ConfigMapName and ConfigKey name the ConfigMap and its
	// KubeProxyConfiguration key (kubeadm's KubeProxyConfigMap and
	// KubeProxyConfigMapKey).
	ConfigMapName, ConfigKey string
	// ClusterRoleBinding binds the kube-proxy ServiceAccount to
	// ClusterRole (kubeadm's KubeProxyClusterRoleBindingName and
	// KubeProxyClusterRoleName).
	ClusterRoleBinding, ClusterRole string
	// Image is the image kubeadm puts in the DaemonSet.
	Image string
}

// KubeadmProxyOptions configures RenderKubeadmProxy. Every field is
// required.
type KubeadmProxyOptions struct {
	// Root is the uproxy module root (bench/tools holds the pin).
	Root string
	// KubeProxy is the kube-proxy binary of the same release; its
	// --write-config-to gives the defaulted KubeProxyConfiguration.
	KubeProxy string
	// ControlPlaneEndpoint is the API server's URL, kubeadm's
	// controlPlaneEndpoint (or the advertise address).
	ControlPlaneEndpoint string
	// PodSubnet is kubeadm's networking.podSubnet, which becomes the
	// configuration's clusterCIDR.
	PodSubnet string
}

// RenderKubeadmProxy renders kubeadm's kube-proxy ConfigMap and DaemonSet as
// `kubeadm init` would for opts: the template text and names come from
// cmd/kubeadm in the pinned k8s.io/kubernetes source (downloaded into the
// module cache if need be), and the KubeProxyConfiguration is kube-proxy's
// own default with the fields kubeadm sets (bindAddress, clusterCIDR,
// clientConnection.kubeconfig, mode).
func RenderKubeadmProxy(ctx context.Context, opts KubeadmProxyOptions) (*KubeadmProxy, error) {
	src, err := kubernetesSource(ctx, opts.Root)
	if err != nil {
		return nil, err
	}
	kubeadm := filepath.Join(src, "cmd", "kubeadm", "app")
	tmpl, err := goStringConsts(filepath.Join(kubeadm, "phases", "addons", "proxy", "manifests.go"),
		"KubeProxyConfigMap19", "KubeProxyDaemonSet19")
	if err != nil {
		return nil, err
	}
	names, err := goStringConsts(filepath.Join(kubeadm, "constants", "constants.go"),
		"KubeProxyConfigMap", "KubeProxyConfigMapKey", "KubeProxyClusterRoleName", "KubeProxyClusterRoleBindingName",
		"KubeProxy")
	if err != nil {
		return nil, err
	}
	repo, err := goStringConsts(filepath.Join(kubeadm, "apis", "kubeadm", "v1beta4", "defaults.go"), "DefaultImageRepository")
	if err != nil {
		return nil, err
	}
	version, err := kubernetesVersion(ctx, opts.Root)
	if err != nil {
		return nil, err
	}
	p := &KubeadmProxy{
		ConfigMapName:      names["KubeProxyConfigMap"],
		ConfigKey:          names["KubeProxyConfigMapKey"],
		ClusterRole:        names["KubeProxyClusterRoleName"],
		ClusterRoleBinding: names["KubeProxyClusterRoleBindingName"],
		// images.GetKubernetesImage: repository/kube-proxy:version.
		Image: repo["DefaultImageRepository"] + "/" + names["KubeProxy"] + ":" + version,
	}

	// kubeadm's componentconfigs kubeProxyConfig.Default sets these.
	dir, err := os.MkdirTemp("", "uproxy-kubeadm-")
	if err != nil {
		return nil, fmt.Errorf("rendering kubeadm's kube-proxy config: %w", err)
	}
	defer os.RemoveAll(dir)
	cfgFile := filepath.Join(dir, p.ConfigKey)
	out, err := exec.CommandContext(ctx, opts.KubeProxy, "--write-config-to="+cfgFile,
		"--bind-address=0.0.0.0", "--cluster-cidr="+opts.PodSubnet,
		"--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf", "--proxy-mode=iptables").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("%s --write-config-to: %w:\n%s", opts.KubeProxy, err, out)
	}
	if p.Config, err = os.ReadFile(cfgFile); err != nil {
		return nil, fmt.Errorf("rendering kubeadm's kube-proxy config: %w", err)
	}
	// createKubeProxyConfigMap indents the configuration by four spaces to
	// fit the template.
	var indented strings.Builder
	sc := bufio.NewScanner(bytes.NewReader(p.Config))
	for sc.Scan() {
		fmt.Fprintf(&indented, "    %s\n", sc.Text())
	}

	if p.ConfigMap, err = renderTemplate("KubeProxyConfigMap19", tmpl["KubeProxyConfigMap19"], struct {
		ControlPlaneEndpoint, ProxyConfig, ProxyConfigMap, ProxyConfigMapKey string
	}{opts.ControlPlaneEndpoint, indented.String(), p.ConfigMapName, p.ConfigKey}); err != nil {
		return nil, err
	}
	if p.DaemonSet, err = renderTemplate("KubeProxyDaemonSet19", tmpl["KubeProxyDaemonSet19"], struct {
		Image, ProxyConfigMap, ProxyConfigMapKey string
	}{p.Image, p.ConfigMapName, p.ConfigKey}); err != nil {
		return nil, err
	}
	return p, nil
}

func renderTemplate(name, text string, data any) ([]byte, error) {
	t, err := template.New(name).Parse(text)
	if err != nil {
		return nil, fmt.Errorf("parsing kubeadm's %s: %w", name, err)
	}
	var b bytes.Buffer
	if err := t.Execute(&b, data); err != nil {
		return nil, fmt.Errorf("rendering kubeadm's %s: %w", name, err)
	}
	return b.Bytes(), nil
}

// toolsGo runs the go command in bench/tools, that module alone.
func toolsGo(ctx context.Context, root string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = filepath.Join(root, "bench", "tools")
	cmd.Env = append(os.Environ(), "GOWORK=off")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go %s in bench/tools: %w:\n%s", strings.Join(args, " "), err, stderr.Bytes())
	}
	return out, nil
}

// kubernetesSource returns the module cache folder of the pinned
// k8s.io/kubernetes, downloading it if it is missing.
func kubernetesSource(ctx context.Context, root string) (string, error) {
	out, err := toolsGo(ctx, root, "mod", "download", "-json", "k8s.io/kubernetes")
	if err != nil {
		return "", err
	}
	var m struct{ Dir, Error string }
	if err := json.Unmarshal(out, &m); err != nil {
		return "", fmt.Errorf("go mod download k8s.io/kubernetes: %w", err)
	}
	if m.Error != "" || m.Dir == "" {
		return "", fmt.Errorf("go mod download k8s.io/kubernetes: %q", m.Error)
	}
	return m.Dir, nil
}

// kubernetesVersion returns the pinned k8s.io/kubernetes version (v1.x.y),
// which is kubeadm's image tag for it.
func kubernetesVersion(ctx context.Context, root string) (string, error) {
	out, err := toolsGo(ctx, root, "list", "-m", "-f", "{{.Version}}", "k8s.io/kubernetes")
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(out)), nil
}

// goStringConsts returns the values of the named string constants of a Go
// source file. Each must be a string literal (or a concatenation of them).
func goStringConsts(file string, names ...string) (map[string]string, error) {
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.SkipObjectResolution)
	if err != nil {
		return nil, fmt.Errorf("reading constants: %w", err)
	}
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}
	found := map[string]string{}
	var errs []error
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			continue
		}
		for _, s := range g.Specs {
			vs := s.(*ast.ValueSpec)
			for i, id := range vs.Names {
				if !want[id.Name] || i >= len(vs.Values) {
					continue
				}
				v, err := stringLiteral(vs.Values[i])
				if err != nil {
					errs = append(errs, fmt.Errorf("%s: constant %s: %w", file, id.Name, err))
					continue
				}
				found[id.Name] = v
			}
		}
	}
	for _, n := range names {
		if _, ok := found[n]; !ok {
			errs = append(errs, fmt.Errorf("%s: no string constant %s", file, n))
		}
	}
	return found, errors.Join(errs...)
}

func stringLiteral(e ast.Expr) (string, error) {
	switch e := e.(type) {
	case *ast.BasicLit:
		if e.Kind == token.STRING {
			return strconv.Unquote(e.Value)
		}
	case *ast.BinaryExpr:
		if e.Op == token.ADD {
			x, err := stringLiteral(e.X)
			if err != nil {
				return "", err
			}
			y, err := stringLiteral(e.Y)
			return x + y, err
		}
	case *ast.ParenExpr:
		return stringLiteral(e.X)
	}
	return "", fmt.Errorf("%T is not a string literal", e)
}
