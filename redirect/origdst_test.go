package redirect

import (
	"io"
	"net"
	"net/netip"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testlab"
)

func TestOriginalDst(t *testing.T) {
	tests := []struct {
		name   string
		family Family
		// listen is the listener's network and address.
		network, listen string
		// vip is where the client connects; route makes it reachable
		// through lo, with a source address for IPv4 (without one, the
		// connection gets source 0.0.0.0 and replies go nowhere).
		vip   netip.AddrPort
		route []string
	}{
		{"IPv4", IPv4, "tcp4", "0.0.0.0:0", netip.MustParseAddrPort("10.96.0.10:80"),
			[]string{"route", "add", "10.96.0.0/16", "dev", "lo", "src", "127.0.0.1"}},
		{"IPv6", IPv6, "tcp6", "[::]:0", netip.MustParseAddrPort("[2001:db8::10]:80"),
			[]string{"-6", "route", "add", "2001:db8::/32", "dev", "lo"}},
		// An IPv4 connection accepted by a dual-stack IPv6 socket.
		{"IPv4DualStack", IPv4, "tcp", "[::]:0", netip.MustParseAddrPort("10.96.0.10:80"),
			[]string{"route", "add", "10.96.0.0/16", "dev", "lo", "src", "127.0.0.1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !testlab.RunInNetns(t, tt.family.command("")) {
				return
			}
			ln, err := net.Listen(tt.network, tt.listen)
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			port := ln.Addr().(*net.TCPAddr).Port
			nsCommand(t, "ip", tt.route...)
			nsCommand(t, tt.family.command(""), "-t", "nat", "-A", "OUTPUT",
				"-d", tt.vip.Addr().String(), "-p", "tcp", "--dport", strconv.Itoa(int(tt.vip.Port())),
				"-j", "REDIRECT", "--to-ports", strconv.Itoa(port))

			client, err := net.DialTimeout("tcp", tt.vip.String(), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer client.Close()
			c, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			server := c.(*net.TCPConn)
			if got := server.LocalAddr().(*net.TCPAddr).Port; got != port {
				t.Fatalf("accepted connection on port %d, want the listener's %d", got, port)
			}

			got, err := OriginalDst(rawOf(t, server), tt.vip.Addr().Is6())
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.vip {
				t.Errorf("OriginalDst = %s, want %s", got, tt.vip)
			}

			// c is undisturbed: it still carries data both ways.
			for _, conn := range []net.Conn{c, client} {
				if err := conn.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := client.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 4)
			if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
				t.Fatalf("server read %q, %v; want ping", buf, err)
			}
			if _, err := c.Write([]byte("pong")); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(client, buf); err != nil || string(buf) != "pong" {
				t.Fatalf("client read %q, %v; want pong", buf, err)
			}
		})
	}
}

// TestOriginalDstClosed checks the error for a closed connection. It needs
// no namespace: it only uses a loopback connection and changes no rules.
func TestOriginalDstClosed(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if _, err := OriginalDst(rawOf(t, c.(*net.TCPConn)), false); err == nil {
		t.Error("OriginalDst of a closed connection succeeded")
	}
}

// rawOf returns c's RawConn, as the proxy passes accepted sockets to
// OriginalDst.
func rawOf(t *testing.T, c *net.TCPConn) syscall.RawConn {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	return rc
}
