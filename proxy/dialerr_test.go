package proxy

import (
	"context"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
)

// TestLocalDialFailuresEjectNoBackend has a backend's first dial fail the
// way a dial fails when the node runs short of descriptors or memory, and
// checks that the backend stays in service, for TCP and UDP; a refused
// connect, the backend's own doing, still ejects it. Before, a process
// at its open-files limit ejected every backend it tried.
func TestLocalDialFailuresEjectNoBackend(t *testing.T) {
	dialErr := func(syscall string, errno syscall.Errno) error {
		return &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError(syscall, errno)}
	}
	for _, tc := range []struct {
		name        string
		err         error
		wantEjected bool
	}{
		{"socket EMFILE", dialErr("socket", syscall.EMFILE), false},
		{"socket ENFILE", dialErr("socket", syscall.ENFILE), false},
		{"socket ENOBUFS", dialErr("socket", syscall.ENOBUFS), false},
		{"bind EADDRINUSE", dialErr("bind", syscall.EADDRINUSE), false},
		{"connect ENOMEM", dialErr("connect", syscall.ENOMEM), false},
		{"connect refused", dialErr("connect", syscall.ECONNREFUSED), true},
	} {
		for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
			t.Run(tc.name+"/"+string(proto), func(t *testing.T) {
				// The first dial fails with tc.err; the rest are real.
				var dials atomic.Int32
				dial := func(ctx context.Context, network, address string) (net.Conn, error) {
					if dials.Add(1) == 1 {
						return nil, tc.err
					}
					var d net.Dialer
					return d.DialContext(ctx, network, address)
				}
				p, rules := startProxier(t, Config{Config: datapath.Config{Dial: dial, EjectBase: time.Minute}})
				var port int
				if proto == v1.ProtocolTCP {
					p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", nameBackend(t, "a")))
					port = rules.port(t, "default/web:http")
					get(t, port)
				} else {
					p.Tracker().Replace([]*v1.Service{svc("dns", "10.96.0.10", "dns:53/UDP")}, udpSlices("dns", udpBackend(t, "a", false)))
					port = rules.port(t, "default/dns:dns")
					c := dialUDP(t, port)
					c.Write([]byte("probe"))
					c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
					c.Read(make([]byte, 100))
				}
				if dials.Load() == 0 {
					t.Fatal("nothing was dialled")
				}
				st := p.Status()
				if len(st.Ports) != 1 || len(st.Ports[0].Endpoints) != 1 {
					t.Fatalf("status: %+v", st)
				}
				// A refused TCP attempt is retried on the one backend, which
				// may answer the retry: the ejection stays, its error count
				// not.
				e := st.Ports[0].Endpoints[0]
				if e.Ejected != tc.wantEjected || !tc.wantEjected && e.RecentDialErrors != 0 {
					t.Errorf("after a dial that failed with %v: ejected %v with %d recent dial errors; want ejected %v",
						tc.err, e.Ejected, e.RecentDialErrors, tc.wantEjected)
				}
			})
		}
	}
}
