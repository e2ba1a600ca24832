package main

import (
	"context"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// TestIOCopy runs the reference Go proxy on loopback in front of two
// backends that answer with their name and what they read: connections go
// to the backends in turn, the bytes arrive both ways, and the client's EOF
// reaches the backend (which answers only after it).
func TestIOCopy(t *testing.T) {
	var backends []string
	for _, name := range []string{"a", "b"} {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
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
		backends = append(backends, ln.Addr().String())
	}
	// A free port for the proxy.
	probe, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	listen := probe.Addr().String()
	probe.Close()
	routes, err := parseRoutes([]string{listen + "=" + strings.Join(backends, ",")})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := runIOCopy(ctx, routes); err != nil {
			t.Error(err)
		}
	})
	defer func() {
		cancel()
		wg.Wait()
	}()

	exchange := func(msg string) string {
		var c net.Conn
		for deadline := time.Now().Add(5 * time.Second); ; {
			if c, err = net.Dial("tcp", listen); err == nil || time.Now().After(deadline) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		if err := c.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(c)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	big := strings.Repeat("x", 3<<20) // several pipes' worth
	got := []string{exchange("one"), exchange("two"), exchange("three"), exchange(big)}
	want := []string{"a:one", "b:two", "a:three", "b:" + big}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("answers (-want +got):\n%.2000s", diff)
	}
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
