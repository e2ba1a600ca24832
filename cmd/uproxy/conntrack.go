package main

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"k8s.io/utils/cpuset"
)

// conntrackOptions are kube-proxy's conntrack settings: its --conntrack-*
// flags, or the conntrack section of its KubeProxyConfiguration. uproxy
// applies them to the node's sysctls at start, as kube-proxy v1.37 does
// (pkg/proxy/conntrack, setSysctls). They matter to uproxy as they do to
// kube-proxy: both REDIRECT and TPROXY are tracked by conntrack, and a
// proxied connection holds two entries, the client's to the listener and
// uproxy's own to the endpoint.
//
// The zero value changes nothing; kube-proxy's defaults are the
// defaultConntrack* constants.
type conntrackOptions struct {
	// MaxPerCore times the node's CPUs, at least Min and at most
	// conntrackMaxLimit, is the nf_conntrack_max to raise the table's
	// limit to (it is never lowered), and a quarter of it the hash
	// table's size to raise to. Zero leaves both as they are, and Min is
	// then ignored.
	MaxPerCore, Min int32
	// TCPEstablishedTimeout and TCPCloseWaitTimeout, whole seconds, are
	// written to nf_conntrack_tcp_timeout_established and
	// nf_conntrack_tcp_timeout_close_wait; zero leaves each as it is.
	TCPEstablishedTimeout, TCPCloseWaitTimeout time.Duration
	// TCPBeLiberal sets nf_conntrack_tcp_be_liberal to 1; false leaves
	// it as it is.
	TCPBeLiberal bool
	// UDPTimeout and UDPStreamTimeout are written to
	// nf_conntrack_udp_timeout and nf_conntrack_udp_timeout_stream; zero
	// leaves each as it is.
	UDPTimeout, UDPStreamTimeout time.Duration
}

// kube-proxy's conntrack defaults (pkg/proxy/apis/config/v1alpha1
// SetDefaults_KubeProxyConfiguration) and its cap on nf_conntrack_max
// (pkg/proxy/conntrack getConntrackMax).
const (
	defaultConntrackMaxPerCore     = 32 * 1024
	defaultConntrackMin            = 128 * 1024
	defaultConntrackTCPEstablished = 24 * time.Hour
	defaultConntrackTCPCloseWait   = time.Hour
	conntrackMaxLimit              = 1 << 20
)

// defaultConntrackOptions are kube-proxy's defaults.
var defaultConntrackOptions = conntrackOptions{
	MaxPerCore: defaultConntrackMaxPerCore, Min: defaultConntrackMin,
	TCPEstablishedTimeout: defaultConntrackTCPEstablished, TCPCloseWaitTimeout: defaultConntrackTCPCloseWait,
}

// The kernel's conntrack parameters.
const (
	netfilterSysctls  = "/proc/sys/net/netfilter/"
	conntrackHashsize = "/sys/module/nf_conntrack/parameters/hashsize"
)

// validate rejects what kube-proxy's validation rejects
// (validateKubeProxyConntrackConfiguration): negative values.
func (c conntrackOptions) validate() error {
	var errs []error
	for _, v := range []struct {
		name  string
		value int64
	}{
		{"conntrack-max-per-core", int64(c.MaxPerCore)}, {"conntrack-min", int64(c.Min)},
		{"conntrack-tcp-timeout-established", int64(c.TCPEstablishedTimeout)}, {"conntrack-tcp-timeout-close-wait", int64(c.TCPCloseWaitTimeout)},
		{"conntrack-udp-timeout", int64(c.UDPTimeout)}, {"conntrack-udp-timeout-stream", int64(c.UDPStreamTimeout)},
	} {
		if v.value < 0 {
			errs = append(errs, fmt.Errorf("--%s (or the file's conntrack section): must be greater than or equal to 0", v.name))
		}
	}
	return errors.Join(errs...)
}

// max returns the nf_conntrack_max that c asks for on a node of cpus
// CPUs, 0 for none.
func (c conntrackOptions) max(cpus int) int {
	if c.MaxPerCore <= 0 {
		return 0
	}
	scaled := int(c.MaxPerCore) * cpus
	if scaled > conntrackMaxLimit {
		return conntrackMaxLimit
	}
	return max(scaled, int(c.Min))
}

// sysctls reads and writes the kernel's integer parameters, by path.
// procSysctls is the kernel's.
type sysctls interface {
	Get(path string) (int, error)
	Set(path string, value int) error
}

// procSysctls reads and writes the files of /proc/sys and /sys.
type procSysctls struct{}

func (procSysctls) Get(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	v, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	return v, nil
}

func (procSysctls) Set(path string, value int) error {
	return os.WriteFile(path, []byte(strconv.Itoa(value)), 0o640)
}

// nodeCPUs is the number of CPUs to size nf_conntrack_max by: the node's
// online CPUs, as kube-proxy counts them, since the table is the whole
// node's and a cpuset given to uproxy's container would undercount them.
func nodeCPUs() int {
	if n, err := cpuset.NumCPU(); err == nil && n > 0 {
		return n
	}
	return runtime.NumCPU()
}

// apply writes c into sys for a node of cpus CPUs, as kube-proxy does: it
// raises nf_conntrack_max and the hash table's size when they are lower
// than c asks, and writes each other parameter c sets that has another
// value; each write is logged. Unlike kube-proxy, which exits, it goes on
// after a failure and returns them all, each naming its parameter: uproxy
// proxies without them, and a container that is not privileged has
// /proc/sys read-only.
func (c conntrackOptions) apply(sys sysctls, cpus int, log *zap.Logger) error {
	var errs []error
	set := func(path string, value int) {
		old, err := sys.Get(path)
		if err == nil && old == value {
			return
		}
		if err := sys.Set(path, value); err != nil {
			errs = append(errs, fmt.Errorf("setting %s to %d: %w", path, value, err))
			return
		}
		log.Info("conntrack parameter set", zap.String("path", path), zap.Int("value", value), zap.Int("was", old))
	}
	if limit := c.max(cpus); limit > 0 {
		if cur, err := sys.Get(netfilterSysctls + "nf_conntrack_max"); err != nil || cur < limit {
			set(netfilterSysctls+"nf_conntrack_max", limit)
		}
		// A table much larger than its hash table makes every lookup
		// walk long chains; kube-proxy keeps the buckets at a quarter of
		// the entries.
		if size, err := sys.Get(conntrackHashsize); err != nil {
			errs = append(errs, fmt.Errorf("reading %s: %w", conntrackHashsize, err))
		} else if size < limit/4 {
			set(conntrackHashsize, limit/4)
		}
	}
	seconds := func(name string, d time.Duration) {
		if d > 0 {
			set(netfilterSysctls+name, int(d/time.Second))
		}
	}
	seconds("nf_conntrack_tcp_timeout_established", c.TCPEstablishedTimeout)
	seconds("nf_conntrack_tcp_timeout_close_wait", c.TCPCloseWaitTimeout)
	if c.TCPBeLiberal {
		set(netfilterSysctls+"nf_conntrack_tcp_be_liberal", 1)
	}
	seconds("nf_conntrack_udp_timeout", c.UDPTimeout)
	seconds("nf_conntrack_udp_timeout_stream", c.UDPStreamTimeout)
	return errors.Join(errs...)
}

// applyConntrack applies c to the kernel, logging what it could not set.
func applyConntrack(c conntrackOptions, log *zap.Logger) {
	if err := c.apply(procSysctls{}, nodeCPUs(), log); err != nil {
		log.Warn("cannot set conntrack's parameters as kube-proxy would (--conntrack-*): set them on the node (deploy/README.md), or pass 0 to leave them",
			zap.Error(err))
	}
}

// newConntrackDeleted registers uproxy_conntrack_entries_deleted_total
// with reg.
func newConntrackDeleted(reg prometheus.Registerer) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "uproxy_conntrack_entries_deleted_total",
		Help: "Stale UDP conntrack entries deleted: flows to an intercepted Service address that another's DNAT sent elsewhere, and redirected flows of removed Services.",
	})
	reg.MustRegister(c)
	return c
}
