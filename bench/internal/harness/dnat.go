package harness

import (
	"crypto/sha256"
	"encoding/base32"
	"fmt"
	"net/netip"
	"strings"
)

// DNATPort is one service port for the kernel DNAT path: a cluster IP and
// port, and the endpoints it is spread over.
type DNATPort struct {
	// Name is "namespace/service:port", as kube-proxy's comments give it.
	Name      string
	ClusterIP netip.Addr
	Port      uint16
	Protocol  string // "tcp" or "udp"
	Endpoints []netip.AddrPort
}

// kubeChain names a chain as kube-proxy's iptables mode does: a prefix and
// the first 16 characters of the base32 SHA-256 of what it stands for.
func kubeChain(prefix, of string) string {
	h := sha256.Sum256([]byte(of))
	return prefix + base32.StdEncoding.EncodeToString(h[:])[:16]
}

func SvcChain(p DNATPort) string { return kubeChain("KUBE-SVC-", p.Name+p.Protocol) }

func SepChain(p DNATPort, ep netip.AddrPort) string {
	return kubeChain("KUBE-SEP-", p.Name+p.Protocol+ep.String())
}

// RenderDNAT renders iptables-restore input for the nat table with the
// rule shapes of kube-proxy's iptables mode: KUBE-SERVICES matches each
// cluster IP and port and jumps to the port's KUBE-SVC chain, which picks
// an endpoint with `-m statistic --mode random --probability 1/n` (the
// last without) and jumps to that endpoint's KUBE-SEP chain, which DNATs;
// traffic from outside clusterCIDR and hairpin traffic is marked for
// masquerading, as kube-proxy does. It replaces the whole nat table.
func RenderDNAT(ports []DNATPort, clusterCIDR string) string {
	var b strings.Builder
	b.Grow(len(ports) * 600)
	b.WriteString("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n")
	b.WriteString(":KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n")
	for _, p := range ports {
		fmt.Fprintf(&b, ":%s - [0:0]\n", SvcChain(p))
		for _, ep := range p.Endpoints {
			fmt.Fprintf(&b, ":%s - [0:0]\n", SepChain(p, ep))
		}
	}
	b.WriteString(`-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
`)
	for _, p := range ports {
		fmt.Fprintf(&b, "-A KUBE-SERVICES -d %s/32 -p %s -m comment --comment \"%s cluster IP\" -m %s --dport %d -j %s\n",
			p.ClusterIP, p.Protocol, p.Name, p.Protocol, p.Port, SvcChain(p))
		writeSvcChain(&b, p, clusterCIDR)
	}
	b.WriteString(`-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS` + "\n")
	b.WriteString("COMMIT\n")
	return b.String()
}

// writeSvcChain writes the rules of p's KUBE-SVC chain and of its
// endpoints' KUBE-SEP chains.
func writeSvcChain(b *strings.Builder, p DNATPort, clusterCIDR string) {
	svc := SvcChain(p)
	fmt.Fprintf(b, "-A %s ! -s %s -d %s/32 -p %s -m comment --comment \"%s cluster IP\" -m %s --dport %d -j KUBE-MARK-MASQ\n",
		svc, clusterCIDR, p.ClusterIP, p.Protocol, p.Name, p.Protocol, p.Port)
	n := len(p.Endpoints)
	for i, ep := range p.Endpoints {
		fmt.Fprintf(b, "-A %s -m comment --comment \"%s -> %s\"", svc, p.Name, ep)
		if i < n-1 {
			fmt.Fprintf(b, " -m statistic --mode random --probability %0.11f", 1/float64(n-i))
		}
		fmt.Fprintf(b, " -j %s\n", SepChain(p, ep))
	}
	for _, ep := range p.Endpoints {
		sep := SepChain(p, ep)
		fmt.Fprintf(b, "-A %s -s %s/32 -m comment --comment \"%s\" -j KUBE-MARK-MASQ\n", sep, ep.Addr(), p.Name)
		fmt.Fprintf(b, "-A %s -p %s -m comment --comment \"%s\" -m %s -j DNAT --to-destination %s\n", sep, p.Protocol, p.Name, p.Protocol, ep)
	}
}

// RenderDNATChange renders iptables-restore --noflush input that moves p
// from the endpoints old to p.Endpoints, as kube-proxy's partial sync
// does: it rewrites the KUBE-SVC chain, adds the new KUBE-SEP chains and
// deletes the old ones.
func RenderDNATChange(p DNATPort, old []netip.AddrPort, clusterCIDR string) string {
	var b strings.Builder
	b.WriteString("*nat\n")
	fmt.Fprintf(&b, ":%s - [0:0]\n", SvcChain(p)) // declaring a chain flushes it
	keep := map[netip.AddrPort]bool{}
	for _, ep := range p.Endpoints {
		keep[ep] = true
		fmt.Fprintf(&b, ":%s - [0:0]\n", SepChain(p, ep))
	}
	var gone []string
	for _, ep := range old {
		if !keep[ep] {
			gone = append(gone, SepChain(p, ep))
			fmt.Fprintf(&b, ":%s - [0:0]\n", SepChain(p, ep))
		}
	}
	writeSvcChain(&b, p, clusterCIDR)
	for _, c := range gone {
		fmt.Fprintf(&b, "-X %s\n", c)
	}
	b.WriteString("COMMIT\n")
	return b.String()
}

// RedirectPort is one VIP:port that a userspace proxy outside uproxy
// (HAProxy, nginx) serves on a local port.
type RedirectPort struct {
	VIP      netip.Addr
	Port     uint16
	Protocol string
	To       uint16
}

// RenderRedirect renders iptables-restore input that REDIRECTs each VIP
// and port to a local port, from pods (PREROUTING) and from the node
// (OUTPUT): the same rule shape as uproxy's redirect mode, so that the
// userspace proxies differ only in the proxy.
func RenderRedirect(ports []RedirectPort) string {
	var b strings.Builder
	b.WriteString("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:BENCH-SERVICES - [0:0]\n")
	b.WriteString("-A PREROUTING -j BENCH-SERVICES\n-A OUTPUT -j BENCH-SERVICES\n")
	for _, p := range ports {
		fmt.Fprintf(&b, "-A BENCH-SERVICES -d %s/32 -p %s -m %s --dport %d -j REDIRECT --to-ports %d\n", p.VIP, p.Protocol, p.Protocol, p.Port, p.To)
	}
	b.WriteString("COMMIT\n")
	return b.String()
}
