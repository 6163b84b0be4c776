#!/usr/bin/env bash
# The main job (the README's first command): builds kvferry and reproduces the seed experiments
# (SPEC §8 A–D) twice, each printed as tables beside the seed's figures:
#   1. with real processes on 127.0.0.1 (kvferry serve P and D over UCX, proxy, load, probe),
#      times scaled by 1/10 (480 s -> 48 s, ...), about 3 minutes; exits non-zero if a check
#      fails. Case A's timeline: out/demo/case_a_timeline.csv and out/demo/case_a.png.
#   2. in the deterministic simulator at the seed's full scale (seconds of wall time), with
#      the seed's old ledger beside the fixed one for case C, and case E (30% of clients
#      cancel on D: timeout vs lease vs lease + release). Plots: out/case_a.png, out/case_e.png.
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
echo "==== 2. Full scale in virtual time (kvferry sim --scenario all)"
build/bin/kvferry sim --scenario all --csv out
if command -v gnuplot >/dev/null; then
  [ -f out/scenario_a_timeline.csv ] && gnuplot scripts/plot_case_a.gp && echo "plot: out/case_a.png"
  [ -f out/scenario_e_timeline.csv ] && gnuplot scripts/plot_case_e.gp && echo "plot: out/case_e.png"
fi
