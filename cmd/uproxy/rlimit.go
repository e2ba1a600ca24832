package main

import (
	"fmt"
	"syscall"

	"go.uber.org/zap"
)

// wantNoFile is the open-files limit uproxy asks for: each proxied TCP
// connection holds two descriptors (client and backend), each UDP flow
// one, and a node may carry hundreds of thousands of connections.
const wantNoFile = 1 << 20

// raiseNoFile raises RLIMIT_NOFILE as far as it goes: the hard limit to
// wantNoFile where the process may (CAP_SYS_RESOURCE), and the soft limit
// to the hard one. The Go runtime already raises the soft limit at start
// (since Go 1.19), but not the hard one; kube-proxy's userspace mode
// panicked when accept ran out of descriptors. It returns the resulting
// soft limit.
func raiseNoFile(setrlimit func(int, *syscall.Rlimit) error, getrlimit func(int, *syscall.Rlimit) error) (uint64, error) {
	var lim syscall.Rlimit
	if err := getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0, fmt.Errorf("reading RLIMIT_NOFILE: %w", err)
	}
	if lim.Max < wantNoFile {
		want := syscall.Rlimit{Cur: wantNoFile, Max: wantNoFile}
		if setrlimit(syscall.RLIMIT_NOFILE, &want) == nil {
			return want.Cur, nil
		}
	}
	if lim.Cur < lim.Max {
		lim.Cur = lim.Max
		if err := setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			return 0, fmt.Errorf("raising RLIMIT_NOFILE to %d: %w", lim.Max, err)
		}
	}
	return lim.Cur, nil
}

// logNoFile raises the limit and says what it is, warning when it holds
// fewer than 10,000 proxied connections. It returns the limit, or 0 if it
// could not be read.
func logNoFile(log *zap.Logger) uint64 {
	n, err := raiseNoFile(syscall.Setrlimit, syscall.Getrlimit)
	switch {
	case err != nil:
		log.Warn("could not raise the open-files limit", zap.Error(err))
	case n < 20000:
		log.Warn("the open-files limit holds fewer than 10,000 proxied connections (2 descriptors each); raise the hard limit (LimitNOFILE, ulimit -Hn)", zap.Uint64("limit", n))
	default:
		log.Info("open-files limit", zap.Uint64("limit", n))
	}
	return n
}

// maxUDPFlows is the flow table's bound when none is asked for.
const maxUDPFlows = 65536

// udpMaxFlows is the flow table's bound: flag, the --udp-max-flows value,
// if set; else maxUDPFlows, or half of noFile, the open-files limit (0:
// unknown), if that is lower.
//
// Each flow holds a socket for --udp-timeout after its last datagram. A
// DNS client sends each query from a new port, so every query is a new
// flow, and a modest query rate holds every descriptor the process may
// open: every new flow, and every new TCP connection, would then fail
// with EMFILE until old flows expired. Bounded below the limit, the
// table makes room by ending least recently used flows instead (of the
// Service port with the most), and the other sockets keep theirs (see
// docs/performance.md).
func udpMaxFlows(flag int, noFile uint64) int {
	if flag > 0 {
		return flag
	}
	if noFile > 0 && noFile/2 < maxUDPFlows {
		return max(int(noFile/2), 1)
	}
	return maxUDPFlows
}

// maxUDPPool is the bound of pooled UDP sockets when none is asked for.
const maxUDPPool = 4096

// udpPoolMax is the bound of pooled UDP sockets: flag, the --udp-pool-max
// value, if set; else maxUDPPool, or a quarter of noFile, the open-files
// limit (0: unknown), if that is lower. The pools come on top of the flow
// table, whose default takes half the limit: together they leave a
// quarter to listeners and TCP connections.
func udpPoolMax(flag int, noFile uint64) int {
	if flag > 0 {
		return flag
	}
	if noFile > 0 && noFile/4 < maxUDPPool {
		return max(int(noFile/4), 1)
	}
	return maxUDPPool
}

// descriptorReserve is how many of noFile, the open-files limit, the
// listeners and the proxied connections each leave to the rest: an eighth
// of it, at least 1,024, at most half. Either one taking every descriptor
// left iptables-restore unable to start, so no rules were written for
// any service.
func descriptorReserve(noFile uint64) uint64 { return min(max(noFile/8, 1024), noFile/2) }

// maxListeners is the listener budget (proxy.Config.MaxListeners): flag,
// the --max-listeners value, if set (-1: no bound); else noFile, the
// open-files limit (0: unknown, no bound), less descriptorReserve, which
// stays for connections, flows and the control plane.
func maxListeners(flag int, noFile uint64) int {
	switch {
	case flag > 0:
		return flag
	case flag < 0 || noFile == 0:
		return 0
	}
	return max(int(noFile-descriptorReserve(noFile)), 1)
}

// maxConnections is the bound of proxied TCP connections
// (datapath.Config.MaxConnections): flag, the --max-connections value, if
// set (-1: no bound); else as many as noFile, the open-files limit (0:
// unknown, no bound), less descriptorReserve, holds at two descriptors
// each (client and backend). Connections up to the limit would take the
// descriptors that iptables-restore and the health servers need: accept
// fails with EMFILE only once none is left.
func maxConnections(flag int, noFile uint64) int {
	switch {
	case flag > 0:
		return flag
	case flag < 0 || noFile == 0:
		return 0
	}
	return max(int((noFile-descriptorReserve(noFile))/2), 1)
}

// maxConnectionsPerPort is the default bound of one service port's TCP
// connections (service.Defaults.MaxConnections), for Services without the
// uproxy.io/max-connections annotation: flag, the
// --max-connections-per-service-port value, if set (-1: no bound); else a
// quarter of total, the bound across every service (0: none, no bound),
// so that no single Service, a loop between nodes included, takes the
// connections of all the others.
func maxConnectionsPerPort(flag, total int) int {
	switch {
	case flag > 0:
		return flag
	case flag < 0 || total == 0:
		return 0
	}
	return max(total/4, 1)
}
