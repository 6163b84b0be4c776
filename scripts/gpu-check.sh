#!/usr/bin/env bash
# The project's check for a machine with a GPU (the `device` tool's H200; docs/vllm.md says what
# it has verified). Needs torch with CUDA there and this source tree; nothing is built or
# installed. Under a minute on an H200; CI never runs it (no GPU), python/tests/test_staging.py
# runs its script small on the CPU.
#
#   bash scripts/gpu-check.sh            # from the repository root
#
# What it checks: host staging's CUDA path (python/kvferry/vllm/staging.py) — pinned staging,
# the side stream behind the compute stream, events polled to completion — moves every byte of
# scattered KV blocks from one cache to another, and how fast beside a copy inside the GPU.
# Not checked here: kvferry's data plane between two processes (it moves host memory, tested on
# the CPU machines) and GPU-direct registration (not built).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else
  "gpu-check: torch sees no GPU (torch " + torch.__version__ + ")")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH}
# A vLLM-sized request: 32 layers x K and V, 8 KV heads of 128, 16-token blocks (32 KiB a block
# and region); 8 requests of 64 blocks (1,024 tokens) each: 1 GiB a round.
"$PYTHON" scripts/staging_check.py --device cuda --layers 32 --blocks 2048 --requests 8 \
  --request-blocks 64 --rounds 5
# Small requests: the fixed cost of a copy (events, index uploads) shows.
"$PYTHON" scripts/staging_check.py --device cuda --layers 32 --blocks 256 --requests 16 \
  --request-blocks 1 --rounds 5
# D's free slots one apart (a pool handing out scattered slots): one copy per slot.
"$PYTHON" scripts/staging_check.py --device cuda --layers 32 --blocks 2048 --requests 8 \
  --request-blocks 64 --rounds 5 --scattered
echo "gpu-check: passed"
