"""Loading one module of kvferry.vllm by path, for tests that must not import vLLM (importing
the package kvferry.vllm would)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_kvferry_vllm_module(name: str) -> ModuleType:
    """python/kvferry/vllm/<name>.py as module ``kvferry_vllm_<name>``."""
    spec = importlib.util.spec_from_file_location(
        f"kvferry_vllm_{name}", Path(__file__).resolve().parents[1] / f"kvferry/vllm/{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
