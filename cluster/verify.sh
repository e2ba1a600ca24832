#!/usr/bin/env bash
# verify.sh: the checks that need a real kubelet, against the running dev
# cluster with uproxy (make cluster-verify; docs/dev-cluster.md):
#
#   rollout   uproxy's DaemonSet is rolled to a new image by the kubelet
#             while a client pod sends requests to a ClusterIP without
#             pause: no request may fail;
#   endpoints a deleted backend pod gets no new request once it is
#             terminating, well before its grace period ends; a new pod is
#             served within a second of becoming Ready;
#   dns       CoreDNS answers pods through uproxy over UDP and TCP, for A
#             and AAAA;
#   netpol    under kube-network-policies (cluster.sh netpol, which it
#             runs), a backend isolated by a NetworkPolicy that admits only
#             role=client is reached through its ClusterIP and its DNS
#             names by a role=client pod, which it sees with the pod's own
#             address, and by no role=other pod on the same node.
#
#	cluster/verify.sh [rollout|endpoints|dns|netpol ...]   (default: all four)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
state=${CLUSTER_STATE:-/var/lib/uproxy-cluster}
cache=$(realpath -m "${CLUSTER_CACHE:-$repo/bench/.cache}")
netns=${CLUSTER_NETNS:-}
[[ -f $state/netns ]] && netns=$(<"$state/netns")
agnhost=registry.k8s.io/e2e-test-images/agnhost:2.66.1
ns=uproxy-verify

say() { echo "verify: $*" >&2; }
die() {
	say "$*"
	exit 1
}
onnode() {
	if [[ -n $netns ]]; then nsenter --net="/run/netns/$netns" -- "$@"; else "$@"; fi
}
kubectl() { onnode "$cache/bin/kubectl" --kubeconfig "$state/pki/admin.kubeconfig" "$@"; }

[[ -f $state/up ]] || die "no cluster runs at $state: make cluster first"
read -r proxy _ <"$state/proxy"
[[ $proxy == uproxy ]] || die "the cluster's proxy is $proxy, not uproxy"

# setup: a namespace with a 3-pod web Deployment behind the Service web, and
# a client pod.
setup() {
	kubectl wait --for=delete "namespace/$ns" --timeout=180s >/dev/null 2>&1 || true
	kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
	kubectl -n "$ns" apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  replicas: 3
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      terminationGracePeriodSeconds: 30
      containers:
      - name: web
        image: $agnhost
        args: [netexec, --http-port=8080]
        readinessProbe:
          httpGet: {path: /healthz, port: 8080}
          periodSeconds: 1
        lifecycle:
          # Keeps a deleted pod serving through its grace period, as an
          # application that drains would: only the proxy can keep new
          # requests away from it.
          preStop: {exec: {command: [sleep, "25"]}}
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  selector: {app: web}
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Pod
metadata: {name: client}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: client
    image: $agnhost
    command: [sh, -c, "touch /tmp/ready; sleep 86400"]
EOF
	kubectl -n "$ns" rollout status deploy/web --timeout=120s >/dev/null
	kubectl -n "$ns" wait --for=condition=Ready pod/client --timeout=120s >/dev/null
}

# hostnames N: the pods that answer N requests to web, one per line.
hostnames() {
	kubectl -n "$ns" exec client -- sh -c "for i in \$(seq $1); do curl -s -m 2 http://web/hostname; echo; done"
}

rollout() {
	say "rollout: requests to web from the client pod while the kubelet rolls uproxy to a new image"
	local sock=$state/containerd/containerd.sock tag before
	tag=uproxy:rollout-$(date +%s)
	ctr -a "$sock" -n k8s.io images tag docker.io/library/uproxy:latest "docker.io/library/$tag" >/dev/null
	# A client pod sends one request after the other, each with a 2-second
	# limit, until /tmp/stop exists, then says how many it sent and how
	# many failed.
	kubectl -n "$ns" delete pod roller --ignore-not-found --wait=true >/dev/null
	kubectl -n "$ns" run roller --restart=Never --image="$agnhost" --command -- sh -c '
		ok=0; fail=0; codes=""
		while [ ! -e /tmp/stop ]; do
			curl -sf -m 2 -o /dev/null http://web/hostname
			rc=$?
			if [ $rc -eq 0 ]; then ok=$((ok+1)); else fail=$((fail+1)); codes="$codes $rc@$(date +%T.%N | cut -c1-12)"; fi
		done
		echo "sent=$((ok+fail)) failed=$fail"
		echo "curl exit codes of the failures:$codes"
		sleep 3600' >/dev/null
	kubectl -n "$ns" wait --for=condition=Ready pod/roller --timeout=60s >/dev/null
	sleep 2 # a baseline of requests before the rollout starts
	before=$(kubectl -n kube-system get pods -l app.kubernetes.io/name=uproxy -o jsonpath='{.items[*].metadata.name}')
	kubectl -n kube-system set image ds/uproxy "uproxy=$tag" >/dev/null
	kubectl -n kube-system rollout status ds/uproxy --timeout=180s >/dev/null
	sleep 2 # and after it
	kubectl -n "$ns" exec roller -- touch /tmp/stop
	local result="" deadline=$((SECONDS + 10))
	until result=$(kubectl -n "$ns" logs roller 2>/dev/null | grep '^sent='); do
		((SECONDS < deadline)) || die "rollout: the client did not report"
		sleep 0.2
	done
	local after
	after=$(kubectl -n kube-system get pods -l app.kubernetes.io/name=uproxy -o jsonpath='{.items[*].metadata.name}')
	[[ $after != "$before" ]] || die "rollout: the uproxy pod was not replaced ($before)"
	say "rollout: uproxy pod $before -> $after (image $tag); $result"
	[[ $result == *" failed=0" ]] || kubectl -n "$ns" logs roller | grep "^curl exit codes" >&2
	[[ $result == *" failed=0" ]] || die "rollout: requests failed during the rollout"
	# Back to uproxy:latest, as make cluster deployed it.
	kubectl -n kube-system set image ds/uproxy uproxy=uproxy:latest >/dev/null
	kubectl -n kube-system rollout status ds/uproxy --timeout=180s >/dev/null
	ctr -a "$sock" -n k8s.io images rm "docker.io/library/$tag" >/dev/null
}

endpoints() {
	local victim answered
	victim=$(kubectl -n "$ns" get pods -l app=web -o jsonpath='{.items[0].metadata.name}')
	say "endpoints: deleting $victim (grace period 30s, its preStop keeps it serving 25s)"
	kubectl -n "$ns" delete pod "$victim" --wait=false >/dev/null
	# Once the API server marks the pod terminating, its endpoint is no
	# longer ready; uproxy must stop choosing it.
	local start=$SECONDS deadline=$((SECONDS + 20))
	while :; do
		answered=$(hostnames 20)
		grep -qx "$victim" <<<"$answered" || break
		((SECONDS < deadline)) || die "endpoints: $victim still answers 20s after its deletion"
	done
	say "endpoints: $victim answered none of 20 requests $((SECONDS - start))s after its deletion, within its grace period; answers came from: $(sort -u <<<"$answered" | tr '\n' ' ')"

	# A new pod: the time from its Ready condition to the first request
	# it answers.
	kubectl -n "$ns" scale deploy/web --replicas=4 >/dev/null
	local new="" ready_at served_at
	deadline=$((SECONDS + 120))
	until [[ -n $new ]]; do
		new=$(kubectl -n "$ns" get pods -l app=web --field-selector=status.phase=Running \
			-o jsonpath='{range .items[*]}{.metadata.name} {.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' |
			grep -v "^$victim " | awk '$2 == "True" {print $1}' | while read -r p; do
				grep -qx "$p" <<<"$answered" || echo "$p"
			done | awk 'NR == 1')
		((SECONDS < deadline)) || die "endpoints: no new pod became Ready"
		[[ -n $new ]] || sleep 0.1
	done
	ready_at=$(date +%s.%N)
	# Not hostnames | grep -q: grep's early exit would kill the pipeline's
	# writer and, under pipefail, fail the test that just matched.
	while ! grep -qx "$new" <<<"$(hostnames 10)"; do
		((SECONDS < deadline)) || die "endpoints: $new is Ready but answers no request"
	done
	served_at=$(date +%s.%N)
	local took
	took=$(awk -v a="$ready_at" -v b="$served_at" 'BEGIN { printf "%.2f", b - a }')
	say "endpoints: the new pod $new answered ${took}s after it was seen Ready (within a burst of 10 requests)"
	awk -v t="$took" 'BEGIN { exit !(t <= 1.0) }' || die "endpoints: the new pod took ${took}s to be served, more than a second"
	kubectl -n "$ns" scale deploy/web --replicas=3 >/dev/null
}

dns() {
	local out
	out=$(kubectl -n "$ns" exec client -- sh -c '
for proto in notcp tcp; do
	for type in A AAAA; do
		status=$(dig +$proto kubernetes.default.svc.cluster.local $type | sed -n "s/.*status: \([A-Z]*\).*/\1/p")
		answer=$(dig +short +$proto kubernetes.default.svc.cluster.local $type | tr "\n" " ")
		echo "$proto $type $status [$answer]"
	done
done')
	say "dns: through the kube-dns Service (uproxy), from a pod:"
	sed 's/^notcp/  UDP/; s/^tcp/  TCP/' <<<"$out" >&2
	grep -q "^notcp A NOERROR \[10.96.0.1 \]" <<<"$out" && grep -q "^tcp A NOERROR \[10.96.0.1 \]" <<<"$out" ||
		die "dns: no A answer over UDP and TCP"
	# The cluster is IPv4 only: NOERROR with no address is the right AAAA
	# answer for a name that exists.
	grep -q "^notcp AAAA NOERROR \[\]" <<<"$out" && grep -q "^tcp AAAA NOERROR \[\]" <<<"$out" ||
		die "dns: no AAAA answer (NOERROR, empty) over UDP and TCP"
}

netpol() {
	"$here/cluster.sh" netpol
	kubectl -n "$ns" apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: isolated, labels: {app: isolated}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: web
    image: $agnhost
    args: [netexec, --http-port=8080]
    readinessProbe:
      httpGet: {path: /healthz, port: 8080}
      periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata: {name: isolated}
spec:
  selector: {app: isolated}
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: isolated}
spec:
  podSelector: {matchLabels: {app: isolated}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {role: client}}}]
---
apiVersion: v1
kind: Pod
metadata: {name: allowed, labels: {role: client}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - {name: c, image: $agnhost, command: [sleep, "86400"]}
---
apiVersion: v1
kind: Pod
metadata: {name: other, labels: {role: other}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - {name: c, image: $agnhost, command: [sleep, "86400"]}
EOF
	kubectl -n "$ns" wait --for=condition=Ready pod/isolated pod/allowed pod/other --timeout=120s >/dev/null
	local vip ip target out rc
	vip=$(kubectl -n "$ns" get svc isolated -o jsonpath='{.spec.clusterIP}')
	ip=$(kubectl -n "$ns" get pod allowed -o jsonpath='{.status.podIP}')
	# The pod is Ready before a proxy's sync (up to --iptables-min-sync-period
	# later, for kube-proxy too) replaces the Service's no-endpoint reject
	# with its endpoint: give the client that long.
	local try
	for try in 1 2 3 4 5; do
		kubectl -n "$ns" exec allowed -- curl -s -m 5 -o /dev/null "http://$vip/clientip" && break
		sleep 1
	done
	for target in "$vip" isolated "isolated.$ns.svc.cluster.local"; do
		# netexec's /clientip answers with the address it sees.
		out=$(kubectl -n "$ns" exec allowed -- curl -s -m 5 "http://$target/clientip") ||
			die "netpol: the role=client pod got no answer from http://$target/"
		[[ ${out%:*} == "$ip" ]] || die "netpol: http://$target/ saw the role=client pod ($ip) as $out"
		say "netpol: role=client ($ip) -> http://$target/: served, seen as ${out%:*}"
		rc=0
		out=$(kubectl -n "$ns" exec other -- curl -s -m 5 "http://$target/clientip") || rc=$?
		[[ $rc != 0 ]] || die "netpol: the role=other pod was served by http://$target/ (seen as $out)"
		say "netpol: role=other -> http://$target/: not served (curl exit $rc)"
	done
	kubectl -n "$ns" delete networkpolicy isolated >/dev/null
}

setup
checks=("$@")
[[ ${#checks[@]} -gt 0 ]] || checks=(dns endpoints rollout netpol)
for c in "${checks[@]}"; do
	case $c in
	rollout | endpoints | dns | netpol) "$c" ;;
	*) die "no check named $c (rollout, endpoints, dns, netpol)" ;;
	esac
done
kubectl delete namespace "$ns" --wait=true --timeout=180s >/dev/null
say "passed: ${checks[*]}"
