package redirect

import (
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

var update = flag.Bool("update", false, "rewrite the testdata/*.golden files from the current output")

// svc returns an intercept for the VIP dest (an address literal).
func svc(comment string, p Protocol, dest string, port, toPort uint16) Intercept {
	return Intercept{Comment: comment, Protocol: p, Dest: netip.MustParseAddr(dest), Port: port, ToPort: toPort}
}

// mixed has IPv4 and IPv6 intercepts, unsorted.
var mixed = Rules{Intercepts: []Intercept{
	svc("default/web:http", TCP, "2001:db8::10", 80, 40001),
	svc("default/web:http", TCP, "10.96.0.10", 80, 40002),
	svc("kube-system/kube-dns:dns", UDP, "2001:db8::a", 53, 40003),
	svc("kube-system/kube-dns:dns", UDP, "10.96.0.2", 53, 40004),
	svc("mapped/v4:x", TCP, "::ffff:10.96.0.3", 8080, 40005),
}}

func TestRenderGolden(t *testing.T) {
	tests := []struct {
		name   string
		family Family
		rules  Rules
	}{
		{"empty", IPv4, Rules{}},
		{"empty_v6", IPv6, Rules{}},
		{"one", IPv4, Rules{Intercepts: []Intercept{svc("default/web:http", TCP, "10.96.0.10", 80, 40001)}}},
		{"many_unsorted", IPv4, Rules{Intercepts: []Intercept{
			svc("default/web:https", TCP, "10.96.0.10", 443, 40002),
			svc("kube-system/kube-dns:dns-tcp", TCP, "10.96.0.2", 53, 40011),
			svc("default/web:http", TCP, "10.96.0.10", 80, 40001),
			svc("shop/cart:grpc", TCP, "10.96.100.7", 9000, 40020),
			svc("kube-system/kube-dns:dns", UDP, "10.96.0.2", 53, 40010),
			svc("default/kubernetes:https", TCP, "10.96.0.1", 443, 40000),
			svc("shop/cart:metrics", TCP, "10.96.12.1", 9100, 40021),
		}}},
		{"mixed_v4", IPv4, mixed},
		{"mixed_v6", IPv6, mixed},
		{"ipv6", IPv6, Rules{Intercepts: []Intercept{
			svc("default/web:http", TCP, "2001:db8::10", 80, 40001),
			svc("default/web:quic", UDP, "2001:db8::10", 443, 40002),
			svc("default/api", TCP, "2001:db8:0:1::1", 443, 40003),
		}}},
		{"comments", IPv4, Rules{Intercepts: []Intercept{
			svc("plain", TCP, "10.96.0.1", 1, 40001),
			svc("with space", TCP, "10.96.0.1", 2, 40002),
			svc(`double "quoted"`, TCP, "10.96.0.1", 3, 40003),
			svc(`back\slash`, TCP, "10.96.0.1", 4, 40004),
			svc("single 'quoted'", TCP, "10.96.0.1", 5, 40005),
			svc("", TCP, "10.96.0.1", 6, 40006),
			svc("new\nline\r\n-A PREROUTING -j ACCEPT", TCP, "10.96.0.1", 7, 40007),
			svc("tab\there", TCP, "10.96.0.1", 8, 40008),
			svc("ünïcödé/名前:port", TCP, "10.96.0.1", 9, 40009),
			svc(strings.Repeat("x", 300), TCP, "10.96.0.1", 10, 40010),
			svc(strings.Repeat("x", 254)+"é", TCP, "10.96.0.1", 11, 40011),
		}}},
		{"invalid_skipped", IPv4, Rules{Intercepts: []Intercept{
			svc("ok", TCP, "10.96.0.1", 80, 40001),
			svc("bad protocol", Protocol("sctp"), "10.96.0.1", 81, 40002),
			svc("bad port", TCP, "10.96.0.1", 0, 40003),
			svc("bad listener", TCP, "10.96.0.1", 82, 0),
			{Comment: "no address", Protocol: TCP, Port: 83, ToPort: 40004},
		}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Render(tt.family, tt.rules)
			path := filepath.Join("testdata", tt.name+".golden")
			if *update {
				if err := os.WriteFile(path, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run go test ./redirect -update to create it)", err)
			}
			if diff := cmp.Diff(string(want), string(got)); diff != "" {
				t.Errorf("Render(%s) differs from %s (-want +got):\n%s", tt.family, path, diff)
			}
		})
	}
}

// TestRenderDeterministic checks that the order of the input does not
// matter.
func TestRenderDeterministic(t *testing.T) {
	fwd := mixed.Intercepts
	rev := make([]Intercept, len(fwd))
	for i, in := range fwd {
		rev[len(fwd)-1-i] = in
	}
	for _, f := range []Family{IPv4, IPv6} {
		a, b := Render(f, Rules{Intercepts: fwd}), Render(f, Rules{Intercepts: rev})
		if diff := cmp.Diff(string(a), string(b)); diff != "" {
			t.Errorf("Render(%s) depends on input order (-forward +reversed):\n%s", f, diff)
		}
	}
}

// TestRenderDoesNotModifyInput checks that Render sorts a copy.
func TestRenderDoesNotModifyInput(t *testing.T) {
	in := []Intercept{
		svc("b", TCP, "10.96.0.2", 80, 40002),
		svc("a", TCP, "10.96.0.1", 80, 40001),
	}
	before := append([]Intercept(nil), in...)
	Render(IPv4, Rules{Intercepts: in})
	if diff := cmp.Diff(before, in, cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); diff != "" {
		t.Errorf("Render modified its input (-before +after):\n%s", diff)
	}
}

func TestQuoteComment(t *testing.T) {
	tests := []struct{ in, want string }{
		{"plain", "plain"},
		{"a-b_C9", "a-b_C9"},
		{"", `""`},
		{"default/web:http", `"default/web:http"`},
		{"a b", `"a b"`},
		{`say "hi"`, `"say \"hi\""`},
		{`c:\dir`, `"c:\\dir"`},
		{"it's", `"it\'s"`},
		{"a\nb", `"a b"`},
		{"a\x00b\x7f", `"a b "`},
		{"a\xffb", "\"a\uFFFDb\""},
		{strings.Repeat("a", 256), strings.Repeat("a", 255)},
		{strings.Repeat("a", 254) + "éé", strings.Repeat("a", 254)},
	}
	for _, tt := range tests {
		if got := quoteComment(tt.in); got != tt.want {
			t.Errorf("quoteComment(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestRulesValidate(t *testing.T) {
	tests := []struct {
		name    string
		rules   Rules
		wantErr string
	}{
		{"empty", Rules{}, ""},
		{"ok mixed", mixed, ""},
		{"same port other protocol", Rules{Intercepts: []Intercept{
			svc("a", TCP, "10.96.0.2", 53, 40001), svc("b", UDP, "10.96.0.2", 53, 40002),
		}}, ""},
		{"protocol", Rules{Intercepts: []Intercept{svc("x", "sctp", "10.96.0.1", 80, 1)}}, `intercept 0 ("x"): protocol "sctp"`},
		{"no address", Rules{Intercepts: []Intercept{{Protocol: TCP, Port: 80, ToPort: 1}}}, "no destination address"},
		{"zone", Rules{Intercepts: []Intercept{svc("x", TCP, "fe80::1%eth0", 80, 1)}}, "has a zone"},
		{"port", Rules{Intercepts: []Intercept{svc("x", TCP, "10.96.0.1", 0, 1)}}, "port 0"},
		{"listener", Rules{Intercepts: []Intercept{svc("x", TCP, "10.96.0.1", 80, 0)}}, "listener port 0"},
		{"duplicate", Rules{Intercepts: []Intercept{
			svc("a", TCP, "10.96.0.1", 80, 40001), svc("b", TCP, "::ffff:10.96.0.1", 80, 40002),
		}}, `intercept 0 ("a") and 1 ("b") both match 10.96.0.1 tcp port 80`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.rules.validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("validate() = %v, want nil", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("validate() = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestParseStateOfRender(t *testing.T) {
	st := parseState(Render(IPv4, mixed))
	want := state{{"nat", "UPROXY-SERVICES"}: {exists: true, rules: []string{
		`-A UPROXY-SERVICES -d 10.96.0.2/32 -p udp -m comment --comment "kube-system/kube-dns:dns" -m udp --dport 53 -j REDIRECT --to-ports 40004`,
		`-A UPROXY-SERVICES -d 10.96.0.3/32 -p tcp -m comment --comment "mapped/v4:x" -m tcp --dport 8080 -j REDIRECT --to-ports 40005`,
		`-A UPROXY-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40002`,
	}}}
	if diff := cmp.Diff(want, st, cmp.AllowUnexported(chainState{})); diff != "" {
		t.Errorf("parseState(Render(...)) (-want +got):\n%s", diff)
	}
	if n := st.ruleCount(); n != 3 {
		t.Errorf("ruleCount() = %d, want 3", n)
	}
}
