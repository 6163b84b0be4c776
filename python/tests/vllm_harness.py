"""Builds vLLM's real v1 Scheduler on a CPU with no network, and fakes the model runner's output,
the way vLLM's own connector unit tests do (tests/v1/kv_connector/unit), in our own code.

What it takes offline (vLLM 0.32.0, PyPI's CUDA wheel, no GPU):
- ModelConfig reads a local directory holding a tiny config.json, with skip_tokenizer_init, and
  HF_HUB_OFFLINE=1 (conftest.py) so nothing asks the Hub;
- its architecture is a class registered in-process with ModelRegistry: inspecting a real vLLM
  model file would import attention kernels and more dependencies; the class is never built;
- DeviceConfig("cpu") and kv_buffer_device="cpu": with the CUDA wheel on a GPU-less machine vLLM
  finds no platform and cannot guess a device;
- a KVCacheConfig with one full-attention group and no tensors: the scheduler only counts blocks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from vllm import ModelRegistry
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
NUM_BLOCKS = 200
ARCH = "KvferryTestForCausalLM"
EOS = 2


class KvferryTestForCausalLM(torch.nn.Module):
    """An architecture for ModelConfig to inspect; vLLM never builds it in these tests."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("scheduler tests run no model")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("scheduler tests run no model")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("scheduler tests run no model")


ModelRegistry.register_model(ARCH, KvferryTestForCausalLM)
init_none_hash(sha256)


def write_model_dir(path: Path) -> Path:
    config = {
        "architectures": [ARCH],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "eos_token_id": EOS,
        "torch_dtype": "float32",
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_vllm_config(
    model_dir: Path,
    kv_role: str,
    *,
    kv_connector: str = "KvferryConnector",
    kv_connector_module_path: str | None = "kvferry.vllm",
    extra_config: dict[str, Any] | None = None,
    kv_load_failure_policy: str = "fail",
    engine_id: str | None = None,
) -> VllmConfig:
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        max_model_len=2048,
        dtype="float32",
        seed=0,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=2048,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    transfer_config = KVTransferConfig(
        kv_connector=kv_connector,
        kv_connector_module_path=kv_connector_module_path,
        kv_role=kv_role,
        engine_id=engine_id,
        kv_buffer_device="cpu",
        kv_connector_extra_config=extra_config or {},
        kv_load_failure_policy=kv_load_failure_policy,
    )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=transfer_config,
    )


def make_kv_cache_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )


def make_scheduler(vllm_config: VllmConfig, num_blocks: int = NUM_BLOCKS) -> Scheduler:
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=make_kv_cache_config(num_blocks),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
    )


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    kv_transfer_params: dict[str, Any] | None,
    *,
    max_tokens: int = 4,
    prompt: list[int] | None = None,
) -> Request:
    if prompt is None:
        # Distinct prompts per request id, so prefix caching shares nothing between requests.
        base = 100 + 7 * (sum(map(ord, request_id)) % 97)
        prompt = [(base + i) % 1000 + 10 for i in range(num_prompt_tokens)]
    params = SamplingParams(max_tokens=max_tokens)
    if kv_transfer_params is not None:
        params.extra_args = {"kv_transfer_params": dict(kv_transfer_params)}
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def p_params(transfer_id: str) -> dict[str, Any]:
    """What vLLM's Mooncake proxy sends to P."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def d_params(transfer_id: str, engine_id: str = "prefill-0") -> dict[str, Any]:
    """What vLLM's Mooncake proxy sends to D."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": "http://127.0.0.1:8998",
        "remote_engine_id": engine_id,
        "transfer_id": transfer_id,
    }


def runner_output(
    scheduler_output: SchedulerOutput,
    *,
    token: int = 500,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
    kv_output: KVConnectorOutput | None = None,
) -> ModelRunnerOutput:
    """A model runner's answer to one step: one sampled token for every request that finished
    its prompt this step, none for a partial prefill, plus the connector's report."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        computed = _computed_after_step(scheduler_output, req_id)
        sampled.append([token] if computed is None or computed else [])
    if kv_output is None and (finished_sending or finished_recving or failed_recving):
        kv_output = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            failed_recving=failed_recving or set(),
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_output,
    )


def _computed_after_step(scheduler_output: SchedulerOutput, req_id: str) -> bool | None:
    """Whether this step reaches the end of the prompt (None: unknown, assume yes)."""
    for new in scheduler_output.scheduled_new_reqs:
        if new.req_id == req_id:
            prompt = len(new.prompt_token_ids or ())
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[req_id]
            return done >= prompt
    return None


def step(scheduler: Scheduler, **kv: Any) -> tuple[SchedulerOutput, dict]:
    """One engine step: schedule, fake the runner, feed its output back. Returns the scheduler
    output and the engine-core outputs by request id."""
    out = scheduler.schedule()
    engine_outputs = scheduler.update_from_output(out, runner_output(out, **kv))
    by_request = {
        o.request_id: o for outputs in engine_outputs.values() for o in outputs.outputs
    }
    return out, by_request


def assert_scheduler_empty(scheduler: Scheduler, num_blocks: int = NUM_BLOCKS) -> None:
    """No request left, no block held (the null block is never free), nothing pending in the
    connector."""
    assert not scheduler.requests, list(scheduler.requests)
    assert not scheduler.running and len(scheduler.waiting) == 0
    assert not scheduler.finished_recving_kv_req_ids
    assert not scheduler.failed_recving_kv_req_ids
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == num_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks[1:])



def read_line(proc, what: str, timeout_s: float = 60.0) -> str:
    """The next line a child process (an engine or a P rank the test drives) writes to stdout,
    within `timeout_s`: a child that hangs fails the test with `what`, instead of hanging it.
    A reader thread per child feeds a queue (select on the pipe would miss lines already in
    Python's read-ahead buffer); "" once the child closed its stdout."""
    import queue
    import threading

    lines = getattr(proc, "_kvferry_lines", None)
    if lines is None:
        lines = proc._kvferry_lines = queue.Queue()

        def pump():
            for line in proc.stdout:
                lines.put(line)
            lines.put("")

        threading.Thread(target=pump, daemon=True).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"{what} said nothing within {timeout_s} s") from None
    assert line, f"{what} exited with {proc.poll()}"
    return line
