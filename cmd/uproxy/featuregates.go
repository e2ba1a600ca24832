package main

//go:generate sh -c "cd ../../bench/tools && go run ./featuregates ../../cmd/uproxy/featuregates_gen.go"

import (
	"fmt"
	"maps"
	"slices"

	"go.uber.org/zap"
	"k8s.io/component-base/featuregate"
)

// The feature gates of kube-proxy v1.37 that uproxy reads, each where
// kube-proxy's pkg/proxy reads it.
const (
	// gateExternalIPs off makes kube-proxy ignore spec.externalIPs (the
	// CVE-2020-8554 mitigation): serviceport.go.
	gateExternalIPs featuregate.Feature = "AllowServiceExternalIPs"
	// gateNFTablesLocalhostNodePorts lets kube-proxy's nftables mode
	// serve node ports on loopback when --nodeport-addresses names it.
	gateNFTablesLocalhostNodePorts featuregate.Feature = "KubeProxyNFTablesLocalhostNodePorts"
	// gateNodeHints is locked on in v1.37: endpoints' node hints are
	// followed, as uproxy always does (proxy/service's topology).
	gateNodeHints featuregate.Feature = "PreferSameTrafficDistribution"
)

// featureGates validates gates as kube-proxy's --feature-gates does,
// against the gates its binary knows (featuregates_gen.go): an unknown
// gate, or a locked one set away from its default, is an error. It
// returns the resulting gate set and notes, once each, the gates given
// that have no effect on uproxy.
func (k *kubeProxyOptions) featureGateSet() (featuregate.FeatureGate, error) {
	fg := featuregate.NewFeatureGate()
	if err := fg.Add(kubeProxyFeatureGates); err != nil {
		return nil, fmt.Errorf("registering kube-proxy's feature gates: %w", err)
	}
	if err := fg.SetFromMap(k.featureGates); err != nil {
		return nil, fmt.Errorf("--feature-gates: %w", err)
	}
	for _, g := range slices.Sorted(maps.Keys(k.featureGates)) {
		switch featuregate.Feature(g) {
		case gateExternalIPs, gateNFTablesLocalhostNodePorts, gateNodeHints:
		default:
			k.notef(false, "kube-proxy feature gate has no effect on uproxy", zap.String("gate", g), zap.Bool("value", k.featureGates[g]))
		}
	}
	return fg, nil
}
