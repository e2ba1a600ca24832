package load

import (
	"context"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/uproxy/uproxy/internal/testwait"
)

// TestIOCopy runs the reference Go proxy on loopback in front of two
// backends that answer with their name and what they read: connections go
// to the backends in turn, the bytes arrive both ways, and the client's EOF
// reaches the backend (which answers only after it).
func TestIOCopy(t *testing.T) {
	backends := echoBackends(t, "tcp4", "127.0.0.1:0", "a", "b")
	listen := freePort(t, "tcp4", "127.0.0.1:0")
	routes, err := parseRoutes([]string{listen + "=" + strings.Join(backends, ",")})
	if err != nil {
		t.Fatal(err)
	}
	runProxy(t, func(ctx context.Context) error { return runIOCopy(ctx, routes) })
	big := strings.Repeat("x", 3<<20) // several pipes' worth
	got := []string{exchange(t, listen, "one"), exchange(t, listen, "two"), exchange(t, listen, "three"), exchange(t, listen, big)}
	want := []string{"a:one", "b:two", "a:three", "b:" + big}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("answers (-want +got):\n%.2000s", diff)
	}
}

// echoBackends starts a backend per name, listening on network and
// address, that reads until the client's EOF and then answers with its
// name, a colon and what it read. It returns their addresses.
func echoBackends(t *testing.T, network, address string, names ...string) []string {
	t.Helper()
	var addrs []string
	for _, name := range names {
		ln, err := net.Listen(network, address)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		go func() { // ends when ln is closed
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				go func() { // ends at the client's EOF
					defer c.Close()
					b, _ := io.ReadAll(c)
					_, _ = c.Write([]byte(name + ":" + string(b)))
				}()
			}
		}()
		addrs = append(addrs, ln.Addr().String())
	}
	return addrs
}

// freePort returns an address on which nothing listens, for a proxy.
func freePort(t *testing.T, network, address string) string {
	t.Helper()
	probe, err := net.Listen(network, address)
	if err != nil {
		t.Fatal(err)
	}
	defer probe.Close()
	return probe.Addr().String()
}

// runProxy runs run until the test ends, then cancels it and waits for it
// to return, failing the test on its error.
func runProxy(t *testing.T, run func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := run(ctx); err != nil {
			t.Error(err)
		}
	})
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
}

// exchange sends msg to a proxy at listen, closes its writing side and
// returns everything that comes back, failing the test on an error.
func exchange(t *testing.T, listen, msg string) string {
	t.Helper()
	got, err := exchangeErr(listen, msg)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// exchangeErr is exchange for any goroutine. It retries the connection
// for a while, as the proxy may not listen yet.
func exchangeErr(listen, msg string) (string, error) {
	var c net.Conn
	var err error
	if !testwait.Poll(5*time.Second, func() bool { c, err = net.Dial("tcp", listen); return err == nil }) {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}

func TestParseRoutes(t *testing.T) {
	got, err := parseRoutes([]string{"0.0.0.0:18080=10.244.1.2:8080,10.244.2.2:8080"})
	if err != nil {
		t.Fatal(err)
	}
	want := []ioRoute{{listen: "0.0.0.0:18080", backends: []string{"10.244.1.2:8080", "10.244.2.2:8080"}}}
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(ioRoute{})); diff != "" {
		t.Errorf("routes (-want +got):\n%s", diff)
	}
	for _, bad := range [][]string{nil, {"0.0.0.0:18080"}, {"=10.244.1.2:8080"}, {"0.0.0.0:18080="}} {
		if _, err := parseRoutes(bad); err == nil {
			t.Errorf("parseRoutes(%q): no error", bad)
		}
	}
}
