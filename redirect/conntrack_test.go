package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/uproxy/uproxy/internal/testlab"
	"golang.org/x/sys/unix"
)

// ctattr builds a netlink attribute the way the kernel lays it out
// (<linux/netlink.h>: length and type in host order, the payload, padding
// to four bytes), independently of the encoder under test.
func ctattr(typ uint16, payload ...[]byte) []byte {
	var body []byte
	for _, p := range payload {
		body = append(body, p...)
	}
	b := make([]byte, 4, 4+len(body)+3)
	binary.NativeEndian.PutUint16(b[0:2], uint16(4+len(body)))
	binary.NativeEndian.PutUint16(b[2:4], typ)
	b = append(b, body...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// Attribute numbers from <linux/netfilter/nfnetlink_conntrack.h>, written
// out here so that the tests do not share the code's constants.
const (
	tCTATupleOrig   = 1
	tCTATupleReply  = 2
	tCTAStatus      = 3
	tCTATupleIP     = 1
	tCTATupleProto  = 2
	tCTAIPv4Src     = 1
	tCTAIPv4Dst     = 2
	tCTAIPv6Src     = 3
	tCTAIPv6Dst     = 4
	tCTAProtoNum    = 1
	tCTAProtoSrc    = 2
	tCTAProtoDst    = 3
	tNested         = 0x8000
	tNetByteorder   = 0x4000
	tAFInet         = 2
	tAFInet6        = 10
	tIPProtoTCP     = 6
	tIPProtoUDP     = 17
	tNFNetlinkV0    = 0
	tNfgenmsgLength = 4
)

func ctBE16(v uint16) []byte { return binary.BigEndian.AppendUint16(nil, v) }

// ctTuple is a CTA_TUPLE_* attribute of the given type.
func ctTuple(typ uint16, src, dst netip.AddrPort, protoNum uint8) []byte {
	srcType, dstType := uint16(tCTAIPv6Src), uint16(tCTAIPv6Dst)
	if src.Addr().Is4() {
		srcType, dstType = tCTAIPv4Src, tCTAIPv4Dst
	}
	return ctattr(typ|tNested,
		ctattr(tCTATupleIP|tNested, ctattr(srcType, src.Addr().AsSlice()), ctattr(dstType, dst.Addr().AsSlice())),
		ctattr(tCTATupleProto|tNested, ctattr(tCTAProtoNum, []byte{protoNum}), ctattr(tCTAProtoSrc, ctBE16(src.Port())), ctattr(tCTAProtoDst, ctBE16(dst.Port()))))
}

// ctMessage is a ctnetlink message payload: nfgenmsg, then attributes.
func ctMessage(family uint8, attrs ...[]byte) []byte {
	return append([]byte{family, tNFNetlinkV0, 0, 0}, ctattr(0, attrs...)[4:]...)
}

func TestConntrackGetPayload(t *testing.T) {
	client4 := netip.MustParseAddrPort("10.244.0.11:40000")
	local4 := netip.MustParseAddrPort("10.244.0.1:35000")
	client6 := netip.MustParseAddrPort("[2001:db8:244::11]:40000")
	local6 := netip.MustParseAddrPort("[2001:db8:244::1]:35000")
	type result struct {
		Family, ProtoNum uint8
		Payload          []byte
	}
	tests := []struct {
		name          string
		proto         Protocol
		client, local netip.AddrPort
		want          result
		wantErr       bool
	}{
		{"IPv4UDP", UDP, client4, local4,
			result{tAFInet, tIPProtoUDP, ctMessage(tAFInet, ctTuple(tCTATupleReply, local4, client4, tIPProtoUDP))}, false},
		{"IPv4TCP", TCP, client4, local4,
			result{tAFInet, tIPProtoTCP, ctMessage(tAFInet, ctTuple(tCTATupleReply, local4, client4, tIPProtoTCP))}, false},
		{"IPv6UDP", UDP, client6, local6,
			result{tAFInet6, tIPProtoUDP, ctMessage(tAFInet6, ctTuple(tCTATupleReply, local6, client6, tIPProtoUDP))}, false},
		// A dual-stack IPv6 socket reports IPv4 peers as mapped addresses.
		{"IPv4Mapped", UDP,
			netip.AddrPortFrom(netip.AddrFrom16(client4.Addr().As16()), client4.Port()),
			netip.AddrPortFrom(netip.AddrFrom16(local4.Addr().As16()), local4.Port()),
			result{tAFInet, tIPProtoUDP, ctMessage(tAFInet, ctTuple(tCTATupleReply, local4, client4, tIPProtoUDP))}, false},
		{"MixedFamilies", UDP, client4, local6, result{}, true},
		{"MissingAddress", UDP, netip.AddrPort{}, local4, result{}, true},
		{"SCTP", Protocol("sctp"), client4, local4, result{}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			family, protoNum, payload, err := conntrackGetPayload(tt.proto, tt.client, tt.local)
			if (err != nil) != tt.wantErr {
				t.Fatalf("conntrackGetPayload error = %v, want error %t", err, tt.wantErr)
			}
			if diff := cmp.Diff(tt.want, result{family, protoNum, payload}); diff != "" {
				t.Errorf("conntrackGetPayload (-want +got):\n%s", diff)
			}
		})
	}
}

func TestParseConntrackOriginalDst(t *testing.T) {
	client4 := netip.MustParseAddrPort("10.244.0.11:40000")
	vip4 := netip.MustParseAddrPort("10.96.0.10:53")
	local4 := netip.MustParseAddrPort("10.244.0.1:35000")
	client6 := netip.MustParseAddrPort("[2001:db8:244::11]:40000")
	vip6 := netip.MustParseAddrPort("[2001:db8::10]:53")
	local6 := netip.MustParseAddrPort("[2001:db8:244::1]:35000")
	entry4 := ctMessage(tAFInet,
		ctTuple(tCTATupleOrig, client4, vip4, tIPProtoUDP),
		ctTuple(tCTATupleReply, local4, client4, tIPProtoUDP),
		ctattr(tCTAStatus, binary.BigEndian.AppendUint32(nil, 0x1b8)))
	// The destination port as the kernel might flag it (nla_put_be16
	// does not, but a parser must not care).
	flaggedPort := ctMessage(tAFInet,
		ctattr(tCTATupleOrig|tNested,
			ctattr(tCTATupleIP|tNested, ctattr(tCTAIPv4Src, client4.Addr().AsSlice()), ctattr(tCTAIPv4Dst, vip4.Addr().AsSlice())),
			ctattr(tCTATupleProto|tNested, ctattr(tCTAProtoNum, []byte{tIPProtoUDP}), ctattr(tCTAProtoDst|tNetByteorder, ctBE16(vip4.Port())))))
	tests := []struct {
		name     string
		msg      []byte
		family   uint8
		protoNum uint8
		want     netip.AddrPort
		wantErr  bool
	}{
		{"IPv4", entry4, tAFInet, tIPProtoUDP, vip4, false},
		{"IPv6", ctMessage(tAFInet6,
			ctTuple(tCTATupleOrig, client6, vip6, tIPProtoUDP),
			ctTuple(tCTATupleReply, local6, client6, tIPProtoUDP)), tAFInet6, tIPProtoUDP, vip6, false},
		// The order of the attributes does not matter.
		{"ReplyFirst", ctMessage(tAFInet,
			ctTuple(tCTATupleReply, local4, client4, tIPProtoTCP),
			ctTuple(tCTATupleOrig, client4, vip4, tIPProtoTCP)), tAFInet, tIPProtoTCP, vip4, false},
		{"NetByteorderFlag", flaggedPort, tAFInet, tIPProtoUDP, vip4, false},
		{"Empty", nil, tAFInet, tIPProtoUDP, netip.AddrPort{}, true},
		{"OnlyHeader", entry4[:tNfgenmsgLength], tAFInet, tIPProtoUDP, netip.AddrPort{}, true},
		{"Truncated", entry4[:len(entry4)-7], tAFInet, tIPProtoUDP, netip.AddrPort{}, true},
		{"TruncatedHeader", append(entry4[:len(entry4):len(entry4)], 8, 0), tAFInet, tIPProtoUDP, netip.AddrPort{}, true},
		{"AttributeTooShort", ctMessage(tAFInet, []byte{2, 0, tCTATupleOrig, 0}), tAFInet, tIPProtoUDP, netip.AddrPort{}, true},
		{"WrongFamily", entry4, tAFInet6, tIPProtoUDP, netip.AddrPort{}, true},
		{"WrongProtocol", entry4, tAFInet, tIPProtoTCP, netip.AddrPort{}, true},
		{"NoOriginal", ctMessage(tAFInet, ctTuple(tCTATupleReply, local4, client4, tIPProtoUDP)), tAFInet, tIPProtoUDP, netip.AddrPort{}, true},
		{"IPv6AddressInIPv4Entry", ctMessage(tAFInet, ctTuple(tCTATupleOrig, client6, vip6, tIPProtoUDP)), tAFInet, tIPProtoUDP, netip.AddrPort{}, true},
		{"NoPort", ctMessage(tAFInet,
			ctattr(tCTATupleOrig|tNested,
				ctattr(tCTATupleIP|tNested, ctattr(tCTAIPv4Dst, vip4.Addr().AsSlice())),
				ctattr(tCTATupleProto|tNested, ctattr(tCTAProtoNum, []byte{tIPProtoUDP})))), tAFInet, tIPProtoUDP, netip.AddrPort{}, true},
		{"ShortPort", ctMessage(tAFInet,
			ctattr(tCTATupleOrig|tNested,
				ctattr(tCTATupleIP|tNested, ctattr(tCTAIPv4Dst, vip4.Addr().AsSlice())),
				ctattr(tCTATupleProto|tNested, ctattr(tCTAProtoNum, []byte{tIPProtoUDP}), ctattr(tCTAProtoDst, []byte{53})))), tAFInet, tIPProtoUDP, netip.AddrPort{}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseConntrackOriginalDst(tt.msg, tt.family, tt.protoNum)
			if (err != nil) != tt.wantErr {
				t.Fatalf("parseConntrackOriginalDst error = %v, want error %t", err, tt.wantErr)
			}
			if diff := cmp.Diff(tt.want, got, cmpopts.EquateComparable(netip.AddrPort{})); diff != "" {
				t.Errorf("parseConntrackOriginalDst (-want +got):\n%s", diff)
			}
		})
	}
}

func TestConntrackAnswer(t *testing.T) {
	const pid, seq = 4242, 7
	client := netip.MustParseAddrPort("10.244.0.11:40000")
	vip := netip.MustParseAddrPort("10.96.0.10:53")
	local := netip.MustParseAddrPort("10.244.0.1:35000")
	entry := ctMessage(tAFInet, ctTuple(tCTATupleOrig, client, vip, tIPProtoUDP), ctTuple(tCTATupleReply, local, client, tIPProtoUDP))
	// msg is a netlink message as the kernel addresses it to port pid.
	// Answers to a GET are flagged NLM_F_MULTI (ctnetlink_fill_info).
	msg := func(typ uint16, seq, pid uint32, data []byte) syscall.NetlinkMessage {
		return syscall.NetlinkMessage{
			Header: syscall.NlMsghdr{Len: uint32(16 + len(data)), Type: typ, Flags: 0x2, Seq: seq, Pid: pid},
			Data:   data,
		}
	}
	const (
		ctNew   = 1 << 8 // NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW (0)
		nlError = 2      // NLMSG_ERROR
		nlDone  = 3      // NLMSG_DONE
	)
	// nlmsgerr is struct nlmsgerr: the error code, then the request's
	// header (the request itself is left out here).
	nlmsgerr := func(code int32) []byte {
		return append(binary.NativeEndian.AppendUint32(nil, uint32(code)), make([]byte, 16)...)
	}
	type result struct {
		Dst  netip.AddrPort
		Done bool
	}
	tests := []struct {
		name      string
		msgs      []syscall.NetlinkMessage
		want      result
		wantErr   bool
		wantErrno syscall.Errno
	}{
		{"Entry", []syscall.NetlinkMessage{msg(ctNew, seq, pid, entry)}, result{vip, true}, false, 0},
		{"LateAnswerFirst", []syscall.NetlinkMessage{
			msg(ctNew, seq-1, pid, ctMessage(tAFInet, ctTuple(tCTATupleOrig, client, netip.MustParseAddrPort("10.96.0.99:53"), tIPProtoUDP))),
			msg(ctNew, seq, pid, entry),
		}, result{vip, true}, false, 0},
		{"OnlyLateAnswer", []syscall.NetlinkMessage{msg(nlError, seq-1, pid, nlmsgerr(-int32(unix.ENOENT)))}, result{}, false, 0},
		{"OtherPort", []syscall.NetlinkMessage{msg(ctNew, seq, pid+1, entry)}, result{}, false, 0},
		{"Done", []syscall.NetlinkMessage{msg(nlDone, seq, pid, make([]byte, 4))}, result{}, false, 0},
		{"NoEntry", []syscall.NetlinkMessage{msg(nlError, seq, pid, nlmsgerr(-int32(unix.ENOENT)))}, result{Done: true}, true, unix.ENOENT},
		{"NoCtnetlink", []syscall.NetlinkMessage{msg(nlError, seq, pid, nlmsgerr(-int32(unix.EOPNOTSUPP)))}, result{Done: true}, true, unix.EOPNOTSUPP},
		{"Acknowledged", []syscall.NetlinkMessage{msg(nlError, seq, pid, nlmsgerr(0))}, result{Done: true}, true, 0},
		{"ShortError", []syscall.NetlinkMessage{msg(nlError, seq, pid, []byte{0xfe, 0xff})}, result{Done: true}, true, 0},
		{"MalformedEntry", []syscall.NetlinkMessage{msg(ctNew, seq, pid, entry[:len(entry)-3])}, result{Done: true}, true, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dst, done, err := conntrackAnswer(tt.msgs, pid, seq, tAFInet, tIPProtoUDP)
			if (err != nil) != tt.wantErr {
				t.Fatalf("conntrackAnswer error = %v, want error %t", err, tt.wantErr)
			}
			if tt.wantErrno != 0 && !errors.Is(err, tt.wantErrno) {
				t.Errorf("conntrackAnswer error = %v, want one wrapping %v", err, tt.wantErrno)
			}
			if diff := cmp.Diff(tt.want, result{dst, done}, cmpopts.EquateComparable(netip.AddrPort{})); diff != "" {
				t.Errorf("conntrackAnswer (-want +got):\n%s", diff)
			}
		})
	}
}

// netfilterSockets returns how many NETLINK_NETFILTER sockets the process
// has open: its descriptors whose socket inode /proc/self/net/netlink
// lists with protocol 12.
func netfilterSockets(t *testing.T) int {
	t.Helper()
	table, err := os.ReadFile("/proc/self/net/netlink")
	if err != nil {
		t.Fatal(err)
	}
	inodes := map[string]bool{}
	for line := range strings.Lines(string(table)) {
		// sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode
		f := strings.Fields(line)
		if len(f) == 10 && f[1] == strconv.Itoa(unix.NETLINK_NETFILTER) {
			inodes[f[9]] = true
		}
	}
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range entries {
		target, err := os.Readlink("/proc/self/fd/" + e.Name())
		if err != nil {
			continue // the descriptor ReadDir itself used, now closed
		}
		if inode, ok := strings.CutPrefix(target, "socket:["); ok && inodes[strings.TrimSuffix(inode, "]")] {
			n++
		}
	}
	return n
}

// TestConntrackLookupKernel redirects UDP datagrams (and a TCP connection)
// from the namespace's own sockets with a nat OUTPUT REDIRECT rule, as
// uproxy does for traffic from the node, and finds their service address
// in the kernel's conntrack table.
func TestConntrackLookupKernel(t *testing.T) {
	tests := []struct {
		name   string
		family Family
		proto  Protocol
		// listen is the listener's address: REDIRECT in nat OUTPUT
		// delivers to the loopback address (nf_nat_redirect).
		listen string
		vip    netip.AddrPort
		// route makes the VIP reachable through lo, with a source
		// address for IPv4.
		route []string
	}{
		{"IPv4", IPv4, UDP, "127.0.0.1:0", netip.MustParseAddrPort("10.96.0.10:53"),
			[]string{"route", "add", "10.96.0.0/16", "dev", "lo", "src", "127.0.0.1"}},
		{"IPv6", IPv6, UDP, "[::1]:0", netip.MustParseAddrPort("[2001:db8::10]:53"),
			[]string{"-6", "route", "add", "2001:db8::/32", "dev", "lo"}},
		{"IPv4TCP", IPv4, TCP, "127.0.0.1:0", netip.MustParseAddrPort("10.96.0.10:80"),
			[]string{"route", "add", "10.96.0.0/16", "dev", "lo", "src", "127.0.0.1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !testlab.RunInNetns(t, tt.family.command("")) {
				return
			}
			ct, err := NewConntrackLookup()
			if errors.Is(err, unix.EPROTONOSUPPORT) {
				t.Skipf("skipping: the kernel has no NETLINK_NETFILTER: %v", err)
			}
			if err != nil {
				t.Fatal(err)
			}
			closed := false
			defer func() {
				if !closed {
					ct.Close()
				}
			}()

			nsCommand(t, "ip", tt.route...)
			network := "udp"
			if tt.proto == TCP {
				network = "tcp"
			}
			var (
				local   netip.AddrPort
				udpLn   *net.UDPConn
				tcpLn   *net.TCPListener
				clients []net.Conn
			)
			if tt.proto == UDP {
				udpLn, err = net.ListenUDP(network, net.UDPAddrFromAddrPort(netip.MustParseAddrPort(tt.listen)))
				if err != nil {
					t.Fatal(err)
				}
				defer udpLn.Close()
				local = udpLn.LocalAddr().(*net.UDPAddr).AddrPort()
			} else {
				tcpLn, err = net.ListenTCP(network, net.TCPAddrFromAddrPort(netip.MustParseAddrPort(tt.listen)))
				if err != nil {
					t.Fatal(err)
				}
				defer tcpLn.Close()
				local = tcpLn.Addr().(*net.TCPAddr).AddrPort()
			}
			nsCommand(t, tt.family.command(""), "-t", "nat", "-A", "OUTPUT",
				"-d", tt.vip.Addr().String(), "-p", string(tt.proto), "--dport", strconv.Itoa(int(tt.vip.Port())),
				"-j", "REDIRECT", "--to-ports", strconv.Itoa(int(local.Port())))

			// A tuple conntrack has never seen. A kernel without
			// ctnetlink (no nf_conntrack_netlink) answers EOPNOTSUPP.
			unseen := netip.AddrPortFrom(local.Addr(), 9)
			if _, err := ct.OriginalDst(tt.proto, unseen, local); errors.Is(err, unix.EOPNOTSUPP) {
				t.Skipf("skipping: the kernel has no nf_conntrack netlink: %v", err)
			} else if !errors.Is(err, ErrNoConntrackEntry) {
				t.Fatalf("OriginalDst of an unseen flow: error %v, want %v", err, ErrNoConntrackEntry)
			}

			// Several flows, each from a client socket of its own.
			const flows = 8
			want := map[netip.AddrPort]netip.AddrPort{}
			for i := range flows {
				c, err := net.DialTimeout(network, tt.vip.String(), 5*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				clients = append(clients, c)
				if tt.proto == UDP {
					if _, err := c.Write([]byte("query " + strconv.Itoa(i))); err != nil {
						t.Fatal(err)
					}
				}
			}
			for range flows {
				var from netip.AddrPort
				if tt.proto == UDP {
					if err := udpLn.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
						t.Fatal(err)
					}
					buf := make([]byte, 64)
					_, from, err = udpLn.ReadFromUDPAddrPort(buf)
					if err != nil {
						t.Fatalf("reading the redirected datagrams: %v", err)
					}
				} else {
					if err := tcpLn.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
						t.Fatal(err)
					}
					c, err := tcpLn.AcceptTCP()
					if err != nil {
						t.Fatalf("accepting the redirected connections: %v", err)
					}
					defer c.Close()
					if got, err := OriginalDst(rawOf(t, c), tt.vip.Addr().Is6()); err != nil || got != tt.vip {
						t.Fatalf("SO_ORIGINAL_DST = %s, %v; want %s", got, err, tt.vip)
					}
					from = c.RemoteAddr().(*net.TCPAddr).AddrPort()
				}
				want[from] = tt.vip
			}
			for _, c := range clients {
				if _, ok := want[netip.MustParseAddrPort(c.LocalAddr().String())]; !ok {
					t.Fatalf("client %s: no redirected flow from it (got flows from %v)", c.LocalAddr(), want)
				}
			}

			// Sequential lookups reuse one socket.
			if n := netfilterSockets(t); n != 1 {
				t.Errorf("%d NETLINK_NETFILTER sockets open after the first lookups, want 1", n)
			}
			for range 20 {
				for client := range want {
					if _, err := ct.OriginalDst(tt.proto, client, local); err != nil {
						t.Fatal(err)
					}
				}
				if _, err := ct.OriginalDst(tt.proto, unseen, local); !errors.Is(err, ErrNoConntrackEntry) {
					t.Fatalf("OriginalDst of an unseen flow: error %v, want %v", err, ErrNoConntrackEntry)
				}
			}
			if n := netfilterSockets(t); n != 1 {
				t.Errorf("%d NETLINK_NETFILTER sockets open after sequential lookups, want 1", n)
			}

			// Concurrent lookups, more than there are sockets, of every
			// flow and of unseen ones: the entries are there, under the
			// other protocol there are none.
			other := UDP
			if tt.proto == UDP {
				other = TCP
			}
			const rounds = 10
			var (
				mu       sync.Mutex
				got      = map[netip.AddrPort]netip.AddrPort{}
				problems []string
				wg       sync.WaitGroup
			)
			for client := range want {
				wg.Add(2)
				go func() { // ends after its rounds; the test waits for it
					defer wg.Done()
					for range rounds {
						dst, err := ct.OriginalDst(tt.proto, client, local)
						mu.Lock()
						if err != nil {
							problems = append(problems, fmt.Sprintf("OriginalDst(%s, %s, %s): %v", tt.proto, client, local, err))
						} else if prev, ok := got[client]; ok && prev != dst {
							problems = append(problems, fmt.Sprintf("OriginalDst(%s, %s, %s) = %s, earlier %s", tt.proto, client, local, dst, prev))
						}
						got[client] = dst
						mu.Unlock()
					}
				}()
				go func() { // ends after its rounds; the test waits for it
					defer wg.Done()
					for range rounds {
						if _, err := ct.OriginalDst(other, client, local); !errors.Is(err, ErrNoConntrackEntry) {
							mu.Lock()
							problems = append(problems, fmt.Sprintf("OriginalDst(%s, %s, %s): error %v, want %v", other, client, local, err, ErrNoConntrackEntry))
							mu.Unlock()
						}
					}
				}()
			}
			wg.Wait()
			if diff := cmp.Diff([]string(nil), problems); diff != "" {
				t.Errorf("concurrent lookups (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(want, got, cmpopts.EquateComparable(netip.AddrPort{})); diff != "" {
				t.Errorf("original destinations by client (-want +got):\n%s", diff)
			}
			if n := netfilterSockets(t); n < 1 || n > conntrackSockets {
				t.Errorf("%d NETLINK_NETFILTER sockets open after concurrent lookups, want 1 to %d", n, conntrackSockets)
			}

			// Close releases every socket, and later lookups fail.
			if err := ct.Close(); err != nil {
				t.Fatal(err)
			}
			closed = true
			if n := netfilterSockets(t); n != 0 {
				t.Errorf("%d NETLINK_NETFILTER sockets open after Close, want 0", n)
			}
			if _, err := ct.OriginalDst(tt.proto, netip.MustParseAddrPort(clients[0].LocalAddr().String()), local); !errors.Is(err, net.ErrClosed) {
				t.Errorf("OriginalDst after Close: error %v, want %v", err, net.ErrClosed)
			}
			if err := ct.Close(); err != nil {
				t.Errorf("second Close: %v", err)
			}
		})
	}
}
