package service

import (
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestParsePrefixes(t *testing.T) {
	for _, tt := range []struct {
		in      string
		want    []netip.Prefix
		wantErr bool
	}{
		{"", []netip.Prefix{}, false},
		{" , ", []netip.Prefix{}, false},
		{"168.63.129.16", []netip.Prefix{netip.MustParsePrefix("168.63.129.16/32")}, false},
		{"fd00:ec2::254, 10.250.1.7/16", []netip.Prefix{netip.MustParsePrefix("fd00:ec2::254/128"), netip.MustParsePrefix("10.250.0.0/16")}, false},
		{"::ffff:100.100.100.200", []netip.Prefix{netip.MustParsePrefix("100.100.100.200/32")}, false},
		{"::ffff:10.0.0.0/104", []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, false},
		{"::ffff:0.0.0.0/64", nil, true},
		{"fe80::1%eth0", nil, true},
		{"10.0.0.0/33", nil, true},
		{"metadata", nil, true},
	} {
		got, err := ParsePrefixes(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("ParsePrefixes(%q) error %v, want error %v", tt.in, err, tt.wantErr)
			continue
		}
		if diff := cmp.Diff(tt.want, got, cmp.Comparer(func(a, b netip.Prefix) bool { return a == b })); diff != "" {
			t.Errorf("ParsePrefixes(%q) (-want +got):\n%s", tt.in, diff)
		}
	}
}

func TestParsePortRanges(t *testing.T) {
	for _, tt := range []struct {
		in      string
		want    PortRanges
		wantErr bool
	}{
		{"", nil, false},
		{"6443", PortRanges{{6443, 6443}}, false},
		{"6443, 9100-9110,", PortRanges{{6443, 6443}, {9100, 9110}}, false},
		{"1-65535", PortRanges{{1, 65535}}, false},
		{"0", nil, true},
		{"65536", nil, true},
		{"9110-9100", nil, true},
		{"80-", nil, true},
		{"http", nil, true},
	} {
		got, err := ParsePortRanges(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("ParsePortRanges(%q) error %v, want error %v", tt.in, err, tt.wantErr)
			continue
		}
		if diff := cmp.Diff(tt.want, got); diff != "" {
			t.Errorf("ParsePortRanges(%q) (-want +got):\n%s", tt.in, diff)
		}
	}
	r := PortRanges{{6443, 6443}, {9100, 9110}}
	for port, want := range map[uint16]bool{6442: false, 6443: true, 9099: false, 9100: true, 9105: true, 9110: true, 9111: false} {
		if got := r.Contains(port); got != want {
			t.Errorf("%v.Contains(%d) = %v, want %v", r, port, got, want)
		}
	}
}

// FuzzEndpointPolicyFlags checks the parsers of --endpoint-deny-cidrs and
// --node-endpoint-ports on any input: they never panic, what they accept
// formats back to the same value, networks are masked and unmapped, and
// a range never ends before it starts.
func FuzzEndpointPolicyFlags(f *testing.F) {
	for _, s := range []string{"", "6443,9100-9110", "fd00:ec2::254/128,100.100.100.200", "::ffff:10.0.0.0/104", "1-65535", "80-79", "10.0.0.0/8,,"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if ps, err := ParsePrefixes(s); err == nil {
			var text []byte
			for i, p := range ps {
				if p != p.Masked() || p.Addr().Is4In6() || p.Addr().Zone() != "" {
					t.Fatalf("ParsePrefixes(%q)[%d] = %v: not masked, or mapped, or zoned", s, i, p)
				}
				if i > 0 {
					text = append(text, ',')
				}
				text = append(text, p.String()...)
			}
			again, err := ParsePrefixes(string(text))
			if err != nil || !cmp.Equal(ps, again, cmp.Comparer(func(a, b netip.Prefix) bool { return a == b })) {
				t.Fatalf("ParsePrefixes(%q) = %v, which formats as %q and parses as %v, %v", s, ps, text, again, err)
			}
		}
		if r, err := ParsePortRanges(s); err == nil {
			for _, pr := range r {
				if pr.First == 0 || pr.Last < pr.First || !r.Contains(pr.First) || !r.Contains(pr.Last) {
					t.Fatalf("ParsePortRanges(%q) = %v: bad range %v", s, r, pr)
				}
			}
			again, err := ParsePortRanges(r.String())
			if err != nil || !cmp.Equal(r, again) {
				t.Fatalf("ParsePortRanges(%q) = %v, which formats as %q and parses as %v, %v", s, r, r.String(), again, err)
			}
			if r.Contains(0) {
				t.Fatalf("ParsePortRanges(%q) contains port 0", s)
			}
		}
	})
}
