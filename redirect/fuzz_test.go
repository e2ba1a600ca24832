package redirect

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// FuzzConntrackEntry checks the ctnetlink parsers against any bytes the
// socket could return: parseConntrackOriginalDst either fails or returns
// an address of the asked family, which an entry built anew with it as the
// original destination reads back as; and conntrackAnswer, given the
// bytes as netlink messages, never reports an answer without an address
// or an error.
func FuzzConntrackEntry(f *testing.F) {
	client := netip.MustParseAddrPort("10.244.0.11:40000")
	vip := netip.MustParseAddrPort("10.96.0.10:53")
	local := netip.MustParseAddrPort("10.244.0.1:35000")
	client6 := netip.MustParseAddrPort("[2001:db8:244::11]:40000")
	vip6 := netip.MustParseAddrPort("[2001:db8::10]:53")
	entry4 := ctMessage(tAFInet, ctTuple(tCTATupleOrig, client, vip, tIPProtoUDP), ctTuple(tCTATupleReply, local, client, tIPProtoUDP))
	entry6 := ctMessage(tAFInet6, ctTuple(tCTATupleOrig, client6, vip6, tIPProtoTCP))
	f.Add(entry4, false, true)
	f.Add(entry6, true, false)
	f.Add(entry4[:len(entry4)-7], false, true)
	f.Add(ctMessage(tAFInet, []byte{2, 0, tCTATupleOrig, 0}), false, true)
	f.Add(ctMessage(tAFInet, ctattr(tCTATupleOrig|tNested, ctattr(tCTATupleIP|tNested), ctattr(tCTATupleProto|tNested))), false, true)
	f.Add(netlinkMessage(1, 7, entry4), false, true)
	f.Add(netlinkMessage(syscall.NLMSG_ERROR, 7, []byte{0xfe, 0xff, 0xff, 0xff}), false, true)
	f.Add([]byte{}, false, false)
	f.Fuzz(func(t *testing.T, msg []byte, v6, udp bool) {
		family, protoNum := uint8(tAFInet), uint8(tIPProtoTCP)
		if v6 {
			family = tAFInet6
		}
		if udp {
			protoNum = tIPProtoUDP
		}
		dst, err := parseConntrackOriginalDst(msg, family, protoNum)
		if err == nil {
			if !dst.IsValid() || dst.Addr().Is4() == v6 {
				t.Fatalf("parseConntrackOriginalDst(%x) = %v, not an address of family %d", msg, dst, family)
			}
			src := netip.AddrPortFrom(netip.IPv4Unspecified(), 1)
			if v6 {
				src = netip.AddrPortFrom(netip.IPv6Unspecified(), 1)
			}
			again, err := parseConntrackOriginalDst(ctMessage(family, ctTuple(tCTATupleOrig, src, dst, protoNum)), family, protoNum)
			if err != nil || again != dst {
				t.Errorf("parseConntrackOriginalDst(%x) = %v, which in an entry of its own reads back as %v, %v", msg, dst, again, err)
			}
		} else if dst != (netip.AddrPort{}) {
			t.Errorf("parseConntrackOriginalDst(%x) = %v with error %v", msg, dst, err)
		}

		msgs, err := syscall.ParseNetlinkMessage(msg)
		if err != nil || len(msgs) == 0 {
			return
		}
		h := msgs[0].Header
		dst, done, err := conntrackAnswer(msgs, h.Pid, h.Seq, family, protoNum)
		switch {
		case !done && (err != nil || dst.IsValid()):
			t.Errorf("conntrackAnswer not done, with %v, %v", dst, err)
		case done && (err == nil) != dst.IsValid():
			t.Errorf("conntrackAnswer done with %v and error %v; want exactly one", dst, err)
		}
	})
}

// netlinkMessage returns a netlink message of type typ with sequence
// number seq and port id 0 around data, as the kernel lays it out.
func netlinkMessage(typ uint16, seq uint32, data []byte) []byte {
	b := make([]byte, syscall.NLMSG_HDRLEN, syscall.NLMSG_HDRLEN+len(data)+3)
	binary.NativeEndian.PutUint32(b[0:4], uint32(syscall.NLMSG_HDRLEN+len(data)))
	binary.NativeEndian.PutUint16(b[4:6], typ)
	binary.NativeEndian.PutUint32(b[8:12], seq)
	b = append(b, data...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// FuzzIptablesSave checks the readers of iptables-save output against any
// text: parseState keeps only uproxy's chains, each rule in the chain it
// appends to; PreviousListenerPorts names only listeners with a comment
// and a port, and reads the same from rules written anew for them; and a
// comment quoted as the rules write it reads back as one word.
func FuzzIptablesSave(f *testing.F) {
	vip := netip.MustParseAddr("10.96.0.10")
	r := Rules{
		Intercepts: []InterceptRule{
			{Comment: "default/web:http", Protocol: TCP, Dest: vip, Port: 80, ToPort: 35513},
			{Comment: "default/dns:dns", Protocol: UDP, Dest: netip.MustParseAddr("10.96.0.53"), Port: 53, ToPort: 41000},
		},
		NodePorts: []NodePort{{Comment: "default/web:http", Family: IPv4, Protocol: TCP, Port: 30080, ToPort: 35513}},
	}
	f.Add(string(Render(IPv4, r)), "default/web:http")
	f.Add(string(Render(IPv4, sharedOf(r, 40000, 40001))), `a "quoted" \ comment`)
	f.Add("*nat\n:UPROXY-SERVICES - [0:0]\n-A UPROXY-SERVICES -p tcp -m comment --comment \"x\\\" y\" -j REDIRECT --to-ports 1-2\nCOMMIT\n", "\x00\xff")
	f.Add("-A UPROXY-X --comment \"unterminated -p udp --on-port 7", "")
	f.Add("-A UPROXY-X -p tcp --comment x --to-ports 65536\n-A UPROXY-X -p tcp --comment x --to-ports 0\n*\n-A \n:", " ")
	f.Fuzz(func(t *testing.T, text, comment string) {
		for key, cs := range parseState([]byte(text)) {
			if !slices.ContainsFunc(chains, func(c chainSpec) bool { return c.table == key.table && c.name == key.chain }) {
				t.Fatalf("parseState: chain %v is not uproxy's", key)
			}
			for _, rule := range cs.rules {
				if rule != "-A "+key.chain && !strings.HasPrefix(rule, "-A "+key.chain+" ") {
					t.Errorf("parseState: rule %q in chain %v", rule, key)
				}
			}
			if len(cs.rules) > 0 && !strings.Contains(text, "*"+key.table) {
				t.Errorf("parseState: rules for chain %v of a table the text does not name", key)
			}
		}
		savedJumps([]byte(text))

		ports := PreviousListenerPorts([]byte(text))
		// A comment read from the rules is one that they could hold, so
		// written back it reads the same (quoteComment changes only what
		// iptables could not store).
		want := map[PreviousListener]uint16{}
		var again strings.Builder
		for k, port := range ports {
			if k.Comment == "" || port == 0 {
				t.Errorf("PreviousListenerPorts: listener %+v at port %d", k, port)
			}
			if k.Comment != quoteCommentRead(k.Comment) || (k.Protocol != TCP && k.Protocol != UDP) {
				continue
			}
			want[k] = port
			fmt.Fprintf(&again, "-A UPROXY-SERVICES -p %s -m comment --comment %s -j REDIRECT --to-ports %d\n", k.Protocol, quoteComment(k.Comment), port)
		}
		if diff := cmp.Diff(want, PreviousListenerPorts([]byte(again.String()))); diff != "" {
			t.Errorf("PreviousListenerPorts of the rules written anew (-want +got):\n%s", diff)
		}

		q := quoteComment(comment)
		fields := ruleFields("-A UPROXY-SERVICES -m comment --comment " + q + " -j RETURN")
		if len(fields) != 8 || fields[5] != quoteCommentRead(comment) || fields[7] != "RETURN" {
			t.Errorf("comment %q quoted as %s reads back as the words %q", comment, q, fields)
		}
	})
}

// quoteCommentRead returns what a comment reads back as once written by
// quoteComment: the same, less the characters iptables cannot store.
func quoteCommentRead(s string) string {
	f := ruleFields(quoteComment(s))
	if len(f) != 1 {
		return "\x00not one word"
	}
	return f[0]
}

// FuzzIpsetSave checks parseSetSave against any text: the members it
// returns are sorted, without duplicates, and each reads back as itself;
// and a save written anew from the content parses to the same content.
func FuzzIpsetSave(f *testing.F) {
	f.Add("create UPROXY-SVC-4 hash:ip,port family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x1234\nadd UPROXY-SVC-4 10.96.0.10,tcp:80\nadd UPROXY-SVC-4 10.96.0.10,udp:53\n", "UPROXY-SVC-4")
	f.Add("create UPROXY-PORTS bitmap:port range 1024-65535\nadd UPROXY-PORTS 40001\nadd UPROXY-PORTS 40000\nadd UPROXY-PORTS 40000\n", "UPROXY-PORTS")
	f.Add("create S hash:ip,port family inet6\nadd S 2001:db8::10,udp:53\nadd S ::ffff:10.0.0.1,tcp:1\nadd S fe80::1%eth0,tcp:1\nadd S 10.0.0.1,sctp:1 timeout 5\n", "S")
	f.Add("add S 70000\nadd S -1\nadd S 10.0.0.1,tcp:\ncreate S hashsize\n", "S")
	f.Fuzz(func(t *testing.T, text, name string) {
		c := parseSetSave(name, []byte(text))
		if !slices.IsSortedFunc(c.members, setMember.compare) || len(slices.Compact(slices.Clone(c.members))) != len(c.members) {
			t.Errorf("parseSetSave members %v are not sorted and unique", c.members)
		}
		for _, m := range c.members {
			if again, ok := parseMember(m.String()); !ok || again != m {
				t.Errorf("member %+v prints as %q, which reads back as %+v, %t", m, m, again, ok)
			}
		}
		if strings.ContainsAny(name, " \t\n\r\v\f\u0085\u00a0") || name == "" {
			return // not a name ipset save could print
		}
		var b strings.Builder
		if c.exists {
			fmt.Fprintf(&b, "create %s %s\n", name, c.header)
		}
		for _, m := range c.members {
			fmt.Fprintf(&b, "add %s %s\n", name, m)
		}
		again := parseSetSave(name, []byte(b.String()))
		if !c.exists {
			again.exists, again.header = false, ""
		}
		if diff := cmp.Diff(c, again, cmp.AllowUnexported(setContent{}, setMember{}), cmpopts.EquateComparable(netip.Addr{})); diff != "" {
			t.Errorf("parseSetSave of the content written anew (-first +again):\n%s", diff)
		}
	})
}
