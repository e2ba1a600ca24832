#!/bin/sh
# install.sh ROOT UPROXY: lays out uproxy's image in the root filesystem
# ROOT, which already holds Debian's iptables and ipset: the uproxy binary
# UPROXY, the entrypoint, /usr/local/bin/kube-proxy, and the iptables
# commands that follow the host's backend. Both deploy/Dockerfile and
# build.sh run it, so that both images are the same.
set -eu

root=$1
uproxy=$2
here=$(cd "$(dirname "$0")" && pwd)

mkdir -p "$root/usr/local/bin" "$root/usr/local/sbin" "$root/usr/local/lib/uproxy"
install -m 0755 "$uproxy" "$root/usr/local/bin/uproxy"
install -m 0755 "$here/entrypoint" "$root/usr/local/bin/uproxy-entrypoint"
install -m 0755 "$here/detect-iptables-mode" "$root/usr/local/lib/uproxy/detect-iptables-mode"
install -m 0755 "$here/iptables-wrapper" "$root/usr/local/sbin/iptables-wrapper"

# kubeadm's DaemonSet runs /usr/local/bin/kube-proxy: the entrypoint, which
# runs uproxy through a link named kube-proxy.
ln -sfn uproxy-entrypoint "$root/usr/local/bin/kube-proxy"
ln -sfn ../../bin/uproxy "$root/usr/local/lib/uproxy/kube-proxy"
for cmd in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
	ln -sfn iptables-wrapper "$root/usr/local/sbin/$cmd"
done
# What a container needs to find in place: the xtables lock lives in /run,
# and /proc, /sys, /dev and /tmp are mount points.
mkdir -p "$root/run" "$root/tmp" "$root/proc" "$root/sys" "$root/dev" "$root/etc"
chmod 1777 "$root/tmp"
