package redirect

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/coreos/go-iptables/iptables"
	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/testwait"
)

// The tests in this file send real traffic through the rules, between the
// network namespaces of a lab (internal/testlab): a node namespace with a bridge,
// and pod namespaces hanging off it. The Syncer and Cleanup work on the
// node namespace through `ip netns exec`, so nothing but ip itself runs in
// the root namespace, and a command for a namespace that is gone fails
// instead of running there.

// netnsExec is OSExec inside the network namespace ns.
type netnsExec struct{ ns string }

var _ Exec = netnsExec{}

func (x netnsExec) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	if x.ns == "" {
		return nil, errors.New("netnsExec: no namespace")
	}
	return OSExec{}.Run(ctx, "ip", append([]string{"netns", "exec", x.ns, name}, args...), stdin)
}

// trafficLab is a lab with a node, pods, a socat server standing in for
// the proxy's listeners, and a Config per family that acts on the node.
type trafficLab struct {
	t    *testing.T
	lab  *testlab.Lab
	pods []*testlab.Pod
	cfg  map[Family]Config
	sync map[Family]*Syncer
}

// nodeAddr is the node's address on the pods' bridge.
var nodeAddr = map[Family]netip.Addr{
	IPv4: netip.MustParseAddr("10.244.0.1"),
	IPv6: netip.MustParseAddr("2001:db8:244::1"),
}

// newTrafficLab builds a lab with the given number of pods. It is closed
// (namespaces deleted, processes killed) when t ends, failed or not.
func newTrafficLab(t *testing.T, pods int) *trafficLab {
	t.Helper()
	testlab.RequireRoot(t, "iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore", "ipset", "socat", "ss")
	l, err := testlab.New(testlab.Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	tl := &trafficLab{t: t, lab: l, cfg: map[Family]Config{}, sync: map[Family]*Syncer{}}
	for i := range pods {
		p, err := l.AddPod(fmt.Sprintf("p%d", i))
		if err != nil {
			t.Fatal(err)
		}
		// The node routes a packet for a guarded address that it does
		// not redirect back out of the bridge, and the kernel sends the
		// pod an ICMPv6 redirect for it before the FORWARD hook drops it
		// (ip6_forward); the pod would then look for that address on
		// its own link and never send to the node again. Pods ignore
		// redirects, so each connection tests the rules afresh.
		tl.exec(p.NS, "sysctl", "-qw", "net.ipv4.conf.all.accept_redirects=0", "net.ipv4.conf.eth0.accept_redirects=0",
			"net.ipv6.conf.all.accept_redirects=0", "net.ipv6.conf.eth0.accept_redirects=0")
		tl.pods = append(tl.pods, p)
	}
	dir := t.TempDir()
	for _, f := range []Family{IPv4, IPv6} {
		// go-iptables runs the binary at Path; this one is iptables in
		// the node namespace, and fails if the namespace is gone.
		script := filepath.Join(dir, f.command(""))
		body := fmt.Sprintf("#!/bin/sh\nexec ip netns exec '%s' %s \"$@\"\n", l.Node, f.command(""))
		if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
			t.Fatal(err)
		}
		proto := iptables.ProtocolIPv4
		if f == IPv6 {
			proto = iptables.ProtocolIPv6
		}
		ipt, err := iptables.New(iptables.IPFamily(proto), iptables.Path(script), iptables.Timeout(5))
		if err != nil {
			t.Fatal(err)
		}
		tl.cfg[f] = Config{Family: f, Exec: netnsExec{l.Node}, Jumps: ipt}
		if tl.sync[f], err = New(tl.cfg[f]); err != nil {
			t.Fatal(err)
		}
	}
	return tl
}

// podAddr returns pod p's address of family f.
func podAddr(p *testlab.Pod, f Family) netip.Addr {
	if f == IPv6 {
		return p.IP6
	}
	return p.IP
}

// apply syncs r into the node's f tables.
func (tl *trafficLab) apply(f Family, r Rules) {
	tl.t.Helper()
	if _, err := tl.sync[f].Sync(context.Background(), r, true); err != nil {
		tl.t.Fatal(err)
	}
}

// exec runs a command in namespace ns and fails the test if it fails.
func (tl *trafficLab) exec(ns string, args ...string) string {
	tl.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := tl.lab.Exec(ctx, ns, args...)
	if err != nil {
		tl.t.Fatal(err)
	}
	return out
}

// serve starts a socat server in namespace ns that answers reply to every
// TCP connection (or UDP datagram) on port of family f, and waits until
// it listens. Its socket is transparent, as the proxy's listeners are
// (see UPROXY-LISTENERS).
func (tl *trafficLab) serve(ns string, f Family, p Protocol, port uint16, reply string) *testlab.Proc {
	tl.t.Helper()
	return tl.serveSocket(ns, f, p, port, reply, true)
}

// serveSocket is serve, with a transparent socket or not.
func (tl *trafficLab) serveSocket(ns string, f Family, p Protocol, port uint16, reply string, transparent bool) *testlab.Proc {
	tl.t.Helper()
	kind := map[Protocol]string{TCP: "TCP", UDP: "UDP"}[p] + map[Family]string{IPv4: "4", IPv6: "6"}[f]
	listen := fmt.Sprintf("%s-LISTEN:%d,fork,reuseaddr", kind, port)
	if p == UDP {
		listen = fmt.Sprintf("%s-RECVFROM:%d,fork,reuseaddr", kind, port)
	}
	if f == IPv6 {
		listen += ",ipv6only=1"
	}
	if transparent {
		listen += ",ip-transparent"
	}
	respond := "SYSTEM:echo " + reply
	if p == UDP {
		// socat writes the datagram to the command's stdin once the
		// command runs, and exits on EPIPE, without sending what the
		// command printed, if the command has already ended; so the
		// command reads the datagram before it answers.
		respond = "SYSTEM:head -c1 >/dev/null; echo " + reply
	}
	proc, err := tl.lab.Start(ns, "socat "+listen, "socat", listen, respond)
	if err != nil {
		tl.t.Fatal(err)
	}
	testwait.Until(tl.t, 10*time.Second, fmt.Sprintf("socat to listen on %s port %d in %s", p, port, ns), func() bool {
		return strings.TrimSpace(tl.exec(ns, "ss", "-Hltun", "sport = :"+strconv.Itoa(int(port)))) != ""
	})
	return proc
}

// The outcomes of dial.
const (
	refused  = "refused"
	timedOut = "timed out"
	noReply  = "no reply"
	// unreachable is an ICMP host unreachable, when the node finds no
	// neighbour for an address it routes on the bridge.
	unreachable = "unreachable"
)

// dial connects from namespace ns to dest over p and returns what the
// server answered, refused (TCP reset), timedOut (TCP SYNs dropped),
// unreachable or noReply (no UDP answer within two seconds).
func (tl *trafficLab) dial(ns string, p Protocol, dest netip.AddrPort) string {
	tl.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out string
	var err error
	switch p {
	case TCP:
		out, err = tl.lab.Exec(ctx, ns, "socat", "-t2", "-T3", "-", fmt.Sprintf("TCP:%s,connect-timeout=2", dest))
	case UDP:
		out, err = tl.lab.Exec(ctx, ns, "sh", "-c", fmt.Sprintf("echo ping | socat -t2 -T3 - 'UDP:%s'", dest))
	}
	switch {
	case err == nil && strings.TrimSpace(out) == "":
		return noReply
	case err == nil:
		return strings.TrimSpace(out)
	case strings.Contains(out, "Connection refused") && p == TCP:
		return refused
	case strings.Contains(out, "Connection refused"):
		return noReply // an ICMP port unreachable
	case strings.Contains(out, "Connection timed out"):
		return timedOut
	case strings.Contains(out, "No route to host"):
		return unreachable
	}
	tl.t.Fatalf("dial %s %s from %s: %v", p, dest, ns, err)
	return ""
}

// expect checks that dialing dest from ns over p gives want.
func (tl *trafficLab) expect(what, ns string, p Protocol, dest netip.AddrPort, want string) {
	tl.t.Helper()
	got := tl.dial(ns, p, dest)
	if p == UDP && got == noReply && want != noReply {
		// A datagram may be lost, or its answer (socat forks twice per
		// datagram) come after the dial's 2 s on a machine busy with
		// the other packages' tests. It gets a second try; a wrong
		// answer, or a second loss, fails the test.
		tl.t.Logf("%s: no answer from %s over UDP from %s; trying once more", what, dest, ns)
		got = tl.dial(ns, p, dest)
	}
	if got != want {
		tl.t.Errorf("%s: %s to %s from %s: got %q, want %q", what, p, dest, ns, got, want)
	}
}

var ruleCounters = regexp.MustCompile(`^\[(\d+):\d+\] (.*)$`)

// packets returns the packet counter of the rule of the node's f table
// that contains match; it fails the test unless exactly one rule does.
func (tl *trafficLab) packets(f Family, table, match string) int {
	tl.t.Helper()
	n, found := 0, 0
	for line := range strings.Lines(tl.exec(tl.lab.Node, f.command("-save"), "-c", "-t", table)) {
		m := ruleCounters.FindStringSubmatch(strings.TrimSpace(line))
		if m != nil && strings.Contains(m[2], match) {
			n, _ = strconv.Atoi(m[1])
			found++
		}
	}
	if found != 1 {
		tl.t.Fatalf("%d rules of %s %s contain %q", found, f, table, match)
	}
	return n
}

// ap is an address and port.
func ap(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

// otherFamilyPrefix is a prefix of the family other than f, which a
// Syncer of f skips.
var otherFamilyPrefix = map[Family]netip.Prefix{
	IPv4: netip.MustParsePrefix("2001:db8:244::a/128"),
	IPv6: netip.MustParsePrefix("10.244.0.10/32"),
}

// TestTrafficNodePort checks that a pod and the node itself reach a
// listener through a node port on the node's address, that loopback is
// not a node-port address by default, and that NodePortAddresses limits
// the addresses.
func TestTrafficNodePort(t *testing.T) {
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			tl := newTrafficLab(t, 1)
			pod, node := tl.pods[0].NS, tl.lab.Node
			listener := uint16(40001)
			tl.serve(node, f, TCP, listener, "hi")
			r := Rules{
				NodePorts: []NodePort{np("default/web:http", f, TCP, 30080, listener)},
				Listeners: []Listener{{f, TCP, listener}},
			}
			if f == IPv4 {
				tl.serve(node, f, UDP, 40002, "hi-udp")
				r.NodePorts = append(r.NodePorts, np("kube-system/dns:dns", f, UDP, 30053, 40002))
				r.Listeners = append(r.Listeners, Listener{f, UDP, 40002})
			}
			loopback := map[Family]netip.Addr{IPv4: netip.MustParseAddr("127.0.0.1"), IPv6: netip.IPv6Loopback()}[f]
			nodePort := ap(nodeAddr[f], 30080)

			tl.apply(f, r)
			tl.expect("node port from a pod", pod, TCP, nodePort, "hi")
			tl.expect("node port from the node", node, TCP, nodePort, "hi")
			tl.expect("node port on loopback", node, TCP, ap(loopback, 30080), refused)
			if f == IPv4 {
				tl.expect("UDP node port from a pod", pod, UDP, ap(nodeAddr[f], 30053), "hi-udp")
				tl.expect("UDP listener from a pod, directly", pod, UDP, ap(nodeAddr[f], 40002), noReply)
			}

			other := map[Family]string{IPv4: "192.168.0.0/16", IPv6: "fd00::/8"}[f]
			r.NodePortAddresses = pfx(other)
			tl.apply(f, r)
			tl.expect("node port outside NodePortAddresses", pod, TCP, nodePort, refused)

			// Addresses of the other family only: no node ports at all.
			r.NodePortAddresses = []netip.Prefix{otherFamilyPrefix[f]}
			tl.apply(f, r)
			tl.expect("NodePortAddresses of the other family", pod, TCP, nodePort, refused)

			bridge := map[Family]string{IPv4: "10.244.0.0/24", IPv6: "2001:db8:244::/64"}[f]
			r.NodePortAddresses = pfx(other, bridge)
			tl.apply(f, r)
			tl.expect("node port inside NodePortAddresses", pod, TCP, nodePort, "hi")
		})
	}
}

// TestTrafficFirewall checks loadBalancerSourceRanges: an allowed pod
// reaches the listener through the LoadBalancer IP, another pod and the
// node are dropped, and the DROP rule sees only the packets that were not
// redirected, because REDIRECT has rewritten the others' destination
// before the filter hooks run.
func TestTrafficFirewall(t *testing.T) {
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			tl := newTrafficLab(t, 2)
			allowed, denied, node := tl.pods[0], tl.pods[1], tl.lab.Node
			lbIP := map[Family]netip.Addr{IPv4: netip.MustParseAddr("10.96.200.1"), IPv6: netip.MustParseAddr("2001:db8:96::c8:1")}[f]
			lb := ap(lbIP, 80)
			listener := uint16(40001)
			tl.serve(node, f, TCP, listener, "hi")
			intercept := InterceptRule{Comment: "default/lb:http", Protocol: TCP, Dest: lbIP, Port: 80, ToPort: listener}
			r := Rules{
				Intercepts: []InterceptRule{intercept},
				Firewalls: []Firewall{{Comment: "default/lb:http", Protocol: TCP, Dest: lbIP, Port: 80,
					Allow: []netip.Prefix{netip.PrefixFrom(podAddr(allowed, f), f.hostBits()), otherFamilyPrefix[f]}}},
				Listeners: []Listener{{f, TCP, listener}},
			}
			tl.apply(f, r)
			drop := fmt.Sprintf("-d %s/%d -p tcp", lbIP, f.hostBits())

			tl.expect("allowed pod", allowed.NS, TCP, lb, "hi")
			if n := tl.packets(f, "filter", drop); n != 0 {
				t.Errorf("the firewall's DROP rule saw %d packets of a redirected connection", n)
			}
			tl.expect("denied pod", denied.NS, TCP, lb, timedOut)
			if n := tl.packets(f, "filter", drop); n == 0 {
				t.Error("the denied pod's SYNs did not hit the firewall's DROP rule")
			}
			before := tl.packets(f, "filter", drop)
			tl.expect("the node, not in the source ranges", node, TCP, lb, timedOut)
			if n := tl.packets(f, "filter", drop); n == before {
				t.Error("the node's SYNs did not hit the firewall's DROP rule")
			}

			// Source ranges of the other family only: nobody gets in.
			r.Firewalls[0].Allow = []netip.Prefix{otherFamilyPrefix[f]}
			tl.apply(f, r)
			tl.expect("allowed pod, source ranges of the other family only", allowed.NS, TCP, lb, timedOut)

			// Without the firewall, the denied pod gets in: it was the
			// firewall that kept it out.
			r.Firewalls = nil
			tl.apply(f, r)
			tl.expect("denied pod without a firewall", denied.NS, TCP, lb, "hi")
		})
	}
}

// TestTrafficListenerGuard checks that a listener cannot be reached
// directly from a pod, while the same pod and the node itself reach it
// through the service address; that the guard, one rule matching the
// listener set, leaves alone traffic to the same port number elsewhere
// and to ports outside the set; and that Cleanup removes everything from
// both tables and the sets, and nothing else.
func TestTrafficListenerGuard(t *testing.T) {
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			tl := newTrafficLab(t, 2)
			client, other, node := tl.pods[0].NS, tl.pods[1], tl.lab.Node
			vipAddr := map[Family]netip.Addr{IPv4: netip.MustParseAddr("10.96.0.10"), IPv6: netip.MustParseAddr("2001:db8:96::10")}[f]
			vip := ap(vipAddr, 80)
			listener := uint16(40001)
			direct := ap(nodeAddr[f], listener)
			tl.serve(node, f, TCP, listener, "hi")
			tl.serve(other.NS, f, TCP, listener, "pod")
			ipt := f.command("")
			tl.exec(node, ipt, "-t", "filter", "-A", "INPUT", "-s", unrelatedSource[f], "-m", "comment", "--comment", "not ours", "-j", "ACCEPT")
			tl.exec(node, ipt, "-t", "nat", "-A", "OUTPUT", "-d", unrelatedDest[f], "-m", "comment", "--comment", "not ours", "-j", "RETURN")
			tl.exec(node, ipt, "-t", "mangle", "-A", "PREROUTING", "-d", unrelatedMangleDest[f], "-m", "comment", "--comment", "not ours", "-j", "RETURN")

			tl.expect("listener directly, before any rule", client, TCP, direct, "hi")
			tl.apply(f, Rules{
				Intercepts: []InterceptRule{{Comment: "default/web:http", Protocol: TCP, Dest: vipAddr, Port: 80, ToPort: listener}},
				Listeners:  []Listener{{f, TCP, listener}},
			})
			set := map[Family]string{IPv4: listenersTCP4, IPv6: listenersTCP6}[f]
			guard := fmt.Sprintf("-p tcp -m set --match-set %s dst -m addrtype", set)
			if got := tl.exec(node, "ipset", "save", set); got != fmt.Sprintf("create %s %s\nadd %s %d\n", set, setType, set, listener) {
				t.Errorf("ipset save %s in the node:\n%s", set, got)
			}

			tl.expect("listener directly from a pod", client, TCP, direct, timedOut)
			if n := tl.packets(f, "filter", guard); n == 0 {
				t.Error("the direct connection's SYNs did not hit the listener guard")
			}
			before := tl.packets(f, "filter", guard)
			// Only a connection's first packet jumps to the guard's chain:
			// the SYN, of the four or more that the connection sends the
			// node (SYN, ACK, FIN, ACK). IPv6 neighbour discovery, which
			// conntrack leaves untracked, may add one more.
			jump := "-A INPUT -m conntrack --ctstate NEW,UNTRACKED"
			jumped := tl.packets(f, "filter", jump)
			tl.expect("service from a pod", client, TCP, vip, "hi")
			if n := tl.packets(f, "filter", jump) - jumped; n < 1 || n > 2 {
				t.Errorf("%d packets jumped from INPUT to the firewall chain during one connection, want its SYN (and at most one neighbour discovery packet)", n)
			}
			tl.expect("service from the node", node, TCP, vip, "hi")
			if n := tl.packets(f, "filter", guard); n != before {
				t.Errorf("the listener guard saw %d packets of redirected connections", n-before)
			}
			// Not the node's: passing through the bridge (FORWARD, with
			// br_netfilter) or leaving the node (OUTPUT).
			tl.expect("another pod on the listener's port number", client, TCP, ap(podAddr(other, f), listener), "pod")
			tl.expect("the node to a pod on the listener's port number", node, TCP, ap(podAddr(other, f), listener), "pod")

			// A port of the node outside the set is not guarded; a port
			// added to the set by an incremental Sync is, at once.
			second := uint16(40002)
			tl.serve(node, f, TCP, second, "second")
			tl.expect("a port outside the listener set", client, TCP, ap(nodeAddr[f], second), "second")
			res, err := tl.sync[f].Sync(context.Background(), Rules{
				Intercepts: []InterceptRule{{Comment: "default/web:http", Protocol: TCP, Dest: vipAddr, Port: 80, ToPort: listener}},
				Listeners:  []Listener{{f, TCP, listener}, {f, TCP, second}},
			}, false)
			if err != nil {
				t.Fatal(err)
			}
			if want := (Result{Rules: 4, WroteSets: true, SetMembers: 2, SetMembersWritten: 1}); res != want {
				t.Errorf("adding a listener: Sync = %+v, want %+v (the set only)", res, want)
			}
			tl.expect("a port added to the listener set", client, TCP, ap(nodeAddr[f], second), timedOut)
			tl.expect("service from a pod, after the change", client, TCP, vip, "hi")

			for range 2 { // idempotent
				if err := Cleanup(context.Background(), tl.cfg[f]); err != nil {
					t.Fatal(err)
				}
			}
			for _, table := range []string{"nat", "mangle", "filter"} {
				saved := tl.exec(node, f.command("-save"), "-t", table)
				if strings.Contains(saved, "UPROXY") || strings.Contains(saved, "uproxy") {
					t.Errorf("Cleanup left rules in %s:\n%s", table, saved)
				}
				if !strings.Contains(saved, `--comment "not ours"`) {
					t.Errorf("Cleanup removed someone else's rule from %s:\n%s", table, saved)
				}
			}
			if sets := tl.exec(node, "ipset", "list", "-n"); sets != "" {
				t.Errorf("Cleanup left sets: %q", sets)
			}
			tl.expect("listener directly after Cleanup", client, TCP, direct, "hi")
			if got := tl.dial(client, TCP, vip); got == "hi" {
				t.Errorf("service after Cleanup: still redirected")
			}
		})
	}
}

// TestTrafficListenerOwner checks UPROXY-LISTENERS: what the rules
// redirect to a listener port reaches only a transparent socket, such as
// the proxy's listeners. A process that binds the port without
// IP_TRANSPARENT, as any local user can once the proxy has closed it or
// died (SIGKILL leaves the rules and sets in the kernel), receives none
// of the service's traffic: the client is refused instead.
func TestTrafficListenerOwner(t *testing.T) {
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			tl := newTrafficLab(t, 1)
			client, node := tl.pods[0].NS, tl.lab.Node
			vipAddr := map[Family]netip.Addr{IPv4: netip.MustParseAddr("10.96.0.10"), IPv6: netip.MustParseAddr("2001:db8:96::10")}[f]
			tcpPort, udpPort := uint16(40001), uint16(40002)
			tl.apply(f, Rules{
				Intercepts: []InterceptRule{
					{Comment: "default/web:http", Protocol: TCP, Dest: vipAddr, Port: 80, ToPort: tcpPort},
					{Comment: "default/dns:dns", Protocol: UDP, Dest: vipAddr, Port: 53, ToPort: udpPort},
				},
				Listeners: []Listener{{f, TCP, tcpPort}, {f, UDP, udpPort}},
			})
			// The proxy is gone: a local process binds its ports.
			squatTCP := tl.serveSocket(node, f, TCP, tcpPort, "squatter", false)
			squatUDP := tl.serveSocket(node, f, UDP, udpPort, "squatter-udp", false)
			tl.expect("service from a pod, to a squatted TCP port", client, TCP, ap(vipAddr, 80), refused)
			tl.expect("service from the node, to a squatted TCP port", node, TCP, ap(vipAddr, 80), refused)
			if got := tl.dial(client, UDP, ap(vipAddr, 53)); got == "squatter-udp" {
				t.Error("service from a pod, to a squatted UDP port: the squatter answered")
			}
			// The proxy is back, with transparent listeners.
			for _, p := range []*testlab.Proc{squatTCP, squatUDP} {
				p.Signal(syscall.SIGKILL)
				p.Wait(5 * time.Second)
			}
			tl.serve(node, f, TCP, tcpPort, "proxy")
			tl.serve(node, f, UDP, udpPort, "proxy-udp")
			tl.expect("service from a pod, to the proxy", client, TCP, ap(vipAddr, 80), "proxy")
			tl.expect("service from the node, to the proxy", node, TCP, ap(vipAddr, 80), "proxy")
			tl.expect("UDP service from a pod, to the proxy", client, UDP, ap(vipAddr, 53), "proxy-udp")
		})
	}
}

// TestTrafficOwnMark checks that the proxy's own packets, which carry
// OwnMark, are not intercepted: a connection from the node to an
// address and port that a Service intercepts, a pod's own in a tenant's
// externalIPs, reaches the pod when it carries the mark, and the
// listener otherwise.
func TestTrafficOwnMark(t *testing.T) {
	for _, f := range []Family{IPv4, IPv6} {
		t.Run(f.String(), func(t *testing.T) {
			tl := newTrafficLab(t, 1)
			pod, node := tl.pods[0], tl.lab.Node
			dest := ap(podAddr(pod, f), 8080)
			tl.serve(pod.NS, f, TCP, 8080, "pod")
			tl.serve(node, f, TCP, 40001, "proxy")
			tl.apply(f, Rules{
				Intercepts: []InterceptRule{{Comment: "tenant/loop:http", Protocol: TCP, Dest: dest.Addr(), Port: 8080, ToPort: 40001}},
				Listeners:  []Listener{{f, TCP, 40001}},
			})
			tl.expect("the node, unmarked", node, TCP, dest, "proxy")
			var got string
			err := testlab.DoInNetns(node, func() error {
				d := net.Dialer{Timeout: 2 * time.Second, Control: func(_, _ string, c syscall.RawConn) error {
					var serr error
					if err := c.Control(func(fd uintptr) {
						serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_MARK, int(OwnMark))
					}); err != nil {
						return err
					}
					return serr
				}}
				c, err := d.Dial("tcp", dest.String())
				if err != nil {
					return err
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(3 * time.Second))
				b, err := io.ReadAll(c)
				got = strings.TrimSpace(string(b))
				return err
			})
			if err != nil || got != "pod" {
				t.Errorf("the node, with the proxy's mark: got %q, %v; want pod", got, err)
			}
		})
	}
}
