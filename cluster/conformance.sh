#!/usr/bin/env bash
# conformance.sh: Kubernetes' own e2e specs against the dev cluster, once
# per service proxy, and docs/conformance.md from the runs.
#
# It brings the cluster up (cluster.sh up) if it is not, builds e2e.test
# (cached), then for each proxy in E2E_PROXIES swaps it in (cluster.sh
# proxy/mode) and runs the specs that E2E_FOCUS selects and E2E_SKIP does
# not, each run's JUnit report kept under CLUSTER_CACHE/conformance. The
# cluster is left running uproxy in the first mode of E2E_MODE.
#
#	E2E_FOCUS    '\[sig-network\] Services.*\[Conformance\]' (the 15 specs)
#	E2E_SKIP     what never runs here, on top of the caller's: specs that
#	             reach the Internet, need a cloud or a feature this kernel
#	             or cluster lacks (see below)
#	E2E_MODE     uproxy's modes to run: redirect, tproxy, or "redirect tproxy"
#	             (the default)
#	E2E_REFERENCE  the kube-proxy modes to run as the reference: "iptables
#	             nftables" (the default), or "" for none
#	E2E_OUT      the table to write (docs/conformance.md)
#	E2E_TIMEOUT  the suite's time limit per run (3h): past it, the specs
#	             not run yet are reported as not run
#	E2E_REUSE    the runs under CLUSTER_CACHE/conformance to keep instead of
#	             running them again: names such as "kube-proxy-iptables
#	             uproxy-redirect", or "kube-proxy" for both kube-proxy runs;
#	             a run is kept only if it had the same focus and skip
#
# The last line is "conformance: P passed, F failed, S skipped", counted over
# uproxy's runs; it exits non-zero when a spec fails with uproxy and passes
# with kube-proxy.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cache=$(realpath -m "${CLUSTER_CACHE:-$repo/bench/.cache}")
state=${CLUSTER_STATE:-/var/lib/uproxy-cluster}
focus=${E2E_FOCUS:-'\[sig-network\] Services.*\[Conformance\]'}
# Never run: specs that send traffic beyond the node (this host has no
# Internet, and must not try), need a cloud provider's load balancer, or
# disrupt the node itself; IPv6 and SCTP need a dual-stack cluster and a
# kernel module that this one lacks.
never='Internet|\[Provider:|\[Feature:Networking-IPv4\]|\[Feature:Networking-DNS\]|\[Feature:LoadBalancer\]|\[Disruptive\]|\[Flaky\]|IPv6|SCTP|\[Feature:IPv6DualStack\]'
skip=${E2E_SKIP:+$E2E_SKIP|}$never
modes=${E2E_MODE:-redirect tproxy}
reference=${E2E_REFERENCE-iptables nftables}
out=${E2E_OUT:-$repo/docs/conformance.md}
runs=$cache/conformance
e2e=$cache/bin/e2e.test

say() { echo "conformance: $*" >&2; }

build_e2e() {
	local tools=$repo/bench/tools
	if [[ -x $e2e && $e2e -nt $tools/go.mod && $e2e -nt $tools/go.sum ]]; then
		return 0
	fi
	say "building e2e.test (about 15 minutes the first time)"
	local version
	version=$(cd "$tools" && GOWORK=off go list -m -f '{{.Version}}' k8s.io/kubernetes)
	local major=${version#v} minor
	minor=${major#*.}
	major=${major%%.*}
	minor=${minor%%.*}
	# The suite refuses a server whose version it cannot compare with its
	# own, so it carries the release's version as the real builds do.
	(cd "$tools" && GOWORK=off CGO_ENABLED=0 go test -c -trimpath -o "$e2e.tmp" \
		-ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitMajor=$major -X k8s.io/component-base/version.gitMinor=$minor" \
		k8s.io/kubernetes/test/e2e)
	mv -f "$e2e.tmp" "$e2e"
}

# reusable NAME: whether E2E_REUSE keeps the run NAME, and it ran the specs
# that this run would.
reusable() {
	local name=$1 dir=$runs/$1 word
	for word in ${E2E_REUSE:-}; do
		if [[ $word == "$name" || ($word == kube-proxy && $name == kube-proxy-*) ]]; then
			[[ -f $dir/junit_01.xml && -f $dir/selection && $(<"$dir/selection") == "$focus"$'\n'"$skip" ]] && return 0
			say "$name: not reusing $dir: it is missing or ran other specs"
			return 1
		fi
	done
	return 1
}

# run_e2e NAME: runs the specs against the cluster's current proxy, into
# runs/NAME, unless E2E_REUSE keeps the run there.
run_e2e() {
	local name=$1 dir=$runs/$1
	if reusable "$name"; then
		say "$name: reusing the run in $dir (E2E_REUSE)"
		return 0
	fi
	rm -rf "$dir"
	mkdir -p "$dir"
	printf '%s\n%s\n' "$focus" "$skip" >"$dir/selection"
	echo "$(date -u +%Y-%m-%d) at commit $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)" >"$dir/when"
	say "$name: running the specs (log: $dir/e2e.log)"
	local start=$SECONDS rc=0
	(cd "$dir" && "$e2e" --kubeconfig "$state/pki/admin.kubeconfig" --provider local \
		--ginkgo.focus "$focus" --ginkgo.skip "$skip" --ginkgo.no-color --ginkgo.timeout "${E2E_TIMEOUT:-3h}" \
		--report-dir "$dir" >"$dir/e2e.log" 2>&1) || rc=$?
	echo $((SECONDS - start)) >"$dir/seconds"
	say "$name: $(grep -E '^(SUCCESS|FAIL)!' "$dir/e2e.log" | tail -1 || echo "exit status $rc") in $((SECONDS - start))s"
}

cd "$repo"
[[ $(id -u) -eq 0 ]] || { say "must run as root"; exit 1; }
build_e2e
"$here/cluster.sh" up

columns=()
counted=()
for m in $reference; do
	reusable "kube-proxy-$m" || "$here/cluster.sh" proxy "kube-proxy-$m"
	run_e2e "kube-proxy-$m"
	columns+=("kube-proxy $m=$runs/kube-proxy-$m/junit_01.xml")
done
for m in $modes; do
	reusable "uproxy-$m" || UPROXY_MODE=$m "$here/cluster.sh" mode "$m"
	run_e2e "uproxy-$m"
	columns+=("uproxy $m=$runs/uproxy-$m/junit_01.xml")
	counted+=("uproxy $m")
done
first=${modes%% *}
UPROXY_MODE=$first "$here/cluster.sh" mode "$first" >/dev/null

header=$(mktemp)
trap 'rm -f "$header"' EXIT
{
	sed -n '/^<!-- header -->$/,/^<!-- table -->$/p' "$here/conformance.md.in" | sed '1d;$d'
	echo
	echo "Written on $(date -u +%Y-%m-%d) at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)," \
		"Kubernetes $(cd bench/tools && GOWORK=off go list -m -f '{{.Version}}' k8s.io/kubernetes), on one node" \
		"($(nproc) CPUs, kernel $(uname -r))."
	echo
	echo "- focus: \`$focus\`"
	echo "- skip: \`$skip\`"
	for c in "${columns[@]}"; do
		n=${c%%=*}
		d=$(dirname "${c#*=}")
		when=
		[[ -f $d/when ]] && when=" (run on $(<"$d/when"))"
		echo "- $n$when: $(grep -E '^Ran [0-9]+ of' "$d/e2e.log" | tail -1 || echo "no run") $(grep -E '^(SUCCESS|FAIL)!' "$d/e2e.log" | tail -1 || true)"
	done
	echo
	sed -n '/^<!-- table -->$/,$p' "$here/conformance.md.in" | sed '1d'
	echo
} >"$header"
count=$(IFS=,; echo "${counted[*]}")
go run ./cluster/e2ereport -focus "$focus" -skip "$skip" -count "$count" \
	-reasons "$here/conformance-reasons.tsv" -header "$header" -out "$out" "${columns[@]}"
