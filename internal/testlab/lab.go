package testlab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Lab is a small cluster node built from network namespaces:
//
//	node   the node's namespace: a bridge (Options.Bridge; 10.244.0.1/24,
//	       2001:db8:244::1/64) that the pods hang off, and a route for the service range, so
//	       node-originated traffic to a VIP reaches the nat OUTPUT chain;
//	       it sends no ICMP redirects.
//	pods   one namespace each, on a veth whose other end is on the bridge,
//	       with addresses 10.244.0.N and 2001:db8:244::N and the node as
//	       default gateway: their traffic to a VIP crosses the node's
//	       PREROUTING chain, like a pod's on a real node.
//	external hosts (AddExternal) on a second bridge, in 192.0.2.0/24 and
//	       2001:db8:c0::/64, routed through the node.
//
// Everything the Lab creates (namespaces, processes) is removed by Close.
// A Lab is not safe for concurrent use, except Start, Exec and Close.
type Lab struct {
	// Node is the node namespace's name.
	Node string
	// Logf receives progress lines; nil means none.
	Logf func(format string, args ...any)

	id    string
	mu    sync.Mutex
	nss   []string
	procs []*Proc
	pods  map[string]*Pod
	next  int

	nextExternal int
	externalNet  bool // brx exists
	bridge       string

	node2    string // the second node's namespace (AddRemotePod), or empty
	nextNode int
}

// Pod is one pod namespace.
type Pod struct {
	Name string
	NS   string
	IP   netip.Addr // IPv4
	IP6  netip.Addr
}

// Options configures New.
type Options struct {
	// Logf receives progress lines; nil means none.
	Logf func(format string, args ...any)
	// Bridge is the name of the node's pod bridge; empty means br0.
	Bridge string
}

// New builds the node namespace. The caller must Close the Lab.
func New(o Options) (*Lab, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("the lab needs root (it creates network namespaces)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, errors.New("the lab needs ip (Debian package iproute2)")
	}
	l := &Lab{Logf: o.Logf, id: UniqueName("")[:6], pods: map[string]*Pod{}, next: 10, bridge: o.Bridge}
	if l.bridge == "" {
		l.bridge = "br0"
	}
	l.Node = "uplab-node-" + l.id
	if err := l.addNS(l.Node); err != nil {
		return nil, err
	}
	err := l.run(
		[]string{"ip", "-n", l.Node, "link", "add", l.bridge, "type", "bridge"},
		[]string{"ip", "-n", l.Node, "addr", "add", "10.244.0.1/24", "dev", l.bridge},
		[]string{"ip", "-n", l.Node, "addr", "add", "2001:db8:244::1/64", "dev", l.bridge, "nodad"},
		[]string{"ip", "-n", l.Node, "link", "set", l.bridge, "up"},
		[]string{"ip", "-n", l.Node, "route", "add", "10.96.0.0/16", "dev", l.bridge},
		[]string{"ip", "-n", l.Node, "-6", "route", "add", "2001:db8:96::/64", "dev", l.bridge},
		[]string{"ip", "netns", "exec", l.Node, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"},
		// The service range is routed back out of the pods' bridge, which
		// a real node's is not: a forwarded packet to it would make the
		// node send an ICMP redirect first, which uses up the per-peer
		// ICMP allowance that a REJECT's port unreachable needs next.
		[]string{"ip", "netns", "exec", l.Node, "sysctl", "-qw", "net.ipv4.conf.all.send_redirects=0", "net.ipv4.conf." + l.bridge + ".send_redirects=0"},
	)
	if err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

func (l *Lab) logf(format string, args ...any) {
	if l.Logf != nil {
		l.Logf(format, args...)
	}
}

func (l *Lab) addNS(name string) error {
	if err := Run("ip", "netns", "add", name); err != nil {
		return err
	}
	l.mu.Lock()
	l.nss = append(l.nss, name)
	l.mu.Unlock()
	return initNetns(name)
}

func (l *Lab) run(cmds ...[]string) error {
	for _, c := range cmds {
		if err := Run(c[0], c[1:]...); err != nil {
			return err
		}
	}
	return nil
}

// AddPod creates a pod namespace on the node's bridge, with the next free
// address (10.244.0.10, .11, …).
func (l *Lab) AddPod(name string) (*Pod, error) {
	n := l.next
	l.next++
	p := &Pod{
		Name: name,
		NS:   fmt.Sprintf("uplab-%s-%s", name, l.id),
		IP:   netip.AddrFrom4([4]byte{10, 244, 0, byte(n)}),
		IP6:  netip.MustParseAddr(fmt.Sprintf("2001:db8:244::%x", n)),
	}
	if err := l.addNS(p.NS); err != nil {
		return nil, err
	}
	host := fmt.Sprintf("vp%d", n)
	err := l.run(
		[]string{"ip", "-n", l.Node, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", p.NS},
		[]string{"ip", "-n", l.Node, "link", "set", host, "master", l.bridge, "up"},
		[]string{"ip", "-n", p.NS, "addr", "add", p.IP.String() + "/24", "dev", "eth0"},
		[]string{"ip", "-n", p.NS, "addr", "add", p.IP6.String() + "/64", "dev", "eth0", "nodad"},
		[]string{"ip", "-n", p.NS, "link", "set", "eth0", "up"},
		[]string{"ip", "-n", p.NS, "route", "add", "default", "via", "10.244.0.1"},
		[]string{"ip", "-n", p.NS, "-6", "route", "add", "default", "via", "2001:db8:244::1"},
	)
	if err != nil {
		return nil, err
	}
	l.pods[name] = p
	return p, nil
}

// AddExternal creates a host outside the cluster: a namespace on its own
// veth to the node, in 192.0.2.0/24 and 2001:db8:c0::/64 (the node is .1
// and ::1 there, and the host's default gateway), with the next free
// address (192.0.2.10, .11, …). Its traffic to node ports, external IPs
// and load-balancer IPs crosses the node's PREROUTING chain like a real
// client's routed through the node.
func (l *Lab) AddExternal(name string) (*Pod, error) {
	n := l.nextExternal + 10
	l.nextExternal++
	h := &Pod{
		Name: name,
		NS:   fmt.Sprintf("uplab-%s-%s", name, l.id),
		IP:   netip.AddrFrom4([4]byte{192, 0, 2, byte(n)}),
		IP6:  netip.MustParseAddr(fmt.Sprintf("2001:db8:c0::%x", n)),
	}
	if err := l.addNS(h.NS); err != nil {
		return nil, err
	}
	host := fmt.Sprintf("vx%d", n)
	cmds := [][]string{
		{"ip", "-n", l.Node, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", h.NS},
		{"ip", "-n", h.NS, "addr", "add", h.IP.String() + "/24", "dev", "eth0"},
		{"ip", "-n", h.NS, "addr", "add", h.IP6.String() + "/64", "dev", "eth0", "nodad"},
		{"ip", "-n", h.NS, "link", "set", "eth0", "up"},
		{"ip", "-n", h.NS, "route", "add", "default", "via", "192.0.2.1"},
		{"ip", "-n", h.NS, "-6", "route", "add", "default", "via", "2001:db8:c0::1"},
	}
	if !l.externalNet {
		// The first external host's veth carries the node's address in the
		// external subnet; later hosts join through a second bridge.
		cmds = append([][]string{
			{"ip", "-n", l.Node, "link", "add", "brx", "type", "bridge"},
			{"ip", "-n", l.Node, "addr", "add", "192.0.2.1/24", "dev", "brx"},
			{"ip", "-n", l.Node, "addr", "add", "2001:db8:c0::1/64", "dev", "brx", "nodad"},
			{"ip", "-n", l.Node, "link", "set", "brx", "up"},
		}, cmds...)
		l.externalNet = true
	}
	cmds = append(cmds, []string{"ip", "-n", l.Node, "link", "set", host, "master", "brx", "up"})
	if err := l.run(cmds...); err != nil {
		return nil, err
	}
	l.pods[name] = h
	return h, nil
}

// Pod returns the pod named name, or nil.
func (l *Lab) Pod(name string) *Pod { return l.pods[name] }

// Proc is a process started in a namespace.
type Proc struct {
	Name string
	Cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error
}

// Output returns what the process has written so far (stdout and stderr).
func (p *Proc) Output() string { return p.out.String() }

// Exited reports whether the process has ended.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Wait waits for the process to end, up to timeout, and returns its error.
func (p *Proc) Wait(timeout time.Duration) error {
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		return fmt.Errorf("%s still running after %v", p.Name, timeout)
	}
}

// Signal sends sig to the process (by pid; it is one the Lab started).
func (p *Proc) Signal(sig os.Signal) error { return p.Cmd.Process.Signal(sig) }

// Start starts a long-running command in namespace ns. Close kills it if it
// is still running.
func (l *Lab) Start(ns, name string, args ...string) (*Proc, error) {
	full := append([]string{"netns", "exec", ns}, args...)
	cmd := exec.Command("ip", full...)
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	// Its own process group, so a signal to the lab's own process group
	// (a terminal's ^C) reaches it only through Close.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &Proc{Name: name, Cmd: cmd, out: out, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.done) }() // exits with the process
	l.mu.Lock()
	l.procs = append(l.procs, p)
	l.mu.Unlock()
	l.logf("started %s in %s (pid %d): %s", name, ns, cmd.Process.Pid, strings.Join(args, " "))
	return p, nil
}

// Exec runs a command in namespace ns to completion and returns its
// combined output.
func (l *Lab) Exec(ctx context.Context, ns string, args ...string) (string, error) {
	full := append([]string{"netns", "exec", ns}, args...)
	out, err := exec.CommandContext(ctx, "ip", full...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s (in %s): %w: %s", strings.Join(args, " "), ns, err, bytes.TrimSpace(out))
	}
	return string(out), nil
}

// Close stops every process the Lab started (SIGTERM, then SIGKILL after a
// second) and deletes every namespace it created.
func (l *Lab) Close() {
	l.mu.Lock()
	procs, nss := l.procs, l.nss
	l.procs, l.nss = nil, nil
	l.mu.Unlock()
	for _, p := range procs {
		if !p.Exited() {
			_ = p.Signal(syscall.SIGTERM)
		}
	}
	for _, p := range procs {
		if p.Wait(time.Second) != nil && !p.Exited() {
			_ = p.Cmd.Process.Kill()
			_ = p.Wait(5 * time.Second)
		}
	}
	for i := len(nss) - 1; i >= 0; i-- {
		DeleteNetns(nss[i])
	}
}

// syncBuffer is a bytes.Buffer safe for one writer and concurrent readers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// BuildBinaries builds uproxy and testpeer (the backends and clients that
// run in the lab's pods, see internal/testpeer) into dir, and returns their
// paths. root is the module root.
func BuildBinaries(root, dir string) (uproxy, peer string, err error) {
	uproxy, peer = filepath.Join(dir, "uproxy"), filepath.Join(dir, "testpeer")
	for _, b := range []struct{ out, pkg string }{{uproxy, "./cmd/uproxy"}, {peer, "./internal/testpeer/cmd/testpeer"}} {
		cmd := exec.Command("go", "build", "-o", b.out, b.pkg)
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", "", fmt.Errorf("go build %s: %w: %s", b.pkg, err, out)
		}
	}
	return uproxy, peer, nil
}
