package main

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/uproxy/uproxy/proxy/introspect"

	"github.com/google/go-cmp/cmp"
	"github.com/spf13/pflag"
)

// TestIOURingFlag: --io-uring is auto unless set; the boolean forms it had
// before keep their meaning.
func TestIOURingFlag(t *testing.T) {
	for _, tt := range []struct {
		args    []string
		want    ioURingMode
		wantErr bool
	}{
		{nil, ioURingAuto, false},
		{[]string{"--io-uring"}, ioURingOn, false},
		{[]string{"--io-uring=true"}, ioURingOn, false},
		{[]string{"--io-uring=1"}, ioURingOn, false},
		{[]string{"--io-uring=false"}, ioURingOff, false},
		{[]string{"--io-uring=0"}, ioURingOff, false},
		{[]string{"--io-uring=auto"}, ioURingAuto, false},
		{[]string{"--io-uring=AUTO"}, ioURingAuto, false},
		{[]string{"--io-uring=false", "--io-uring=auto"}, ioURingAuto, false},
		{[]string{"--io-uring=maybe"}, "", true},
	} {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			var o runOptions
			fs := pflag.NewFlagSet("run", pflag.ContinueOnError)
			fs.SetOutput(&bytes.Buffer{})
			o.register(fs)
			err := fs.Parse(tt.args)
			if (err != nil) != tt.wantErr {
				t.Fatalf("parsing %v: %v, want an error: %v", tt.args, err, tt.wantErr)
			}
			if err == nil && o.ioURing != tt.want {
				t.Errorf("--io-uring is %q, want %q", o.ioURing, tt.want)
			}
		})
	}
}

// TestChooseIOURing: auto takes io_uring where the kernel allows it and
// epoll elsewhere; true and false keep their meaning, and false asks the
// kernel nothing.
func TestChooseIOURing(t *testing.T) {
	refused := errors.New("io_uring_setup: operation not permitted")
	type result struct {
		Use         bool
		Unavailable string
		Probed      bool
	}
	for _, tt := range []struct {
		name  string
		mode  ioURingMode
		probe error
		want  result
	}{
		{"auto, kernel allows", ioURingAuto, nil, result{Use: true, Probed: true}},
		{"auto, kernel refuses", ioURingAuto, refused, result{Unavailable: refused.Error(), Probed: true}},
		{"true, kernel allows", ioURingOn, nil, result{Use: true, Probed: true}},
		{"true, kernel refuses", ioURingOn, refused, result{Unavailable: refused.Error(), Probed: true}},
		{"false", ioURingOff, nil, result{}},
		{"false, kernel refuses", ioURingOff, refused, result{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var got result
			use, err := chooseIOURing(tt.mode, func() error { got.Probed = true; return tt.probe })
			got.Use = use
			if err != nil {
				got.Unavailable = err.Error()
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("chooseIOURing(%q) (-want +got):\n%s", tt.mode, diff)
			}
		})
	}
}

// TestPrintStatusDataPath: `uproxy status` says what carries the
// connections, and nothing when an older uproxy does not say.
func TestPrintStatusDataPath(t *testing.T) {
	for _, tt := range []struct {
		loops int
		io    string
		want  string
	}{
		{1, "io_uring", "mode redirect, 1 event loop on io_uring, last sync never, 0 active connections, 0 UDP flows"},
		{2, "epoll", "mode redirect, 2 event loops on epoll, last sync never, 0 active connections, 0 UDP flows"},
		{0, "goroutines", "mode redirect, no event loops (goroutines), last sync never, 0 active connections, 0 UDP flows"},
		{0, "", "mode redirect, last sync never, 0 active connections, 0 UDP flows"},
	} {
		t.Run(tt.io, func(t *testing.T) {
			var b bytes.Buffer
			if err := printStatus(&b, &introspect.Status{Mode: "redirect", EventLoops: tt.loops, IO: tt.io}); err != nil {
				t.Fatal(err)
			}
			if got, _, _ := strings.Cut(b.String(), "\n"); got != tt.want {
				t.Errorf("first line:\n%s\nwant:\n%s", got, tt.want)
			}
		})
	}
}
