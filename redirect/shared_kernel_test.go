package redirect

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// savedMembers returns the members of set name as ipset save prints them
// in the test's namespace, sorted as strings.
func savedMembers(t *testing.T, name string) []string {
	t.Helper()
	var ms []string
	for line := range strings.Lines(nsCommand(t, "ipset", "save", name)) {
		if m, ok := strings.CutPrefix(strings.TrimSpace(line), "add "+name+" "); ok {
			ms = append(ms, m)
		}
	}
	slices.Sort(ms)
	return ms
}

// TestKernelShared checks the shared layout against real iptables and
// ipset: the rules are what iptables-save prints back and do not change
// with the services, which are set members that ipset save prints as
// rendered; a change of services is one ipset restore; a full Sync
// repairs a member deleted behind the Syncer's back; Cleanup leaves
// nothing of uproxy's.
func TestKernelShared(t *testing.T) {
	inEachFamilyNetns(t, func(t *testing.T, f Family) {
		testKernelShared(t, f)
	})
}

func testKernelShared(t *testing.T, f Family) {
	ctx := context.Background()
	ipt := func(args ...string) { t.Helper(); nsCommand(t, f.command(""), args...) }
	save, restore := f.command("-save"), f.command("-restore")
	reads := len(setsOf(f))
	servicesSet, nodePortSet := setOf(serviceSet, f, "").name, setOf(nodePortSet, f, TCP).name
	// addr returns the address of family f with the last byte b.
	addr := func(b byte) string {
		if f == IPv6 {
			return fmt.Sprintf("2001:db8:96::%x", b)
		}
		return fmt.Sprintf("10.96.0.%d", b)
	}
	tcp, udp := sharedPort(f, TCP), sharedPort(f, UDP)
	r := Rules{
		Shared: true,
		Intercepts: []InterceptRule{
			svc("default/web:http", TCP, addr(10), 80, tcp),
			svc("default/api:grpc", TCP, addr(11), 9000, tcp),
			svc("kube-system/kube-dns:dns", UDP, addr(2), 53, udp),
		},
		NodePorts: []NodePort{np("default/web:http", f, TCP, 30080, tcp)},
		Listeners: []Listener{{f, TCP, tcp}, {f, UDP, udp}},
	}
	check := func(step string, r Rules, synced bool) {
		t.Helper()
		if diff := cmp.Diff(kernelWant(f, r, synced), savedTables(t, f)); diff != "" {
			t.Fatalf("%s: nat, mangle and filter tables (-want +got):\n%s", step, diff)
		}
		if !synced {
			r = Rules{}
		}
		checkSets(t, step, f, r)
	}
	x := &countingExec{calls: map[string]int{}}
	s, err := New(Config{Family: f, Exec: x})
	if err != nil {
		t.Fatal(err)
	}
	sync := func(step string, r Rules, full bool, want Result, wantCalls map[string]int) {
		t.Helper()
		res, err := s.Sync(ctx, r, full)
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		if res != want {
			t.Errorf("%s: Sync = %+v, want %+v", step, res, want)
		}
		if diff := cmp.Diff(wantCalls, x.take()); diff != "" {
			t.Errorf("%s: commands run (-want +got):\n%s", step, diff)
		}
	}

	ipt("-t", "nat", "-A", "OUTPUT", "-d", unrelatedDest[f], "-m", "comment", "--comment", "someone else", "-j", "RETURN")
	ipt("-t", "mangle", "-A", "PREROUTING", "-d", unrelatedMangleDest[f], "-m", "comment", "--comment", "someone else", "-j", "RETURN")
	ipt("-t", "filter", "-A", "INPUT", "-s", unrelatedSource[f], "-m", "comment", "--comment", "someone else", "-j", "ACCEPT")

	// 6 rules: a REDIRECT per protocol matching the service set, the
	// jump to node ports and the node-port set's REDIRECT, two listener
	// guards. 6 members: 3 services, 1 node port, 2 listeners.
	sync("first Sync", r, false, Result{Wrote: true, Rules: 10, WroteSets: true, SetMembers: 6, SetMembersWritten: 6},
		map[string]int{save: 1, "ipset": reads + 1, restore: 1})
	check("first Sync", r, true)
	wantMembers := []string{
		netip.MustParseAddr(addr(10)).String() + ",tcp:80",
		netip.MustParseAddr(addr(11)).String() + ",tcp:9000",
		netip.MustParseAddr(addr(2)).String() + ",udp:53",
	}
	slices.Sort(wantMembers)
	if diff := cmp.Diff(wantMembers, savedMembers(t, servicesSet)); diff != "" {
		t.Errorf("ipset save %s (-want +got):\n%s", servicesSet, diff)
	}
	if diff := cmp.Diff([]string{"30080"}, savedMembers(t, nodePortSet)); diff != "" {
		t.Errorf("ipset save %s (-want +got):\n%s", nodePortSet, diff)
	}
	saved := nsCommand(t, save, "-t", "nat")
	for _, rule := range []string{
		fmt.Sprintf(`-A UPROXY-SERVICES -p tcp -m set --match-set %s dst,dst -m comment --comment "uproxy shared tcp listener" -j REDIRECT --to-ports %d`, servicesSet, tcp),
		fmt.Sprintf(`-A UPROXY-SERVICES -p udp -m set --match-set %s dst,dst -m comment --comment "uproxy shared udp listener" -j REDIRECT --to-ports %d`, servicesSet, udp),
		fmt.Sprintf(`-A UPROXY-NODEPORTS -p tcp -m set --match-set %s dst -m comment --comment "uproxy shared tcp node ports" -j REDIRECT --to-ports %d`, nodePortSet, tcp),
	} {
		if !strings.Contains(saved, "\n"+rule+"\n") {
			t.Errorf("%s -t nat has no %q:\n%s", save, rule, saved)
		}
	}
	// Nothing to write: the rules are what iptables-save prints, the
	// members what ipset save prints, and the header options the kernel
	// adds (hashsize, bucketsize, initval) are no drift.
	sync("unchanged full Sync", r, true, Result{Rules: 10, SetMembers: 6}, map[string]int{save: 1, "ipset": reads})
	rules := savedTables(t, f)

	// One service added, one removed: one ipset restore, no rule.
	changed := r
	changed.Intercepts = []InterceptRule{r.Intercepts[0], r.Intercepts[2], svc("default/new:http", TCP, addr(12), 8080, tcp)}
	sync("one added, one removed", changed, false, Result{Rules: 10, WroteSets: true, SetMembers: 6, SetMembersWritten: 2}, map[string]int{"ipset": 1})
	check("one added, one removed", changed, true)
	if got := savedTables(t, f); got != rules {
		t.Errorf("the rules changed with the services (-before +after):\n%s", cmp.Diff(rules, got))
	}
	wantMembers = []string{
		netip.MustParseAddr(addr(10)).String() + ",tcp:80",
		netip.MustParseAddr(addr(12)).String() + ",tcp:8080",
		netip.MustParseAddr(addr(2)).String() + ",udp:53",
	}
	slices.Sort(wantMembers)
	if diff := cmp.Diff(wantMembers, savedMembers(t, servicesSet)); diff != "" {
		t.Errorf("ipset save %s after the change (-want +got):\n%s", servicesSet, diff)
	}

	// A member deleted behind the Syncer's back: a full Sync adds it,
	// and only it.
	nsCommand(t, "ipset", "del", servicesSet, wantMembers[0])
	sync("repair a deleted member", changed, true,
		Result{Rules: 10, Repaired: true, WroteSets: true, SetMembers: 6, SetMembersWritten: 1, SetsRepaired: true},
		map[string]int{save: 1, "ipset": reads + 1})
	check("repair a deleted member", changed, true)

	// 2,000 services: the set grows (and the kernel its hash table),
	// the rules stay; a full Sync then finds nothing to do.
	many := changed
	many.Intercepts = slices.Clone(changed.Intercepts)
	for i := range 2000 {
		a := netip.AddrFrom4([4]byte{10, 96, 10 + byte(i>>8), byte(i)})
		if f == IPv6 {
			a = netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, 0x96, 0, 1, 14: byte(i >> 8), 15: byte(i)})
		}
		many.Intercepts = append(many.Intercepts, svc(fmt.Sprintf("ns/svc-%d:http", i), TCP, a.String(), 80, tcp))
	}
	sync("2,000 services", many, false, Result{Rules: 10, WroteSets: true, SetMembers: 2006, SetMembersWritten: 2000}, map[string]int{"ipset": 1})
	sync("2,000 services, unchanged full Sync", many, true, Result{Rules: 10, SetMembers: 2006}, map[string]int{save: 1, "ipset": reads})
	check("2,000 services", many, true)
	if got := savedTables(t, f); got != rules {
		t.Errorf("the rules changed with 2,000 services (-before +after):\n%s", cmp.Diff(rules, got))
	}
	sync("back to 3 services", changed, false, Result{Rules: 10, WroteSets: true, SetMembers: 6, SetMembersWritten: 2000}, map[string]int{"ipset": 1})

	// A LoadBalancer address with source ranges: its rule before the
	// set's, out of the set, round-tripped.
	lb := map[Family]string{IPv4: "192.0.2.80", IPv6: "2001:db8:c0::80"}[f]
	guarded := changed
	guarded.Intercepts = append(slices.Clone(changed.Intercepts), svc("default/lb:https", TCP, lb, 443, tcp))
	guarded.Firewalls = []Firewall{fw("default/lb:https", TCP, lb, 443, "10.244.0.0/16", "2001:db8:244::/64")}
	sync("firewall", guarded, false, Result{Wrote: true, Rules: 12, SetMembers: 6}, map[string]int{restore: 1})
	check("firewall", guarded, true)
	sync("firewall, unchanged full Sync", guarded, true, Result{Rules: 12, SetMembers: 6}, map[string]int{save: 1, "ipset": reads})

	// Tproxy mode: the same sets, the rules in mangle, round-tripped.
	tp := tproxied(guarded, Routing{})
	tp.Listeners = nil
	k := parseState(Render(f, tp)).ruleCount()
	// A change of mode reads the tables and sets, as a full Sync does.
	sync("tproxy mode", tp, false, Result{Wrote: true, Rules: k, WroteSets: true, SetMembers: 4}, map[string]int{save: 1, restore: 1, "ipset": reads + 2})
	check("tproxy mode", tp, true)
	sync("tproxy mode, unchanged full Sync", tp, true, Result{Rules: k, SetMembers: 4}, map[string]int{save: 1, "ipset": reads})
	sync("tproxy mode, one service removed", func() Rules { r := tp; r.Intercepts = tp.Intercepts[1:]; return r }(), false,
		Result{Rules: k, WroteSets: true, SetMembers: 3, SetMembersWritten: 1}, map[string]int{"ipset": 1})

	// Per-service layout: the service and node-port sets go, once no
	// rule names them.
	perService := guarded
	perService.Shared = false
	sync("per-service layout", perService, false, Result{Wrote: true, Rules: parseState(Render(f, perService)).ruleCount(), WroteSets: true, SetMembers: 2, SetMembersWritten: 2},
		map[string]int{save: 1, restore: 1, "ipset": reads + 3})
	check("per-service layout", perService, true)

	sync("shared layout again", changed, false, Result{Wrote: true, Rules: 10, WroteSets: true, SetMembers: 6, SetMembersWritten: 4}, map[string]int{restore: 1, "ipset": 1})
	check("shared layout again", changed, true)
	for i := range 2 {
		if err := Cleanup(ctx, Config{Family: f, Exec: x}); err != nil {
			t.Fatalf("Cleanup %d: %v", i+1, err)
		}
		x.take()
		if saved := nsCommand(t, save); strings.Contains(saved, "UPROXY") || strings.Contains(saved, "uproxy") {
			t.Errorf("Cleanup %d left rules:\n%s", i+1, saved)
		}
		if names := nsCommand(t, "ipset", "list", "-n"); names != "" {
			t.Errorf("Cleanup %d left sets: %q", i+1, names)
		}
	}
	check("Cleanup", Rules{}, false)
}

// TestKernelSharedRoundTrip checks, for the rules of the shared golden
// files in both modes, that what Render writes is what iptables-save
// prints back and what RenderSetUpdate writes what ipset save prints
// back: after a first Sync, a full Sync finds nothing to write.
func TestKernelSharedRoundTrip(t *testing.T) {
	withAddrs := sharedAll
	withAddrs.NodePortAddresses = pfx("192.168.1.7/24", "2001:db8::/64", "10.0.0.0/8", "0.0.0.0/0", "::/0")
	cases := map[string]Rules{
		"services":                     sharedServices,
		"node ports":                   withSharedNodePorts(sharedServices),
		"firewall":                     withSharedFirewalls(sharedServices),
		"all":                          sharedAll,
		"node-port addresses":          withAddrs,
		"tproxy all":                   tproxied(sharedAll, Routing{}),
		"tproxy node-port addresses":   tproxied(withAddrs, Routing{Mark: 0x10, Mask: 0xf0}),
		"tproxy services, no listener": tproxied(Rules{Shared: true, Intercepts: sharedServices.Intercepts}, Routing{}),
	}
	inEachFamilyNetns(t, func(t *testing.T, f Family) {
		ctx := context.Background()
		for _, name := range slices.Sorted(maps.Keys(cases)) {
			r := cases[name]
			s, err := New(Config{Family: f})
			if err != nil {
				t.Fatal(err)
			}
			if res, err := s.Sync(ctx, r, true); err != nil || !res.Wrote {
				t.Fatalf("%s: first Sync = %+v, %v", name, res, err)
			}
			res, err := s.Sync(ctx, r, true)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if res.Wrote || res.WroteSets || res.Repaired {
				t.Errorf("%s: full Sync of an unchanged kernel = %+v; rendered:\n%s\niptables-save:\n%s\nipset save:\n%s",
					name, res, Render(f, r), nsCommand(t, f.command("-save")), nsCommand(t, "ipset", "save"))
			}
			if err := Cleanup(ctx, Config{Family: f}); err != nil {
				t.Fatal(err)
			}
			if names := nsCommand(t, "ipset", "list", "-n"); names != "" {
				t.Errorf("%s: Cleanup left sets: %q", name, names)
			}
		}
	})
}
