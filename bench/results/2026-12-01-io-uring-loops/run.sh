#!/bin/bash
# usage: run.sh PROXY WORKLOAD  (PROXY: haproxy|uproxy|iocopy; WORKLOAD: rr|short)
P=$1; W=${2:-rr}; PORT=80; [ "$W" = udp ] && PORT=53; [ "$W" = bulk ] && PORT=5001; S=$$; C=pkc$S; N=pkn$S; B=pkb$S; D=/tmp/pk
$D/lab.sh up $S
ip netns exec $B $D/ubench-backend backend --rr :8080 --udp :9000 --sink :5001 2>/dev/null & BP=$!
case $P in
 haproxy) ip netns exec $N iptables -t nat -A PREROUTING -d 10.96.0.10 -p tcp --dport 80 -j REDIRECT --to-ports 18080
          ip netns exec $N haproxy -db -f ${HCFG:-$D/haproxy.cfg} & PP=$!; COMM=haproxy;;
 iocopy)  ip netns exec $N iptables -t nat -A PREROUTING -d 10.96.0.10 -p tcp --dport 80 -j REDIRECT --to-ports 18080
          ip netns exec $N iptables -t nat -A PREROUTING -d 10.96.0.10 -p tcp --dport 5001 -j REDIRECT --to-ports 15001
          ln -f $D/ubench-load $D/ubench-iocopy
          ip netns exec $N $D/ubench-iocopy iocopy --route 0.0.0.0:18080=10.244.0.10:8080 --route 0.0.0.0:15001=10.244.0.10:5001 2>/dev/null & PP=$!;;
 dnat)    ip netns exec $N iptables -t nat -A PREROUTING -d 10.96.0.10 -p tcp --dport 80 -j DNAT --to-destination 10.244.0.10:8080; ip netns exec $N iptables -t nat -A PREROUTING -d 10.96.0.10 -p tcp --dport 5001 -j DNAT --to-destination 10.244.0.10:5001
          ip netns exec $N sleep 1000 & PP=$!;;
 cproxy2) ip netns exec $N iptables -t nat -A PREROUTING -d 10.96.0.10 -p tcp --dport 80 -j REDIRECT --to-ports 18080
          ip netns exec $N env CPROXY_REUSEPORT=1 $D/cproxy & PX=$!
          ip netns exec $N env CPROXY_REUSEPORT=1 $D/cproxy & PP=$!;;
 gouring2) ip netns exec $N env GOURING_RAW=$GOURING_RAW $D/gouring & PX=$!
          ip netns exec $N env GOURING_RAW=$GOURING_RAW $D/gouring & PP=$!
          ip netns exec $N iptables -t nat -A PREROUTING -d 10.96.0.10 -p tcp --dport 80 -j REDIRECT --to-ports 18080;;
 gouring) ip netns exec $N iptables -t nat -A PREROUTING -d 10.96.0.10 -p tcp --dport 80 -j REDIRECT --to-ports 18080
          ip netns exec $N env GOURING_RAW=$GOURING_RAW $D/gouring & PP=$!;;
 uring2)  ip netns exec $N iptables -t nat -A PREROUTING -d 10.96.0.10 -p tcp --dport 80 -j REDIRECT --to-ports 18080
          ip netns exec $N $D/uring & PX=$!
          ip netns exec $N $D/uring & PP=$!;;
 uring)   ip netns exec $N iptables -t nat -A PREROUTING -d 10.96.0.10 -p tcp --dport 80 -j REDIRECT --to-ports 18080
          ip netns exec $N $D/uring & PP=$!;;
 cproxy)  ip netns exec $N iptables -t nat -A PREROUTING -d 10.96.0.10 -p tcp --dport 80 -j REDIRECT --to-ports 18080
          ip netns exec $N $D/cproxy & PP=$!;;
 uproxy*) ip netns exec $N env $UPX_ENV ${UPX_BIN:-$D/uproxy} run --config ${SVC:-$D/svc.yaml} --hostname-override n1 --healthz-bind-address= --metrics-bind-address= --upgrade-socket= $UPX_ARGS >$D/uproxy.$S.log 2>&1 & PP=$!;;
esac
sleep 1.5
[ -n "$POSTCMD" ] && ip netns exec $N sh -c "$POSTCMD"
ip netns exec $C $D/ubench-load load $W --target ${VIP:-10.96.0.10}:$PORT --conns ${CONNS:-32} --duration 8s --warmup 1s > $D/load.$S.json &
LP=$!
sleep 3
snap() { for ns in $C $N $B; do ip netns exec $ns nstat -saz TcpOutSegs TcpInSegs TcpExtDelayedACKs TcpExtTCPPureAcks 2>/dev/null | awk -v ns=${ns:0:3} 'NR>1{print ns, $1, $2}'; done; }
snap > $D/s1.$S
# threads: perf per process
LPID=$(pgrep -f "ubench-load load $W" | tail -1)
BPID=$BP; BPID=$(pgrep -P $BP | head -1 || echo $BP); [ -z "$BPID" ] && BPID=$BP
csw() { cat /proc/$1/task/*/status 2>/dev/null | awk '/^voluntary_ctxt/{v+=$2} /^nonvoluntary_ctxt/{n+=$2} END{print v, n}'; }
thr() { for t in /proc/$1/task/*; do echo "$(basename $t) $(cat $t/schedstat | tr ' ' '_')"; done; }
[ -n "$THR" ] && thr $PP > $D/thr0.$S
CS0="$(csw $PP) $(csw $LPID) $(csw $BPID)"
T0=$(date +%s.%N)
perf stat -x, -e context-switches,task-clock,raw_syscalls:sys_enter -p $PP -o $D/perfP.$S -- sleep 3 & Q1=$!
perf stat -x, -e context-switches,task-clock -p $BPID -o $D/perfB.$S -- sleep 3 & Q2=$!
perf stat -x, -e context-switches,task-clock -p $LPID -o $D/perfC.$S -- sleep 3 & Q3=$!
[ -n "$PERFTRACE" ] && perf trace -s -p $PP -o $D/trace.$P.txt -- sleep 2 2>/dev/null
[ -n "$PERFRECC" ] && perf record -q -g -p $LPID -o $D/recC.$P.data -- sleep 2 2>/dev/null
[ -n "$PERFREC" ] && perf record -q -g -p $PP -o $D/rec.$P.data -- sleep 2 2>/dev/null
wait $Q1 $Q2 $Q3
T1=$(date +%s.%N)
[ -n "$THR" ] && thr $PP > $D/thr1.$S && join $D/thr0.$S $D/thr1.$S | tr '_' ' ' | awk '{r=($5-$2)/1e6; w=($6-$3)/1e6; n=$7-$4; if (r>1) printf "  thread %s: run %.0f ms wait %.0f ms slices %d\n", $1, r, w, n}'
CS1="$(csw $PP) $(csw $LPID) $(csw $BPID)"
echo "csw0 $CS0"; echo "csw1 $CS1"
snap > $D/s2.$S
wait $LP
RATE=$(python3 -c "import json;d=json.load(open('$D/load.$S.json'));print(round(d['rate']))")
echo "proxy=$P workload=$W rate=$RATE window=$(python3 -c "print(round($T1-$T0,2))")"
python3 - $D/s1.$S $D/s2.$S "$RATE" $T0 $T1 <<'PY'
import sys,re
def rd(f):
    d={}
    for l in open(f):
        ns,k,v=l.split(); d[(ns,k)]=int(v)
    return d
a,b=rd(sys.argv[1]),rd(sys.argv[2])
print("  (rate from the load generator's report)")
for k in sorted(b):
    print("  ",k[0],k[1],b[k]-a.get(k,0))
PY
for f in perfP perfC perfB; do echo " $f: $(grep -v '^#' $D/$f.$S | grep -v '^$' | cut -d, -f1,3 | tr '\n' ' ')"; done
kill $PP $PX $BP 2>/dev/null; wait $PP $PX $BP 2>/dev/null
$D/lab.sh down $S
