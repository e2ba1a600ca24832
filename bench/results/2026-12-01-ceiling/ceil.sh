#!/bin/bash
# rounds of one workload for several proxies, in turn
# usage: [PROXIES="haproxy uring ..."] ceil.sh WORKLOAD [ROUNDS] > ceilN.WORKLOAD.txt
D=$(cd "$(dirname "$0")" && pwd); cd "$D"
W=$1; R=${2:-3}
for r in $(seq $R); do
 for p in ${PROXIES:-haproxy cproxy2 cproxy uproxy}; do
  case $p in
   uproxy) UPX_BIN=$D/uproxy ./run.sh uproxy $W;;
   uproxy2) UPX_BIN=$D/uproxy UPX_ARGS=--event-loops=2 ./run.sh uproxy2 $W;;
   # uproxy-ring, uproxy-ring1: uproxy built at the commits 2026-12-01-io-uring-loops.md names
   uproxyring) UPX_BIN=$D/uproxy-ring UPX_ARGS=--io-uring ./run.sh uproxyring $W;;
   uproxyring1) UPX_BIN=$D/uproxy-ring1 UPX_ARGS=--io-uring ./run.sh uproxyring1 $W;;
   uproxyring2) UPX_BIN=$D/uproxy-ring UPX_ARGS="--io-uring --event-loops=2" ./run.sh uproxyring2 $W;;
   uproxyring2p3) UPX_BIN=$D/uproxy-ring UPX_ARGS="--io-uring --event-loops=2" UPX_ENV=GOMAXPROCS=3 ./run.sh uproxyring2p3 $W;;
   gouringraw) GOURING_RAW=1 ./run.sh gouring $W | sed 's/proxy=gouring /proxy=gouringraw /';;
   # uproxy-raw: uproxy built with epollraw.patch applied
   uproxyblock) UPX_BIN=$D/uproxy-raw UPX_ENV=UPROXY_EPOLL_RAW=block ./run.sh uproxyblock $W;;
   uproxypeek) UPX_BIN=$D/uproxy-raw UPX_ENV=UPROXY_EPOLL_RAW=peek ./run.sh uproxypeek $W;;
   uproxy2p3) UPX_BIN=$D/uproxy UPX_ARGS=--event-loops=2 UPX_ENV=GOMAXPROCS=3 ./run.sh uproxy2p3 $W;;
   *) ./run.sh $p $W;;
  esac 2>&1 | grep -E '^proxy=| perf'
 done
done
