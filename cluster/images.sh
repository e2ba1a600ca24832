#!/usr/bin/env bash
# images.sh CACHE IMAGE...: builds the dev cluster's container images as
# OCI image tar files in CACHE/images, from the binaries in CACHE/bin and
# Debian's packages (deploy/image/oci.sh), with no container engine and no
# registry. Each image is rebuilt only when a binary or script it is made
# from is newer than its tar file.
#
#	pause     registry.k8s.io/pause:3.10.2, the pod sandbox (cluster/pause)
#	coredns   registry.k8s.io/coredns/coredns:v1.14.7, the cluster DNS
#	agnhost   registry.k8s.io/e2e-test-images/agnhost:2.66.1 (and
#	          glibc-dns-testing:2.1.1, the same tools): agnhost with the
#	          shell, nc, dig, curl, ip and socat that the e2e specs run in it
#	busybox   registry.k8s.io/e2e-test-images/busybox:1.37.0-2
#	uproxy    uproxy:latest, as make image builds it (deploy/image)
#	netpol    registry.k8s.io/networking/kube-network-policies:v0.8.0, SIG
#	          Network's NetworkPolicy implementation (cluster.sh netpol)
#
# The names and tags are the ones the kubelet and Kubernetes' e2e suite ask
# for (test/utils/image/manifest.go at the pinned release), so that no
# pull is ever attempted: the images are imported into containerd, and the
# pods' pull policy finds them there.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cache=$(realpath -m "$1")
shift
bin=$cache/bin
out=$cache/images
mkdir -p "$out"
# shellcheck source=../deploy/image/oci.sh
. "$repo/deploy/image/oci.sh"
oci_require

# stale TAR INPUT...: whether TAR is missing or older than an input.
stale() {
	local tar=$1 f
	shift
	[[ -f $tar ]] || return 0
	for f in "$@"; do
		[[ $f -nt $tar ]] && return 0
	done
	return 1
}

# busybox_links ROOTFS: links busybox's applets into /bin, except where a
# Debian package already put a command of that name.
busybox_links() {
	local rootfs=$1 applet
	for applet in $("$rootfs/bin/busybox" --list); do
		[[ $applet == busybox ]] && continue
		[[ -e $rootfs/bin/$applet || -e $rootfs/usr/bin/$applet || -e $rootfs/sbin/$applet || -e $rootfs/usr/sbin/$applet ]] && continue
		ln -s busybox "$rootfs/bin/$applet"
	done
}

# base ROOTFS: what every container expects to find: the mount points, a
# root user, and name resolution through files then DNS.
base() {
	local rootfs=$1
	mkdir -p "$rootfs"/{bin,etc,proc,sys,dev,tmp,run,var/run}
	chmod 1777 "$rootfs/tmp"
	[[ -e $rootfs/etc/passwd ]] || printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$rootfs/etc/passwd"
	[[ -e $rootfs/etc/group ]] || printf 'root:x:0:\nnogroup:x:65534:\n' >"$rootfs/etc/group"
	printf 'hosts: files dns\n' >"$rootfs/etc/nsswitch.conf"
}

build() {
	local image=$1 work tar
	tar=$out/$image.tar
	work=$(mktemp -d "${TMPDIR:-/tmp}/cluster-image.XXXXXX")
	local rootfs=$work/rootfs
	mkdir -p "$rootfs"
	case $image in
	pause)
		stale "$tar" "$bin/pause" "$0" "$repo/deploy/image/oci.sh" || { echo "images.sh: $tar is up to date"; rm -rf "$work"; return; }
		base "$rootfs"
		install -m 0755 "$bin/pause" "$rootfs/pause"
		oci_pack "$rootfs" "$tar.new" '"Entrypoint":["/pause"]' registry.k8s.io/pause:3.10.2
		;;
	coredns)
		stale "$tar" "$bin/coredns" "$0" "$repo/deploy/image/oci.sh" || { echo "images.sh: $tar is up to date"; rm -rf "$work"; return; }
		base "$rootfs"
		install -m 0755 "$bin/coredns" "$rootfs/coredns"
		oci_pack "$rootfs" "$tar.new" '"Entrypoint":["/coredns"]' registry.k8s.io/coredns/coredns:v1.14.7
		;;
	busybox)
		stale "$tar" "$0" "$repo/deploy/image/oci.sh" || { echo "images.sh: $tar is up to date"; rm -rf "$work"; return; }
		oci_debs "$rootfs" busybox-static
		base "$rootfs"
		busybox_links "$rootfs"
		oci_pack "$rootfs" "$tar.new" '"Cmd":["sh"],"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]' \
			registry.k8s.io/e2e-test-images/busybox:1.37.0-2
		;;
	agnhost)
		stale "$tar" "$bin/agnhost" "$0" "$repo/deploy/image/oci.sh" || { echo "images.sh: $tar is up to date"; rm -rf "$work"; return; }
		# As upstream's Dockerfile: dig, curl, nc, ip and ss, socat and a
		# shell for the specs that exec into it, getent (libc-bin) for the
		# DNS specs' queriers; a user and group that the security-context
		# specs look up. GNU wget, because Debian's busybox wget crashes
		# (SIGSEGV) on the -T timeout the Services specs pass it; tried
		# once, as busybox's is (GNU wget retries a timed-out read twenty
		# times, which turns a spec's one-second probe into minutes).
		oci_debs "$rootfs" busybox-static dash bash netcat-openbsd bind9-dnsutils curl iproute2 socat libc-bin wget
		base "$rootfs"
		# Debian names these commands through alternatives, which
		# maintainer scripts would set. The shell is dash, not busybox's:
		# Debian's busybox shell runs its own applets before PATH, which
		# would hide nc, ip and the others.
		ln -sfn nc.openbsd "$rootfs/bin/nc"
		ln -sfn dash "$rootfs/bin/sh"
		printf 'tries = 1\n' >>"$rootfs/etc/wgetrc"
		busybox_links "$rootfs"
		install -m 0755 "$bin/agnhost" "$rootfs/agnhost"
		ln -s agnhost "$rootfs/agnhost-2"
		mkdir -p "$rootfs/uploads"
		local src
		src=$(cd "$repo/bench/tools" && GOWORK=off GOFLAGS=-mod=mod go list -m -f '{{.Dir}}' k8s.io/kubernetes)
		install -m 0644 "$src/test/images/agnhost/porter/localhost.crt" "$src/test/images/agnhost/porter/localhost.key" "$rootfs/"
		printf 'user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n' >>"$rootfs/etc/passwd"
		printf 'user-defined-in-image:x:1000:\ngroup-defined-in-image:x:50000:user-defined-in-image\n' >>"$rootfs/etc/group"
		oci_pack "$rootfs" "$tar.new" '"Entrypoint":["/agnhost"],"Cmd":["pause"],"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]' \
			registry.k8s.io/e2e-test-images/agnhost:2.66.1 registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1
		;;
	netpol)
		stale "$tar" "$bin/kube-network-policies" "$0" "$repo/deploy/image/oci.sh" || { echo "images.sh: $tar is up to date"; rm -rf "$work"; return; }
		base "$rootfs"
		install -m 0755 "$bin/kube-network-policies" "$rootfs/bin/netpol"
		oci_pack "$rootfs" "$tar.new" '"Entrypoint":["/bin/netpol"]' registry.k8s.io/networking/kube-network-policies:v0.8.0
		;;
	uproxy)
		stale "$tar" "$bin/uproxy-static" "$repo"/deploy/image/* || { echo "images.sh: $tar is up to date"; rm -rf "$work"; return; }
		bash "$repo/deploy/image/build.sh" "$bin/uproxy-static" "$tar.new" "${UPROXY_IMAGE:-uproxy:latest}"
		;;
	*)
		echo "images.sh: no image named $image" >&2
		rm -rf "$work"
		return 2
		;;
	esac
	mv -f "$tar.new" "$tar"
	rm -rf "$work"
}

for image in "$@"; do
	build "$image"
done
