//go:build tools

// Package tools pins CoreDNS, the cluster DNS of the dev cluster
// (cluster/build.sh builds it into an image). It is a module of its own so
// that CoreDNS's dependencies never meet uproxy's or Kubernetes' versions.
package tools

import (
	_ "github.com/coredns/coredns"
)
