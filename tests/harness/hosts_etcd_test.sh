#!/usr/bin/env bash
# The etcd registry across test hosts (scripts/testhosts.sh, issue 12): a 3-member etcd cluster
# on hosts 1-3, P on host 4, D on host 5, the proxy and the clients on host 6, P and D finding
# each other through etcd. Checks, with real processes:
#   - requests succeed across hosts;
#   - one etcd member killed: nothing fails;
#   - two killed (no quorum): requests to the engine D already knows still succeed, and a new P
#     cannot start ("etcd registration: etcd unreachable ..."); with the members back, it can;
#   - P's host killed while D waits on it: D fails the load within the lease TTL + one poll,
#     naming the reason, instead of at its pull deadline (105 s here), and its fence releases the
#     blocks of that pull: D's pool ends idle with 0 blocks quarantined;
#   - P's host frozen (SIGSTOP) past its TTL under load: D's pool goes idle while P is frozen
#     (fences), the thawed P's writes for the fenced pulls are refused (0 corrupt), D's releases
#     reach it so it frees that KV and aborts those prefills at once, and it serves new
#     requests.
# Every process and namespace is removed at the end (the trap), also when a check fails.
# Usage: hosts_etcd_test.sh KVFERRY_BINARY REPO_ROOT. Exit 77 (skipped) without network
# namespaces or without etcd.
set -euo pipefail

bin=$1
th="$2/scripts/testhosts.sh"
name="kve$$"
needs_etcd=1
# shellcheck source=hosts_lib.sh
source "$(dirname "$0")/hosts_lib.sh"

"$th" up "$name" 6
etcd_setup 6 1 2 3
for i in 1 2 3; do start_etcd "$i"; done
wait_etcd_healthy || fail "the etcd cluster did not come up"

# As in hosts_test.sh: UCX's 1 s keepalive can leave a write unanswered after a stall on the
# veth links (docs/operations.md known limits); this test is about the registry.
export UCX_KEEPALIVE_INTERVAL=30s
p_addr=$("$th" addr 4)
d_addr=$("$th" addr 5)
extra="\"etcd_endpoints\":[$endpoints],\"etcd_lease_ttl\":2,\"kv_lease_duration\":30"
start_p() {  # start_p ENGINE HTTP_PORT BOOTSTRAP_PORT READY_FILE LOG
  "$th" exec "$name" 4 "$bin" serve --role prefill --host "$p_addr" --port "$2" \
    --num-blocks 1024 --prefill-us-per-token 200 --ready-file "$4" --kv-transfer-config \
    "{\"engine_id\":\"$1\",\"kv_role\":\"kv_producer\",\"kv_connector_extra_config\":{\"bootstrap_port\":$3,$extra}}" \
    >"$5" 2>&1
}
start_p prefill-0 8100 8998 "$out/p.json" "$out/p.log" &
disown
"$th" exec "$name" 5 "$bin" serve --role decode --host "$d_addr" --port 8200 \
  --num-blocks 1024 --ready-file "$out/d.json" --kv-transfer-config \
  "{\"kv_role\":\"kv_consumer\",\"kv_connector_extra_config\":{$extra}}" >"$out/d.log" 2>&1 &
disown
for _ in $(seq 1 150); do
  [ -s "$out/p.json" ] && [ -s "$out/d.json" ] && break
  sleep 0.1
done
[ -s "$out/p.json" ] && [ -s "$out/d.json" ] || fail "P or D did not start"
grep -q "etcd: engine prefill-0 .* registered" "$out/p.log" || fail "P did not register in etcd"

"$th" exec "$name" 6 "$bin" proxy --port 8000 --prefill "http://$p_addr:8100" \
  --prefill-bootstrap "$p_addr:8998" --prefill-engine-id prefill-0 \
  --decode "http://$d_addr:8200" >"$out/proxy.log" 2>&1 &
disown
for _ in $(seq 1 100); do
  "$th" exec "$name" 6 bash -c 'exec 3<>/dev/tcp/127.0.0.1/8000' 2>/dev/null && break
  sleep 0.1
done
load() {  # load REQUESTS
  "$th" exec "$name" 6 "$bin" load --url http://127.0.0.1:8000 --requests "$1" \
    --prompt-tokens 128 --max-tokens 4 --timeout 30 >>"$out/load.log" 2>&1
}

load 16 || fail "requests across hosts through etcd failed"
echo "through etcd across hosts: 16/16 requests"

"$th" kill "$name" 1
load 16 || fail "requests failed with one etcd member of three lost"
# If the lost member led, the other two elect a new leader first (etcd's election timeout: 1 s).
wait_etcd_healthy || fail "two members of three have no quorum"
echo "one etcd member lost: 16/16 requests, quorum kept"

"$th" kill "$name" 2
sleep 1
etcd_healthy && fail "one member of three still has a quorum"
if ! load 16; then
  for h in "4 $p_addr 8100" "5 $d_addr 8200"; do
    set -- $h
    "$th" exec "$name" "$1" bash -c "exec 3<>/dev/tcp/$2/$3; printf 'GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n' >&3; cat <&3" | grep -E "^kvferry_(requests|pull|lookup|bootstrap|hold_entries|renewal|kv_blocks_used)" >>"$out/metrics.log" || true
  done
  fail "requests to the engine D already knows failed without an etcd quorum"
fi
if start_p prefill-1 8101 8999 "$out/p1.json" "$out/p1.log"; then
  fail "a new P started without an etcd quorum"
fi
grep -q "etcd registration: etcd unreachable" "$out/p1.log" ||
  fail "the new P's failure does not say etcd is unreachable"
echo "two etcd members lost: 16/16 requests to the known engine; a new P refused: $(grep -o 'etcd registration: etcd unreachable' "$out/p1.log" | head -1)"

start_etcd 1
start_etcd 2
wait_etcd_healthy || fail "etcd did not recover its quorum"
start_p prefill-1 8101 8999 "$out/p1.json" "$out/p1.log" &
disown
for _ in $(seq 1 100); do
  [ -s "$out/p1.json" ] && break
  sleep 0.1
done
[ -s "$out/p1.json" ] || fail "a new P could not start once etcd recovered"
load 16 || fail "requests failed after etcd recovered"
echo "etcd members back: quorum, a new P registered, 16/16 requests"

# P's host frozen (SIGSTOP) under load for longer than its etcd TTL: D declares it down, fails
# what waits on it and fences its pulls (their write keys revoked), so D's pool goes idle while
# P is still frozen. When P thaws, nothing it does for those pulls lands in D's reused blocks,
# and P, back in etcd under the same incarnation, serves new requests.
p_failed_before=$(metric 4 8100 kvferry_writes_failed_total)
p_released_before=$(metric 4 8100 kvferry_releases_received_total)
d_down_before=$(metric 5 8200 kvferry_etcd_engines_down_total)
# 64 request pairs sent straight to P and D (not through the proxy, which would cancel P's half
# once D fails it): 128 blocks each, so P holds 8 prefills at a time (0.4 s each at 200 us per
# token) and D 8 loads, and the
# pulls of those loads wait at P when it freezes. P's halves stay open across the freeze, so
# the thawed P finishes them and writes for the pulls D fenced meanwhile.
"$th" exec "$name" 6 python3 - "$p_addr" "$d_addr" >"$out/freeze.log" 2>&1 <<'PY' &
import json, sys, threading, urllib.error, urllib.request
p, d = sys.argv[1], sys.argv[2]
prompt = list(range(100, 100 + 2048))
def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:
        return str(e)
results = []
def pair(i):
    xfer = f"xfer-freeze-{i}"
    pt = threading.Thread(target=lambda: results.append(("P", post(
        f"http://{p}:8100/v1/completions",
        {"model": "m", "prompt": prompt, "max_tokens": 1, "stream": False,
         "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                "transfer_id": xfer}}))))
    pt.start()
    results.append(("D", post(f"http://{d}:8200/v1/completions",
        {"model": "m", "prompt": prompt, "max_tokens": 2, "stream": False,
         "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                "transfer_id": xfer, "remote_engine_id": "prefill-0",
                                "remote_bootstrap_addr": "unused"}})))
    pt.join()
import time
start = time.time()
threads = [threading.Thread(target=pair, args=(i,)) for i in range(64)]
for t in threads: t.start()
for t in threads: t.join()
for side in ("P", "D"):
    codes = [str(r) for s, r in results if s == side]
    print(side, {c: codes.count(c) for c in sorted(set(codes))})
print(f"wall {time.time() - start:.1f} s")
PY
freeze_load=$!
sleep 0.4
"$th" freeze "$name" 4
frozen=$(date +%s.%N)
idle=""
for _ in $(seq 1 100); do
  down=$(metric 5 8200 kvferry_etcd_engines_down_total)
  used=$(metric 5 8200 kvferry_kv_blocks_used)
  quarantined=$(metric 5 8200 kvferry_quarantined_blocks)
  if [ "${down:-0}" != "${d_down_before:-0}" ] && [ "${used:-1}" = 0 ] && [ "${quarantined:-1}" = 0 ]; then
    idle=$(python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.2f}')" "$frozen")
    break
  fi
  sleep 0.1
done
"$th" thaw "$name" 4
[ -n "$idle" ] || fail "D still holds blocks for the frozen P: used ${used:-?}, quarantined ${quarantined:-?}, fences $(metric 5 8200 kvferry_fences_total)/failed $(metric 5 8200 kvferry_fences_failed_total)"
wait "$freeze_load" || true  # requests that waited on the frozen P fail, with the reason
# D released what it gave up to the P it had declared down (advisory), so the thawed P frees
# that KV and aborts the prefills nobody needs any more at once: every P half ends (503 for the
# aborted ones), none waits for blocks held for requests D gave up, until its lease ran out.
if grep -q "timed out" "$out/freeze.log"; then
  fail "P halves waited out the client's timeout after the thaw: $(tr '\n' ' ' <"$out/freeze.log")"
fi
# What became of the pulls P held when it froze: it finished their prefills and wrote, and D
# refused every such write (P counts them failed; nothing else can fail them here: D is up and
# the link never broke), or D's releases reached it first and it dropped them. Which comes first
# is a race after the thaw; either way nothing lands in D's reused blocks.
refused=0
released=0
for _ in $(seq 1 50); do
  p_failed=$(metric 4 8100 kvferry_writes_failed_total)
  refused=$(( ${p_failed%.*} - ${p_failed_before%.*} ))
  p_released=$(metric 4 8100 kvferry_releases_received_total)
  released=$(( ${p_released%.*} - ${p_released_before%.*} ))
  [ $(( refused + released )) -gt 0 ] && break
  sleep 0.1
done
[ $(( refused + released )) -gt 0 ] || fail "the thawed P neither wrote for the fenced pulls nor got D's releases (nothing was tested)"
corrupt=$(metric 5 8200 kvferry_corrupt_blocks_total)
[ "${corrupt:-1}" = 0 ] || fail "${corrupt:-no} corrupt blocks on D after P thawed"
for _ in $(seq 1 50); do  # P's lease was lost while frozen: it publishes again
  load 8 2>/dev/null && break
  sleep 0.2
done
load 8 || fail "the thawed P does not serve new requests"
echo "P's host frozen past its TTL: D's pool idle ${idle} s after the freeze (0 quarantined); after the thaw D refused ${refused} late writes of the P and it got ${released} releases, 0 corrupt, every P half ended: $(grep '^P ' "$out/freeze.log") ($(grep '^wall' "$out/freeze.log")); 8/8 new requests"

# D waits on P for a transfer P never prefills (P parks the pull); then P's host dies.
"$th" exec "$name" 6 python3 - "$d_addr" >"$out/orphan.log" 2>&1 <<'PY' &
import json, sys, time, urllib.error, urllib.request
body = {"model": "m", "prompt": list(range(100, 164)), "max_tokens": 4,
        "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                               "transfer_id": "xfer-orphan", "remote_engine_id": "prefill-0",
                               "remote_bootstrap_addr": "unused"}}
req = urllib.request.Request(f"http://{sys.argv[1]}:8200/v1/completions",
                             data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        print("status", r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print("status", e.code, e.read().decode())
print("done", time.time())
PY
orphan_pid=$!
sleep 1.5  # the pull reaches P
"$th" kill "$name" 4
killed=$(date +%s.%N)
wait "$orphan_pid" || true
grep -q "left etcd" "$out/orphan.log" || fail "the load did not fail with the etcd reason"
done_at=$(awk '$1 == "done" { print $2 }' "$out/orphan.log")
after=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" \
  "$killed" "$done_at")
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < 8 else 1)" "$after" ||
  fail "D failed the load only ${after} s after P's host died (TTL 2 s)"
echo "P's host killed: D failed the load waiting on it ${after} s later (etcd lease TTL 2 s; pull deadline 105 s)"
# D fenced the dead P (fence_writes is on with etcd): the pull's write key is revoked, so the
# blocks it quarantined go back to the pool without waiting for an answer that will not come.
released=""
for i in $(seq 1 50); do
  used=$(metric 5 8200 kvferry_kv_blocks_used)
  quarantined=$(metric 5 8200 kvferry_quarantined_blocks)
  if [ "${used:-1}" = 0 ] && [ "${quarantined:-1}" = 0 ]; then
    released=$(python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.2f}')" "$killed")
    break
  fi
  sleep 0.1
done
[ -n "$released" ] || fail "D still holds blocks for the dead P: used ${used:-?}, quarantined ${quarantined:-?}, fences $(metric 5 8200 kvferry_fences_total)/failed $(metric 5 8200 kvferry_fences_failed_total)"
echo "P's host killed: D's pool idle, 0 blocks quarantined ${released} s after the kill (fences $(metric 5 8200 kvferry_fences_total), failed $(metric 5 8200 kvferry_fences_failed_total))"
echo "PASS"
