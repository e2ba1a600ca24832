package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"

	"github.com/uproxy/uproxy/internal/testwait"
)

// kubeadmAddon is kubeadm v1.37.2's kube-proxy addon, rendered by
// kubeadm's own code (bench/tools/kubeadmproxy).
type kubeadmAddon struct {
	serviceAccount     *v1.ServiceAccount
	clusterRoleBinding *rbacv1.ClusterRoleBinding
	role               *rbacv1.Role
	roleBinding        *rbacv1.RoleBinding
	configMap          *v1.ConfigMap
	daemonSet          *appsv1.DaemonSet
}

// renderKubeadmAddon runs bench/tools/kubeadmproxy for an API server at
// endpoint (host:port) and a pod network, and decodes its objects.
func renderKubeadmAddon(t *testing.T, endpoint, podSubnet string) kubeadmAddon {
	t.Helper()
	cmd := exec.Command("go", "run", "./kubeadmproxy", "-control-plane-endpoint", endpoint, "-pod-subnet", podSubnet)
	cmd.Dir = "../../bench/tools"
	cmd.Env = append(os.Environ(), "GOWORK=off")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("rendering kubeadm's kube-proxy addon: %v\n%s", err, stderr.String())
	}
	var a kubeadmAddon
	rd := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(out)))
	for {
		doc, err := rd.Read()
		if err != nil {
			break
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("decoding kubeadm's addon: %v\n%s", err, doc)
		}
		switch o := obj.(type) {
		case *v1.ServiceAccount:
			a.serviceAccount = o
		case *rbacv1.ClusterRoleBinding:
			a.clusterRoleBinding = o
		case *rbacv1.Role:
			a.role = o
		case *rbacv1.RoleBinding:
			a.roleBinding = o
		case *v1.ConfigMap:
			a.configMap = o
		case *appsv1.DaemonSet:
			a.daemonSet = o
		default:
			t.Fatalf("unexpected %T in kubeadm's addon", obj)
		}
	}
	if a.serviceAccount == nil || a.clusterRoleBinding == nil || a.configMap == nil || a.daemonSet == nil {
		t.Fatalf("kubeadm's addon lacks an object:\n%s", out)
	}
	return a
}

// expandEnv expands $(VAR) references in a container's command from its
// env, as the kubelet does; fieldRef spec.nodeName is nodeName.
func expandEnv(c v1.Container, nodeName string) []string {
	vars := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName":
			vars[e.Name] = nodeName
		case e.ValueFrom == nil:
			vars[e.Name] = e.Value
		}
	}
	ref := regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)
	var out []string
	for _, arg := range c.Command {
		out = append(out, ref.ReplaceAllStringFunc(arg, func(m string) string {
			if v, ok := vars[m[2:len(m)-1]]; ok {
				return v
			}
			return m
		}))
	}
	return append(out, c.Args...)
}

// podMounts is a shell script that gives the command it runs the files a
// kubeadm kube-proxy pod sees, in a mount namespace of its own: the
// ConfigMap at /var/lib/kube-proxy, the service account's token and CA at
// /var/run/secrets/kubernetes.io/serviceaccount, and the image's binary at
// /usr/local/bin/kube-proxy (here uproxy's). The tmpfs mounts hide
// nothing outside that namespace.
const podMounts = `set -eu
mount --make-rprivate /
mount -t tmpfs kube-proxy /var/lib
mkdir /var/lib/kube-proxy
mount --bind "$CONFIGMAP" /var/lib/kube-proxy
run=$(readlink -f /var/run)
mount -t tmpfs kube-proxy "$run"
mkdir -p "$run/secrets/kubernetes.io/serviceaccount"
mount --bind "$SECRETS" "$run/secrets/kubernetes.io/serviceaccount"
mount -t tmpfs kube-proxy /usr/local/bin
touch /usr/local/bin/kube-proxy
mount --bind "$BINARY" /usr/local/bin/kube-proxy
exec "$@"
`

// TestE2EKubeadmCommandLine runs uproxy as kubeadm v1.37.2 runs
// kube-proxy: the DaemonSet's exact command line, with the ConfigMap's
// files and the service account's credentials where the pod has them,
// and the addon's RBAC, against a real API server; then Services work.
func TestE2EKubeadmCommandLine(t *testing.T) {
	// As kubeadm's API server: kube-proxy's pod is privileged.
	c := newKubeCluster(t, 2, "--allow-privileged=true")
	ctx := context.Background()
	client := c.cp.Client
	server, err := url.Parse(c.cp.Server)
	if err != nil {
		t.Fatal(err)
	}
	addon := renderKubeadmAddon(t, server.Host, "10.244.0.0/16")

	// The addon's objects, as kubeadm creates them.
	if _, err := client.CoreV1().ServiceAccounts("kube-system").Create(ctx, addon.serviceAccount, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.RbacV1().ClusterRoleBindings().Create(ctx, addon.clusterRoleBinding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.RbacV1().Roles("kube-system").Create(ctx, addon.role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.RbacV1().RoleBindings("kube-system").Create(ctx, addon.roleBinding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cm, err := client.CoreV1().ConfigMaps("kube-system").Create(ctx, addon.configMap, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ds, err := client.AppsV1().DaemonSets("kube-system").Create(ctx, addon.daemonSet, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.cp.CreateNode(ctx, "node-a", "10.244.0.1"); err != nil {
		t.Fatal(err)
	}

	// The pod's files: the ConfigMap's volume, the projected service
	// account token and CA.
	dir := t.TempDir()
	cmDir, secrets := filepath.Join(dir, "configmap"), filepath.Join(dir, "serviceaccount")
	for _, d := range []string{cmDir, secrets} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for name, content := range cm.Data {
		if err := os.WriteFile(filepath.Join(cmDir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tr, err := client.CoreV1().ServiceAccounts("kube-system").CreateToken(ctx, ds.Spec.Template.Spec.ServiceAccountName,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3600)}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(c.cp.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string][]byte{"token": []byte(tr.Status.Token), "ca.crt": ca, "namespace": []byte("kube-system")} {
		if err := os.WriteFile(filepath.Join(secrets, name), content, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	container := ds.Spec.Template.Spec.Containers[0]
	argv := expandEnv(container, "node-a")
	t.Logf("kubeadm's command line: %q", argv)
	if got := fmt.Sprint(argv); got != "[/usr/local/bin/kube-proxy --config=/var/lib/kube-proxy/config.conf --hostname-override=node-a]" {
		t.Logf("kubeadm's command line changed: %s", got)
	}
	launch := append([]string{"env", "CONFIGMAP=" + cmDir, "SECRETS=" + secrets, "BINARY=" + c.uproxy,
		"unshare", "--mount", "--propagation", "private", "sh", "-c", podMounts, "sh"}, argv...)
	if c.up, err = c.lab.Start(c.lab.Node, "kube-proxy", launch...); err != nil {
		t.Fatal(err)
	}

	// A Service with a node port, and its endpoints.
	svc, err := client.CoreV1().Services("default").Create(ctx, &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: v1.ServiceSpec{
			Type:     v1.ServiceTypeNodePort,
			Selector: map[string]string{"app": "web"},
			Ports:    []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.DiscoveryV1().EndpointSlices("default").Create(ctx,
		kubeSlice("web-abc", "web", readyEP(c.pods[0]), readyEP(c.pods[1])), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// A Service with an SCTP port besides its TCP port: the TCP port is
	// served, the SCTP port logged.
	mixed, err := client.CoreV1().Services("default").Create(ctx, &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "mixed"},
		Spec: v1.ServiceSpec{
			Selector: map[string]string{"app": "web"},
			Ports: []v1.ServicePort{
				{Name: "http", Port: 80, TargetPort: intstr.FromString("http")},
				{Name: "sig", Port: 3868, Protocol: v1.ProtocolSCTP},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.DiscoveryV1().EndpointSlices("default").Create(ctx,
		kubeSlice("mixed-abc", "mixed", readyEP(c.pods[0]), readyEP(c.pods[1])), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitServed := func(what, ns, u string) {
		t.Helper()
		testwait.UntilOK(t, 30*time.Second, fmt.Sprintf("%s (%s) served through uproxy", what, u), func() (bool, string) {
			if c.up.Exited() {
				t.Fatalf("uproxy exited:\n%s", c.up.Output())
			}
			r := c.get(ns, u, 6, "--timeout", "1s")
			return r.Errors == 0 && r.Counts["web-0"] > 0 && r.Counts["web-1"] > 0, fmt.Sprintf("%+v\nuproxy:\n%s", r, c.up.Output())
		})
	}
	waitServed("cluster IP from a pod", c.client.NS, "http://"+svc.Spec.ClusterIP+"/")
	waitServed("the TCP port of a service with an SCTP port", c.client.NS, "http://"+mixed.Spec.ClusterIP+"/")
	nodePort := strconv.Itoa(int(svc.Spec.Ports[0].NodePort))
	waitServed("node port on the node's address", c.client.NS, "http://10.244.0.1:"+nodePort+"/")
	// kubeadm's configuration leaves nodePortAddresses unset: kube-proxy's
	// iptables mode then serves node ports on localhost too.
	waitServed("node port on the node's loopback", c.lab.Node, "http://127.0.0.1:"+nodePort+"/")

	out := c.up.Output()
	for _, want := range []string{
		`"proxyMode": "iptables"`, // the ConfigMap's mode, served by redirect mode
		`"node": "node-a"`,        // --hostname-override=$(NODE_NAME) over the file's empty hostnameOverride
		`"source": "API server"`,
		`"object": "default/mixed", "error": "spec.ports[1] (\"sig\", 3868/SCTP): SCTP is not supported by uproxy`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("uproxy's log lacks %s:\n%s", want, out)
		}
	}
	// The health server on kube-proxy's default address.
	if out, err := c.lab.Exec(ctx, c.lab.Node, "curl", "-sf", "--max-time", "2", "http://127.0.0.1:10256/healthz"); err != nil || !strings.Contains(out, `"healthy":true`) {
		t.Errorf("healthz on kube-proxy's default address: %v: %s", err, out)
	}
	// The OOM score: kube-proxy's -999, where the kernel lets the process
	// lower it (CAP_SYS_RESOURCE), else a warning saying why not.
	pid := c.up.Cmd.Process.Pid
	adj, err := os.ReadFile(fmt.Sprintf("/proc/%d/oom_score_adj", pid))
	if err != nil {
		t.Fatal(err)
	}
	switch got := strings.TrimSpace(string(adj)); {
	case got == "-999":
	case strings.Contains(out, "cannot set the OOM score adjustment") && strings.Contains(out, "permission denied"):
		t.Logf("oom_score_adj stays %s: this machine denies CAP_SYS_RESOURCE, and uproxy said so", got)
	default:
		t.Errorf("oom_score_adj of uproxy (pid %d) = %s, want kube-proxy's -999\n%s", pid, got, out)
	}
}
