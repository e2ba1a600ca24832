# oci.sh: functions that build a container image without a container
# engine, sourced by build.sh (uproxy's image) and cluster/images.sh (the
# dev cluster's images). The root filesystem is Debian packages unpacked
# with dpkg -x, plus whatever the caller lays out; the image is one
# reproducible layer in an OCI image layout, packed in a tar file that
# `ctr images import`, `docker load` and `podman load` read.

# oci_require: fails unless the tools these functions run are installed.
oci_require() {
	local tool
	for tool in apt-get apt-cache dpkg-deb tar gzip sha256sum; do
		command -v "$tool" >/dev/null || {
			echo "oci.sh: $tool is missing (a Debian host is needed)" >&2
			return 1
		}
	done
}

# oci_debs ROOTFS PACKAGE...: unpacks the packages and everything they
# depend on (alternatives' first choice, virtual packages resolved by apt,
# no recommendations) into ROOTFS. Maintainer scripts do not run.
oci_debs() {
	local rootfs=$1
	shift
	local debs closure deb
	debs=$(mktemp -d "${TMPDIR:-/tmp}/oci-debs.XXXXXX")
	mapfile -t closure < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
		--no-breaks --no-replaces --no-enhances "$@" | grep -v '^[ <]' | sort -u)
	if [[ ${#closure[@]} -eq 0 ]]; then
		echo "oci.sh: apt-cache found none of $* (run apt-get update?)" >&2
		rm -rf "$debs"
		return 1
	fi
	echo "oci.sh: ${#closure[@]} Debian packages: ${closure[*]}"
	# apt-get download writes into the working directory; as root it warns
	# that its unprivileged user cannot, which is harmless.
	(cd "$debs" && apt-get download -q "${closure[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
	shopt -s nullglob
	local got=("$debs"/*.deb)
	shopt -u nullglob
	if [[ ${#got[@]} -ne ${#closure[@]} ]]; then
		echo "oci.sh: downloaded ${#got[@]} of ${#closure[@]} packages" >&2
		rm -rf "$debs"
		return 1
	fi
	mkdir -p "$rootfs"
	for deb in "${got[@]}"; do
		dpkg-deb -x "$deb" "$rootfs"
	done
	rm -rf "$debs" "$rootfs/usr/share/doc" "$rootfs/usr/share/man" "$rootfs/usr/share/info" "$rootfs/usr/share/locale"
}

# oci_full_name NAME: the name containerd gives an image that a kubelet
# asks for as NAME ("uproxy:latest" is docker.io/library/uproxy:latest).
oci_full_name() {
	local name=$1 last=${1##*/}
	[[ $last == *:* ]] || name=$name:latest
	if [[ $name != */* ]]; then
		name=docker.io/library/$name
	elif [[ ${name%%/*} != *.* && ${name%%/*} != *:* && ${name%%/*} != localhost ]]; then
		name=docker.io/$name
	fi
	echo "$name"
}

# oci_pack ROOTFS OUT CONFIG NAME...: packs ROOTFS as the one layer of an
# image whose config section (Entrypoint, Cmd, Env, as JSON members
# without the braces) is CONFIG, named NAME..., into the tar file OUT.
oci_pack() {
	local rootfs=$1 out=$2 config=$3
	shift 3
	local work layout
	work=$(mktemp -d "${TMPDIR:-/tmp}/oci-pack.XXXXXX")
	layout=$work/layout
	mkdir -p "$layout/blobs/sha256"

	# blob FILE MEDIATYPE: moves FILE into the layout's blobs and prints
	# its descriptor.
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
	local diffid layer arch cfg manifest
	diffid=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
	gzip -n -9 "$work/layer.tar"
	layer=$(blob "$work/layer.tar.gz" application/vnd.oci.image.layer.v1.tar+gzip)

	arch=$(dpkg --print-architecture)
	case $arch in
	i386) arch=386 ;;
	armhf) arch=arm ;;
	esac
	printf '{"architecture":"%s","os":"linux","config":{%s},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
		"$arch" "$config" "$diffid" >"$work/config.json"
	cfg=$(blob "$work/config.json" application/vnd.oci.image.config.v1+json)
	printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":%s,"layers":[%s]}' \
		"$cfg" "$layer" >"$work/manifest.json"
	manifest=$(blob "$work/manifest.json" application/vnd.oci.image.manifest.v1+json)

	# containerd names each image after io.containerd.image.name; docker
	# load reads manifest.json's RepoTags.
	local entries="" tags="" name full tag
	for name in "$@"; do
		full=$(oci_full_name "$name")
		tag=${full##*:}
		entries+=${entries:+,}${manifest%\}}',"annotations":{"io.containerd.image.name":"'$full'","org.opencontainers.image.ref.name":"'$tag'"}}'
		[[ ${name##*/} == *:* ]] || name=$name:latest
		tags+=${tags:+,}'"'$name'"'
	done
	printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[%s]}' \
		"$entries" >"$layout/index.json"
	printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
	local config_digest=${cfg#*sha256:} layer_digest=${layer#*sha256:}
	printf '[{"Config":"blobs/sha256/%s","RepoTags":[%s],"Layers":["blobs/sha256/%s"]}]' \
		"${config_digest%%\"*}" "$tags" "${layer_digest%%\"*}" >"$layout/manifest.json"

	mkdir -p "$(dirname "$out")"
	tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$layout" -cf "$out.tmp" .
	mv -f "$out.tmp" "$out"
	rm -rf "$work"
	echo "oci.sh: wrote $out ($*, $(du -h "$out" | cut -f1))"
}
