// Command kubeadmproxy prints the kube-proxy addon that kubeadm installs
// (its ServiceAccount, RBAC objects, ConfigMap and DaemonSet), rendered by
// kubeadm's own code at the version this module pins: the DaemonSet and
// ConfigMap templates of phases/addons/proxy, and the
// KubeProxyConfiguration that kubeadm's componentconfigs default. uproxy's
// drop-in test runs the DaemonSet's command line and ConfigMap against a
// real API server, so they must be kubeadm's, not a copy typed by hand.
//
//	GOWORK=off go run ./kubeadmproxy -control-plane-endpoint 127.0.0.1:6443 -pod-subnet 10.244.0.0/16
package main

import (
	"flag"
	"fmt"
	"os"

	kubeadmapi "k8s.io/kubernetes/cmd/kubeadm/app/apis/kubeadm"
	"k8s.io/kubernetes/cmd/kubeadm/app/componentconfigs"
	"k8s.io/kubernetes/cmd/kubeadm/app/phases/addons/proxy"
)

func main() {
	endpoint := flag.String("control-plane-endpoint", "", "the API server's host:port, as kubeadm's controlPlaneEndpoint (required)")
	advertise := flag.String("advertise-address", "127.0.0.1", "the API server's advertise address, as kubeadm's localAPIEndpoint")
	podSubnet := flag.String("pod-subnet", "", "the cluster's pod network, as kubeadm's networking.podSubnet")
	version := flag.String("kubernetes-version", "v1.37.2", "the Kubernetes version, for the image tag")
	flag.Parse()
	if *endpoint == "" {
		fmt.Fprintln(os.Stderr, "kubeadmproxy: -control-plane-endpoint is required")
		os.Exit(2)
	}
	cfg := &kubeadmapi.ClusterConfiguration{
		ControlPlaneEndpoint: *endpoint,
		KubernetesVersion:    *version,
		ImageRepository:      "registry.k8s.io",
		Networking:           kubeadmapi.Networking{PodSubnet: *podSubnet},
	}
	local := &kubeadmapi.APIEndpoint{AdvertiseAddress: *advertise, BindPort: 6443}
	componentconfigs.Default(cfg, local, &kubeadmapi.NodeRegistrationOptions{})
	// A nil client with printManifest: kubeadm prints the objects instead
	// of creating them (kubeadm init phase addon kube-proxy --print-manifest).
	if err := proxy.EnsureProxyAddon(cfg, local, nil, "", os.Stdout, true); err != nil {
		fmt.Fprintln(os.Stderr, "kubeadmproxy:", err)
		os.Exit(1)
	}
}
