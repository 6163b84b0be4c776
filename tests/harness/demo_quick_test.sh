#!/usr/bin/env bash
# e2e: `kvferry demo --quick --scenario S` must exit 0 and leave no process behind.
# Usage: demo_quick_test.sh KVFERRY_BINARY SCENARIO OUT_DIR
# The demo tags every child with KVFERRY_DEMO_RUN=<demo pid>-<random>; after the demo exits no
# process may still carry its tag.
set -u
bin=$1
scenario=$2
out=$3
rm -rf "$out"
mkdir -p "$out"
"$bin" demo --quick --scenario "$scenario" --out "$out" &
pid=$!
wait "$pid"
rc=$?
left=""
for attempt in 1 2 3 4 5 6 7 8 9 10; do
  left=$(grep -l -a "KVFERRY_DEMO_RUN=${pid}-" /proc/[0-9]*/environ 2>/dev/null |
         sed -e 's#/proc/##' -e 's#/environ##' | tr '\n' ' ')
  [ -z "$left" ] && break
  sleep 0.2
done
if [ -n "$left" ]; then
  echo "FAIL: processes left behind by the demo: $left"
  ps -o pid,pgid,args -p "${left// /,}" 2>/dev/null || true
  for p in $left; do kill -9 "$p" 2>/dev/null || true; done
  exit 1
fi
if [ "$rc" -ne 0 ]; then
  echo "FAIL: kvferry demo --quick --scenario $scenario exited $rc"
  exit 1
fi
echo "ok: demo --quick --scenario $scenario exited 0, no process left behind"
