#!/usr/bin/env bash
# The real-engine part of the demo: kvferry beside vLLM's own MooncakeConnector and NixlConnector
# through real `vllm serve` engines (vLLM 0.32.0's CPU build, a tiny Llama made on the spot), the
# seed's cases A, B and E time-scaled (python/bench/bench_vllm_connectors.py; ~11 min on 2 cores).
# Tables beside the seed's figures on stdout; out/vllm/{results.json,report.txt,case_*.csv} and,
# with gnuplot, out/vllm/case_{a,b,e}.png.
#
# Makes .venv with the connectors' packages (scripts/install-python.sh --bench, pinned in
# python/requirements-bench.txt) and builds kvferry._native when it is missing. A connector whose
# packages do not import is skipped with the reason; without vLLM this prints "skipped: REASON" and
# exits 0.
#
# Environment: KVFERRY_BENCH_EXTRA_PATH (see the bench), KVFERRY_BENCH_ARGS (more flags for the bench),
# KVFERRY_DEMO_NO_BUILD=1 (do not build kvferry._native when it is missing),
# KVFERRY_DEMO_NO_INSTALL=1 (use .venv as it is).
set -euo pipefail
cd "$(dirname "$0")/.."

py=.venv/bin/python
if [ "${KVFERRY_DEMO_NO_INSTALL:-0}" != 1 ]; then
  scripts/install-python.sh --bench
fi
if [ ! -x "$py" ]; then
  echo "skipped: no .venv with vLLM (scripts/install-python.sh makes it)"
  exit 0
fi
if ! "$py" -c "import vllm" >/dev/null 2>&1; then
  echo "skipped: vLLM is not importable in .venv (scripts/install-python.sh)"
  exit 0
fi
export PYTHONPATH="$PWD/python:$PWD/build/python${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import kvferry._native" >/dev/null 2>&1; then
  if [ "${KVFERRY_DEMO_NO_BUILD:-0}" = 1 ]; then
    echo "skipped: kvferry._native is not built (scripts/test.sh builds it)"
    exit 0
  fi
  echo "== building kvferry._native (build/, -DKVFERRY_PYTHON=ON)"
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVFERRY_PYTHON=ON \
    -DPython_EXECUTABLE="$PWD/$py" -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" >/dev/null
  cmake --build build -j "${JOBS:-$(nproc)}" --target kvferry kvferry_native
fi

mkdir -p out/vllm
args=(--out out/vllm)
# shellcheck disable=SC2206
args+=(${KVFERRY_BENCH_ARGS:-})
exec "$py" python/bench/bench_vllm_connectors.py "${args[@]}"
