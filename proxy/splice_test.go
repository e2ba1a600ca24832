package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
)

// readSyscalls returns this process's count of read-family syscalls
// (syscr in /proc/self/io). splice(2) and sendfile(2) do not count; every
// read(2) of a userspace copy does.
func readSyscalls(t *testing.T) int64 {
	t.Helper()
	f, err := os.Open("/proc/self/io")
	if err != nil {
		t.Skipf("no /proc/self/io: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "syscr: "); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	t.Skip("no syscr in /proc/self/io")
	return 0
}

// TestTCPPathSplices proves the proxy copies with splice(2): 64 MiB go
// client ← proxy ← backend, where the backend sends with sendfile and the
// client drains into /dev/null with splice, so the only read(2) calls left
// in the process would be the proxy's own if it copied through userspace.
// A control transfer through a userspace copy shows the measure works.
func TestTCPPathSplices(t *testing.T) {
	const size = 64 << 20
	payload := filepath.Join(t.TempDir(), "payload")
	if err := os.WriteFile(payload, make([]byte, size), 0o600); err != nil {
		t.Fatal(err)
	}
	be := startBackend(t, func(c net.Conn) {
		f, err := os.Open(payload)
		if err != nil {
			return
		}
		defer f.Close()
		c.(*net.TCPConn).ReadFrom(f) // sendfile
	})
	devnull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	receive := func(port int) int64 {
		c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		n, err := devnull.ReadFrom(c) // splice
		if err != nil || n != size {
			t.Fatalf("received %d bytes, %v; want %d", n, err, size)
		}
		return n
	}

	p, rules := startProxier(t, Config{IdleTimeout: time.Hour}) // deadlines must not disable splice
	p.Tracker().Replace([]*v1.Service{svc("web", "10.96.0.10", "http:80")}, slicesFor("web", "http", be))
	port := rules.port(t, "default/web:http")
	receive(port) // warm up: pipes, goroutines
	before := readSyscalls(t)
	receive(port)
	proxied := readSyscalls(t) - before

	// Control: the same transfer through a copy that hides ReadFrom/WriteTo,
	// as any wrapper around the conns would.
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		bc, err := net.Dial("tcp4", be.addr.String())
		if err != nil {
			return
		}
		defer bc.Close()
		io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{bc})
	}()
	before = readSyscalls(t)
	receive(ln.Addr().(*net.TCPAddr).Port)
	copied := readSyscalls(t) - before

	t.Logf("read syscalls for 64 MiB: spliced proxy %d, userspace copy %d", proxied, copied)
	if copied < 1000 {
		t.Fatalf("the control copy made only %d reads; the measure is broken", copied)
	}
	if proxied > copied/20 {
		t.Fatalf("the proxy made %d read syscalls for 64 MiB (a userspace copy made %d): it is not splicing", proxied, copied)
	}
}
