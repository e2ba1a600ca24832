package proxy

import (
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/proxy/introspect"
	"github.com/uproxy/uproxy/proxy/service"
)

// TestTProxyRefusesForgedLoopbackClient checks that in tproxy mode a
// connection from a loopback address to a Service address that is not
// loopback is refused on every data path: the kernel never routes such
// a packet, so it can only be a pod's forged frame that re-entered
// through lo by the bridged path, and serving it would send the
// backend's answer to the node's loopback services. Another client of
// the same listener is served.
func TestTProxyRefusesForgedLoopbackClient(t *testing.T) {
	if !testlab.RunInNetns(t) {
		return
	}
	if out, err := exec.Command("ip", "addr", "add", "192.0.2.7/32", "dev", "lo").CombinedOutput(); err != nil {
		t.Fatalf("ip addr add: %v: %s", err, out)
	}
	be := nameBackend(t, "served")
	for _, tt := range []struct {
		name  string
		loops int
		ring  bool
	}{{"goroutines", 0, false}, {"event loops", 1, false}, {"io_uring", 1, true}} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.ring {
				if err := datapath.IOURingSupported(); err != nil {
					t.Skipf("skipping: %v", err)
				}
			}
			reg := prometheus.NewRegistry()
			p, rules := startProxier(t, Config{
				Config: datapath.Config{Transparent: true, EventLoops: tt.loops, IOURing: tt.ring,
					OriginalDst: func(syscall.RawConn, bool) (netip.AddrPort, error) {
						return netip.MustParseAddrPort("10.96.0.10:80"), nil
					}},
				Metrics: introspect.NewMetrics(reg),
			})
			s := svc("web", "10.96.0.10", "http:80")
			s.Annotations = map[string]string{service.AnnotationPreserveSourceIP: "false"}
			p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", be))
			port := rules.port(t, "default/web:http")

			from := func(src string) (string, error) {
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 2 * time.Second}
				c, err := d.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
				if err != nil {
					return "", err
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(5 * time.Second))
				b := make([]byte, 64)
				n, err := c.Read(b)
				return string(b[:n]), err
			}
			if got, err := from("127.0.0.1"); err == nil {
				t.Errorf("a loopback client of the cluster IP was served %q", got)
			}
			if got, err := from("192.0.2.7"); err != nil || got != "served\n" {
				t.Errorf("another client: got %q, %v; want it served", got, err)
			}
			labels := map[string]string{"service": "default/web", "port": "http", "result": "refused_destination"}
			if got, _ := scrape(t, reg, "uproxy_connections_total", labels); got != 1 {
				t.Errorf("refused_destination = %v, want 1", got)
			}
		})
	}
}
