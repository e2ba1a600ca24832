package main

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/promtest"
	"github.com/uproxy/uproxy/internal/testlab"
	"github.com/uproxy/uproxy/internal/testwait"
)

// udpFromPort sends one datagram from port src of namespace ns to dst and
// returns the answer's first word (the backend's name), or why there was
// none.
func udpFromPort(t *testing.T, ns string, src uint16, dst netip.AddrPort) string {
	t.Helper()
	var c *net.UDPConn
	if err := testlab.DoInNetns(ns, func() (err error) {
		c, err = net.DialUDP("udp4", &net.UDPAddr{Port: int(src)}, net.UDPAddrFromAddrPort(dst))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte("query")); err != nil {
		return err.Error()
	}
	b := make([]byte, 512)
	n, err := c.Read(b)
	var ne net.Error
	switch {
	case err == nil:
		name, _, _ := strings.Cut(string(b[:n]), " ")
		return name
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.As(err, &ne) && ne.Timeout():
		return "no reply"
	}
	return err.Error()
}

// TestE2EStaleConntrackAfterKubeProxy is a swap from kube-proxy with a
// long-lived UDP client: kube-proxy's DNAT sent the client's flow to a
// pod (web-1), and the client keeps sending from the same port, so the
// flow's conntrack entry never expires. uproxy's rules alone would never
// see the flow: it deletes the entry after its first sync, and the
// client's next datagram reaches uproxy's endpoint (web-0), counted in
// uproxy_conntrack_entries_deleted_total.
func TestE2EStaleConntrackAfterKubeProxy(t *testing.T) {
	c := newCluster(t, 2)
	c.serveUDP(c.pods...)
	vip := netip.MustParseAddrPort("10.96.0.53:53")
	const clientPort = 33053
	// The DNAT of kube-proxy's iptables mode, left in place as a swap
	// leaves it until `uproxy cleanup --kube-proxy`; uproxy's rules come
	// before it.
	if _, err := c.lab.Exec(context.Background(), c.lab.Node, "iptables", "-t", "nat", "-A", "PREROUTING", "-d", vip.Addr().String(),
		"-p", "udp", "--dport", "53", "-j", "DNAT", "--to-destination", c.pods[1].IP.String()+":5353"); err != nil {
		t.Fatal(err)
	}
	testwait.UntilOK(t, 10*time.Second, "kube-proxy's DNAT to answer", func() (bool, string) {
		got := udpFromPort(t, c.client.NS, clientPort, vip)
		return got == "web-1", got
	})

	c.write("dns.yaml", dnsService(0, c.pods[0]))
	c.start(1)
	testwait.UntilOK(t, 20*time.Second, "the client's flow to reach uproxy's endpoint", func() (bool, string) {
		got := udpFromPort(t, c.client.NS, clientPort, vip)
		return got == "web-0", got
	})
	if v, _ := promtest.Sum(c.scrapeMetrics()["uproxy_conntrack_entries_deleted_total"], nil); v < 1 {
		t.Errorf("uproxy_conntrack_entries_deleted_total = %v, want at least 1", v)
	}
}
