"""KvferryConnector: vLLM's KV connector interface, split like MooncakeConnector into a scheduler
half (scheduler.py, pure bookkeeping) and a worker half (worker.py, driving kvferry's native
runtime). vLLM builds one instance per role: SCHEDULER in the engine core, WORKER in each worker
process."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput

from kvferry.vllm.config import parse_settings
from kvferry.vllm.metadata import KvferryConnectorMetadata
from kvferry.vllm.scheduler import KvferryConnectorScheduler
from kvferry.vllm.worker import KvferryConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def adopt_vllm_logging() -> None:
    """Sends the ``kvferry`` loggers' records through vLLM's logging (its handlers, format and
    level: process name, pid and time on every line, ``VLLM_LOGGING_LEVEL`` honoured) unless the
    application configured logging itself (a handler on ``kvferry`` or on the root logger, which
    then keeps receiving them). Without it, vLLM configures only its own ``vllm`` logger:
    kvferry's INFO lines vanished and its warnings printed bare. Idempotent."""
    ours = logging.getLogger("kvferry")
    theirs = logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        adopt_vllm_logging()
        transfer_config = self._kv_transfer_config
        # Bad settings stop the engine at start, in both processes, with the key named.
        self.settings = parse_settings(transfer_config.kv_connector_extra_config)
        assert transfer_config.engine_id is not None  # vLLM fills in a uuid when unset
        self.engine_id: str = transfer_config.engine_id
        self.connector_scheduler: KvferryConnectorScheduler | None = None
        self.connector_worker: KvferryConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvferryConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config, self.settings
            )
        else:
            self.connector_worker = KvferryConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config, self.settings
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Heads outermost inside each block ([L, B, H, N, C]), so that when P and D run
        # different TP sizes a rank's heads are one contiguous slice of the block (as
        # MooncakeConnector asks). MLA has one latent head: any layout will do.
        if vllm_config.model_config is None or vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    def _scheduler(self) -> KvferryConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side call on a worker"
        return self.connector_scheduler

    def _worker(self) -> KvferryConnectorWorker:
        assert self.connector_worker is not None, "a worker-side call on the scheduler"
        return self.connector_worker

    # -- scheduler side -------------------------------------------------------------------------

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A P/D load restores the request's own blocks in every transfer group.
        return self._kv_cache_config.transfer_group_ids

    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvferryConnectorMetadata), type(meta)
        self._worker().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole requests written by P between steps, never layer by layer."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """P, in the step that completes a prompt: this layer's KV goes to the decoder pulls
        already waiting (layer_writes); the rest of the request's KV follows its end."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvferryConnectorMetadata), type(meta)
        self._worker().save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        """Nothing to wait for: the layer writes run on while P's blocks stay allocated
        (request_finished delays their free) until the runtime reports the transfer done."""
        self._worker().wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker().get_transfer_results()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker().build_worker_meta()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
