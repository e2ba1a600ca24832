#!/bin/bash
# usage: lab.sh up|down SUFFIX
S=$2; C=pkc$S; N=pkn$S; B=pkb$S
if [ "$1" = up ]; then
  for ns in $C $N $B; do ip netns add $ns; ip -n $ns link set lo up; done
  ip link add c0$S type veth peer name nc$S
  ip link set c0$S netns $C name eth0; ip link set nc$S netns $N name eth-c
  ip link add b0$S type veth peer name nb$S
  ip link set b0$S netns $B name eth0; ip link set nb$S netns $N name eth-b
  ip -n $C addr add 10.244.1.2/24 dev eth0; ip -n $C link set eth0 up; ip -n $C route add default via 10.244.1.1
  ip -n $N addr add 10.244.1.1/24 dev eth-c; ip -n $N link set eth-c up
  ip -n $N addr add 10.244.0.1/24 dev eth-b; ip -n $N link set eth-b up
  ip -n $B addr add 10.244.0.10/24 dev eth0; ip -n $B link set eth0 up; ip -n $B route add default via 10.244.0.1
  ip netns exec $N sysctl -qw net.ipv4.ip_forward=1
else
  for ns in $C $N $B; do ip netns del $ns 2>/dev/null; done
fi
