package balancer

import (
	"fmt"
	"net/netip"
	"testing"
)

// benchSizes are the backend counts the benchmarks compare: a small
// Service, a large one, and ones past the usual sizes of a Deployment.
var benchSizes = []int{10, 1000, 10000, 40000}

// benchBalancer is one balancer of the package, as a sync builds it.
type benchBalancer struct {
	name  string
	equal bool // every backend weighs the same
	build func([]*Backend) Balancer
}

// benchBalancers lists every balancer in the package. The weighted ones
// get weights that differ (a weighted round-robin over equal weights is
// plain round-robin), but also appear with equal weights, the usual case.
func benchBalancers() []benchBalancer {
	var out []benchBalancer
	for _, k := range Kinds {
		out = append(out, benchBalancer{name: string(k), build: func(bs []*Backend) Balancer { return New(k, bs) }})
		if k == WeightedRoundRobin || k == WeightedLeastConn {
			out = append(out, benchBalancer{name: string(k) + "-equal", equal: true, build: func(bs []*Backend) Balancer { return New(k, bs) }})
		}
	}
	return append(out,
		benchBalancer{name: "rendezvous", build: func(bs []*Backend) Balancer { return NewSourceHash(bs, nil) }},
		benchBalancer{name: "affinity", build: func(bs []*Backend) Balancer {
			return NewAffinityTable(AffinityConfig{}).Wrap(New(RoundRobin, bs), bs)
		}},
	)
}

// benchBackends returns n backends, weighing 1 to 4 in turn unless equal,
// a third of them idle and the others with one or two connections.
func benchBackends(n int, equal bool) []*Backend {
	weights := make([]int, n)
	for i := range weights {
		weights[i] = 1
		if !equal {
			weights[i] += i % 4
		}
	}
	bs := testBackends(weights...)
	for i, b := range bs {
		for range i % 3 {
			b.Acquire()
		}
	}
	return bs
}

// BenchmarkBuild measures what a sync pays per service port and family to
// build a balancer when the endpoints change.
func BenchmarkBuild(b *testing.B) {
	for _, bb := range benchBalancers() {
		for _, n := range benchSizes {
			bs := benchBackends(n, bb.equal)
			b.Run(fmt.Sprintf("%s/n=%d", bb.name, n), func(b *testing.B) {
				for b.Loop() {
					bb.build(bs)
				}
			})
		}
	}
}

// BenchmarkPick measures what an event loop pays per new connection.
// The affinity balancer's clients all have entries already (a hit).
func BenchmarkPick(b *testing.B) {
	clients := make([]netip.Addr, 1024)
	for i := range clients {
		clients[i] = clientAddr(i)
	}
	for _, bb := range benchBalancers() {
		for _, n := range benchSizes {
			bal := bb.build(benchBackends(n, bb.equal))
			for _, c := range clients {
				bal.Pick(c)
			}
			b.Run(fmt.Sprintf("%s/n=%d", bb.name, n), func(b *testing.B) {
				i := 0
				for b.Loop() {
					bal.Pick(clients[i%len(clients)])
					i++
				}
			})
		}
	}
}
