package main

import v1 "k8s.io/api/core/v1"

// families returns the IP families whose rules k programs: IPv4, and IPv6
// when ip6tables is usable. Health and metrics report these, as
// kube-proxy reports the families of the proxiers it runs. Call it after
// init.
func (k *kernelRules) families() []v1.IPFamily {
	if k.v6 == nil {
		return []v1.IPFamily{v1.IPv4Protocol}
	}
	return []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}
}
