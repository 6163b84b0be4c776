#!/usr/bin/env bash
# `kvferry demo` across test hosts (issue 12): the seed experiments A-D with P, D, the proxy and
# a 3-member etcd cluster on separate network-namespace hosts (scripts/testhosts.sh) of this
# machine, joined by veth links to a bridge, UCX over tcp between them:
#   host 1: P (kvferry serve --role prefill)      host 4-6: etcd members e4, e5, e6
#   host 2: D (kvferry serve --role decode)
#   host 3: the demo itself: proxy, load, probe and the /metrics sampler
# Every serve registers in etcd and finds its peers there; D fences its writers (on with etcd).
# Needs root (network namespaces) and etcd (scripts/install-deps.sh installs etcd-server).
# Arguments go to `kvferry demo` (e.g. --quick, --scenario AB); output in out/demo-hosts
# (KVFERRY_DEMO_OUT). Exit status: the demo's (0: every check passed), or 77 when this machine
# cannot run it (no root, network namespaces or etcd). KVFERRY_DEMO_NO_BUILD=1 and KVFERRY_BIN
# skip the build (ctest's hosts_demo_quick). Every host and process is removed at the end, also
# on failure or Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${KVFERRY_DEMO_NO_BUILD:-0}" != 1 ]; then
  scripts/install-deps.sh
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build -j "${JOBS:-$(nproc)}" --target kvferry
fi
bin=${KVFERRY_BIN:-$PWD/build/bin/kvferry}
th=$PWD/scripts/testhosts.sh
if [ "$(id -u)" -ne 0 ] || ! "$th" supported; then
  echo "demo-hosts: needs root and network namespaces (ip netns)" >&2
  exit 77
fi
if ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null; then
  echo "demo-hosts: etcd or etcdctl is missing (scripts/install-deps.sh)" >&2
  exit 77
fi
out=${KVFERRY_DEMO_OUT:-out/demo-hosts}

name="kvdh$$"
data=$(mktemp -d)
cleanup() {
  "$th" down "$name"
  rm -rf "$data"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
"$th" up "$name" 6

cluster=""
endpoints=()
for i in 4 5 6; do
  a=$("$th" addr "$i")
  cluster+="${cluster:+,}e$i=http://$a:2380"
  endpoints+=("http://$a:2379")
done
for i in 4 5 6; do
  a=$("$th" addr "$i")
  "$th" exec "$name" "$i" etcd --name "e$i" --data-dir "$data/e$i" \
    --listen-client-urls "http://$a:2379" --advertise-client-urls "http://$a:2379" \
    --listen-peer-urls "http://$a:2380" --initial-advertise-peer-urls "http://$a:2380" \
    --initial-cluster "$cluster" --initial-cluster-state new >"$data/etcd$i.log" 2>&1 &
  disown  # stopped by `testhosts.sh down` in the trap
done
healthy=0
for _ in $(seq 1 100); do
  if "$th" exec "$name" 3 etcdctl --endpoints "$(IFS=,; echo "${endpoints[*]}")" \
    --command-timeout=2s put /kvferry-demo/probe x >/dev/null 2>&1; then
    healthy=1
    break
  fi
  sleep 0.2
done
if [ "$healthy" -ne 1 ]; then
  tail -5 "$data"/etcd*.log >&2
  echo "demo-hosts: the etcd cluster did not come up" >&2
  exit 2
fi

mkdir -p "$out"
# As the test hosts' ctests do: with UCX's keepalive at kvferry's 1 s default, six hosts' worth of
# processes on 2 cores stall long enough for UCX to declare a live P->D endpoint dead mid-write;
# that write is left unanswered (P cannot prove it stopped) and its request waits for D's pull
# deadline. Seen here as case B with 10 of 24 requests done and P's pool held by the stuck sends
# (docs/operations.md, known limits). The user's own setting wins.
export UCX_KEEPALIVE_INTERVAL=${UCX_KEEPALIVE_INTERVAL:-30s}
etcd_args=()
for e in "${endpoints[@]}"; do etcd_args+=(--etcd "$e"); done
"$th" exec "$name" 3 "$bin" demo --out "$out" \
  --p-netns "$name-h1" --p-address "$("$th" addr 1)" \
  --d-netns "$name-h2" --d-address "$("$th" addr 2)" \
  "${etcd_args[@]}" "$@"
