"""kvferry's vLLM KV connector. Use it in place of MooncakeConnector with::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {...}}'

Written against vLLM 0.32.0 (python/requirements.txt). ``KvferryConnector`` is imported on first
use (vLLM's loader does ``getattr(module, "KvferryConnector")``), so that the parts that need no
vLLM (native.py, runtime.py, config.py) load in a fraction of a second: importing vLLM takes ~5 s.
"""

from typing import Any

__all__ = ["KvferryConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvferryConnector":
        from kvferry.vllm.connector import KvferryConnector

        return KvferryConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
