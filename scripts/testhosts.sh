#!/usr/bin/env bash
# Test hosts on one machine (issue 12): N network namespaces ("hosts") joined by veth pairs to a
# bridge that lives in a namespace of its own, each host with its own address in 10.231.0.0/24.
# The addresses exist only inside those namespaces: the machine's own namespace never sees them.
#
#   testhosts.sh up NAME N          create NAME-br (the bridge) and hosts NAME-h1 .. NAME-hN;
#                                   host i is 10.231.0.i (eth0), loopback up
#   testhosts.sh down NAME          kill every process in NAME-* namespaces, delete them
#   testhosts.sh partition NAME I   cut host I's link (its bridge port goes down)
#   testhosts.sh heal NAME I        restore it
#   testhosts.sh kill NAME I        SIGKILL every process of host I (the host is lost)
#   testhosts.sh freeze NAME I      SIGSTOP every process of host I (a hung host)
#   testhosts.sh thaw NAME I        SIGCONT them
#   testhosts.sh exec NAME I CMD..  run CMD on host I (the env carries the UCX settings below)
#   testhosts.sh addr I             print host I's address
#   testhosts.sh supported          exit 0 if this machine can create network namespaces
#
# Processes on different hosts still share the kernel, /dev/shm and PIDs, so UCX could bridge
# two "hosts" through shared memory or CMA. `exec` pins UCX to tcp on eth0
# (UCX_TLS=tcp, UCX_NET_DEVICES=eth0): data between hosts goes over the veth links, and a
# partition cuts it like a real one. Root is required (ip netns). Names are short: one run
# per NAME at a time; use a unique NAME per test.
set -euo pipefail

subnet=10.231.0

usage() {
  sed -n '2,23p' "$0" >&2
  exit 2
}

host_ns() { echo "$1-h$2"; }

cmd=${1:-}
case "$cmd" in
  supported)
    probe="kvfprobe$$"
    if ip netns add "$probe" 2>/dev/null; then
      ip netns del "$probe"
      exit 0
    fi
    exit 1
    ;;
  addr)
    [ $# -eq 2 ] || usage
    echo "$subnet.$2"
    exit 0
    ;;
esac

[ $# -ge 2 ] || usage
name=$2
br="$name-br"

case "$cmd" in
  up)
    [ $# -eq 3 ] || usage
    n=$3
    ip netns add "$br"
    ip -n "$br" link set lo up
    ip -n "$br" link add br0 type bridge
    ip -n "$br" link set br0 up
    for i in $(seq 1 "$n"); do
      h=$(host_ns "$name" "$i")
      ip netns add "$h"
      ip -n "$h" link set lo up
      ip -n "$br" link add "v$i" type veth peer name eth0 netns "$h"
      ip -n "$br" link set "v$i" master br0
      ip -n "$br" link set "v$i" up
      ip -n "$h" addr add "$subnet.$i/24" dev eth0
      ip -n "$h" link set eth0 up
    done
    ;;
  down)
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^${name}-(br|h[0-9]+)$" || true); do
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      if [ -n "$pids" ]; then
        kill -KILL $pids 2>/dev/null || true
      fi
      ip netns del "$ns" 2>/dev/null || true
    done
    ;;
  partition)
    [ $# -eq 3 ] || usage
    ip -n "$br" link set "v$3" down
    ;;
  heal)
    [ $# -eq 3 ] || usage
    ip -n "$br" link set "v$3" up
    ;;
  kill | freeze | thaw)
    [ $# -eq 3 ] || usage
    signal=KILL
    [ "$cmd" = freeze ] && signal=STOP
    [ "$cmd" = thaw ] && signal=CONT
    pids=$(ip netns pids "$(host_ns "$name" "$3")" 2>/dev/null || true)
    if [ -n "$pids" ]; then
      kill -"$signal" $pids 2>/dev/null || true
    fi
    ;;
  exec)
    [ $# -ge 4 ] || usage
    h=$(host_ns "$name" "$3")
    shift 3
    exec ip netns exec "$h" env UCX_TLS=tcp UCX_NET_DEVICES=eth0 "$@"
    ;;
  *)
    usage
    ;;
esac
