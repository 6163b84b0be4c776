#!/usr/bin/env bash
# Real processes on three test hosts (scripts/testhosts.sh): P on host 1, D on host 2, the proxy
# and the load on host 3, the KV moving between hosts over UCX tcp on the veth links. Checks the
# hosts are isolated from this machine, that requests succeed across hosts with every block
# verified, that a partition of D shorter than the lease costs nothing, that one longer than the
# lease makes P free D's KV within lease + one pass and D's late pulls fail at once (nothing
# corrupt once the link heals), and that every process and namespace is gone at the end (also
# when a check fails: the trap tears down).
# Usage: hosts_test.sh KVFERRY_BINARY REPO_ROOT. Exit 77 (skipped) without network namespaces.
set -euo pipefail

bin=$1
th="$2/scripts/testhosts.sh"
name="kvh$$"
needs_etcd=0
# shellcheck source=hosts_lib.sh
source "$(dirname "$0")/hosts_lib.sh"

"$th" up "$name" 3
p_addr=$("$th" addr 1)
d_addr=$("$th" addr 2)

# Isolation: the hosts' addresses exist only inside their namespaces (this machine's own
# interfaces carry none of them), and host 1 reaches host 2 over the bridge.
if [[ "$(ip -o addr show)" == *"inet ${p_addr%.*}."* ]]; then
  fail "this machine has an address of the test hosts' range"
fi
[[ "$("$th" exec "$name" 1 ip -o addr show eth0)" == *"inet $p_addr/"* ]] ||
  fail "host 1 has no $p_addr"
reached=0
for _ in $(seq 1 50); do  # the links take a moment to come up
  answer=$("$th" exec "$name" 1 bash -c "exec 3<>/dev/tcp/$d_addr/9" 2>&1 || true)
  if [[ "$answer" == *refused* ]]; then
    reached=1
    break
  fi
  sleep 0.1
done
[ "$reached" -eq 1 ] || fail "host 1 cannot reach host 2 (no RST from $d_addr)"

lease='"kv_lease_duration":3'
# UCX's own keepalive (1 s by default in kvferry) declares a P->D endpoint dead during a
# partition of a second or more, and a write that fails that way cannot be fenced from D's side,
# so its request stays quarantined until pull_timeout: recovery from that is open work (issue
# 12, docs/operations.md known limits). This test checks the protocol's own behaviour across
# partitions, so UCX's keepalive is set above the longest partition here.
export UCX_KEEPALIVE_INTERVAL=30s
"$th" exec "$name" 1 "$bin" serve --role prefill --host "$p_addr" --port 8100 \
  --num-blocks 1024 --ready-file "$out/p.json" --kv-transfer-config \
  "{\"kv_role\":\"kv_producer\",\"kv_connector_extra_config\":{\"bootstrap_port\":8998,$lease}}" \
  >"$out/p.log" 2>&1 &
disown  # torn down by the trap, not waited for
"$th" exec "$name" 2 "$bin" serve --role decode --host "$d_addr" --port 8200 \
  --num-blocks 1024 --max-running 4 --ready-file "$out/d.json" --kv-transfer-config \
  "{\"kv_role\":\"kv_consumer\",\"kv_connector_extra_config\":{$lease}}" \
  >"$out/d.log" 2>&1 &
disown
for _ in $(seq 1 150); do
  [ -s "$out/p.json" ] && [ -s "$out/d.json" ] && break
  sleep 0.1
done
[ -s "$out/p.json" ] && [ -s "$out/d.json" ] || fail "P or D did not start"
engine=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["engine_id"])' "$out/p.json")

"$th" exec "$name" 3 "$bin" proxy --port 8000 --prefill "http://$p_addr:8100" \
  --prefill-bootstrap "$p_addr:8998" --prefill-engine-id "$engine" \
  --decode "http://$d_addr:8200" >"$out/proxy.log" 2>&1 &
disown
for _ in $(seq 1 100); do
  "$th" exec "$name" 3 bash -c 'exec 3<>/dev/tcp/127.0.0.1/8000' 2>/dev/null && break
  sleep 0.1
done

load() {  # load REQUESTS MAX_TOKENS
  "$th" exec "$name" 3 "$bin" load --url http://127.0.0.1:8000 --requests "$1" \
    --prompt-tokens 256 --max-tokens "$2" --timeout 30 >>"$out/load.log" 2>&1
}
metric() {  # metric HOST ADDR PORT NAME: the value of NAME on that host's /metrics
  "$th" exec "$name" "$1" bash -c "exec 3<>/dev/tcp/$2/$3; \
    printf 'GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n' >&3; cat <&3" |
    awk -v m="$4" '$1 == m { print $2 }'
}
# wait_metric HOST ADDR PORT NAME OP VALUE: polls for 5 s until NAME's value OP VALUE (a test
# operator: -eq, -ge). Prints the last value; fails if the condition never held.
wait_metric() {
  local v=""
  for _ in $(seq 1 50); do
    v=$(metric "$1" "$2" "$3" "$4")
    if [ -n "$v" ] && [ "${v%.*}" "$5" "$6" ]; then
      echo "$v"
      return 0
    fi
    sleep 0.1
  done
  echo "${v:-none}"
  return 1
}

load 32 8 || fail "requests across hosts failed"
verified=$(metric 2 "$d_addr" 8200 kvferry_verified_blocks_total)
corrupt=$(metric 2 "$d_addr" 8200 kvferry_corrupt_blocks_total)
[ "${verified%.*}" -ge 512 ] || fail "D verified only ${verified:-no} blocks"
[ "${corrupt%.*}" -eq 0 ] || fail "$corrupt corrupt blocks"
echo "across hosts: 32/32 requests, $verified blocks verified on D, 0 corrupt"

# D cut off for 1 s (a third of the lease) while its requests decode (500 tokens at 2 ms a step:
# ~1 s each) and renew: nothing fails.
load 8 500 &
load_pid=$!
sleep 0.3
"$th" partition "$name" 2
sleep 1
"$th" heal "$name" 2
wait "$load_pid" || fail "a partition shorter than the lease failed requests"
echo "a 1 s partition of D under load (lease 3 s): 8/8 requests"

# D cut off for 6 s (twice the lease) while 8 requests queue on it (its 4 running slots busy)
# with their KV held on P: P frees it within lease + one pass of D's last renewal, and once the
# link heals D's pulls of it fail at once (TOMBSTONED), nothing corrupt. The 4 running requests
# already have their KV: they finish once the link is back.
load 4 1500 &
running_pid=$!
running=$(wait_metric 2 "$d_addr" 8200 kvferry_requests_running -ge 4) ||
  fail "D runs only $running requests"
load 8 1000 &
load_pid=$!
held=$(wait_metric 1 "$p_addr" 8100 'kvferry_held_blocks{state="ready"}' -ge 64) ||
  fail "P held only $held blocks for the queued requests"
"$th" partition "$name" 2
cut=$(date +%s.%N)
freed=""
for _ in $(seq 1 70); do
  held=$(metric 1 "$p_addr" 8100 'kvferry_held_blocks{state="ready"}')
  if [ "${held%.*}" -eq 0 ]; then
    freed=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" \
      "$cut" "$(date +%s.%N)")
    break
  fi
  sleep 0.1
done
sleep 1
"$th" heal "$name" 2
[ -n "$freed" ] || fail "P still held D's KV 7 s into a partition (lease 3 s)"
# Renewals stop at the cut (at most lease/6 earlier): freed by lease + a pass + slack.
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= 5.0 else 1)" "$freed" ||
  fail "P freed D's KV only ${freed} s into the partition (lease 3 s)"
wait "$load_pid" && fail "no request failed although P freed their KV"
wait "$running_pid" || fail "requests that had their KV failed across the partition"
grep -qi "tombstoned\|late pull" "$out/load.log" || fail "the failures do not say TOMBSTONED"
corrupt=$(metric 2 "$d_addr" 8200 kvferry_corrupt_blocks_total)
[ "${corrupt%.*}" -eq 0 ] || fail "$corrupt corrupt blocks after the partition"
used_d=$(wait_metric 2 "$d_addr" 8200 kvferry_kv_blocks_used -eq 0) ||
  fail "D still uses $used_d blocks"
echo "a 6 s partition of D (lease 3 s): P freed its KV ${freed} s in; late pulls TOMBSTONED; 0 corrupt"

used_p=$(wait_metric 1 "$p_addr" 8100 kvferry_kv_blocks_used -eq 0) ||
  fail "P still uses $used_p blocks"
echo "PASS"
