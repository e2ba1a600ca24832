package main

import (
	"fmt"
	"strconv"
	"strings"
)

// ioURingMode is the value of --io-uring: auto, true or false. A bare
// --io-uring means true, and --io-uring=false false, as when the flag was
// a boolean.
type ioURingMode string

const (
	ioURingAuto ioURingMode = "auto"
	ioURingOn   ioURingMode = "true"
	ioURingOff  ioURingMode = "false"
)

func (m *ioURingMode) String() string { return string(*m) }

// Type is what the flag's help shows as its argument.
func (m *ioURingMode) Type() string { return "auto|true|false" }

func (m *ioURingMode) Set(s string) error {
	if strings.EqualFold(strings.TrimSpace(s), string(ioURingAuto)) {
		*m = ioURingAuto
		return nil
	}
	b, err := strconv.ParseBool(strings.TrimSpace(s))
	if err != nil {
		return fmt.Errorf("%q is not auto, true or false", s)
	}
	*m = ioURingOff
	if b {
		*m = ioURingOn
	}
	return nil
}

// chooseIOURing decides whether the event loops wait in an io_uring, and
// says why not when the kernel refuses one. probe says why the kernel
// cannot give the loops a ring, or nil (datapath.IOURingSupported), and is
// called only when the answer depends on it. Under true a refusal is the operator's
// surprise, under auto the expected case on older or locked-down kernels:
// the caller logs it accordingly.
func chooseIOURing(m ioURingMode, probe func() error) (use bool, unavailable error) {
	if m == ioURingOff {
		return false, nil
	}
	if err := probe(); err != nil {
		return false, err
	}
	return true, nil
}
