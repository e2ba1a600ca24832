package upgrade

import (
	"net"
	"os"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"
)

// socketpair returns the two ends of a SOCK_SEQPACKET socket pair, as the
// upgrade socket's connections are; they close with the test.
func socketpair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Skip(err)
	}
	var conns [2]*net.UnixConn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c.(*net.UnixConn)
		t.Cleanup(func() { c.Close() })
	}
	return conns[0], conns[1]
}

// openFiles opens n descriptors to send; they close with the test.
func openFiles(t *testing.T, n int) []*os.File {
	t.Helper()
	var files []*os.File
	for range n {
		f, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		files = append(files, f)
	}
	return files
}

// TestUpgradeMessageOverSocketpair checks that a message and its
// descriptors arrive together, with the sender's version, and that a
// packet the receiver cannot take whole is refused rather than read in
// part.
func TestUpgradeMessageOverSocketpair(t *testing.T) {
	for _, tc := range []struct {
		name      string
		m         Message
		files     int
		wantErr   string // empty: received as sent
		wantFiles int
	}{
		{"hello", Message{Type: "hello", PID: 42, Netns: "4:4026531840", Mode: "redirect"}, 0, "", 0},
		{"sockets with their descriptors", Message{Type: "sockets", Sockets: []Socket{
			{Kind: kindListener, Key: "tcp4 default/web:http", Port: 40000},
			{Kind: kindServer, Key: "metrics tcp4 127.0.0.1:10249"},
		}}, 2, "", 2},
		{"a packet's worth of descriptors", Message{Type: "sockets"}, fdsPerMessage, "", fdsPerMessage},
		// The kernel delivers what fits in the receiver's control buffer
		// and sets MSG_CTRUNC; the rest are closed in transit.
		{"more descriptors than a packet carries", Message{Type: "sockets"}, fdsPerMessage + 1, "message truncated", fdsPerMessage},
		{"a packet over the size bound", Message{Type: "offer", Error: strings.Repeat("x", maxMessage)}, 0, "message truncated", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := socketpair(t)
			if err := Send(a, tc.m, openFiles(t, tc.files)); err != nil {
				t.Fatal(err)
			}
			got, files, err := Recv(b)
			closeFiles(files)
			if len(files) != tc.wantFiles {
				t.Errorf("%d descriptors, want %d", len(files), tc.wantFiles)
			}
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Errorf("got %+v, %v; want an error with %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := tc.m
			want.Version = ProtocolVersion
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("(-sent +received):\n%s", diff)
			}
		})
	}
}
