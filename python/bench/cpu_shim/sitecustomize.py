"""BENCH/TEST SETUP SHIM, not part of kvferry: lets vLLM's own MooncakeConnector start on a CPU-only
torch, so that bench_vllm_connectors.py can run it beside KvferryConnector on this machine.

MooncakeConnector's worker (vLLM 0.32.0) asks ``torch.accelerator.current_device_index()`` for the
device it runs on. CPU torch has no accelerator and raises ``RuntimeError: Cannot access
accelerator device when none is available``; the engine then hangs instead of exiting. This answers
that one call with 0 when no accelerator is available (the only index a CPU engine has) and leaves
it alone everywhere else. Nothing in vLLM or Mooncake is edited.

It is active only when ``KVFERRY_BENCH_CPU_SHIM=1`` is in the environment and this directory is on
``PYTHONPATH`` (Python imports the first ``sitecustomize`` it finds at start, in every process,
the engine core's included). torch is patched the moment it is first imported, so processes that
never import torch pay nothing.
"""

from __future__ import annotations

import os
import sys


def _patch(torch) -> None:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or getattr(accelerator, "_kvferry_bench_shim", False):
        return
    original = accelerator.current_device_index

    def current_device_index() -> int:
        if not accelerator.is_available():
            return 0
        return original()

    accelerator.current_device_index = current_device_index
    accelerator._kvferry_bench_shim = True


class _PatchTorchOnImport:
    """A meta-path finder that runs _patch right after ``torch`` finishes importing."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


if os.environ.get("KVFERRY_BENCH_CPU_SHIM") == "1":
    if "torch" in sys.modules:
        _patch(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _PatchTorchOnImport())
