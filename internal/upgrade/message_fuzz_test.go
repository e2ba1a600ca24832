package upgrade

import (
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"golang.org/x/sys/unix"
)

// FuzzUpgradeMessage feeds packets to the upgrade socket's decoder,
// through a real SOCK_SEQPACKET socket pair as a peer would send them.
// A packet is either refused with an error or decodes to a message whose
// fields are within bounds and which survives an encoding round trip.
func FuzzUpgradeMessage(f *testing.F) {
	for _, seed := range []string{
		`{"type":"hello","version":1,"pid":42,"netns":"4:4026531840","mode":"redirect"}`,
		`{"type":"offer","version":1,"pid":7,"netns":"4:4026531840","mode":"tproxy","count":3}`,
		`{"type":"offer","version":2,"netns":"1:2","error":"another network namespace","somethingNew":true}`,
		`{"type":"sockets","version":1,"sockets":[{"kind":"listener","key":"tcp4 default/web:http","port":40000},{"kind":"server","key":"metrics tcp4 127.0.0.1:10249"},{"kind":"upgrade","key":"/run/uproxy/upgrade.sock"}]}`,
		`{"type":"ready","version":1}`,
		`{"type":"offer","version":1,"pid":7,"netns":"4:4026531840","mode":"redirect","count":3,"aborts":true}`,
		`{"type":"abort","version":1}`,
		`{"type":"release","version":1}`,
		`{"type":"released"}`,
		`{"type":"offer","count":-1}`,
		`{"type":"hello","pid":-5}`,
		`{"version":1}`,
		`{"type":"sockets","sockets":[{"port":70000}]}`,
		`[]`,
		`null`,
		"",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, packet []byte) {
		if len(packet) > maxMessage {
			return // the kernel delivers it truncated, which is refused before decoding
		}
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Skip(err)
		}
		conns := make([]*net.UnixConn, 2)
		for i, fd := range fds {
			file := os.NewFile(uintptr(fd), "socketpair")
			c, err := net.FileConn(file)
			file.Close()
			if err != nil {
				t.Fatal(err)
			}
			conns[i] = c.(*net.UnixConn)
			defer c.Close()
		}
		if _, _, err := conns[0].WriteMsgUnix(packet, nil, nil); err != nil {
			t.Fatal(err)
		}
		m, files, err := Recv(conns[1])
		closeFiles(files)
		if len(files) != 0 {
			t.Fatalf("%d descriptors from a packet that carried none", len(files))
		}
		if len(packet) == 0 {
			if !errors.Is(err, io.EOF) {
				t.Fatalf("an empty packet: %+v, %v; want io.EOF", m, err)
			}
			return
		}
		direct, derr := decode(packet)
		if (err == nil) != (derr == nil) || !cmp.Equal(m, direct) {
			t.Fatalf("over the socket %+v, %v; decoded directly %+v, %v", m, err, direct, derr)
		}
		if err != nil {
			if m.Type != "" || m.Count != 0 || m.Sockets != nil {
				t.Fatalf("a refused packet left a message behind: %+v", m)
			}
			return
		}
		if m.Type == "" || m.PID < 0 || m.Count < 0 || m.Count > maxSockets || len(m.Sockets) > fdsPerMessage {
			t.Fatalf("accepted a message out of bounds: %+v", m)
		}
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		again, err := decode(b)
		if err != nil {
			t.Fatalf("re-decoding %s: %v", b, err)
		}
		// An empty list and none encode alike (omitempty): equal.
		if diff := cmp.Diff(m, again, cmpopts.EquateEmpty()); diff != "" {
			t.Fatalf("round trip (-first +second):\n%s", diff)
		}
	})
}
