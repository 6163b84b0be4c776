"""kvferry: KV cache transfer from prefill to decode instances, with leases.

``kvferry.vllm`` holds the vLLM KV connector; ``kvferry._native`` (built from the C++ sources
with the CMake option KVFERRY_PYTHON=ON) the runtime its worker half drives.
"""
