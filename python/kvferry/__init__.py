"""kvferry: moves a request's KV cache from a prefill instance to a decode instance, with the
lifetime rules of docs/design.md (leases, tombstones, multi-peer settlement).

``kvferry.vllm`` holds the vLLM KV connector; ``kvferry._native`` (python/src/native.cc, built
from the C++ sources with the CMake option KVFERRY_PYTHON=ON) the runtime its worker half drives.
A development build puts ``_native`` in ``<build>/python/kvferry/``: the package path is extended
(pkgutil) so that a build directory on ``sys.path`` provides it.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
