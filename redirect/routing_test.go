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
		})
	}
}
