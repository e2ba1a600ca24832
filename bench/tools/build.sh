#!/usr/bin/env bash
# build.sh builds the Kubernetes binaries that uproxy's tests and benchmarks
# run against (kube-apiserver, kube-proxy and kubectl, at the version pinned in
# this directory's go.mod) into a cache folder, by default bench/.cache/bin.
#
#	bench/tools/build.sh [outdir]
#
# Each binary that already exists and is newer than go.mod and go.sum is
# kept, so a repeated run is instant. The first build takes several minutes.
set -euo pipefail

tools=$(cd "$(dirname "$0")" && pwd)
out=${1:-"$tools/../.cache/bin"}
shift || true
cmds=("$@")
[[ ${#cmds[@]} -gt 0 ]] || cmds=(kube-apiserver kube-proxy kubectl)
mkdir -p "$out"
out=$(cd "$out" && pwd)

# One build at a time: test packages run in parallel, and may all ask.
exec 9>"$out/.build.lock"
flock 9

cd "$tools"
export GOWORK=off # this module alone, whatever go.work may say
version=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
major=${version#v}
major=${major%%.*}
minor=${version#v*.}
minor=${minor%%.*}

# Stamp the release version, as Kubernetes' own build does: the apiserver
# reports it, and derives its compatibility version from it; kubectl's
# version skew check compares it with the server's.
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
	ldflags+=" -X $pkg.gitTreeState=clean"
done

for cmd in "${cmds[@]}"; do
	bin="$out/$cmd"
	if [[ -x "$bin" && "$bin" -nt go.mod && "$bin" -nt go.sum ]]; then
		echo "build.sh: $bin is up to date ($version)"
		continue
	fi
	echo "build.sh: building $cmd $version into $bin (this takes minutes the first time)"
	start=$SECONDS
	CGO_ENABLED=0 go build -trimpath -ldflags="$ldflags" -o "$bin.tmp" "k8s.io/kubernetes/cmd/$cmd"
	mv -f "$bin.tmp" "$bin"
	echo "build.sh: built $bin in $((SECONDS - start))s ($(du -h "$bin" | cut -f1))"
done
