package proxy

import (
	"bufio"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"

	"github.com/uproxy/uproxy/datapath"
	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/proxy/service"
)

// TestPreserveSourceIPFallsBackWhenNoReply runs a proxier in tproxy mode
// in a namespace of its own, with a backend in another namespace that has
// no route back to the client's address: a dial from the client's address
// never gets its SYN-ACK, as when the backend shares a bridge with the
// client and answers it directly. The route lookup cannot tell, so
// it is the timeout that must fall back: the connection works, from the
// node's address, within about one dial timeout, with the client's
// address still in the PROXY protocol header, and the next connection of
// the same client does not wait at all.
func TestPreserveSourceIPFallsBackWhenNoReply(t *testing.T) {
	if !testlab.RunInNetns(t) {
		return
	}
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v: %s", args, err, out)
		}
	}
	bns := testlab.NewNetns(t, "uplab-be-")
	run("ip", "link", "add", "vbe0", "type", "veth", "peer", "name", "eth0", "netns", bns)
	run("ip", "addr", "add", "10.244.0.1/24", "dev", "vbe0")
	run("ip", "link", "set", "vbe0", "up")
	run("ip", "-n", bns, "addr", "add", "10.244.0.2/24", "dev", "eth0")
	run("ip", "-n", bns, "link", "set", "eth0", "up")
	// The client's address: local to the node, unknown to the backend.
	run("ip", "addr", "add", "192.0.2.7/32", "dev", "lo")

	var ln net.Listener
	if err := testlab.DoInNetns(bns, func() (err error) {
		ln, err = net.Listen("tcp4", "10.244.0.2:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// The backend answers with the address it sees and the client's
	// address from the PROXY protocol header.
	be := startBackendOn(t, ln, func(c net.Conn) {
		host, _, _ := net.SplitHostPort(c.RemoteAddr().String())
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		hdr, _ := bufio.NewReader(c).ReadString('\n') // PROXY TCP4 src dst sport dport
		var proto, src string
		fmt.Sscan(hdr, &proto, &proto, &src)
		fmt.Fprintln(c, host, src)
	})

	for _, tt := range []struct {
		name  string
		loops int
		ring  bool
	}{{"event loops", 1, false}, {"io_uring", 1, true}} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.ring {
				if err := datapath.IOURingSupported(); err != nil {
					t.Skipf("skipping: %v", err)
				}
			}
			const dialTimeout = 300 * time.Millisecond
			reg := prometheus.NewRegistry()
			// The client's address is on lo, but stands for one outside
			// the cluster, not the node's.
			nodeOnly := func() ([]netip.Addr, error) { return []netip.Addr{netip.MustParseAddr("10.244.0.1")}, nil }
			p, rules := startProxier(t, Config{Config: datapath.Config{Transparent: true, EventLoops: tt.loops, IOURing: tt.ring, DialTimeout: dialTimeout}, Metrics: introspect.NewMetrics(reg), LocalAddrs: nodeOnly})
			s := svc("web", "10.96.0.10", "http:80")
			s.Annotations = map[string]string{service.AnnotationPreserveSourceIP: "true", service.AnnotationProxyProtocol: "v1"}
			p.Tracker().Replace([]*v1.Service{s}, slicesFor("web", "http", be))
			port := rules.port(t, "default/web:http")

			get := func() (string, time.Duration) {
				t.Helper()
				start := time.Now()
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("192.0.2.7")}, Timeout: 2 * time.Second}
				c, err := d.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(5 * time.Second))
				line, err := bufio.NewReader(c).ReadString('\n')
				if err != nil {
					t.Fatalf("after %v, the connection failed: %v", time.Since(start), err)
				}
				return strings.TrimSpace(line), time.Since(start)
			}
			const want = "10.244.0.1 192.0.2.7" // the node's address; the client's in the PROXY header
			seen, took := get()
			if seen != want {
				t.Errorf("first connection: the backend saw %q, want %q", seen, want)
			}
			if took < dialTimeout || took > 2*dialTimeout+time.Second {
				t.Errorf("first connection took %v, want one dial timeout (%v) and a retry", took, dialTimeout)
			}
			seen, took = get()
			if seen != want || took >= dialTimeout {
				t.Errorf("second connection: the backend saw %q after %v; want %q at once (the missing reply remembered)", seen, took, want)
			}
			labels := map[string]string{"service": "default/web", "port": "http"}
			if got, _ := scrape(t, reg, "uproxy_source_ip_fallbacks_total", plusLabel(labels, "reason", "no_reply")); got != 2 {
				t.Errorf("no_reply fallbacks = %v, want 2", got)
			}
			if got, _ := scrape(t, reg, "uproxy_connections_total", plusLabel(labels, "result", "dial_error")); got != 0 {
				t.Errorf("dial errors = %v, want none: the backend answers from the node's address", got)
			}
		})
	}
}

func plusLabel(m map[string]string, k, v string) map[string]string {
	out := map[string]string{k: v}
	for a, b := range m {
		out[a] = b
	}
	return out
}

// TestClientPortTakenRetriesAnotherPort runs a client that connects to
// two services with the same backend from one address and port (a
// kernel shares an ephemeral port between destinations): the proxy
// dials the backend from the client's address and port for the first,
// finds that pair of addresses and ports taken for the second
// (EADDRNOTAVAIL), and dials it from the client's address and another
// port, never from the node's, on the epoll and the io_uring loops.
func TestClientPortTakenRetriesAnotherPort(t *testing.T) {
	if !testlab.RunInNetns(t) {
		return
	}
	// The client's address: local, so that the backend's replies come
	// back, but not one of the node's as the proxier sees them.
	// The backend's too: one on loopback would be the node's, dialled
	// from the node's address.
	for _, a := range []string{"192.0.2.7/32", "192.0.2.8/32"} {
		if out, err := exec.Command("ip", "addr", "add", a, "dev", "lo").CombinedOutput(); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
	}
	ln, err := net.Listen("tcp4", "192.0.2.8:0")
	if err != nil {
		t.Fatal(err)
	}
	be := startBackendOn(t, ln, func(c net.Conn) { fmt.Fprintln(c, c.RemoteAddr()) })
	for _, tt := range []struct {
		name string
		ring bool
	}{{"epoll", false}, {"io_uring", true}} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.ring {
				if err := datapath.IOURingSupported(); err != nil {
					t.Skipf("skipping: %v", err)
				}
			}
			nodeOnly := func() ([]netip.Addr, error) { return []netip.Addr{netip.MustParseAddr("10.244.0.1")}, nil }
			p, rules := startProxier(t, Config{Config: datapath.Config{EventLoops: 1, IOURing: tt.ring}, LocalAddrs: nodeOnly})
			var svcs []*v1.Service
			var sl = slicesFor("one", "http", be)
			for _, name := range []string{"one", "two"} {
				s := svc(name, map[string]string{"one": "10.96.0.11", "two": "10.96.0.12"}[name], "http:80")
				s.Annotations = map[string]string{service.AnnotationPreserveSourceIP: "true"}
				svcs = append(svcs, s)
			}
			sl = append(sl, slicesFor("two", "http", be)...)
			p.Tracker().Replace(svcs, sl)
			var from *net.TCPAddr
			var seen []string
			for _, name := range []string{"default/one:http", "default/two:http"} {
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("192.0.2.7")}, Timeout: 2 * time.Second,
					Control: func(_, _ string, c syscall.RawConn) error {
						var serr error
						if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) }); err != nil {
							return err
						}
						return serr
					}}
				if from != nil {
					d.LocalAddr = from
				}
				c, err := d.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", rules.port(t, name)))
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close() // held open: its dial keeps the pair of addresses and ports taken
				from = c.LocalAddr().(*net.TCPAddr)
				c.SetDeadline(time.Now().Add(5 * time.Second))
				line, err := bufio.NewReader(c).ReadString('\n')
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				seen = append(seen, strings.TrimSpace(line))
			}
			if want := from.String(); len(seen) != 2 || seen[0] != want || seen[1] == want || !strings.HasPrefix(seen[1], "192.0.2.7:") {
				t.Errorf("the backend saw %q; want the client's address and port (%s), then its address from another port", seen, want)
			}
		})
	}
}
