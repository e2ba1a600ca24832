package main

import (
	"fmt"
	"io/fs"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/zap"
)

// fakeSysctls holds the kernel's parameters in a map and records the
// writes.
type fakeSysctls struct {
	values map[string]int
	// readOnly fails every write, as a /proc/sys mounted read-only does.
	readOnly bool
	// writes are "path=value", in order.
	writes []string
}

func (f *fakeSysctls) Get(path string) (int, error) {
	v, ok := f.values[path]
	if !ok {
		return 0, fmt.Errorf("open %s: %w", path, fs.ErrNotExist)
	}
	return v, nil
}

func (f *fakeSysctls) Set(path string, value int) error {
	if f.readOnly {
		return fmt.Errorf("open %s: read-only file system", path)
	}
	f.values[path] = value
	f.writes = append(f.writes, fmt.Sprintf("%s=%d", path, value))
	return nil
}

// The parameters, by short name.
const (
	ctMax         = netfilterSysctls + "nf_conntrack_max"
	ctEstablished = netfilterSysctls + "nf_conntrack_tcp_timeout_established"
	ctCloseWait   = netfilterSysctls + "nf_conntrack_tcp_timeout_close_wait"
	ctLiberal     = netfilterSysctls + "nf_conntrack_tcp_be_liberal"
	ctUDP         = netfilterSysctls + "nf_conntrack_udp_timeout"
	ctUDPStream   = netfilterSysctls + "nf_conntrack_udp_timeout_stream"
)

// kernelDefaults are a small node's values before kube-proxy ran.
var kernelDefaults = map[string]int{
	ctMax: 65536, conntrackHashsize: 16384, ctEstablished: 432000, ctCloseWait: 60,
	ctLiberal: 0, ctUDP: 30, ctUDPStream: 120,
}

// TestConntrackSysctls checks what the --conntrack-* settings write, as
// kube-proxy v1.37's setSysctls would.
func TestConntrackSysctls(t *testing.T) {
	tests := []struct {
		name string
		opts conntrackOptions
		cpus int
		// values are the kernel's before; nil means kernelDefaults.
		values   map[string]int
		readOnly bool
		want     []string
		// wantErrs are what the error names, one each.
		wantErrs []string
	}{
		{name: "kube-proxy's defaults on 2 CPUs: the minimum", opts: defaultConntrackOptions, cpus: 2,
			want: []string{ctMax + "=131072", conntrackHashsize + "=32768", ctEstablished + "=86400", ctCloseWait + "=3600"}},
		{name: "kube-proxy's defaults on 8 CPUs: per core", opts: defaultConntrackOptions, cpus: 8,
			want: []string{ctMax + "=262144", conntrackHashsize + "=65536", ctEstablished + "=86400", ctCloseWait + "=3600"}},
		{name: "per core, capped", opts: conntrackOptions{MaxPerCore: 32768, Min: 131072}, cpus: 64,
			want: []string{ctMax + "=1048576", conntrackHashsize + "=262144"}},
		{name: "a larger table is not made smaller", opts: defaultConntrackOptions, cpus: 2,
			values: map[string]int{ctMax: 2000000, conntrackHashsize: 500000, ctEstablished: 86400, ctCloseWait: 3600}},
		{name: "a larger table gets a larger hash table", opts: conntrackOptions{MaxPerCore: 32768, Min: 131072}, cpus: 2,
			values: map[string]int{ctMax: 262144, conntrackHashsize: 1024}, want: []string{conntrackHashsize + "=32768"}},
		{name: "no per-core maximum leaves the table and ignores the minimum", opts: conntrackOptions{Min: 131072, TCPCloseWaitTimeout: time.Hour}, cpus: 2,
			want: []string{ctCloseWait + "=3600"}},
		{name: "the zero value writes nothing", cpus: 2},
		{name: "every parameter, in whole seconds", cpus: 1,
			opts: conntrackOptions{TCPEstablishedTimeout: 90 * time.Minute, TCPCloseWaitTimeout: 1500 * time.Millisecond, TCPBeLiberal: true, UDPTimeout: 10 * time.Second, UDPStreamTimeout: 3 * time.Minute},
			want: []string{ctEstablished + "=5400", ctCloseWait + "=1", ctLiberal + "=1", ctUDP + "=10", ctUDPStream + "=180"}},
		{name: "lower timeouts are written too, as kube-proxy does", cpus: 1, opts: conntrackOptions{UDPStreamTimeout: 60 * time.Second},
			want: []string{ctUDPStream + "=60"}},
		{name: "a parameter that cannot be read is written", cpus: 1, opts: conntrackOptions{TCPBeLiberal: true},
			values: map[string]int{}, want: []string{ctLiberal + "=1"}},
		{name: "a read-only /proc/sys: every write fails, and each is named", opts: defaultConntrackOptions, cpus: 2, readOnly: true,
			wantErrs: []string{"setting " + ctMax + " to 131072", "setting " + conntrackHashsize + " to 32768",
				"setting " + ctEstablished + " to 86400", "setting " + ctCloseWait + " to 3600"}},
		{name: "a read-only /proc/sys with the values in place: nothing to write", opts: defaultConntrackOptions, cpus: 2, readOnly: true,
			values: map[string]int{ctMax: 262144, conntrackHashsize: 65536, ctEstablished: 86400, ctCloseWait: 3600}},
		{name: "no hash size to read: the others still apply", opts: defaultConntrackOptions, cpus: 2,
			values: map[string]int{ctMax: 262144, ctEstablished: 432000, ctCloseWait: 3600},
			want:   []string{ctEstablished + "=86400"}, wantErrs: []string{"reading " + conntrackHashsize}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			values := tt.values
			if values == nil {
				values = kernelDefaults
			}
			sys := &fakeSysctls{values: maps.Clone(values), readOnly: tt.readOnly}
			err := tt.opts.apply(sys, tt.cpus, zap.NewNop())
			if diff := cmp.Diff(tt.want, sys.writes); diff != "" {
				t.Errorf("writes (-want +got):\n%s", diff)
			}
			var got []string
			if err != nil {
				for _, e := range err.(interface{ Unwrap() []error }).Unwrap() {
					got = append(got, e.Error())
				}
			}
			if len(got) != len(tt.wantErrs) {
				t.Fatalf("errors %q, want %d naming %q", got, len(tt.wantErrs), tt.wantErrs)
			}
			for i, want := range tt.wantErrs {
				if !strings.Contains(got[i], want) {
					t.Errorf("error %d is %q, want one containing %q", i, got[i], want)
				}
			}
		})
	}
}
