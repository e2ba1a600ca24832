package redirect

import (
	"errors"
	"net/netip"
	"slices"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// familyClaims are a service port with an address in each family.
var familyClaims = []Intercept{
	{Comment: "default/web:http", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.10"), Port: 80, ToPort: 40001},
	{Comment: "default/web:http", Protocol: TCP, Dest: netip.MustParseAddr("2001:db8::10"), Port: 80, ToPort: 40002},
}

// callCount returns how many commands and jump rule calls k has seen.
func (k *fakeKernel) callCount() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.calls)
}

// routingCalls is a fake FamiliesConfig.EnsureRouting: it records the
// families asked for, and reports a repair for those in repair.
type routingCalls struct {
	mu     sync.Mutex
	asked  []Family
	repair map[Family]bool
}

func (r *routingCalls) ensure(f Family) (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.asked = append(r.asked, f)
	return r.repair[f], nil
}

func (r *routingCalls) take() map[Family]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[Family]int{}
	for _, f := range r.asked {
		out[f]++
	}
	r.asked = nil
	return out
}

// newFakeFamilies returns Families over a fake kernel per family, and the
// log it writes.
func newFakeFamilies(t *testing.T, cfg FamiliesConfig, v4, v6 *fakeKernel) (*Families, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zap.DebugLevel)
	cfg.Logger = zap.New(core)
	cfg.IPv4.Exec, cfg.IPv4.Jumps = v4, v4
	if v6 != nil {
		cfg.IPv6.Exec, cfg.IPv6.Jumps = v6, v6
	}
	f, err := NewFamilies(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return f, logs
}

// messages returns the level and message of each log entry, and forgets
// them.
func messages(logs *observer.ObservedLogs) []string {
	var out []string
	for _, e := range logs.TakeAll() {
		s := e.Level.String() + " " + e.Message
		if f, ok := e.ContextMap()["family"]; ok {
			s += " " + f.(string)
		}
		out = append(out, s)
	}
	return out
}

// TestFamiliesSync checks that both families sync, and that the result
// adds them up: the rules, the rules written (none when the kernel holds
// them already) and the commands run by both families' Syncers, which
// Commands sees too.
func TestFamiliesSync(t *testing.T) {
	v4, v6 := newFakeKernel(IPv4), newFakeKernel(IPv6)
	var mu sync.Mutex
	counted := 0
	f, logs := newFakeFamilies(t, FamiliesConfig{Commands: func(string) { mu.Lock(); counted++; mu.Unlock() }}, v4, v6)
	if diff := cmp.Diff([]Family{IPv4, IPv6}, f.Available()); diff != "" {
		t.Errorf("Available (-want +got):\n%s", diff)
	}
	rules := ServiceRules(familyClaims, ServiceOptions{})
	want4, want6 := Render(IPv4, rules), Render(IPv6, rules)
	n4, n6 := parseState(want4).ruleCount(), parseState(want6).ruleCount()

	for _, step := range []struct {
		name   string
		full   bool
		wrote  bool
		noCmds bool
	}{
		{"first", false, true, false},
		{"unchanged", false, false, true},
		{"full, unchanged", true, false, false},
	} {
		before := v4.callCount() + v6.callCount()
		got, err := f.Sync(t.Context(), familyClaims, step.full)
		if err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		ran := v4.callCount() + v6.callCount() - before
		want := FamiliesResult{Rules: n4 + n6, Commands: ran}
		if step.wrote {
			want.Written = n4 + n6
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("%s: result (-want +got):\n%s", step.name, diff)
		}
		if (ran == 0) != step.noCmds {
			t.Errorf("%s: %d commands run", step.name, ran)
		}
	}
	mu.Lock()
	if total := v4.callCount() + v6.callCount(); counted != total {
		t.Errorf("Commands saw %d commands, the kernels %d", counted, total)
	}
	mu.Unlock()
	if diff := cmp.Diff([]string{"debug iptables rules written IPv4", "debug iptables rules written IPv6"}, messages(logs)); diff != "" {
		t.Errorf("log (-want +got):\n%s", diff)
	}
}

// TestFamiliesRepairLogged checks that a full sync that repairs one
// family's drift says so, naming the family.
func TestFamiliesRepairLogged(t *testing.T) {
	v4, v6 := newFakeKernel(IPv4), newFakeKernel(IPv6)
	f, logs := newFakeFamilies(t, FamiliesConfig{}, v4, v6)
	if _, err := f.Sync(t.Context(), familyClaims, false); err != nil {
		t.Fatal(err)
	}
	logs.TakeAll()
	v6.edit("nat", func(order []string, rules map[string][]string) []string {
		rules["UPROXY-SERVICES"] = rules["UPROXY-SERVICES"][1:]
		return order
	})
	got, err := f.Sync(t.Context(), familyClaims, true)
	if err != nil {
		t.Fatal(err)
	}
	if got.Written == 0 {
		t.Errorf("the repair wrote no rules: %+v", got)
	}
	if diff := cmp.Diff([]string{"warn iptables rules had drifted (changed or deleted by someone else); repaired IPv6"}, messages(logs)); diff != "" {
		t.Errorf("log (-want +got):\n%s", diff)
	}
}

// TestFamiliesOneFails checks that a family's failure is returned
// without keeping the other family from syncing, and that the result
// counts the family that synced.
func TestFamiliesOneFails(t *testing.T) {
	v4, v6 := newFakeKernel(IPv4), newFakeKernel(IPv6)
	f, _ := newFakeFamilies(t, FamiliesConfig{}, v4, v6)
	failure := errors.New("ip6tables-restore: line 3 failed")
	v6.failRestore = failure
	got, err := f.Sync(t.Context(), familyClaims, false)
	if !errors.Is(err, failure) {
		t.Errorf("Sync: %v, want the IPv6 failure", err)
	}
	n4 := parseState(Render(IPv4, ServiceRules(familyClaims, ServiceOptions{}))).ruleCount()
	if got.Rules != n4 || got.Written != n4 {
		t.Errorf("result %+v, want IPv4's %d rules, written", got, n4)
	}
	v4.mu.Lock()
	defer v4.mu.Unlock()
	if v4.rules["nat"]["UPROXY-SERVICES"] == nil {
		t.Error("IPv4's rules were not written")
	}
}

// TestFamiliesWithoutIPv6 checks a node whose ip6tables is unusable:
// New's refusal is logged, only IPv4 is available and synced, and an
// IPv6 claim is reported once, not at every sync, and every sync says
// that IPv6 was skipped, so that the proxier guards no IPv6 listener.
func TestFamiliesWithoutIPv6(t *testing.T) {
	v4 := newFakeKernel(IPv4)
	v6 := newFakeKernel(IPv6)
	f, logs := newFakeFamilies(t, FamiliesConfig{IPv6: Config{Wait: -1}}, v4, v6)
	if diff := cmp.Diff([]Family{IPv4}, f.Available()); diff != "" {
		t.Errorf("Available (-want +got):\n%s", diff)
	}
	for range 2 {
		res, err := f.Sync(t.Context(), familyClaims, false)
		if err != nil {
			t.Fatal(err)
		}
		if res.Skipped != [2]bool{false, true} {
			t.Errorf("Skipped = %v, want IPv6's", res.Skipped)
		}
	}
	if v6.callCount() != 0 {
		t.Errorf("the IPv6 kernel ran %d commands", v6.callCount())
	}
	want := []string{
		"warn ip6tables is not usable; IPv6 service addresses will not be proxied",
		"error IPv6 services present but ip6tables is unavailable; their IPv6 addresses are not proxied, and uproxy's IPv6 UDP listeners check every datagram's destination with conntrack",
		"debug iptables rules written IPv4",
	}
	if diff := cmp.Diff(want, messages(logs)); diff != "" {
		t.Errorf("log (-want +got):\n%s", diff)
	}
}

// TestFamiliesTProxyRouting checks that tproxy mode ensures each family's
// policy routing before its first sync and at every full sync, not at
// the syncs between, and warns when a later check had to repair it.
func TestFamiliesTProxyRouting(t *testing.T) {
	v4, v6 := newFakeKernel(IPv4), newFakeKernel(IPv6)
	routing := &routingCalls{repair: map[Family]bool{IPv4: true, IPv6: true}}
	f, logs := newFakeFamilies(t, FamiliesConfig{Services: ServiceOptions{TProxy: &TProxy{}}, EnsureRouting: routing.ensure}, v4, v6)
	for _, step := range []struct {
		name string
		full bool
		want map[Family]int
		log  []string
	}{
		{"first", false, map[Family]int{IPv4: 1, IPv6: 1}, nil},
		{"partial", false, map[Family]int{}, nil},
		{"full", true, map[Family]int{IPv4: 1, IPv6: 1}, []string{
			"warn the policy routing of marked packets had been removed; repaired IPv4",
			"warn the policy routing of marked packets had been removed; repaired IPv6",
		}},
	} {
		logs.TakeAll()
		if _, err := f.Sync(t.Context(), familyClaims, step.full); err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		if diff := cmp.Diff(step.want, routing.take()); diff != "" {
			t.Errorf("%s: routing checks (-want +got):\n%s", step.name, diff)
		}
		var warns []string
		for _, m := range messages(logs) {
			if m[:4] == "warn" {
				warns = append(warns, m)
			}
		}
		slices.Sort(warns) // the families sync side by side
		if diff := cmp.Diff(step.log, warns); diff != "" {
			t.Errorf("%s: warnings (-want +got):\n%s", step.name, diff)
		}
	}
}

// TestFamiliesRedirectNoRouting checks that redirect mode leaves the
// policy routing alone.
func TestFamiliesRedirectNoRouting(t *testing.T) {
	routing := &routingCalls{}
	f, _ := newFakeFamilies(t, FamiliesConfig{EnsureRouting: routing.ensure}, newFakeKernel(IPv4), newFakeKernel(IPv6))
	if _, err := f.Sync(t.Context(), familyClaims, true); err != nil {
		t.Fatal(err)
	}
	if got := routing.take(); len(got) != 0 {
		t.Errorf("redirect mode checked the routing: %v", got)
	}
}
