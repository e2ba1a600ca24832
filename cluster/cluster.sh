#!/usr/bin/env bash
# cluster.sh: a one-node Kubernetes with uproxy in place of kube-proxy, on a
# bare Linux host, no Docker (docs/dev-cluster.md).
#
#	cluster.sh build     the binaries and images, cached under CLUSTER_CACHE
#	cluster.sh up        start it, or nothing if it runs; waits until a pod
#	                     resolves kubernetes.default and reaches it
#	cluster.sh down      stop it and undo every change it made to the host
#	cluster.sh status    what runs, and where the kubeconfig is
#	cluster.sh check     the smoke check of `up` again
#	cluster.sh reload    after build: import changed images, restart uproxy
#	cluster.sh mode M    switch uproxy to --mode M (redirect or tproxy)
#	cluster.sh proxy P   swap the service proxy: uproxy, or kube-proxy-iptables
#	                     or kube-proxy-nftables (the reference)
#	cluster.sh netpol    run kube-network-policies, SIG Network's
#	                     NetworkPolicy implementation (its nftables table
#	                     goes with down)
#
# The environment sets it up (zero or empty: the default):
#	CLUSTER_STATE   every file it writes: PKI, kubeconfigs, data, logs
#	                (/var/lib/uproxy-cluster)
#	CLUSTER_CACHE   the builds (the repository's bench/.cache)
#	CLUSTER_NETNS   run the whole node in this network namespace, created
#	                and deleted here, instead of the host's (the tests do)
#	CLUSTER_PROXY   uproxy (default), kube-proxy-iptables, kube-proxy-nftables
#	UPROXY_MODE     uproxy's --mode: redirect (default) or tproxy
#
# What `up` changes on the host, and `down` undoes (in CLUSTER_NETNS only
# the namespace's own network, which down deletes): the cni0 bridge with the
# node's address 10.244.0.1/24 and the pod veths, the pod and service
# routes through it, uproxy's (or kube-proxy's) rules and sets, the
# kubelet's KUBE-IPTABLES-HINT and KUBE-KUBELET-CANARY chains, the sysctls
# listed in SYSCTLS (ip_forward among them), mounts under CLUSTER_STATE,
# pod cgroups under /sys/fs/cgroup/*/uproxy-cluster*, and the directories
# /run/containerd and /var/log/containers when they were not there.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
state=${CLUSTER_STATE:-/var/lib/uproxy-cluster}
cache=$(realpath -m "${CLUSTER_CACHE:-$repo/bench/.cache}")
bin=$cache/bin
netns=${CLUSTER_NETNS:-}
proxy=${CLUSTER_PROXY:-uproxy}
mode=${UPROXY_MODE:-redirect}

node=${CLUSTER_NODE_NAME:-uproxy-dev}
node_ip=10.244.0.1
pod_cidr=10.244.0.0/24
cluster_cidr=10.244.0.0/16
service_cidr=10.96.0.0/16
# The external IP that the e2e specs give a Service, fenced like the
# Service range. Only that address: a host may use the rest of its
# documentation range for real services.
spec_external_ip=203.0.113.250/32
# uproxy's tproxy routing mark (its default): see the fence in up.
uproxy_tproxy_mark=0x200000/0x200000
kubernetes_ip=10.96.0.1
dns_ip=10.96.0.10
cgroup_root=/uproxy-cluster${netns:+-$netns}
version=v1.37.2
# SIG Network's NetworkPolicy implementation (cluster.sh netpol).
netpol_version=v0.8.0

# The sysctls that the kubelet (its kernel defaults), the CNI bridge plugin
# (ip_forward), kube-proxy and uproxy may change: saved by up, restored by
# down.
SYSCTLS=(
	net.ipv4.ip_forward net.ipv6.conf.all.forwarding net.ipv4.conf.all.route_localnet
	net.ipv4.ip_local_reserved_ports net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables
	vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
	kernel.keys.root_maxkeys kernel.keys.root_maxbytes
	net.netfilter.nf_conntrack_max net.netfilter.nf_conntrack_tcp_timeout_established
	net.netfilter.nf_conntrack_tcp_timeout_close_wait
)
# Directories that the kubelet and containerd create at fixed paths.
FIXED_DIRS=(/run/containerd /var/log/containers)

say() { echo "cluster: $*" >&2; }
die() {
	say "$*"
	exit 1
}

# onnode CMD...: runs CMD in the node's network namespace.
onnode() {
	if [[ -n $netns ]]; then
		nsenter --net="/run/netns/$netns" -- "$@"
	else
		"$@"
	fi
}

kubectl() { onnode "$bin/kubectl" --kubeconfig "$state/pki/admin.kubeconfig" "$@"; }

# running NAME: whether the component NAME that up started still runs.
running() {
	local pidfile=$state/run/$1.pid pid
	[[ -f $pidfile ]] || return 1
	pid=$(<"$pidfile")
	[[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$(<"$state/run/$1.cmd")"
}

# start NAME CMD...: starts CMD in the node's network namespace, detached,
# logging to CLUSTER_STATE/log/NAME.log, unless it runs already.
start() {
	local name=$1
	shift
	running "$name" && return 0
	mkdir -p "$state/run" "$state/log"
	echo "$1" >"$state/run/$name.cmd"
	if [[ -n $netns ]]; then
		setsid nsenter --net="/run/netns/$netns" -- "$@" >>"$state/log/$name.log" 2>&1 </dev/null &
	else
		setsid "$@" >>"$state/log/$name.log" 2>&1 </dev/null &
	fi
	echo $! >"$state/run/$name.pid"
	say "started $name (pid $!, log $state/log/$name.log)"
}

# stop NAME: stops the component NAME, if it runs: SIGTERM, then SIGKILL
# after 20 seconds.
stop() {
	local name=$1 pid i
	running "$name" || {
		rm -f "$state/run/$name.pid"
		return 0
	}
	pid=$(<"$state/run/$name.pid")
	kill -TERM "$pid" 2>/dev/null || true
	for ((i = 0; i < 200; i++)); do
		[[ -d /proc/$pid ]] || break
		sleep 0.1
	done
	kill -KILL "$pid" 2>/dev/null || true
	rm -f "$state/run/$name.pid"
	say "stopped $name"
}

# wait_for WHAT SECONDS CMD...: runs CMD until it succeeds, for at most
# SECONDS.
wait_for() {
	local what=$1 limit=$2 deadline=$((SECONDS + $2))
	shift 2
	until "$@" >/dev/null 2>&1; do
		((SECONDS < deadline)) || die "timed out after ${limit}s waiting for $what"
		sleep 0.5
	done
}

require() {
	[[ $(id -u) -eq 0 ]] || die "must run as root: it starts a kubelet and changes the node's network"
	local b
	for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl coredns pause agnhost uproxy; do
		[[ -x $bin/$b ]] || die "$bin/$b is missing: run make cluster-build (or cluster.sh build) first"
	done
}

build() {
	mkdir -p "$bin"
	"$repo/bench/tools/build.sh" "$bin" kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy
	(
		cd "$repo/bench/tools"
		export GOWORK=off CGO_ENABLED=0
		if [[ ! -x $bin/agnhost || go.mod -nt $bin/agnhost ]]; then
			say "building agnhost"
			go build -trimpath -ldflags "-s -w" -o "$bin/agnhost" k8s.io/kubernetes/test/images/agnhost
		fi
		cd "$here/tools"
		if [[ ! -x $bin/coredns || go.mod -nt $bin/coredns ]]; then
			say "building coredns"
			go build -trimpath -ldflags "-s -w" -o "$bin/coredns" github.com/coredns/coredns
		fi
		# Built from its own module and go.mod, whose Kubernetes libraries
		# are older than ours, with the queue statement that this kernel
		# may lack replaced (kube-network-policies-xt-queue.patch says why).
		local stamp
		stamp="$netpol_version $(sha256sum <"$here/kube-network-policies-xt-queue.patch" | cut -c1-16)"
		if [[ ! -x $bin/kube-network-policies || $(cat "$bin/kube-network-policies.version" 2>/dev/null) != "$stamp" ]]; then
			say "building kube-network-policies $netpol_version"
			local src work
			src=$(cd / && GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/kube-network-policies@$netpol_version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
			[[ -d $src ]] || die "cannot download sigs.k8s.io/kube-network-policies@$netpol_version"
			work=$(mktemp -d "${TMPDIR:-/tmp}/cluster-netpol.XXXXXX")
			cp -r "$src/." "$work"
			chmod -R u+w "$work"
			patch -s -d "$work" -p1 <"$here/kube-network-policies-xt-queue.patch"
			(cd "$work" && GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$bin/kube-network-policies" ./cmd)
			rm -rf "$work"
			echo "$stamp" >"$bin/kube-network-policies.version"
		fi
	)
	(
		cd "$repo"
		export CGO_ENABLED=0
		go build -trimpath -o "$bin/pause.new" ./cluster/pause
		go build -o "$bin/uproxy.new" ./cmd/uproxy
		go build -trimpath -o "$bin/uproxy-static.new" ./cmd/uproxy
	)
	local b
	for b in pause uproxy uproxy-static; do
		# Replace a binary only when it changed, so the image built from it
		# is rebuilt only then.
		if cmp -s "$bin/$b.new" "$bin/$b"; then rm -f "$bin/$b.new"; else mv -f "$bin/$b.new" "$bin/$b"; fi
	done
	"$here/images.sh" "$cache" pause coredns busybox agnhost uproxy netpol
}

# snapshot DIR: what the node's network and the host look like, in files
# that down compares: rules, links, addresses, routes, sysctls, mounts.
snapshot() {
	local dir=$1 s
	mkdir -p "$dir"
	{ onnode iptables-save 2>/dev/null || true; } | sed '/^#/d; s/\[[0-9]*:[0-9]*\]/[0:0]/' >"$dir/iptables"
	{ onnode ip6tables-save 2>/dev/null || true; } | sed '/^#/d; s/\[[0-9]*:[0-9]*\]/[0:0]/' >"$dir/ip6tables"
	{ onnode nft list ruleset 2>/dev/null || true; } | sed 's/counter packets [0-9]* bytes [0-9]*/counter/' >"$dir/nft"
	onnode ip -o link show | sed 's/^[0-9]*: //' | sort >"$dir/links"
	onnode ip -o addr show | sed 's/^[0-9]*: //; s/valid_lft.*//' | sort >"$dir/addrs"
	{
		onnode ip route show table all
		onnode ip -6 route show table all
		onnode ip rule
		onnode ip -6 rule
	} | sed 's/ expires [0-9]*sec//' | sort >"$dir/routes"
	for s in "${SYSCTLS[@]}"; do
		printf '%s = %s\n' "$s" "$(onnode sysctl -n "$s" 2>/dev/null | tr '\t' ' ' || echo absent)"
	done >"$dir/sysctls"
	# Mounts and paths where the cluster's would be: other software (and
	# other tests' namespaces) may come and go elsewhere meanwhile.
	awk '{print $5}' /proc/self/mountinfo | grep -E "^($state/|/run/containerd|/run/netns/cni-|/var/run/netns/cni-)" | sort >"$dir/mounts" || true
	ls -d /run/netns/cni-* "${FIXED_DIRS[@]}" 2>/dev/null | sort >"$dir/paths" || true
}

pki() {
	local dir=$state/pki
	[[ -f $dir/done ]] && return 0
	mkdir -p "$dir"
	say "writing certificates and kubeconfigs in $dir"
	(
		cd "$dir"
		openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 \
			-subj "/CN=uproxy-dev-ca" 2>/dev/null
		openssl genrsa -out sa.key 2048 2>/dev/null
		openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
		# cert NAME SUBJECT [SANS]: a key and a certificate signed by the CA.
		cert() {
			local ext=extendedKeyUsage=clientAuth
			[[ -n ${3:-} ]] && ext="extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$3"
			openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
			openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
				-out "$1.crt" -extfile <(printf '%s\n' "$ext") 2>/dev/null
			rm -f "$1.csr"
		}
		cert apiserver "/CN=kube-apiserver" \
			"IP:$node_ip,IP:$kubernetes_ip,IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
		cert kubelet "/CN=$node" "IP:$node_ip,DNS:$node"
		cert admin "/O=system:masters/CN=uproxy-dev-admin"
		cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
		cert node "/O=system:nodes/CN=system:node:$node"
		cert controller-manager "/CN=system:kube-controller-manager"
		cert scheduler "/CN=system:kube-scheduler"
		cert kube-proxy "/CN=system:kube-proxy"
		# kubeconfig NAME: a kubeconfig for the client certificate NAME.
		kubeconfig() {
			cat >"$1.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: uproxy-dev
  cluster:
    certificate-authority: $dir/ca.crt
    server: https://$node_ip:6443
users:
- name: $1
  user:
    client-certificate: $dir/$1.crt
    client-key: $dir/$1.key
contexts:
- name: uproxy-dev
  context: {cluster: uproxy-dev, user: $1}
current-context: uproxy-dev
KC
		}
		for k in admin node controller-manager scheduler kube-proxy; do
			kubeconfig "$k"
		done
	)
	touch "$dir/done"
}

configs() {
	# Without CAP_SYS_RESOURCE (in a container, or a sandbox that withholds
	# it) no process may lower its OOM score, and runc fails to start a
	# sandbox whose score the kubelet set below containerd's.
	local restrict_oom=false
	sh -c 'echo -1 >/proc/self/oom_score_adj' 2>/dev/null || restrict_oom=true
	mkdir -p "$state/containerd" "$state/cni/net.d" "$state/kubelet" "$state/etc"
	cat >"$state/containerd/config.toml" <<EOF
version = 2
root = "$state/containerd/root"
state = "$state/containerd/state"
[grpc]
  address = "$state/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10.2"
  netns_mounts_under_state_dir = true
  enable_selinux = false
  restrict_oom_score_adj = $restrict_oom
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$state/cni/net.d"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
EOF
	# No masquerade: pods reach the node, each other and the Services,
	# and nothing beyond the node.
	cat >"$state/cni/net.d/10-uproxy-dev.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "uproxy-dev",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$pod_cidr", "gateway": "$node_ip"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$state/cni/ipam"
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
	# Pods with dnsPolicy Default, and CoreDNS, get this resolv.conf: no
	# upstream, so no query ever leaves the node.
	printf 'nameserver %s\nsearch cluster.local\n' "$dns_ip" >"$state/etc/resolv.conf"
	cat >"$state/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $node_ip
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $state/pki/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
cgroupRoot: $cgroup_root
clusterDNS: [$dns_ip]
clusterDomain: cluster.local
containerRuntimeEndpoint: unix://$state/containerd/containerd.sock
failCgroupV1: false
failSwapOn: false
podLogsDir: $state/pod-logs
resolvConf: $state/etc/resolv.conf
tlsCertFile: $state/pki/kubelet.crt
tlsPrivateKeyFile: $state/pki/kubelet.key
rotateCertificates: false
serializeImagePulls: false
# The images are imported, not pulled: never collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%}
EOF
}

# uproxy_manifests: the DaemonSet of deploy/, pointed at this API server,
# in UPROXY_MODE, with its upgrade socket under CLUSTER_STATE.
uproxy_manifests() {
	local dir=$state/manifests/uproxy
	mkdir -p "$dir"
	cat >"$dir/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $(realpath --relative-to="$dir" "$repo/deploy")
patches:
  - target: {kind: ConfigMap, name: uproxy}
    patch: |-
      - op: replace
        path: /data/kubeconfig.conf
        value: |
          apiVersion: v1
          kind: Config
          clusters:
          - cluster:
              certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
              server: https://$node_ip:6443
            name: default
          contexts:
          - context: {cluster: default, namespace: default, user: default}
            name: default
          current-context: default
          users:
          - name: default
            user:
              tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
  - target: {kind: DaemonSet, name: uproxy}
    patch: |-
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --mode=$mode
  - patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata: {name: uproxy, namespace: kube-system}
      spec:
        template:
          spec:
            volumes:
              - name: upgrade
                hostPath: {path: $state/uproxy-run, type: DirectoryOrCreate}
EOF
	"$bin/kubectl" kustomize "$dir" >"$dir/rendered.yaml"
}

up() {
	require
	if [[ -f $state/up ]] && all_running; then
		say "already running; kubeconfig: $state/pki/admin.kubeconfig"
		return 0
	fi
	mkdir -p "$state"
	if [[ ! -f $state/host-before/done ]]; then
		if [[ -n $netns ]]; then
			ip netns add "$netns"
			echo "$netns" >"$state/netns"
			onnode ip link set lo up
		fi
		snapshot "$state/host-before"
		touch "$state/host-before/done"
		say "recorded the host's state in $state/host-before; cluster-down restores it"
	fi
	pki
	configs

	# The node's address lives on the pod bridge, made before the kubelet
	# starts so that it finds its node IP; the bridge plugin adopts it.
	onnode ip link show cni0 >/dev/null 2>&1 || {
		onnode ip link add cni0 type bridge
		onnode ip addr add "$node_ip/24" dev cni0
		onnode ip link set cni0 up
	}
	onnode sysctl -qw net.ipv4.ip_forward=1
	# A node's own connections to a Service address need a route before
	# any rule sees them (a host has its default route); a namespace of
	# its own has none, so the Service range is routed to the pods' bridge.
	if [[ -n $netns ]]; then
		onnode ip route replace "$service_cidr" dev cni0
	fi
	# Pods reach the node, each other and the Services, never beyond: the
	# node forwards nothing from the pod network to other addresses. The
	# node's own sockets (host-network pods, the specs' probes) must not
	# send a Service address that no proxy took, or the external address
	# the specs use, out of the host's default route. The filter table
	# sees a packet after a proxy's DNAT or REDIRECT, so what still has
	# such a destination was not rewritten; uproxy's tproxy mode keeps the
	# destination and marks the packet (its routing mark) to reroute it to
	# lo, which OUTPUT's -o does not see (the hook's output device is the
	# route's before mangle changed it), so the mark is what tells.
	if ! onnode iptables -C FORWARD -s "$cluster_cidr" ! -d "$cluster_cidr" -j DEV-CLUSTER-FENCE 2>/dev/null; then
		onnode iptables -N DEV-CLUSTER-FENCE 2>/dev/null || true
		onnode iptables -F DEV-CLUSTER-FENCE
		onnode iptables -A DEV-CLUSTER-FENCE -j REJECT --reject-with icmp-net-prohibited
		onnode iptables -I FORWARD 1 -s "$cluster_cidr" ! -d "$cluster_cidr" -j DEV-CLUSTER-FENCE
	fi
	local fenced
	for fenced in "$service_cidr" "$spec_external_ip"; do
		onnode iptables -C OUTPUT -d "$fenced" -m mark ! --mark "$uproxy_tproxy_mark" -j DEV-CLUSTER-FENCE 2>/dev/null ||
			onnode iptables -I OUTPUT 1 -d "$fenced" -m mark ! --mark "$uproxy_tproxy_mark" -j DEV-CLUSTER-FENCE
	done

	start etcd etcd --name uproxy-dev --data-dir "$state/etcd" \
		--listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
		--listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
		--initial-cluster uproxy-dev=http://127.0.0.1:2380 --listen-metrics-urls ""
	local p=$state/pki
	start kube-apiserver "$bin/kube-apiserver" --etcd-servers http://127.0.0.1:2379 \
		--bind-address "$node_ip" --advertise-address "$node_ip" --secure-port 6443 \
		--service-cluster-ip-range "$service_cidr" --allow-privileged \
		--authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
		--client-ca-file "$p/ca.crt" --tls-cert-file "$p/apiserver.crt" --tls-private-key-file "$p/apiserver.key" \
		--kubelet-client-certificate "$p/apiserver-kubelet-client.crt" --kubelet-client-key "$p/apiserver-kubelet-client.key" \
		--kubelet-certificate-authority "$p/ca.crt" --kubelet-preferred-address-types InternalIP \
		--service-account-issuer https://kubernetes.default.svc.cluster.local \
		--service-account-key-file "$p/sa.pub" --service-account-signing-key-file "$p/sa.key"
	wait_for "the API server" 120 kubectl get --raw /readyz
	start kube-controller-manager "$bin/kube-controller-manager" --kubeconfig "$p/controller-manager.kubeconfig" \
		--authentication-kubeconfig "$p/controller-manager.kubeconfig" --authorization-kubeconfig "$p/controller-manager.kubeconfig" \
		--bind-address 127.0.0.1 --use-service-account-credentials \
		--service-account-private-key-file "$p/sa.key" --root-ca-file "$p/ca.crt" \
		--cluster-signing-cert-file "$p/ca.crt" --cluster-signing-key-file "$p/ca.key" \
		--allocate-node-cidrs --cluster-cidr "$cluster_cidr" --node-cidr-mask-size 24 \
		--service-cluster-ip-range "$service_cidr"
	start kube-scheduler "$bin/kube-scheduler" --kubeconfig "$p/scheduler.kubeconfig" \
		--authentication-kubeconfig "$p/scheduler.kubeconfig" --authorization-kubeconfig "$p/scheduler.kubeconfig" \
		--bind-address 127.0.0.1
	start containerd containerd --config "$state/containerd/config.toml"
	wait_for "containerd" 60 ctr -a "$state/containerd/containerd.sock" version
	import_images
	# The kubelet puts its pods' cgroups under cgroupRoot, which must exist
	# in every hierarchy; a cpuset cgroup takes no task until it has CPUs
	# and memory nodes.
	local h
	for h in /sys/fs/cgroup/ /sys/fs/cgroup/*/; do
		# Each cgroup v1 hierarchy, or the v2 root when that is all there is.
		[[ -e $h/cgroup.procs ]] || continue
		[[ -e $h/cgroup.controllers && $h != /sys/fs/cgroup/ ]] && continue
		[[ $h == /sys/fs/cgroup/ && ! -e $h/cgroup.controllers ]] && continue
		mkdir -p "$h${cgroup_root#/}"
		if [[ -e $h/cpuset.cpus ]]; then
			cat "$h/cpuset.cpus" >"$h${cgroup_root#/}/cpuset.cpus"
			cat "$h/cpuset.mems" >"$h${cgroup_root#/}/cpuset.mems"
		fi
	done
	start kubelet "$bin/kubelet" --config "$state/kubelet/config.yaml" --kubeconfig "$p/node.kubeconfig" \
		--hostname-override "$node" --node-ip "$node_ip" --root-dir "$state/kubelet/root" \
		--cert-dir "$state/kubelet/pki"
	wait_for "the node $node to register" 120 kubectl get node "$node"

	deploy_proxy
	sed "s/@DNS_IP@/$dns_ip/g" "$here/manifests/coredns.yaml" | kubectl apply -f - >/dev/null
	wait_for "the node to be Ready" 180 kubectl wait --for=condition=Ready "node/$node" --timeout=5s
	wait_for "CoreDNS to be Ready" 180 kubectl -n kube-system wait --for=condition=Available deploy/coredns --timeout=5s
	check
	touch "$state/up"
	say "ready. kubeconfig: $state/pki/admin.kubeconfig"
	say "  export KUBECONFIG=$state/pki/admin.kubeconfig; alias kubectl=$bin/kubectl"
}

all_running() {
	local c
	for c in etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet; do
		running "$c" || return 1
	done
	local current=$proxy
	[[ -f $state/proxy ]] && read -r current _ <"$state/proxy"
	case $current in kube-proxy-*) running kube-proxy || return 1 ;; esac
}

import_images() {
	local sock=$state/containerd/containerd.sock tar
	for tar in "$cache"/images/*.tar; do
		# Import when the tar's manifest digest is not among containerd's.
		if ! ctr -a "$sock" -n k8s.io images ls 2>/dev/null | grep -q "$(image_digest "$tar")"; then
			ctr -a "$sock" -n k8s.io images import "$tar" >/dev/null
			say "imported $(basename "$tar")"
		fi
	done
}

# image_digest TAR: the digest of the image manifest in an OCI archive.
image_digest() {
	tar -xOf "$1" ./index.json | grep -o '"digest":"sha256:[0-9a-f]*"' | head -1 | cut -d'"' -f4
}

# deploy_proxy: runs CLUSTER_PROXY as the node's service proxy.
deploy_proxy() {
	case $proxy in
	uproxy)
		uproxy_manifests
		kubectl apply --server-side --force-conflicts -f "$state/manifests/uproxy/rendered.yaml" >/dev/null
		kubectl -n kube-system rollout status ds/uproxy --timeout=120s >/dev/null
		;;
	kube-proxy-iptables | kube-proxy-nftables)
		# The reference runs on the node as a process, with kube-proxy's
		# defaults but for conntrack sysctls, which it leaves alone.
		start kube-proxy "$bin/kube-proxy" --kubeconfig "$state/pki/kube-proxy.kubeconfig" \
			--hostname-override "$node" --cluster-cidr "$cluster_cidr" --proxy-mode "${proxy#kube-proxy-}" \
			--conntrack-max-per-core 0 --conntrack-tcp-timeout-established 0 --conntrack-tcp-timeout-close-wait 0 \
			--metrics-bind-address 127.0.0.1:10249 --healthz-bind-address 127.0.0.1:10256
		kubectl create clusterrolebinding uproxy-dev:kube-proxy --clusterrole system:node-proxier \
			--user system:kube-proxy --dry-run=client -o yaml | kubectl apply -f - >/dev/null
		wait_for "kube-proxy to be healthy" 60 onnode curl -sf http://127.0.0.1:10256/healthz
		;;
	*) die "CLUSTER_PROXY=$proxy: want uproxy, kube-proxy-iptables or kube-proxy-nftables" ;;
	esac
	echo "$proxy $mode" >"$state/proxy"
}

# swap_proxy P: replaces the running service proxy with P (and uproxy's
# mode with UPROXY_MODE): the old one goes, its rules are removed, then the
# new one starts, so that the two never program the node together.
swap_proxy() {
	proxy=$1
	[[ -f $state/up ]] || die "no cluster runs at $state"
	local was was_mode
	read -r was was_mode <"$state/proxy"
	if [[ $was == "$proxy" && ($proxy != uproxy || $was_mode == "$mode") ]]; then
		say "the service proxy is already $proxy${was_mode:+ ($was_mode)}"
		return 0
	fi
	if [[ $was == uproxy ]]; then
		kubectl -n kube-system delete ds uproxy --wait=true >/dev/null
		local deadline=$((SECONDS + 90))
		while kubectl -n kube-system get pods -l app.kubernetes.io/name=uproxy -o name | grep -q .; do
			((SECONDS < deadline)) || die "timed out waiting for the uproxy pod to go"
			sleep 0.5
		done
	else
		stop kube-proxy
	fi
	onnode "$bin/uproxy" cleanup >/dev/null 2>&1 || true
	onnode "$bin/uproxy" cleanup --kube-proxy >/dev/null 2>&1 || true
	deploy_proxy
	say "the service proxy is now $proxy$([[ $proxy == uproxy ]] && echo " (--mode=$mode)")"
}

# check: a pod resolves kubernetes.default through the cluster DNS (UDP and
# TCP, through the service proxy) and connects to it.
check() {
	# Retried for a minute: the first pod may start while uproxy is still
	# applying the kube-dns Service it has just seen.
	local tries=0 deadline=$((SECONDS + 60))
	# check_once dies on failure: a subshell keeps that to one try.
	until (check_once) 2>"$state/check.err"; do
		((SECONDS < deadline)) || die "$(<"$state/check.err")"
		tries=$((tries + 1))
		sleep 2
	done
	local after=""
	((tries == 0)) || after=" (after $tries failed tries)"
	say "check: a pod resolved kubernetes.default to $kubernetes_ip over UDP and TCP and connected to it, and so did the node$after"
}

check_once() {
	local name=cluster-check-$RANDOM out
	out=$(kubectl run "$name" --rm -i --restart=Never --quiet --pod-running-timeout=2m \
		--image=registry.k8s.io/e2e-test-images/agnhost:2.66.1 --command -- sh -c '
set -e
udp=$(dig +short +notcp kubernetes.default.svc.cluster.local A)
tcp=$(dig +short +tcp kubernetes.default.svc.cluster.local A)
echo "udp=$udp tcp=$tcp"
nc -z -w 5 kubernetes.default 443 && echo connected' 2>&1) || die "check: a pod could not resolve or reach kubernetes.default:
$out"
	grep -q "udp=$kubernetes_ip tcp=$kubernetes_ip" <<<"$out" && grep -q connected <<<"$out" ||
		die "check: unexpected answer from the check pod:
$out"
	# The node itself, as host-network pods are: it reaches the Service
	# through the proxy, and a port no Service has is refused on the node
	# at once (the proxy's REJECT, or the fence), not sent on.
	local rc=0
	onnode curl --noproxy '*' -sk -m 5 -o /dev/null "https://$kubernetes_ip/" || rc=$?
	((rc == 0)) || die "check: the node could not reach https://$kubernetes_ip/ (curl exit status $rc)"
	rc=0
	onnode curl --noproxy '*' -s --connect-timeout 1 -m 2 -o /dev/null "http://$kubernetes_ip:1/" || rc=$?
	((rc == 7)) || die "check: the node's connection to $kubernetes_ip:1, a port no Service has, was not refused at once (curl exit status $rc, want 7)"
}

# remove_new_chains BEFORE: deletes, in every iptables table of both
# families, the chains that were not in the saved rules BEFORE and the
# rules that jump to them.
remove_new_chains() {
	local before=$1 fam tool
	for fam in iptables ip6tables; do
		command -v "$fam-save" >/dev/null || continue
		local script
		script=$(onnode "$fam-save" 2>/dev/null | awk -v before="$before/$fam" '
			BEGIN { while ((getline line < before) > 0) if (line ~ /^:/) { split(line, f, " "); old[substr(f[1], 2)] = 1 } }
			/^\*/ { table = substr($0, 2); new_chains = ""; delete isnew; rules = ""; next }
			/^:/ { c = substr($1, 2); if (!(c in old) && c !~ /^(INPUT|OUTPUT|FORWARD|PREROUTING|POSTROUTING)$/) { isnew[c] = 1; new_chains = new_chains " " c } next }
			/^-A/ { for (i = 1; i <= NF; i++) if (($i == "-j" || $i == "-g") && ($(i+1) in isnew) && !($2 in isnew)) { sub(/^-A/, "-D"); rules = rules $0 "\n" } next }
			/^COMMIT/ { if (new_chains != "") { printf "*%s\n%s", table, rules; n = split(new_chains, cs, " "); for (i = 1; i <= n; i++) print "-F " cs[i]; for (i = 1; i <= n; i++) print "-X " cs[i]; print "COMMIT" } }
		')
		if [[ -n $script ]]; then
			onnode "$fam-restore" --noflush <<<"$script"
		fi
	done
}

# nft_chains: the ruleset's chains, a line each: "FAMILY TABLE CHAIN RULES",
# and "FAMILY TABLE - RULES" for each table.
nft_chains() {
	awk '
		/^table / { fam = $2; tbl = $3; total = 0; next }
		/^\tchain / { chain = $2; rules = 0; next }
		/^\t\t/ && !/^\t\ttype / && chain != "" { rules++; total++; next }
		/^\t}/ { if (chain != "") print fam, tbl, chain, rules; chain = ""; next }
		/^}/ { print fam, tbl, "-", total }
	'
}

# remove_new_tables BEFORE: deletes the nftables chains and tables that
# were not in the ruleset BEFORE and hold no rule now: the ones iptables-nft
# made for the rules that were removed, base chains included.
remove_new_tables() {
	command -v nft >/dev/null || return 0
	local fam tbl chain rules
	local old
	old=$(nft_chains <"$1")
	onnode nft list ruleset | nft_chains | while read -r fam tbl chain rules; do
		((rules == 0)) || continue
		grep -q "^$fam $tbl $chain " <<<"$old" && continue
		if [[ $chain == - ]]; then
			onnode nft delete table "$fam" "$tbl"
		elif grep -q "^$fam $tbl - " <<<"$old"; then
			onnode nft delete chain "$fam" "$tbl" "$chain"
		fi
	done
}

down() {
	[[ -d $state ]] || {
		say "no cluster at $state"
		return 0
	}
	if [[ -f $state/netns ]]; then
		netns=$(<"$state/netns")
		cgroup_root=/uproxy-cluster-$netns
	fi
	local before
	before=$(mktemp -d "${TMPDIR:-/tmp}/cluster-before.XXXXXX")
	[[ -d $state/host-before ]] && cp -a "$state/host-before/." "$before/" && rm -f "$before/done"

	stop kubelet
	stop kube-proxy
	# Every pod's processes, by their cgroups: the kubelet no longer
	# restarts them.
	local cg
	for cg in /sys/fs/cgroup"$cgroup_root" /sys/fs/cgroup/*"$cgroup_root"; do
		[[ -d $cg ]] || continue
		find "$cg" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
	done
	# The runtime shims of this containerd, then containerd.
	pkill -KILL -f "containerd-shim-runc-v2 .*-address $state/containerd/containerd.sock" 2>/dev/null || true
	stop containerd
	stop kube-controller-manager
	stop kube-scheduler
	stop kube-apiserver
	stop etcd

	# Mounts under the state folder (volumes, overlays, pod network
	# namespaces), deepest first.
	awk '{print $5}' /proc/self/mountinfo | { grep "^$state/" || true; } | sort -r | while read -r m; do
		umount -l "$m" 2>/dev/null || true
	done
	for cg in /sys/fs/cgroup"$cgroup_root" /sys/fs/cgroup/*"$cgroup_root"; do
		[[ -d $cg ]] || continue
		find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
	done

	if [[ -n $netns ]]; then
		ip netns del "$netns" 2>/dev/null || true
	else
		ip link del cni0 2>/dev/null || true
		[[ -x $bin/uproxy ]] && "$bin/uproxy" cleanup >/dev/null 2>&1 || true
		[[ -x $bin/uproxy ]] && "$bin/uproxy" cleanup --kube-proxy >/dev/null 2>&1 || true
		# kube-network-policies (cluster.sh netpol) leaves its table, rules
		# and all, when its pod is stopped with the kubelet.
		if [[ -f $before/nft ]] && ! grep -q "^table inet kube-network-policies " "$before/nft"; then
			nft delete table inet kube-network-policies 2>/dev/null || true
		fi
		if [[ -f $before/iptables ]]; then remove_new_chains "$before"; fi
		if [[ -f $before/nft ]]; then remove_new_tables "$before/nft"; fi
	fi
	# The kubelet's kernel settings are the host's in either mode; the
	# net.* ones are the namespace's in CLUSTER_NETNS, gone with it.
	if [[ -f $before/sysctls ]]; then
		local k v
		while read -r k _ v; do
			[[ $v == absent || (-n $netns && $k == net.*) ]] && continue
			[[ $(sysctl -n "$k" 2>/dev/null | tr '\t' ' ') == "$v" ]] || sysctl -qw "$k=$v" || say "could not restore $k to $v"
		done <"$before/sysctls"
	fi
	# The fixed directories, when they were not there and no other
	# containerd or kubelet (another cluster's) may be using them.
	if [[ -f $before/paths ]] && ! pgrep -x containerd >/dev/null && ! pgrep -x kubelet >/dev/null; then
		local d
		for d in "${FIXED_DIRS[@]}"; do
			grep -qxF "$d" "$before/paths" || rm -rf "$d"
		done
	fi
	rm -rf "$state"
	say "stopped every process and removed $state"

	[[ -f $before/links ]] || return 0
	local after
	after=$(mktemp -d "${TMPDIR:-/tmp}/cluster-after.XXXXXX")
	netns= snapshot "$after"
	if [[ -n $netns ]]; then
		# The namespace is gone, and its network with it; the host's
		# mounts, paths and kernel settings must be as before.
		rm -f "$before"/{iptables,ip6tables,nft,links,addrs,routes} "$after"/{iptables,ip6tables,nft,links,addrs,routes}
		sed -i '/^net\./d' "$before/sysctls" "$after/sysctls"
	fi
	if diff -r "$before" "$after" >"$after.diff"; then
		say "the host is as before: $(ls "$before" | grep -v done | tr '\n' ' ')unchanged"
		rm -rf "$before" "$after" "$after.diff"
	else
		say "the host differs from before the cluster started:"
		cat "$after.diff" >&2
		rm -rf "$before" "$after" "$after.diff"
		return 1
	fi
}

status() {
	if [[ ! -f $state/up ]]; then
		say "not running (state: $state)"
		return 1
	fi
	local c
	for c in etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy; do
		[[ -f $state/run/$c.pid ]] || continue
		if running "$c"; then say "$c: running (pid $(<"$state/run/$c.pid"))"; else say "$c: stopped"; fi
	done
	say "service proxy: $(<"$state/proxy")"
	say "kubeconfig: $state/pki/admin.kubeconfig"
	kubectl get nodes -o wide
	kubectl -n kube-system get pods -o wide
}

# netpol: runs kube-network-policies as the node's NetworkPolicy engine,
# and waits until it is up.
netpol() {
	[[ -f $state/up ]] || die "no cluster runs at $state"
	import_images
	kubectl apply -f "$here/manifests/kube-network-policies.yaml" >/dev/null
	kubectl -n kube-system rollout status ds/kube-network-policies --timeout=120s >/dev/null
	wait_for "kube-network-policies' nftables table" 60 onnode nft list table inet kube-network-policies
	say "kube-network-policies $netpol_version enforces NetworkPolicy on the node"
}

# reload: imports the images that changed since up (after cluster.sh
# build) and restarts uproxy's pods on them, with the manifests of deploy/
# as they are now.
reload() {
	[[ -f $state/up ]] || die "no cluster runs at $state"
	import_images
	local was
	read -r was mode <"$state/proxy"
	[[ $was == uproxy ]] || {
		say "the service proxy is $was; images imported"
		return 0
	}
	uproxy_manifests
	kubectl apply --server-side --force-conflicts -f "$state/manifests/uproxy/rendered.yaml" >/dev/null
	kubectl -n kube-system rollout restart ds/uproxy >/dev/null
	kubectl -n kube-system rollout status ds/uproxy --timeout=180s >/dev/null
	say "uproxy restarted on the current image and manifests (--mode=$mode)"
}

case ${1:-} in
build) build ;;
reload) reload ;;
up) up ;;
down) down ;;
status) status ;;
check) check ;;
mode)
	[[ ${2:-} == redirect || ${2:-} == tproxy ]] || die "usage: cluster.sh mode redirect|tproxy"
	mode=$2
	swap_proxy uproxy
	;;
proxy) swap_proxy "${2:?usage: cluster.sh proxy uproxy|kube-proxy-iptables|kube-proxy-nftables}" ;;
netpol) netpol ;;
*)
	sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
	exit 2
	;;
esac
