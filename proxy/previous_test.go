package proxy

import (
	"fmt"
	"math/rand/v2"
	"net"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// TestListenersRebindPreviousPorts checks that a listener binds the port
// the previous instance's rules name (so those rules work before the first
// sync), and falls back to another port when that one is taken.
func TestListenersRebindPreviousPorts(t *testing.T) {
	be := nameBackend(t, "a")
	// A port nobody holds now, below the ephemeral range (which other
	// tests' connections take at any moment).
	free := func() int {
		for range 50 {
			port := 30000 + rand.IntN(2000)
			if l, err := net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port)); err == nil {
				l.Close()
				return port
			}
		}
		t.Fatal("no free port")
		return 0
	}
	wantA := free()
	busy, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	wantB := busy.Addr().(*net.TCPAddr).Port
	previous := map[string]uint16{"default/a:http": uint16(wantA), "default/b:http": uint16(wantB)}
	p, rules := startProxier(t, Config{PreviousPort: func(name ServicePortName, network string) uint16 {
		if network != "tcp4" {
			return 0
		}
		return previous[name.String()]
	}})
	p.Tracker().Replace([]*v1.Service{svc("a", "10.96.0.10", "http:80"), svc("b", "10.96.0.11", "http:80")},
		append(slicesFor("a", "http", be), slicesFor("b", "http", be)...))
	if got := rules.port(t, "default/a:http"); got != wantA {
		t.Errorf("service a listens on %d, want its previous port %d", got, wantA)
	}
	if got := rules.port(t, "default/b:http"); got == wantB || got == 0 {
		t.Errorf("service b listens on %d, want another port than its previous, busy %d", got, wantB)
	}
	if name, err := get(t, wantA); err != nil || name != "a" {
		t.Errorf("service a on its previous port: %q, %v", name, err)
	}
}
