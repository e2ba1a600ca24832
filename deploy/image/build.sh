#!/usr/bin/env bash
# build.sh UPROXY OUT [NAME]: builds uproxy's container image without a
# container engine, as an OCI image layout packed in the tar file OUT, from
# the static binary UPROXY and Debian's packages. NAME (default
# uproxy:latest) is the image's name for the importing tool.
#
#	make image                                  # bin/uproxy-image.tar
#	ctr -n k8s.io images import bin/uproxy-image.tar   # containerd, for the kubelet
#	docker load -i bin/uproxy-image.tar                # or podman load
#
# The root filesystem is iptables, ipset, nftables (nft, for `uproxy cleanup
# --kube-proxy`), dash and grep with their
# dependencies, downloaded with apt-get download from the host's Debian
# sources (the same release as deploy/Dockerfile's base when the host runs
# it) and unpacked with dpkg -x (oci.sh), then install.sh's layout.
# Maintainer scripts do not run: nothing needs them, since the iptables
# commands are install.sh's wrappers, not Debian's alternatives. Runs as any
# user with apt-get, dpkg-deb, tar, gzip and sha256sum; the files in the
# image are root's whoever builds it.
set -euo pipefail

if [[ $# -lt 2 || $# -gt 3 ]]; then
	echo "usage: $0 UPROXY OUT [NAME]" >&2
	exit 2
fi
uproxy=$(realpath "$1")
out=$(realpath -m "$2")
name=${3:-uproxy:latest}
here=$(cd "$(dirname "$0")" && pwd)
packages=(iptables ipset nftables dash grep)

# shellcheck source=oci.sh
. "$here/oci.sh"
oci_require
if file "$uproxy" 2>/dev/null | grep -q 'dynamically linked'; then
	echo "build.sh: $uproxy is dynamically linked; build it with CGO_ENABLED=0" >&2
	exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/uproxy-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
oci_debs "$rootfs" "${packages[@]}"
sh "$here/install.sh" "$rootfs" "$uproxy"
oci_pack "$rootfs" "$out" '"Entrypoint":["/usr/local/bin/uproxy-entrypoint"],"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]' "$name"
