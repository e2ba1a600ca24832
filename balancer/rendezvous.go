package balancer

import "net/netip"

// rendezvous is rendezvous (highest random weight) hashing on the client
// address (Thaler and Ravishankar, 1998): each backend scores the client
// with a hash of both, and the highest score wins. It is the source-hash
// balancer that needs no table: a client's backend depends only on the
// backends' addresses, so every node picks alike, and removing a backend
// moves only its own clients. Each pick scores every backend.
type rendezvous struct {
	backends []*Backend // sorted by address: ties go to the first
	seeds    []uint64   // each backend's hash of its address and port
}

var _ Balancer = (*rendezvous)(nil)

func newRendezvous(sorted []*Backend) *rendezvous {
	r := &rendezvous{backends: sorted, seeds: make([]uint64, len(sorted))}
	for i, b := range sorted {
		a := b.Addr.Addr().As16()
		key := append(a[:], byte(b.Addr.Port()>>8), byte(b.Addr.Port()))
		r.seeds[i] = mix64(fnv1a(key))
	}
	return r
}

// Pick returns the backend that scores client highest among those not
// ejected, or among all of them when every one is ejected. An ejected
// backend's clients thus go to their second choice, which is stable, and
// return when it is readmitted.
func (r *rendezvous) Pick(client netip.Addr) *Backend {
	if len(r.backends) == 0 {
		return nil
	}
	h := hashAddr(client)
	best, healthy := -1, -1
	var bestScore, healthyScore uint64
	for i, s := range r.seeds {
		score := mix64(h ^ s)
		if best < 0 || score > bestScore {
			best, bestScore = i, score
		}
		if (healthy < 0 || score > healthyScore) && !r.backends[i].Ejected() {
			healthy, healthyScore = i, score
		}
	}
	if healthy >= 0 {
		return r.backends[healthy]
	}
	return r.backends[best]
}
