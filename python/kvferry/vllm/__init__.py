"""kvferry's vLLM KV connector. Use it in place of MooncakeConnector with::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {...}}'

Written against vLLM 0.32.0 (python/requirements.txt); importing this package imports vLLM.
"""

from kvferry.vllm.connector import KvferryConnector

__all__ = ["KvferryConnector"]
