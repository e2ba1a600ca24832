package uring

import (
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"
)

// TestABI checks the sizes of the structures the kernel reads and writes
// (include/uapi/linux/io_uring.h).
func TestABI(t *testing.T) {
	got := []uintptr{unsafe.Sizeof(SQE{}), unsafe.Sizeof(CQE{}), unsafe.Sizeof(params{}), unsafe.Sizeof(bufReg{}), unsafe.Sizeof(buf{}), unsafe.Sizeof(getEventsArg{})}
	if diff := cmp.Diff([]uintptr{64, 16, 120, 40, 16, 24}, got); diff != "" {
		t.Errorf("sizes of io_uring_sqe, io_uring_cqe, io_uring_params, io_uring_buf_reg, io_uring_buf, io_uring_getevents_arg (-want +got):\n%s", diff)
	}
}

// TestRecvBuffers receives on a socket pair through the buffer ring: a
// receive takes a buffer only when data comes, the completion names it,
// and a receive that finds none fails with ENOBUFS until one is put back
// and published.
func TestRecvBuffers(t *testing.T) {
	r := testRing(t)
	b, err := NewBufRing(r, 1, 64)
	if err != nil {
		t.Skipf("skipping: no provided-buffer rings here: %v", err)
	}
	defer b.Close()
	fds := socketPair(t, unix.SOCK_STREAM)

	recv := func(ud uint64) {
		e := r.SQE()
		e.Opcode, e.Fd, e.Flags, e.Len, e.UserData = OpRecv, int32(fds[0]), SQEBufSelect, 64, ud
	}
	wait := func() CQE {
		t.Helper()
		if err := r.EnterTimeout(1, 5*time.Second); err != nil {
			t.Fatal(err)
		}
		var got []CQE
		r.Completions(func(c CQE) { got = append(got, c) })
		if len(got) != 1 {
			t.Fatalf("completions: got %d, want 1", len(got))
		}
		return got[0]
	}

	recv(1)
	if err := r.EnterTimeout(1, 20*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if n := r.Completions(func(CQE) {}); n != 0 || b.Held() != 0 {
		t.Fatalf("with no data: %d completions, %d buffers held; want none", n, b.Held())
	}
	if _, err := unix.Write(fds[1], []byte("hello")); err != nil {
		t.Fatal(err)
	}
	c := wait()
	if c.UserData != 1 || c.Res != 5 || c.Flags&CQEFBuffer == 0 {
		t.Fatalf("receive: %+v, want user data 1, 5 bytes, a buffer", c)
	}
	b.Took()
	bid := uint16(c.Flags >> CQEBufferShift)
	if got := string(b.Buf(bid)[:c.Res]); got != "hello" {
		t.Errorf("buffer %d holds %q, want hello", bid, got)
	}

	recv(2) // the only buffer is held
	if _, err := unix.Write(fds[1], []byte("again")); err != nil {
		t.Fatal(err)
	}
	if c := wait(); c.UserData != 2 || c.Res != -int32(unix.ENOBUFS) {
		t.Fatalf("receive with no buffer: %+v, want user data 2, -ENOBUFS", c)
	}
	b.Put(bid)
	b.Flush()
	recv(3)
	if c := wait(); c.UserData != 3 || c.Res != 5 || string(b.Buf(uint16(c.Flags >> CQEBufferShift))[:5]) != "again" {
		t.Fatalf("receive after the buffer came back: %+v", c)
	}
}

// TestPollMulti polls a socket's readiness with one multishot poll: each
// readiness completes it, and it stays armed.
func TestPollMulti(t *testing.T) {
	r := testRing(t)
	fds := socketPair(t, unix.SOCK_DGRAM)
	e := r.SQE()
	e.Opcode, e.Fd, e.Len, e.OpFlags, e.UserData = OpPollAdd, int32(fds[0]), PollAddMulti, unix.POLLIN, 7
	for i := range 2 {
		if _, err := unix.Write(fds[1], []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
		if err := r.EnterTimeout(1, 5*time.Second); err != nil {
			t.Fatal(err)
		}
		var got []CQE
		r.Completions(func(c CQE) { got = append(got, c) })
		if len(got) != 1 || got[0].UserData != 7 || got[0].Flags&CQEFMore == 0 || got[0].Res&unix.POLLIN == 0 {
			t.Fatalf("readiness %d: %+v, want one completion of user data 7, POLLIN, still armed", i, got)
		}
		var b [1]byte
		if _, err := unix.Read(fds[0], b[:]); err != nil {
			t.Fatal(err)
		}
	}
}

// testRing returns a ring of 8 entries, closed when the test ends, with
// the test's goroutine locked to its thread until then: the ring is
// single-issuer. It skips the test where io_uring is not available.
func testRing(t *testing.T) *Ring {
	t.Helper()
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread) // cleanups run on the test's goroutine
	r, err := New(8)
	if err != nil {
		t.Skipf("skipping: io_uring is not available here: %v", err)
	}
	t.Cleanup(r.Close)
	return r
}

// socketPair returns a connected pair of Unix sockets of type typ, closed
// when the test ends.
func socketPair(t *testing.T, typ int) [2]int {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, typ|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fds[0]); unix.Close(fds[1]) })
	return fds
}

// TestCompletionsPostedWithoutEntering: a completion is posted at the
// ring's thread's next return from the kernel, whatever system call it
// made, not only when the thread enters the ring for it: a loop busy with
// other system calls, or just back from waiting for a CPU, finds its
// completions ready.
func TestCompletionsPostedWithoutEntering(t *testing.T) {
	r := testRing(t)
	fds := socketPair(t, unix.SOCK_DGRAM)
	e := r.SQE()
	e.Opcode, e.Fd, e.Len, e.OpFlags, e.UserData = OpPollAdd, int32(fds[0]), PollAddMulti, unix.POLLIN, 7
	if err := r.Enter(0); err != nil { // submits, waits for nothing
		t.Fatal(err)
	}
	if _, err := unix.Write(fds[1], []byte{1}); err != nil {
		t.Fatal(err)
	}
	var got []CQE
	for deadline := time.Now().Add(time.Second); len(got) == 0 && time.Now().Before(deadline); {
		unix.Getpid() // any system call, never io_uring_enter
		r.Completions(func(c CQE) { got = append(got, c) })
	}
	if len(got) != 1 || got[0].UserData != 7 || got[0].Res&unix.POLLIN == 0 {
		t.Fatalf("completions seen without entering the ring: %+v, want the poll's (user data 7, POLLIN)", got)
	}
}
