package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/internal/testkube"
	"github.com/uproxy/uproxy/internal/testwait"
)

// TestE2EScale creates 5,000 Services × 10 endpoints in a real API server
// and checks that uproxy programs all of them correctly: one rule per
// service, and a spot-check of VIPs that each answer from their endpoints.
// How fast is measured by the bench harness, not here.
func TestE2EScale(t *testing.T) {
	const services, endpoints = 5000, 10
	c := newKubeCluster(t, 1)
	ctx := context.Background()
	// The pod answers on ten addresses: the ten endpoints of every service.
	pod := c.pods[0]
	var addrs []netip.Addr
	for i := range endpoints {
		a := netip.AddrFrom4([4]byte{10, 244, 0, byte(100 + i)})
		if _, err := c.lab.Exec(ctx, pod.NS, "ip", "addr", "add", a.String()+"/24", "dev", "eth0"); err != nil {
			t.Fatal(err)
		}
		addrs = append(addrs, a)
	}

	start := time.Now()
	gen, err := testkube.Generate(ctx, c.cp.RESTConfig, testkube.GenerateSpec{Services: services, Endpoints: addrs})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("created %d services × %d endpoints in %v", services, endpoints, time.Since(start).Round(time.Millisecond))

	start = time.Now()
	var err2 error
	if c.up, err2 = c.run("uproxy", "--kubeconfig", c.cp.Kubeconfig,
		"--hostname-override", "node-a", "--iptables-min-sync-period", "1s",
		"--upgrade-socket", filepath.Join(t.TempDir(), "upgrade.sock"), "--state-file", filepath.Join(t.TempDir(), "state.json")); err2 != nil {
		t.Fatal(err2)
	}
	var rules string
	testwait.UntilOK(t, 3*time.Minute, fmt.Sprintf("all %d services programmed", services+1), func() (bool, string) {
		rules = c.natRules()
		n := strings.Count(rules, "-j REDIRECT") // the kubernetes service's too
		return n == services+1, fmt.Sprintf("%d programmed\n%s", n, tailLines(c.up.Output(), 20))
	})
	for _, g := range gen {
		if !strings.Contains(rules, fmt.Sprintf("-d %s/32 ", g.ClusterIP)) {
			t.Fatalf("no rule for %s (%s)", g.Name, g.ClusterIP)
		}
	}
	t.Logf("all %d services programmed %v after uproxy started", services, time.Since(start).Round(time.Millisecond))

	// Spot-check: the first, the last and random services answer, spread
	// over their ten endpoints.
	check := []testkube.Generated{gen[0], gen[len(gen)-1]}
	for range 18 {
		check = append(check, gen[rand.IntN(len(gen))])
	}
	for _, g := range check {
		r := c.get(c.client.NS, fmt.Sprintf("http://%s/", g.ClusterIP), 20)
		if r.Errors > 0 {
			t.Errorf("%s (%s): %d errors (%s)", g.Name, g.ClusterIP, r.Errors, r.FirstError)
		}
	}
	r := c.get(c.client.NS, fmt.Sprintf("http://%s/", gen[len(gen)/2].ClusterIP), 40)
	if len(r.Peers) != 1 || r.Errors > 0 {
		t.Errorf("unexpected answer %+v", r)
	}
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
