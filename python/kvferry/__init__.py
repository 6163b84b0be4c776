"""kvferry: moves a request's KV cache from a prefill instance to a decode instance, with the
lifetime rules of docs/design.md (leases, tombstones, multi-peer settlement).

`kvferry._native` is the C++ runtime's binding (python/src/native.cc); `kvferry.vllm` holds the
vLLM KV connector. A development build puts `_native` in `<build>/python/kvferry/`: the package
path is extended (pkgutil) so that a build directory on `sys.path` provides it.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
