package main

import (
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestServerAddrs(t *testing.T) {
	for _, tt := range []struct {
		in   []string
		want []netip.AddrPort
	}{
		{[]string{"0.0.0.0:10256", "127.0.0.1:10249"}, []netip.AddrPort{netip.MustParseAddrPort("0.0.0.0:10256"), netip.MustParseAddrPort("127.0.0.1:10249")}},
		{[]string{":10256", ""}, []netip.AddrPort{netip.MustParseAddrPort("0.0.0.0:10256")}},
		{[]string{"[::]:10256", "[::ffff:192.0.2.1]:9000"}, []netip.AddrPort{netip.MustParseAddrPort("[::]:10256"), netip.MustParseAddrPort("192.0.2.1:9000")}},
		{[]string{"localhost:10249"}, []netip.AddrPort{netip.MustParseAddrPort("0.0.0.0:10249")}},
		{[]string{"", "no-port", "127.0.0.1:http"}, nil},
	} {
		if diff := cmp.Diff(tt.want, serverAddrs(tt.in...), cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
			t.Errorf("serverAddrs(%q) (-want +got):\n%s", tt.in, diff)
		}
	}
}
