#!/usr/bin/env bash
# The main job (the README's first command): builds kvferry and reproduces the seed experiments
# (SPEC §8 A–D) three times, each printed as tables beside the seed's figures:
#   1. with real processes on 127.0.0.1 (kvferry serve P and D over UCX, proxy, load, probe),
#      times scaled by 1/10 (480 s -> 48 s, ...), about 3 minutes; exits non-zero if a check
#      fails. Case A's timeline: out/demo/case_a_timeline.csv and out/demo/case_a.png.
#   2. the same across test hosts (scripts/demo-hosts.sh): P, D, the proxy and a 3-member etcd
#      on network namespaces joined by veth links, UCX over tcp, about 4 minutes (out/demo-hosts);
#      skipped, saying so, where namespaces or etcd are unavailable.
#   3. in the deterministic simulator at the seed's full scale (seconds of wall time), with
#      the seed's old ledger beside the fixed one for case C, and case E (30% of clients
#      cancel on D: timeout vs lease vs lease + release). Plots: out/case_a.png, out/case_e.png.
#   4. through real `vllm serve` engines (vLLM 0.32.0's CPU build, a tiny model made on the
#      spot): KvferryConnector beside vLLM's own MooncakeConnector and NixlConnector, identical
#      outputs, TTFT and handoff, cases A, B and E time-scaled (scripts/demo-vllm.sh, about 11
#      minutes; out/vllm). It installs .venv with the connectors' pinned packages; it says
#      "skipped: REASON" where vLLM cannot run.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
jobs=${JOBS:-$(nproc)}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$jobs" --target kvferry
mkdir -p out

echo "==== 1. Real processes on loopback (kvferry demo)"
build/bin/kvferry demo --out out/demo

echo
echo "==== 2. Across test hosts (scripts/demo-hosts.sh: P, D, proxy and etcd on network namespaces)"
status=0
KVFERRY_DEMO_NO_BUILD=1 scripts/demo-hosts.sh || status=$?
if [ "$status" -eq 77 ]; then
  echo "(skipped: this machine cannot make network namespaces, or etcd is missing)"
elif [ "$status" -ne 0 ]; then
  exit "$status"
fi

echo
echo "==== 3. Full scale in virtual time (kvferry sim --scenario all)"
build/bin/kvferry sim --scenario all --csv out
if command -v gnuplot >/dev/null; then
  [ -f out/scenario_a_timeline.csv ] && gnuplot scripts/plot_case_a.gp && echo "plot: out/case_a.png"
  [ -f out/scenario_e_timeline.csv ] && gnuplot scripts/plot_case_e.gp && echo "plot: out/case_e.png"
fi

echo
echo "==== 4. Real vLLM engines: KvferryConnector beside MooncakeConnector and NixlConnector (scripts/demo-vllm.sh)"
scripts/demo-vllm.sh
