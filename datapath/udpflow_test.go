package datapath

import (
	"math"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
)

// TestFlowTouchNeverRevivesAReplacedFlow races a flow's touch, as its reply
// goroutine makes it, against the flow's replacement, as the listener's
// goroutine makes it when the flow's backend is ejected (udpFlowFor). A
// touch that found the flow current and then added it back after its
// replacement overwrote the replacement without ending it: its socket and
// goroutine stayed, out of the table, until the process exited.
func TestFlowTouchNeverRevivesAReplacedFlow(t *testing.T) {
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	p := &Engine{}
	p.udpRelay.e = p
	key := flowKey{client: netip.MustParseAddrPort("10.244.0.5:40000"), dst: netip.MustParseAddrPort("10.96.0.10:53")}
	// Closing a flow closes conn, which each flow shares: a second close
	// of it changes nothing.
	newFlow := func() *udpFlow { return &udpFlow{p: p, key: key, conn: conn, fd: -1} }
	first := newFlow()
	p.addFlow(first, nil)
	var current atomic.Pointer[udpFlow]
	current.Store(first)
	all := []*udpFlow{first}

	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			f := current.Load()
			f.refreshed.Store(math.MinInt64 / 2) // due for a refresh
			f.touch(p)
		}
	}()
	for range 100000 {
		old, f := current.Load(), newFlow()
		p.removeFlow(old)
		p.addFlow(f, nil)
		current.Store(f)
		all = append(all, f)
	}
	close(stop)
	<-done

	in, ok := p.flowTable().Peek(key)
	if !ok {
		t.Fatal("the table lost the key's flow")
	}
	if in.closed.Load() {
		t.Error("the table holds a flow that was replaced and ended")
	}
	leaked := 0
	for _, f := range all {
		if f != in && !f.closed.Load() {
			leaked++
		}
	}
	if leaked > 0 {
		t.Errorf("%d of %d replaced flows were never ended: a touch put their predecessor back over them", leaked, len(all)-1)
	}
}
