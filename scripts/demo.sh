#!/usr/bin/env bash
# The main job (the README's first command): builds kvferry and reproduces the seed
# experiments (SPEC §8 A–D), printing each as a table beside the seed's figures, and plots
# P's KV usage over time for case A (timeout against lease) into out/case_a.png.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
jobs=${JOBS:-$(nproc)}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVFERRY_BENCH=OFF >/dev/null
cmake --build build -j "$jobs" --target kvferry
mkdir -p out
build/bin/kvferry sim --scenario all --csv out
if [ -f out/scenario_a_timeline.csv ] && command -v gnuplot >/dev/null; then
  gnuplot scripts/plot_case_a.gp && echo "plot: out/case_a.png"
fi
