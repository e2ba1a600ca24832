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
# it) and unpacked with dpkg -x, then install.sh's layout. Maintainer
# scripts do not run: nothing needs them, since the iptables commands are
# install.sh's wrappers, not Debian's alternatives. Runs as any user with
# apt-get, dpkg-deb, tar, gzip and sha256sum; the files in the image are
# root's whoever builds it.
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

for tool in apt-get apt-cache dpkg-deb tar gzip sha256sum; do
	command -v "$tool" >/dev/null || {
		echo "build.sh: $tool is missing (a Debian host is needed)" >&2
		exit 1
	}
done
if file "$uproxy" 2>/dev/null | grep -q 'dynamically linked'; then
	echo "build.sh: $uproxy is dynamically linked; build it with CGO_ENABLED=0" >&2
	exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/uproxy-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
layout=$work/layout
mkdir -p "$rootfs" "$layout/blobs/sha256" "$work/debs"

# The packages and everything they depend on (alternatives' first choice,
# virtual packages resolved by apt), without recommendations.
mapfile -t closure < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
	--no-breaks --no-replaces --no-enhances "${packages[@]}" | grep -v '^[ <]' | sort -u)
echo "build.sh: ${#closure[@]} Debian packages: ${closure[*]}"
# apt-get download writes into the working directory; as root it warns
# that its unprivileged user cannot, which is harmless.
(cd "$work/debs" && apt-get download -q "${closure[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
shopt -s nullglob
debs=("$work"/debs/*.deb)
if [[ ${#debs[@]} -ne ${#closure[@]} ]]; then
	echo "build.sh: downloaded ${#debs[@]} of ${#closure[@]} packages" >&2
	exit 1
fi
for deb in "${debs[@]}"; do
	dpkg-deb -x "$deb" "$rootfs"
done
rm -rf "$rootfs/usr/share/doc" "$rootfs/usr/share/man" "$rootfs/usr/share/info" "$rootfs/usr/share/locale"
sh "$here/install.sh" "$rootfs" "$uproxy"

# blob FILE MEDIATYPE: moves FILE into the layout's blobs and prints its
# descriptor.
blob() {
	local sum size
	sum=$(sha256sum "$1" | cut -d' ' -f1)
	size=$(stat -c %s "$1")
	mv "$1" "$layout/blobs/sha256/$sum"
	printf '{"mediaType":"%s","digest":"sha256:%s","size":%d}' "$2" "$sum" "$size"
}

# One layer, reproducible: sorted names, root's files, a fixed time.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 --format=gnu \
	-C "$rootfs" -cf "$work/layer.tar" .
diffid=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
gzip -n -9 "$work/layer.tar"
layer=$(blob "$work/layer.tar.gz" application/vnd.oci.image.layer.v1.tar+gzip)

arch=$(dpkg --print-architecture)
case $arch in
i386) arch=386 ;;
armhf) arch=arm ;;
esac
cat >"$work/config.json" <<JSON
{"architecture":"$arch","os":"linux","config":{"Entrypoint":["/usr/local/bin/uproxy-entrypoint"],"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},"rootfs":{"type":"layers","diff_ids":["sha256:$diffid"]}}
JSON
config=$(blob "$work/config.json" application/vnd.oci.image.config.v1+json)
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":%s,"layers":[%s]}' \
	"$config" "$layer" >"$work/manifest.json"
manifest=$(blob "$work/manifest.json" application/vnd.oci.image.manifest.v1+json)

# containerd names the image after io.containerd.image.name, and a kubelet
# looks "uproxy:latest" up as docker.io/library/uproxy:latest.
last=${name##*/}
[[ $last == *:* ]] || name=$name:latest
tag=${name##*:}
full=$name
if [[ $name != */* ]]; then
	full=docker.io/library/$name
elif [[ ${name%%/*} != *.* && ${name%%/*} != *:* && ${name%%/*} != localhost ]]; then
	full=docker.io/$name
fi
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[%s]}' \
	"${manifest%\}},\"annotations\":{\"io.containerd.image.name\":\"$full\",\"org.opencontainers.image.ref.name\":\"$tag\"}}" \
	>"$layout/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
# docker load reads manifest.json.
config_digest=${config#*sha256:}
layer_digest=${layer#*sha256:}
printf '[{"Config":"blobs/sha256/%s","RepoTags":["%s"],"Layers":["blobs/sha256/%s"]}]' \
	"${config_digest%%\"*}" "$name" "${layer_digest%%\"*}" >"$layout/manifest.json"

mkdir -p "$(dirname "$out")"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$layout" -cf "$out.tmp" .
mv -f "$out.tmp" "$out"
echo "build.sh: wrote $out ($name, $(du -h "$out" | cut -f1))"
