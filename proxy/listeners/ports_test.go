package listeners

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestParseEphemeralPorts(t *testing.T) {
	for _, tt := range []struct {
		rng, reserved string
		want          *ephemeralPorts
	}{
		{"32768\t60999\n", "\n", &ephemeralPorts{lo: 32768, hi: 60999, reserved: map[uint16]bool{}}},
		{"1024 1030", "1024,1026-1027\n", &ephemeralPorts{lo: 1024, hi: 1030, reserved: map[uint16]bool{1024: true, 1026: true, 1027: true}}},
		{"32768", "", nil},
		{"60999 32768", "", nil},
		{"0 100", "", nil},
		{"1 70000", "", nil},
		{"1024 2048", "80,x", nil},
	} {
		got, err := parseEphemeralPorts(tt.rng, tt.reserved)
		if (err != nil) != (tt.want == nil) {
			t.Errorf("parseEphemeralPorts(%q, %q) error %v, want error %v", tt.rng, tt.reserved, err, tt.want == nil)
			continue
		}
		if diff := cmp.Diff(tt.want, got, cmp.AllowUnexported(ephemeralPorts{})); diff != "" {
			t.Errorf("parseEphemeralPorts(%q, %q) (-want +got):\n%s", tt.rng, tt.reserved, diff)
		}
	}
}

// TestAllocateEphemeral checks the ports picked with no range: from the
// kernel's range, odd ones first, skipping reserved ports, uproxy's own
// and those another socket holds; bind(0) when the range is unknown or
// nearly full.
func TestAllocateEphemeral(t *testing.T) {
	taken := map[uint16]bool{40003: true} // another process's
	var tried []uint16
	try := func(p uint16) (uint16, error) {
		tried = append(tried, p)
		if p == 0 {
			return 50001, nil // what bind(0) would pick
		}
		if taken[p] {
			return 0, errors.New("address already in use")
		}
		return p, nil
	}
	a := &portAllocator{
		readEph: func() (*ephemeralPorts, error) {
			return &ephemeralPorts{lo: 40000, hi: 40007, reserved: map[uint16]bool{40001: true}}, nil
		},
		randN: func(int) int { return 0 },
	}
	alloc := func() uint16 {
		t.Helper()
		tried = nil
		p, err := a.allocate("tcp4", try)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	var got []uint16
	for range 5 {
		got = append(got, alloc())
	}
	// 40001 is reserved and 40003 taken; the even ports come after the
	// odd ones run out.
	if diff := cmp.Diff([]uint16{40005, 40007, 40000, 40002, 40004}, got); diff != "" {
		t.Errorf("ports (-want +got):\n%s", diff)
	}
	// Another family has ports of its own.
	if p, err := a.allocate("tcp6", try); err != nil || p != 40005 {
		t.Errorf("first tcp6 port = %d, %v; want 40005", p, err)
	}
	// A released port is free again; uproxy's own are not tried.
	a.release("tcp4", 40007)
	if p := alloc(); p != 40007 || !cmp.Equal(tried, []uint16{40003, 40007}) {
		t.Errorf("after releasing 40007: got %d, tried %v; want 40007 after trying the taken 40003", p, tried)
	}
	// A full range leaves the choice to bind(0).
	alloc()
	if p := alloc(); p != 50001 || tried[len(tried)-1] != 0 {
		t.Errorf("full range: got %d, tried %v; want bind(0)'s 50001", p, tried)
	}
	if !a.used["tcp4"][50001] {
		t.Error("bind(0)'s port is not marked as uproxy's")
	}

	// A range that others fill is left to bind(0) after ephemeralTries.
	b := &portAllocator{
		readEph: func() (*ephemeralPorts, error) { return &ephemeralPorts{lo: 40000, hi: 40999}, nil },
		randN:   func(int) int { return 0 },
	}
	tried = nil
	for p := uint16(40000); p <= 40999; p++ {
		taken[p] = true
	}
	if p, err := b.allocate("tcp4", try); err != nil || p != 50001 || len(tried) != ephemeralTries+1 {
		t.Errorf("crowded range: got %d, %v after %d tries; want bind(0)'s 50001 after %d", p, err, len(tried), ephemeralTries+1)
	}

	// Without the kernel's range, bind(0) picks, and the reason is told
	// once.
	var warned []error
	c := &portAllocator{
		readEph: func() (*ephemeralPorts, error) { return nil, errors.New("no /proc") },
		warn:    func(err error) { warned = append(warned, err) },
	}
	for range 2 {
		tried = nil
		if p, err := c.allocate("tcp4", try); err != nil || p != 50001 || !cmp.Equal(tried, []uint16{0}) {
			t.Errorf("unknown range: got %d, %v, tried %v; want bind(0)", p, err, tried)
		}
	}
	if len(warned) != 1 || warned[0].Error() != "no /proc" {
		t.Errorf("warnings %v; want the read error once", warned)
	}
}

func TestExposedPorts(t *testing.T) {
	for _, tt := range []struct {
		rng, reserved string
		r             PortRange
		want          int
	}{
		{"32768\t60999", "", PortRange{Base: 40000, Size: 10000}, 10000},
		{"32768\t60999", "40000-49999", PortRange{Base: 40000, Size: 10000}, 0},
		{"32768\t60999", "40000-44999", PortRange{Base: 40000, Size: 10000}, 5000},
		{"32768\t60999", "", PortRange{Base: 20000, Size: 1000}, 0}, // below the range: never picked
		{"32768\t60999", "", PortRange{Base: 32000, Size: 1000}, 232},
		{"32768\t60999", "8080,40001", PortRange{Base: 40000, Size: 3}, 2},
		{"32768\t60999", "", PortRange{}, 0},
	} {
		e, err := parseEphemeralPorts(tt.rng, tt.reserved)
		if err != nil {
			t.Fatal(err)
		}
		if got := e.exposed(tt.r); got != tt.want {
			t.Errorf("exposed(%v) with range %q, reserved %q = %d, want %d", tt.r, tt.rng, tt.reserved, got, tt.want)
		}
	}
}

func TestParsePortRange(t *testing.T) {
	tests := []struct {
		in      string
		want    PortRange
		wantErr bool
	}{
		{"", PortRange{}, false},
		{"30000-30009", PortRange{30000, 10}, false},
		{"30000+9", PortRange{30000, 10}, false},
		{"30000", PortRange{30000, 1}, false},
		{"30009-30000", PortRange{}, true},
		{"0-10", PortRange{}, true},
		{"65535+1", PortRange{}, true},
		{"a-b", PortRange{}, true},
	}
	for _, tt := range tests {
		got, err := ParsePortRange(tt.in)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("ParsePortRange(%q) = %v, %v; want %v, err %v", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

// FuzzParsePortRange checks that a --proxy-port-range that parses is a
// non-empty range within 1-65535 (or the zero value for ""), and reads back
// the same from its String form.
func FuzzParsePortRange(f *testing.F) {
	for _, s := range []string{"", " ", "30000-30009", " 30000 - 30009 ", "30000+9", "30000", "1-65535", "65535+0",
		"30009-30000", "0-10", "65535+1", "1+-1", "a-b", "-", "+", "1-2-3", "1+2+3", "30000-", "+5", "99999",
		"1+9223372036854775807", // lo+off overflowed into a negative Size
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParsePortRange(s)
		if err != nil {
			if r != (PortRange{}) || !strings.Contains(err.Error(), "invalid port range") {
				t.Errorf("ParsePortRange(%q) = %+v, %v; want the zero range and an error saying so", s, r, err)
			}
			return
		}
		if strings.TrimSpace(s) == "" {
			if r != (PortRange{}) {
				t.Errorf("ParsePortRange(%q) = %+v, want the zero range", s, r)
			}
			return
		}
		if r.Base < 1 || r.Size < 1 || int(r.Base)+r.Size-1 > 65535 {
			t.Fatalf("ParsePortRange(%q) = %+v: not a range within 1-65535", s, r)
		}
		again, err := ParsePortRange(r.String())
		if err != nil || again != r {
			t.Errorf("ParsePortRange(%q) = %+v, whose String %q reads back as %+v, %v", s, r, r.String(), again, err)
		}
	})
}
