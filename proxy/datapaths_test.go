package proxy

import (
	"testing"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testbackend"
)

// eachDataPath runs f once per TCP data path: the event loops on epoll
// (the default) and with io_uring (Config.IOURing).
func eachDataPath(t *testing.T, f func(t *testing.T, dp dataPath)) {
	for _, tt := range []struct {
		name string
		dp   dataPath
	}{{"loops", dataPath{}}, {"ring", dataPath{ring: true}}} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.dp.ring {
				if err := datapath.IOURingSupported(); err != nil {
					t.Skipf("skipping: the event loops cannot use io_uring here: %v", err)
				}
			}
			f(t, tt.dp)
			if tt.dp.ring {
				for _, p := range startedProxiers.Of(t) {
					checkRingCarried(t, p.cfg.Stats)
				}
			}
		})
	}
}

// checkRingCarried fails t unless the ring carried the sessions that s
// counted: each one a ring could take went on one, and the ring
// received bytes of some if any session moved bytes. A loop whose ring
// failed to set up carries its sessions on epoll, and the traffic of a
// test of the ring would flow all the same.
func checkRingCarried(t *testing.T, s *datapath.Stats) {
	t.Helper()
	eligible, onRing, served, carried := s.Eligible.Load(), s.OnRing.Load(), s.RingServed.Load(), s.Carried.Load()
	if n := s.NoRing.Load(); n > 0 {
		t.Errorf("%d event loops could not set up their ring, and carried the test's traffic on epoll", n)
	}
	if onRing != eligible || (carried > 0 && served == 0) {
		t.Errorf("the ring did not carry the traffic: of %d sessions it could take, %d went on a ring; %d sessions moved bytes, %d of them on a ring",
			eligible, onRing, carried, served)
	}
}

// startedProxiers records the proxiers each test started (startProxier),
// so that eachDataPath can check how they carried the test's traffic.
var startedProxiers testbackend.Registry[*Proxier]

// dataPath is a data path of the proxier's: ring is Config.IOURing.
type dataPath struct {
	ring bool
}
