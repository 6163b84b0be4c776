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


class _PatchingLoader:
    """Wraps torch's own loader: runs it, then _patch; everything else is the wrapped loader's."""

    def __init__(self, loader, finder):
        self._loader = loader
        self._finder = finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # torch sees its own loader, as without the shim.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _patch(module)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _PatchTorchOnImport:
    """A meta-path finder that gives ``torch``'s spec a loader which runs _patch right after torch
    finished importing. It stays until torch is really imported: a bare
    ``importlib.util.find_spec("torch")`` (libraries probe for torch that way) loads nothing."""

    def __init__(self):
        self._busy = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self._busy:
            return None
        import importlib.util

        self._busy = True
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            self._busy = False
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, self)
        return spec


if os.environ.get("KVFERRY_BENCH_CPU_SHIM") == "1":
    if "torch" in sys.modules:
        _patch(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _PatchTorchOnImport())
