# uproxy — see README.md. Every target that needs root-only tools checks for
# them, installs the Debian packages when run as root, and otherwise prints
# the exact apt-get command.

GO        ?= go
BIN       := bin
# Debian packages the demo runs: uproxy's rules and sets (iptables, ipset),
# the namespace lab (iproute2, and procps for sysctl) and the demo's curl.
# bench's TestDemo fails if the demo runs a program from a package missing
# here.
DEMO_PKGS := iptables iproute2 ipset procps curl
# Debian packages the tests need besides: the e2e tests run a real etcd and
# kube-apiserver, and compare uproxy with HAProxy, nginx and nftables.
TEST_PKGS := $(DEMO_PKGS) socat etcd-server nftables haproxy nginx-light libnginx-mod-stream iperf3 wrk
GOTESTFLAGS ?=

.PHONY: all build image test test-short fuzz kube-binaries demo deps-test deps-demo vet fmt lint clean cluster cluster-build cluster-down cluster-status cluster-verify deps-cluster conformance

all: build

# VERSION is stamped into the binary (uproxy version) and names the image:
# the tag, or the commits since the last one and the revision, -dirty for a
# modified tree; "devel" outside a git checkout.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
LDFLAGS := -X main.version=$(VERSION)

build:
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/uproxy ./cmd/uproxy

# image: the container image, as an OCI image tar file, without a container
# engine: a static uproxy and Debian's iptables and ipset (apt-get download),
# laid out by deploy/image (see build.sh there). Import it with
# `ctr -n k8s.io images import $(BIN)/uproxy-image.tar`, `docker load` or
# `podman load`. deploy/Dockerfile builds the same image with docker.
IMAGE ?= uproxy:latest
image:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/image/uproxy ./cmd/uproxy
	deploy/image/build.sh $(BIN)/image/uproxy $(BIN)/uproxy-image.tar $(IMAGE)

# make test: vet, then every test with the race detector, in the main
# module and then in the bench's own (bench/go.mod: the harness, the demo
# and its TestDemo), then the fuzz targets for a bounded time. Root-only
# tests skip (saying why) when not run as root; CI runs as root. The dev
# cluster's test runs only when make cluster-build's builds are cached.
# CLUSTER_CACHED mirrors cachedBuilds in cluster/cluster_test.go.
CLUSTER_CACHED := bin/kube-apiserver bin/kube-controller-manager bin/kube-scheduler bin/kubelet \
	bin/kubectl bin/coredns bin/pause bin/agnhost bin/uproxy images/pause.tar images/coredns.tar \
	images/agnhost.tar images/uproxy.tar
test: deps-test kube-binaries
	$(GO) vet ./...
	cd bench && $(GO) vet ./...
	@for f in $(CLUSTER_CACHED); do [ -e bench/.cache/$$f ] || { \
		echo "make test: TestDevClusterInNamespace will skip: bench/.cache/$$f is missing (make cluster-build makes the dev cluster's builds)"; break; }; done
	$(GO) test -race -count=1 -timeout 25m $(GOTESTFLAGS) ./...
	cd bench && $(GO) test -race -count=1 -timeout 25m $(GOTESTFLAGS) ./...
	$(MAKE) fuzz

# fuzz: each fuzz target of proxy/fuzz_test.go and redirect/fuzz_test.go
# (go test fuzzes one target per run). Every go test also runs their seeds;
# a failing input is written to PKG/testdata/fuzz/TARGET/, where it becomes
# a seed too. The first run
# builds the dependencies with coverage instrumentation (minutes).
#
# The budgets are counts of inputs, about 10 seconds of fuzzing each here:
# with a duration, Go 1.26's fuzz coordinator can report its own deadline
# as a failure ("context deadline exceeded", no failing input;
# go.dev/issue/75804, fixed in Go 1.27). FUZZTIME=5m sets a duration for
# all of them instead; -timeout bounds a run that stalls.
FUZZTIME ?=
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeManifests$$' -fuzztime $(or $(FUZZTIME),1000x) -timeout 10m ./proxy/source/
	$(GO) test -run '^$$' -fuzz '^FuzzConvert$$' -fuzztime $(or $(FUZZTIME),10000x) -timeout 10m ./proxy/service/
	$(GO) test -run '^$$' -fuzz '^FuzzAnnotations$$' -fuzztime $(or $(FUZZTIME),4000x) -timeout 10m ./proxy/service/
	$(GO) test -run '^$$' -fuzz '^FuzzParsePortRange$$' -fuzztime $(or $(FUZZTIME),20000x) -timeout 10m ./proxy/listeners/
	$(GO) test -run '^$$' -fuzz '^FuzzConnectionLimits$$' -fuzztime $(or $(FUZZTIME),10000x) -timeout 10m ./proxy/service/
	$(GO) test -run '^$$' -fuzz '^FuzzTopologyHints$$' -fuzztime $(or $(FUZZTIME),20000x) -timeout 10m ./proxy/service/
	$(GO) test -run '^$$' -fuzz '^FuzzEndpointPolicyFlags$$' -fuzztime $(or $(FUZZTIME),20000x) -timeout 10m ./proxy/service/
	$(GO) test -run '^$$' -fuzz '^FuzzConntrackEntry$$' -fuzztime $(or $(FUZZTIME),100000x) -timeout 10m ./redirect/
	$(GO) test -run '^$$' -fuzz '^FuzzIptablesSave$$' -fuzztime $(or $(FUZZTIME),100000x) -timeout 10m ./redirect/
	$(GO) test -run '^$$' -fuzz '^FuzzIpsetSave$$' -fuzztime $(or $(FUZZTIME),50000x) -timeout 10m ./redirect/
	$(GO) test -run '^$$' -fuzz '^FuzzUpgradeMessage$$' -fuzztime $(or $(FUZZTIME),10000x) -timeout 10m ./internal/upgrade/

# kube-binaries: the real kube-apiserver, kube-proxy and kubectl that the
# API-server tests and the benchmarks run, built once from bench/tools into
# bench/.cache/bin (about 10 minutes the first time, instant afterwards),
# before the tests start so no test's timeout includes the build.
kube-binaries:
	bench/tools/build.sh

# test-short: the unit tests only (no root needed).
test-short:
	$(GO) test -race -count=1 -short ./...
	cd bench && $(GO) test -race -count=1 -short ./...

demo: deps-demo build
	cd bench && $(GO) run . demo --uproxy $(abspath $(BIN))/uproxy --manifests $(CURDIR)/deploy/examples

# The dev cluster (docs/dev-cluster.md): a one-node Kubernetes with uproxy
# as its service proxy, on this host, run by cluster/cluster.sh. Its
# binaries and images are built once into bench/.cache (the Kubernetes ones
# by bench/tools/build.sh), then reused. CLUSTER_PROXY and UPROXY_MODE
# choose the proxy (cluster/cluster.sh's header).
CLUSTER_PKGS := containerd runc containernetworking-plugins conntrack openssl iptables ipset nftables iproute2 procps curl etcd-server util-linux patch

cluster-build: deps-cluster
	cluster/cluster.sh build

cluster: cluster-build
	cluster/cluster.sh up

cluster-down:
	cluster/cluster.sh down

cluster-status:
	cluster/cluster.sh status

# cluster-verify: the checks that need a real kubelet, on the running
# cluster (cluster/verify.sh): uproxy's rolling update under load, backend
# deletion and readiness, CoreDNS over UDP and TCP, a NetworkPolicy under
# kube-network-policies (which it deploys).
cluster-verify:
	cluster/verify.sh

# conformance: Kubernetes' e2e Service specs against the dev cluster with
# kube-proxy (the reference) and uproxy in each mode, written to
# docs/conformance.md (cluster/conformance.sh: E2E_FOCUS, E2E_SKIP,
# E2E_MODE, E2E_REFERENCE).
conformance: cluster-build
	cluster/conformance.sh

deps-cluster:
	$(call apt-ensure,$(CLUSTER_PKGS))

# apt-ensure: as root, install the missing packages; otherwise print the
# exact command and carry on (the tests that need them skip, saying why).
define apt-ensure
	@missing=""; for p in $(1); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" -eq 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	  else \
	    echo "missing Debian packages:$$missing"; \
	    echo "install them with: sudo apt-get update && sudo apt-get install -y$$missing"; \
	  fi; \
	fi
endef

deps-test:
	$(call apt-ensure,$(TEST_PKGS))

deps-demo:
	$(call apt-ensure,$(DEMO_PKGS))

fmt:
	gofmt -w $$(git ls-files '*.go')

# lint: gofmt, vet and staticcheck with every check, over both modules, then
# the project's own rules (internal/doccheck: no figures and no issue numbers
# in comments, links, tests and metrics the docs cite; and the flags they
# cite). CI runs it before the tests.
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go') </dev/null); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	cd bench && $(GO) vet ./...
	$(GO) run $(STATICCHECK) -checks all ./...
	cd bench && $(GO) run $(STATICCHECK) -checks all ./...
	$(GO) test -count=1 ./internal/doccheck/
	$(GO) test -count=1 -run '^(TestDocsCiteExistingFlags|TestFlagHelpIsOneSentence)$$' ./cmd/uproxy/

clean:
	rm -rf $(BIN)

# The benchmarks (bench/, a module of its own: see `cd bench && go run . --help`) need, beyond the
# tests' packages, the proxies they compare and perf for the CPU profiles.
BENCH_PKGS := $(TEST_PKGS) linux-perf
BENCHFLAGS ?=

.PHONY: bench bench-smoke

# bench: every part (datapath, controlplane, gobench), then the report:
# bench/results/DATE-HOST.md and its charts, 5 runs. About an hour and a half
# (the control plane goes up to 20,000 services: see bench/README.md).
bench:
	$(call apt-ensure,$(BENCH_PKGS))
	cd bench && $(GO) run . all $(BENCHFLAGS)

# bench-smoke: the same with tiny durations and counts, into a temporary
# folder: checks that the harness works end to end, in about a minute.
bench-smoke:
	$(call apt-ensure,$(BENCH_PKGS))
	cd bench && $(GO) run . all --smoke $(BENCHFLAGS)
