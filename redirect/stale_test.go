package redirect

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/uproxy/uproxy/internal/testwait"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// fakeConntrack is a ConntrackTable of UDP entries held in memory.
type fakeConntrack struct {
	mu      sync.Mutex
	entries map[Family][]ConntrackEntry
	local   map[Family][]netip.Addr
	// err, when set, fails DeleteUDP.
	err error
	// deleted are the entries DeleteUDP deleted, in order.
	deleted []ConntrackEntry
	// calls counts DeleteUDP's calls, by family.
	calls map[Family]int
}

func newFakeConntrack() *fakeConntrack {
	return &fakeConntrack{
		entries: map[Family][]ConntrackEntry{},
		local: map[Family][]netip.Addr{
			IPv4: {netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("10.244.0.1"), netip.MustParseAddr("192.0.2.1")},
			IPv6: {netip.MustParseAddr("::1"), netip.MustParseAddr("2001:db8:244::1")},
		},
		calls: map[Family]int{},
	}
}

func (f *fakeConntrack) DeleteUDP(fam Family, stale func(ConntrackEntry) bool, limit int) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls[fam]++
	if f.err != nil {
		return 0, f.err
	}
	var keep []ConntrackEntry
	n := 0
	for _, e := range f.entries[fam] {
		if n < limit && stale(e) {
			f.deleted = append(f.deleted, e)
			n++
			continue
		}
		keep = append(keep, e)
	}
	f.entries[fam] = keep
	return n, nil
}

func (f *fakeConntrack) LocalAddrs(fam Family) ([]netip.Addr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.local[fam]), nil
}

func (f *fakeConntrack) add(fam Family, es ...ConntrackEntry) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.entries[fam] = append(f.entries[fam], es...)
}

func (f *fakeConntrack) takeDeleted() []ConntrackEntry {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := f.deleted
	f.deleted = nil
	return d
}

// ct is the entry of a flow from client to dst whose replies come from
// reply (and go back to client).
func ct(client, dst, reply string) ConntrackEntry {
	c := netip.MustParseAddrPort(client)
	return ConntrackEntry{
		Original: ConntrackTuple{Src: c, Dst: netip.MustParseAddrPort(dst)},
		Reply:    ConntrackTuple{Src: netip.MustParseAddrPort(reply), Dst: c},
	}
}

// staleClaims are the claims of TestStaleJudge: a cluster IP, a node
// port and an external IP of UDP, a TCP cluster IP on the UDP one's
// address, and an IPv6 cluster IP.
var staleClaims = []Intercept{
	{Comment: "default/dns:dns", Protocol: UDP, Dest: netip.MustParseAddr("10.96.0.10"), Port: 53, ToPort: 40000},
	// A later claim of the same destination loses (ServiceRules).
	{Comment: "default/other:dns", Protocol: UDP, Dest: netip.MustParseAddr("10.96.0.10"), Port: 53, ToPort: 40099},
	{Comment: "default/dns:dns", Protocol: UDP, NodePort: true, Dest: netip.IPv4Unspecified(), Port: 30053, ToPort: 40001},
	{Comment: "default/syslog:syslog", Protocol: UDP, Dest: netip.MustParseAddr("192.0.2.10"), Port: 514, ToPort: 40010, ToPortEnd: 40012},
	{Comment: "default/dns:dns-tcp", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.10"), Port: 53, ToPort: 40003},
	{Comment: "default/dns:dns", Protocol: UDP, Dest: netip.MustParseAddr("2001:db8::10"), Port: 53, ToPort: 40002},
}

// TestStaleJudge checks which UDP entries a clean deletes, in each family.
func TestStaleJudge(t *testing.T) {
	tests := []struct {
		name   string
		family Family
		entry  ConntrackEntry
		// removed are claims dropped since the last clean.
		removed []Intercept
		// nodePortAddresses is StaleConntrackConfig's.
		nodePortAddresses []netip.Prefix
		want              bool
	}{
		{name: "kube-proxy's DNAT of a claimed cluster IP to a pod",
			entry: ct("10.244.1.5:33000", "10.96.0.10:53", "10.244.2.7:53"), want: true},
		{name: "REDIRECT of a pod's flow to the claim's listener",
			entry: ct("10.244.1.5:33000", "10.96.0.10:53", "10.244.0.1:40000")},
		{name: "REDIRECT of the node's own flow to the listener on loopback",
			entry: ct("10.244.0.1:33000", "10.96.0.10:53", "127.0.0.1:40000")},
		{name: "REDIRECT to a port that is not the claim's listener (the losing claim's, or an earlier instance's)",
			entry: ct("10.244.1.5:33000", "10.96.0.10:53", "10.244.0.1:40099"), want: true},
		{name: "TPROXY: no destination NAT",
			entry: ct("10.244.1.5:33000", "10.96.0.10:53", "10.96.0.10:53")},
		{name: "DNAT to a host-network pod of this node, on a port that is not the listener's",
			entry: ct("10.244.1.5:33000", "10.96.0.10:53", "192.0.2.1:53"), want: true},
		{name: "an address that is not claimed",
			entry: ct("10.244.1.5:33000", "10.96.0.99:53", "10.244.2.7:53")},
		{name: "a claimed address on a port that is not claimed",
			entry: ct("10.244.1.5:33000", "10.96.0.10:5353", "10.244.2.7:5353")},
		{name: "an external IP's DNAT",
			entry: ct("192.0.2.50:40000", "192.0.2.10:514", "10.244.2.7:514"), want: true},
		{name: "an external IP's REDIRECT to the last of its listener's ports",
			entry: ct("192.0.2.50:40000", "192.0.2.10:514", "192.0.2.1:40012")},
		{name: "kube-proxy's DNAT of a claimed node port",
			entry: ct("192.0.2.50:40000", "192.0.2.1:30053", "10.244.2.7:53"), want: true},
		{name: "the node port's REDIRECT",
			entry: ct("192.0.2.50:40000", "192.0.2.1:30053", "192.0.2.1:40001")},
		{name: "a node port's number on an address that is not the node's",
			entry: ct("10.244.1.5:33000", "192.0.2.200:30053", "10.244.2.7:53")},
		{name: "a node port on loopback, which the rules do not claim by default",
			entry: ct("127.0.0.1:33000", "127.0.0.1:30053", "10.244.2.7:53")},
		{name: "a node port on an address outside the node-port addresses",
			entry: ct("10.244.1.5:33000", "10.244.0.1:30053", "10.244.2.7:53"), nodePortAddresses: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}},
		{name: "a node port on an address inside the node-port addresses",
			entry: ct("192.0.2.50:40000", "192.0.2.1:30053", "10.244.2.7:53"), nodePortAddresses: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}, want: true},
		{name: "a node port on loopback, when the node-port addresses include it",
			entry: ct("127.0.0.1:33000", "127.0.0.1:30053", "10.244.2.7:53"), nodePortAddresses: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, want: true},
		{name: "IPv6: kube-proxy's DNAT", family: IPv6,
			entry: ct("[2001:db8:1::5]:33000", "[2001:db8::10]:53", "[2001:db8:2::7]:53"), want: true},
		{name: "IPv6: REDIRECT to the listener", family: IPv6,
			entry: ct("[2001:db8:1::5]:33000", "[2001:db8::10]:53", "[2001:db8:244::1]:40002")},
		{name: "IPv6: no node port claimed in the family", family: IPv6,
			entry: ct("[2001:db8:1::5]:33000", "[2001:db8:244::1]:30053", "[2001:db8:2::7]:53")},
		{name: "a removed claim's REDIRECT to its listener",
			removed: []Intercept{{Protocol: UDP, Dest: netip.MustParseAddr("10.96.0.20"), Port: 53, ToPort: 40005}},
			entry:   ct("10.244.1.5:33000", "10.96.0.20:53", "10.244.0.1:40005"), want: true},
		{name: "a removed claim without a destination NAT (tproxy mode)",
			removed: []Intercept{{Protocol: UDP, Dest: netip.MustParseAddr("10.96.0.20"), Port: 53, ToPort: 40005}},
			entry:   ct("10.244.1.5:33000", "10.96.0.20:53", "10.96.0.20:53")},
		{name: "a removed node port's REDIRECT",
			removed: []Intercept{{Protocol: UDP, NodePort: true, Dest: netip.IPv4Unspecified(), Port: 30054, ToPort: 40006}},
			entry:   ct("192.0.2.50:40000", "192.0.2.1:30054", "192.0.2.1:40006"), want: true},
		{name: "a removed claim of the other family",
			removed: []Intercept{{Protocol: UDP, Dest: netip.MustParseAddr("2001:db8::20"), Port: 53, ToPort: 40007}},
			entry:   ct("10.244.1.5:33000", "10.96.0.20:53", "10.244.0.1:40007")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			table := newFakeConntrack()
			removed := map[claimKey]bool{}
			for k := range udpClaims(tt.removed) {
				removed[k] = true
			}
			j := newStaleJudge(tt.family, udpClaims(staleClaims), removed, table.local[tt.family], tt.nodePortAddresses)
			if got := j.stale(tt.entry); got != tt.want {
				t.Errorf("stale(%+v) = %v, want %v", tt.entry, got, tt.want)
			}
		})
	}
}

// TestStaleConntrackTrigger checks when Trigger asks for a clean, what
// the clean deletes, and what it counts and logs.
func TestStaleConntrackTrigger(t *testing.T) {
	dns := Intercept{Comment: "default/dns:dns", Protocol: UDP, Dest: netip.MustParseAddr("10.96.0.10"), Port: 53, ToPort: 40000}
	syslog := Intercept{Comment: "default/syslog:syslog", Protocol: UDP, Dest: netip.MustParseAddr("10.96.0.11"), Port: 514, ToPort: 40001}
	web := Intercept{Comment: "default/web:http", Protocol: TCP, Dest: netip.MustParseAddr("10.96.0.13"), Port: 80, ToPort: 40003}
	dns6 := Intercept{Comment: "default/dns:dns", Protocol: UDP, Dest: netip.MustParseAddr("2001:db8::10"), Port: 53, ToPort: 40004}
	// Each service has an entry from kube-proxy's DNAT and one from the
	// proxy's REDIRECT.
	kubeProxy := map[string]ConntrackEntry{
		"dns":    ct("10.244.1.5:33000", "10.96.0.10:53", "10.244.2.7:53"),
		"syslog": ct("10.244.1.5:33001", "10.96.0.11:514", "10.244.2.8:514"),
		"web":    ct("10.244.1.5:33003", "10.96.0.13:80", "10.244.2.10:80"),
		"dns6":   ct("[2001:db8:1::5]:33000", "[2001:db8::10]:53", "[2001:db8:2::7]:53"),
	}
	redirected := map[string]ConntrackEntry{
		"dns":    ct("10.244.1.6:33000", "10.96.0.10:53", "10.244.0.1:40000"),
		"syslog": ct("10.244.1.6:33001", "10.96.0.11:514", "10.244.0.1:40001"),
	}
	type step struct {
		name     string
		claims   []Intercept
		families []Family
		full     bool
		// add are entries put in the table before the step.
		add []ConntrackEntry
		// want are the entries the step's clean deletes; wantClean is
		// whether it asks for one at all.
		wantClean bool
		want      []ConntrackEntry
	}
	steps := []step{
		{name: "the first sync cleans, also with nothing to delete", claims: []Intercept{dns, web}, families: []Family{IPv4}, wantClean: true,
			add: []ConntrackEntry{redirected["dns"], kubeProxy["web"]}},
		{name: "the same claims, not full: no clean", claims: []Intercept{dns, web}, families: []Family{IPv4},
			add: []ConntrackEntry{kubeProxy["dns"]}},
		{name: "a full sync cleans", claims: []Intercept{dns, web}, families: []Family{IPv4}, full: true, wantClean: true,
			want: []ConntrackEntry{kubeProxy["dns"]}},
		{name: "a new UDP claim cleans its own", claims: []Intercept{dns, syslog, web}, families: []Family{IPv4}, wantClean: true,
			add: []ConntrackEntry{kubeProxy["syslog"], redirected["syslog"]}, want: []ConntrackEntry{kubeProxy["syslog"]}},
		{name: "a removed claim: its redirected entries go too", claims: []Intercept{dns, web}, families: []Family{IPv4}, wantClean: true,
			want: []ConntrackEntry{redirected["syslog"]}},
		{name: "a TCP change alone: no clean", claims: []Intercept{dns}, families: []Family{IPv4}},
		{name: "IPv6 is cleaned when its family synced", claims: []Intercept{dns, dns6}, families: []Family{IPv4, IPv6}, wantClean: true,
			add: []ConntrackEntry{kubeProxy["dns6"]}, want: []ConntrackEntry{kubeProxy["dns6"]}},
	}
	table := newFakeConntrack()
	var counted []int
	core, logs := observer.New(zap.DebugLevel)
	s, err := NewStaleConntrack(StaleConntrackConfig{Table: table, Deleted: func(n int) { counted = append(counted, n) }, Logger: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range steps {
		for _, e := range st.add {
			fam := IPv4
			if e.Original.Dst.Addr().Is6() {
				fam = IPv6
			}
			table.add(fam, e)
		}
		s.Trigger(st.claims, st.families, st.full)
		if got := len(s.wake) == 1; got != st.wantClean {
			t.Fatalf("%s: clean pending = %v, want %v", st.name, got, st.wantClean)
		}
		if st.wantClean {
			<-s.wake
		}
		s.cleanPending()
		if diff := cmp.Diff(st.want, table.takeDeleted(), cmpopts.EquateComparable(netip.AddrPort{})); diff != "" {
			t.Errorf("%s: deleted entries (-want +got):\n%s", st.name, diff)
		}
	}
	if diff := cmp.Diff([]int{1, 1, 1, 1}, counted); diff != "" {
		t.Errorf("Deleted calls (-want +got):\n%s", diff)
	}
	if n := logs.FilterMessage("deleted stale UDP conntrack entries").Len(); n != 5 {
		t.Errorf("%d debug lines for the cleans, want 5", n)
	}
}

// TestStaleConntrackRemovedCoalesce checks that the claims that several
// Triggers drop before one clean are all cleaned as removed, unless a
// later one claims them again.
func TestStaleConntrackRemovedCoalesce(t *testing.T) {
	claim := func(last byte, toPort uint16) Intercept {
		return Intercept{Protocol: UDP, Dest: netip.AddrFrom4([4]byte{10, 96, 0, last}), Port: 53, ToPort: toPort}
	}
	a, b, c := claim(1, 40001), claim(2, 40002), claim(3, 40003)
	redirectedTo := func(last byte, toPort uint16) ConntrackEntry {
		return ConntrackEntry{
			Original: ConntrackTuple{Src: netip.MustParseAddrPort("10.244.1.5:33000"), Dst: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 96, 0, last}), 53)},
			Reply:    ConntrackTuple{Src: netip.AddrPortFrom(netip.MustParseAddr("10.244.0.1"), toPort), Dst: netip.MustParseAddrPort("10.244.1.5:33000")},
		}
	}
	table := newFakeConntrack()
	table.add(IPv4, redirectedTo(1, 40001), redirectedTo(2, 40002), redirectedTo(3, 40003))
	s, err := NewStaleConntrack(StaleConntrackConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	v4 := []Family{IPv4}
	s.Trigger([]Intercept{a, b, c}, v4, false)
	s.Trigger([]Intercept{a}, v4, false)    // drops b and c
	s.Trigger([]Intercept{a, c}, v4, false) // claims c again
	s.cleanPending()
	if diff := cmp.Diff([]ConntrackEntry{redirectedTo(2, 40002)}, table.takeDeleted(), cmpopts.EquateComparable(netip.AddrPort{})); diff != "" {
		t.Errorf("deleted entries (-want +got):\n%s", diff)
	}

	// A clean that fails keeps the removed claims for the next one.
	table.err = errors.New("netlink: no buffer space")
	table.add(IPv4, redirectedTo(2, 40002))
	s.Trigger([]Intercept{a}, v4, false) // drops c
	s.cleanPending()
	table.err = nil
	s.Trigger([]Intercept{a}, v4, true)
	s.cleanPending()
	if diff := cmp.Diff([]ConntrackEntry{redirectedTo(3, 40003)}, table.takeDeleted(), cmpopts.EquateComparable(netip.AddrPort{})); diff != "" {
		t.Errorf("deleted entries after a failed clean (-want +got):\n%s", diff)
	}
}

// TestStaleConntrackLimit checks that one clean deletes at most Limit
// entries per family, and the next the rest.
func TestStaleConntrackLimit(t *testing.T) {
	table := newFakeConntrack()
	for port := range uint16(5) {
		table.add(IPv4, ConntrackEntry{
			Original: ConntrackTuple{Src: netip.AddrPortFrom(netip.MustParseAddr("10.244.1.5"), 33000+port), Dst: netip.MustParseAddrPort("10.96.0.10:53")},
			Reply:    ConntrackTuple{Src: netip.MustParseAddrPort("10.244.2.7:53"), Dst: netip.AddrPortFrom(netip.MustParseAddr("10.244.1.5"), 33000+port)},
		})
	}
	s, err := NewStaleConntrack(StaleConntrackConfig{Table: table, Limit: 3})
	if err != nil {
		t.Fatal(err)
	}
	claims := []Intercept{{Protocol: UDP, Dest: netip.MustParseAddr("10.96.0.10"), Port: 53, ToPort: 40000}}
	s.Trigger(claims, []Family{IPv4}, false)
	if n := s.cleanPending(); n != 3 {
		t.Errorf("first clean deleted %d, want the limit, 3", n)
	}
	s.Trigger(claims, []Family{IPv4}, true)
	if n := s.cleanPending(); n != 2 {
		t.Errorf("second clean deleted %d, want the other 2", n)
	}
	if _, err := NewStaleConntrack(StaleConntrackConfig{Table: table, Limit: -1}); err == nil {
		t.Error("NewStaleConntrack with a negative limit: no error")
	}
	if _, err := NewStaleConntrack(StaleConntrackConfig{}); err == nil {
		t.Error("NewStaleConntrack without a table: no error")
	}
}

// TestStaleConntrackRun checks that Run cleans on its own goroutine after
// Triggers from another, and returns when its context is done.
func TestStaleConntrackRun(t *testing.T) {
	table := newFakeConntrack()
	s, err := NewStaleConntrack(StaleConntrackConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { // ends when ctx is done; the test waits for it
		defer close(done)
		s.Run(ctx)
	}()
	claims := []Intercept{{Protocol: UDP, Dest: netip.MustParseAddr("10.96.0.10"), Port: 53, ToPort: 40000}}
	for i := range 20 {
		client := netip.AddrPortFrom(netip.MustParseAddr("10.244.1.5"), 33000+uint16(i))
		table.add(IPv4, ConntrackEntry{
			Original: ConntrackTuple{Src: client, Dst: netip.MustParseAddrPort("10.96.0.10:53")},
			Reply:    ConntrackTuple{Src: netip.MustParseAddrPort("10.244.2.7:53"), Dst: client},
		})
		s.Trigger(claims, []Family{IPv4}, true)
	}
	testwait.Until(t, 10*time.Second, "the entries to be deleted", func() bool {
		table.mu.Lock()
		defer table.mu.Unlock()
		return len(table.entries[IPv4]) == 0
	})
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context was done")
	}
}
