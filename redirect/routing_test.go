package redirect

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/internal/testlab"
)

func TestRoutingEnsureAndRemove(t *testing.T) {
	if !testlab.RunInNetns(t) {
		return
	}
	show := func(args ...string) string {
		t.Helper()
		out, err := exec.Command("ip", args...).CombinedOutput()
		if err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
		return string(out)
	}
	r := Routing{}
	for _, f := range []Family{IPv4, IPv6} {
		fam := "-4"
		if f == IPv6 {
			fam = "-6"
		}
		t.Run(f.String(), func(t *testing.T) {
			for i := range 2 {
				repaired, err := r.Ensure(f)
				if err != nil {
					t.Fatal(err)
				}
				if repaired != (i == 0) {
					t.Errorf("Ensure #%d repaired=%v", i+1, repaired)
				}
			}
			rules := show(fam, "rule", "show")
			if n := strings.Count(rules, "fwmark 0x200000/0x200000 lookup 117"); n != 1 {
				t.Errorf("%d policy rules, want 1:\n%s", n, rules)
			}
			if rt := show(fam, "route", "show", "table", "117"); !strings.Contains(rt, "local default dev lo") {
				t.Errorf("table 117:\n%s", rt)
			}
			// Someone deletes the route: Ensure puts it back.
			show(fam, "route", "del", "local", "default", "dev", "lo", "table", "117")
			if repaired, err := r.Ensure(f); err != nil || !repaired {
				t.Fatalf("Ensure after deleting the route: repaired=%v, %v", repaired, err)
			}
			if rt := show(fam, "route", "show", "table", "117"); !strings.Contains(rt, "local default dev lo") {
				t.Errorf("route not repaired:\n%s", rt)
			}
			// The bridge loop: its rule right before, its route, and the
			// veth pair, which a deleted end makes Ensure recreate.
			if rules := show(fam, "rule", "show"); !strings.Contains(rules, "99:\tfrom all fwmark 0x300000/0x300000 lookup 118") {
				t.Errorf("no bridge loop rule:\n%s", rules)
			}
			if rt := show(fam, "route", "show", "table", "118"); !strings.Contains(rt, "default dev "+BridgeLoopOut) {
				t.Errorf("table 118:\n%s", rt)
			}
			for _, dev := range []string{BridgeLoopOut, BridgeLoopIn} {
				if l := show("link", "show", dev); !strings.Contains(l, "NOARP,UP") || !strings.Contains(l, "02:75:70:72:6f:78") {
					t.Errorf("%s:\n%s", dev, l)
				}
			}
			show("link", "del", BridgeLoopOut)
			if repaired, err := r.Ensure(f); err != nil || !repaired {
				t.Fatalf("Ensure after deleting the bridge loop: repaired=%v, %v", repaired, err)
			}
			if rt := show(fam, "route", "show", "table", "118"); !strings.Contains(rt, "default dev "+BridgeLoopOut) {
				t.Errorf("table 118 not repaired:\n%s", rt)
			}
			for range 2 {
				if err := r.Remove(f); err != nil {
					t.Fatal(err)
				}
			}
			if rules := show(fam, "rule", "show"); strings.Contains(rules, "lookup 117") {
				t.Errorf("rule left after Remove:\n%s", rules)
			}
			if rt := show(fam, "route", "show", "table", "117"); strings.TrimSpace(rt) != "" {
				t.Errorf("route left after Remove:\n%s", rt)
			}
			if rules := show(fam, "rule", "show"); strings.Contains(rules, "lookup 118") {
				t.Errorf("bridge loop rule left after Remove:\n%s", rules)
			}
			if links := show("link", "show"); strings.Contains(links, "uproxy-loop") {
				t.Errorf("bridge loop left after Remove:\n%s", links)
			}
		})
	}
}
