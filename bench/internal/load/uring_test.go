package load

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/uproxy/uproxy/internal/uring"
)

// TestURing runs the io_uring yardstick on loopback, as TestIOCopy runs the
// reference proxy: connections go to the backends in turn, the bytes
// arrive both ways (a large message in many receives and sends), and the
// client's EOF reaches the backend. A second route carries IPv6. An idle
// connection left open does not keep the proxy from stopping.
func TestURing(t *testing.T) {
	if err := uring.Available(); err != nil {
		t.Skipf("skipping: io_uring is not available here: %v", err)
	}
	v4 := echoBackends(t, "tcp4", "127.0.0.1:0", "a", "b")
	v6 := echoBackends(t, "tcp6", "[::1]:0", "c")
	listen4 := freePort(t, "tcp4", "127.0.0.1:0")
	listen6 := freePort(t, "tcp6", "[::1]:0")
	routes, err := parseRoutes([]string{listen4 + "=" + strings.Join(v4, ","), listen6 + "=" + v6[0]})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runURing(ctx, routes) }() // ends when ctx is cancelled
	stopped := false
	defer func() {
		if !stopped {
			cancel()
			<-done
		}
	}()

	big := strings.Repeat("x", 3<<20) // many 16 KiB buffers' worth
	got := []string{exchange(t, listen4, "one"), exchange(t, listen4, "two"), exchange(t, listen4, "three"), exchange(t, listen4, big), exchange(t, listen6, "six")}
	want := []string{"a:one", "b:two", "a:three", "b:" + big, "c:six"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("answers (-want +got):\n%.2000s", diff)
	}

	idle, err := net.Dial("tcp", listen4)
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	if _, err := idle.Write([]byte("held")); err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case err := <-done:
		stopped = true
		if err != nil {
			t.Errorf("runURing: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("runURing did not return within 5 s of its context's end, with an idle connection open")
	}
	// The proxy closed the idle connection: its client reads EOF (or a reset).
	_ = idle.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := idle.Read(make([]byte, 1)); err == nil {
		t.Errorf("the idle connection is still open after the proxy stopped (read %d bytes)", n)
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Error("the idle connection is still open after the proxy stopped")
	}
}

// TestURingStarved runs the yardstick with two provided buffers and eight
// clients sending 1 MiB each at once, so that receives find no buffer
// (ENOBUFS) and must wait for one to come back: every answer must still be
// whole.
func TestURingStarved(t *testing.T) {
	if err := uring.Available(); err != nil {
		t.Skipf("skipping: io_uring is not available here: %v", err)
	}
	backends := echoBackends(t, "tcp4", "127.0.0.1:0", "a")
	listen := freePort(t, "tcp4", "127.0.0.1:0")
	routes, err := parseRoutes([]string{listen + "=" + backends[0]})
	if err != nil {
		t.Fatal(err)
	}
	runProxy(t, func(ctx context.Context) error { return runURingBuffers(ctx, routes, 2) })
	exchange(t, listen, "ready") // waits until the proxy listens
	const clients = 8
	got := make([]string, clients)
	var wg sync.WaitGroup
	for i := range clients {
		wg.Go(func() {
			var err error
			if got[i], err = exchangeErr(listen, strings.Repeat(fmt.Sprint(i), 1<<20)); err != nil {
				t.Errorf("client %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	for i, g := range got {
		if want := "a:" + strings.Repeat(fmt.Sprint(i), 1<<20); g != want {
			t.Errorf("client %d: got %d bytes (%.20q…), want %d", i, len(g), g, len(want))
		}
	}
}
