"""The scheduler half of KvferryConnector: decides, in vLLM's scheduler process, which requests
load KV from a prefill instance (D) or hold their KV for a decoder (P), and hands that to the
worker half through KvferryConnectorMetadata.

It keeps MooncakeConnector's semantics for the same ``kv_transfer_params`` (what vLLM's Mooncake
proxy sends), with these deliberate differences:

- D: a ``do_remote_prefill`` request without ``remote_engine_id``, ``remote_bootstrap_addr`` and
  ``transfer_id`` is prefilled locally (0 matched tokens); MooncakeConnector reports its prompt
  as matched and then never loads it, so it would wait forever.
- D: a request is tracked from ``on_new_request`` (queued) until its receive settles or it ends,
  so the worker can renew its lease while it waits and release it when it ends.
- D: a full local prefix hit (nothing to load) releases the transfer instead of sending an empty
  pull whose completion vLLM would have to ignore.
- P: a request that finished with ``FINISHED_STOPPED`` (its one token was a stop token) keeps its
  KV for D like ``FINISHED_LENGTH_CAPPED`` (as NixlConnector does); MooncakeConnector frees it.
- P: ``request_finished`` returns the ``kv_transfer_params`` D needs to pull, for a router that
  sends D's request after P's (MooncakeConnector returns none; its proxy asks P's bootstrap).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvferry.vllm.config import ConnectorSettings
from kvferry.vllm.metadata import (
    BlockIds,
    HoldSpec,
    KvferryConnectorMetadata,
    KvferryWorkerMetadata,
    LoadSpec,
)
from kvferry.vllm.native import RemoteSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvferry.vllm")

# P keeps a finished request's KV for D only when its prefill really completed.
_HANDOFF_STATUSES = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def remote_source(params: dict[str, Any] | None) -> RemoteSource | None:
    """D's pull source from kv_transfer_params, or None when a field is missing or mistyped."""
    if not params:
        return None
    engine = params.get("remote_engine_id")
    addr = params.get("remote_bootstrap_addr")
    transfer = params.get("transfer_id")
    if not all(isinstance(v, str) and v for v in (engine, addr, transfer)):
        return None
    return RemoteSource(engine_id=engine, bootstrap_addr=addr, transfer_id=transfer)


class KvferryConnectorScheduler:
    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        settings: ConnectorSettings,
    ):
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        self.engine_id = engine_id
        self.settings = settings
        self.is_producer = transfer_config.is_kv_producer
        self.is_consumer = transfer_config.is_kv_consumer
        self.kv_cache_config = kv_cache_config

        if kv_cache_config.has_mamba_layers:
            raise ValueError(
                "KvferryConnector does not transfer Mamba/linear-attention state; "
                "this model's KV cache has Mamba layers"
            )
        if any(g.kv_cache_spec.prefix_replay_tokens > 0 for g in kv_cache_config.kv_cache_groups):
            raise ValueError(
                "KvferryConnector does not support KV caches with prefix replay windows"
            )

        # With the hybrid allocator, a sliding-window group holds blocks that left the window;
        # only the last ones (window / block_size, plus one for the boundary) carry KV worth
        # sending. Without it vLLM keeps one group and every block.
        hma = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        self._window_blocks: list[int] = []
        for group in kv_cache_config.transfer_groups:
            spec = group.kv_cache_spec
            if hma and isinstance(spec, SlidingWindowSpec):
                self._window_blocks.append(-(-spec.sliding_window // spec.block_size) + 1)
            else:
                self._window_blocks.append(0)

        # What P returns to the router in kv_transfer_params: its bootstrap, when it can name
        # it without guessing an address (bootstrap_server_address, or VLLM_HOST_IP).
        if settings.bootstrap_server_address:
            address = settings.bootstrap_server_address.removeprefix("http://")
            self._bootstrap_addr: str | None = f"http://{address}"
        elif os.environ.get("VLLM_HOST_IP"):
            self._bootstrap_addr = f"http://{os.environ['VLLM_HOST_IP']}:{settings.bootstrap_port}"
        else:
            self._bootstrap_addr = None

        # Pending for the next metadata (reset by build_connector_meta).
        self._track: dict[str, RemoteSource] = {}
        self._load: dict[str, LoadSpec] = {}
        self._release: list[str] = []
        self._admit: dict[str, str] = {}
        self._hold: dict[str, HoldSpec] = {}
        self._drop: dict[str, str] = {}

        # Long-lived: D requests whose transfer the worker tracks (renews) until their receive
        # settles or they end; P requests admitted, and those whose blocks are held for D.
        self._tracked: dict[str, RemoteSource] = {}
        self._admitted: dict[str, str] = {}
        self._holding: dict[str, str] = {}
        # P: the request that owns each live transfer id (admitted or held). A second request
        # naming a live transfer id (a router's retry, a client reaching P directly) is served
        # as a plain request: the runtime keys a transfer by its id, and two owners would let
        # D read one request's KV from blocks vLLM freed for the other.
        self._owner: dict[str, str] = {}
        # P, with layer_writes: admitted requests still prefilling and the blocks vLLM gave them
        # so far (from each step's scheduler output), to tell the worker, in the step that
        # completes a prompt, which blocks its layers are computed into.
        self._prefilling: dict[str, Request] = {}
        self._prefill_blocks: dict[str, list[list[int]]] = {}

        # D: why loads failed, for a router to ask (config.py: load_failure_port), and the
        # transfer of each load in flight, to file the reasons under.
        self._load_failures: Any = None
        self._load_transfer: dict[str, str] = {}
        if self.is_consumer and settings.load_failure_port is not None:
            import kvferry._native as native

            self._load_failures = native.LoadFailureService(
                host="0.0.0.0", port=settings.load_failure_port)
            logger.info("kvferry: load-failure service on port %d", self._load_failures.port)

        if settings.ignored_keys:
            logger.warning(
                "KvferryConnector ignores kv_connector_extra_config keys %s",
                ", ".join(settings.ignored_keys),
            )

    # -- helpers ----------------------------------------------------------------------------

    def _transfer_blocks(self, block_ids: tuple[list[int], ...] | list[list[int]]) -> BlockIds:
        """The blocks of the transfer groups, clipped to the sliding window where it applies."""
        groups = list(block_ids)
        if len(groups) != len(self.kv_cache_config.transfer_group_ids):
            groups = list(self.kv_cache_config.select_transfer_block_ids(groups))
        return [
            list(blocks[-keep:]) if keep and len(blocks) > keep else list(blocks)
            for blocks, keep in zip(groups, self._window_blocks)
        ]

    def _stop_tracking(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is not None:
            self._release.append(request_id)

    # -- vLLM's scheduler-side calls ----------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self.is_consumer:
            return
        source = remote_source(params)
        if source is None:
            logger.warning(
                "request %s asks for a remote prefill without remote_engine_id, "
                "remote_bootstrap_addr and transfer_id (%s); it will be prefilled here",
                request.request_id,
                params,
            )
            return
        self._tracked[request.request_id] = source
        self._track[request.request_id] = source

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if (
            not params
            or not params.get("do_remote_prefill")
            or not self.is_consumer
            or remote_source(params) is None
        ):
            return 0, False
        # The whole prompt comes from P; vLLM's scheduler then recomputes the last prompt
        # token (num_computed_tokens = prompt - 1) to sample the first output token.
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count > 0:
            return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        request_id = request.request_id
        if params.get("do_remote_prefill") and self.is_consumer:
            source = self._tracked.get(request_id) or remote_source(params)
            # One transfer per request: a request re-allocated after preemption loads nothing.
            params["do_remote_prefill"] = False
            if source is None:
                return
            block_ids = (
                self._transfer_blocks(blocks.get_unhashed_block_ids_all_groups())
                if num_external_tokens > 0
                else []
            )
            if any(block_ids):
                self._load[request_id] = LoadSpec(source=source, block_ids=block_ids)
                self._load_transfer[request_id] = source.transfer_id
            else:
                # A full local prefix hit: nothing to pull; tell P it may free the KV.
                self._tracked.setdefault(request_id, source)
                self._stop_tracking(request_id)
        elif params.get("do_remote_decode") and self.is_producer:
            transfer_id = params.get("transfer_id")
            if not isinstance(transfer_id, str) or not transfer_id:
                logger.warning(
                    "request %s has do_remote_decode without a transfer_id; its KV will not "
                    "be held for a decoder",
                    request_id,
                )
                return
            owner = self._owner.get(transfer_id)
            if owner is not None and owner != request_id:
                logger.warning(
                    "request %s names transfer %s, which request %s already uses; it is "
                    "served without handing its KV to a decoder",
                    request_id, transfer_id, owner,
                )
                return
            if request_id not in self._admitted:
                self._admitted[request_id] = transfer_id
                self._admit[request_id] = transfer_id
                self._owner[transfer_id] = request_id
                if self.settings.layer_writes:
                    self._prefilling[request_id] = request

    def _layer_writes(self, scheduler_output: SchedulerOutput) -> dict[str, HoldSpec]:
        """P: the admitted requests whose prompt this step completes, with their blocks: the
        worker sends each layer's KV to the pulls already waiting as it is computed."""
        if not self._prefilling:
            return {}
        for data in scheduler_output.scheduled_new_reqs:
            if data.req_id in self._prefilling:
                self._prefill_blocks[data.req_id] = [list(b) for b in data.block_ids]
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if request_id not in self._prefilling or new is None:
                continue
            known = self._prefill_blocks.get(request_id)
            if known is None or request_id in cached.resumed_req_ids:
                self._prefill_blocks[request_id] = [list(b) for b in new]
            else:
                for blocks, more in zip(known, new):
                    blocks.extend(more)
        layers: dict[str, HoldSpec] = {}
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._prefilling.get(request_id)
            blocks = self._prefill_blocks.get(request_id)
            if request is None or blocks is None:
                continue
            # num_computed_tokens advances after this call (vLLM's _update_after_schedule).
            if request.num_computed_tokens + scheduled < request.num_prompt_tokens:
                continue
            transfer_id = self._admitted.get(request_id)
            if transfer_id is not None:
                layers[request_id] = HoldSpec(transfer_id=transfer_id,
                                              block_ids=self._transfer_blocks(blocks))
            # One step completes a prompt: nothing more to follow for it.
            del self._prefilling[request_id]
            del self._prefill_blocks[request_id]
        return layers

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvferryConnectorMetadata:
        meta = KvferryConnectorMetadata(
            layers=self._layer_writes(scheduler_output),
            track=self._track,
            load=self._load,
            release=self._release,
            admit=self._admit,
            hold=self._hold,
            drop=self._drop,
        )
        self._track, self._load, self._release = {}, {}, []
        self._admit, self._hold, self._drop = {}, {}, {}
        return meta

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        request_id = request.request_id
        if not params:
            return False, None

        if self.is_consumer and (request_id in self._tracked or params.get("do_remote_prefill")):
            # D: the request ended while its transfer is tracked: queued (do_remote_prefill is
            # still set: it never got blocks), receiving (vLLM then keeps its blocks until the
            # worker reports it finished), or just finished. Stop renewing, release to P.
            params["do_remote_prefill"] = False
            self._stop_tracking(request_id)
            return False, None

        if not params.get("do_remote_decode") or not self.is_producer:
            return False, None
        self._prefilling.pop(request_id, None)
        self._prefill_blocks.pop(request_id, None)
        transfer_id = self._admitted.pop(request_id, None)
        if transfer_id is None:
            # Never admitted: ended before its blocks were allocated, or a duplicate of a live
            # transfer. Only a transfer nobody owns may be dropped (its pulls then fail at once).
            transfer_id = params.get("transfer_id")
            if isinstance(transfer_id, str) and transfer_id and transfer_id not in self._owner:
                self._drop[request_id] = transfer_id
            return False, None
        self._admit.pop(request_id, None)

        blocks = self._transfer_blocks(block_ids)
        if request.status not in _HANDOFF_STATUSES or not any(blocks):
            # Aborted, failed or never computed: nothing to hand over. The worker tells P's
            # runtime, so a pull waiting for this transfer fails at once.
            self._drop[request_id] = transfer_id
            self._owner.pop(transfer_id, None)
            return False, None

        self._hold[request_id] = HoldSpec(transfer_id=transfer_id, block_ids=blocks)
        self._holding[request_id] = transfer_id
        decode_params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "transfer_id": transfer_id,
        }
        if self._bootstrap_addr is not None:
            decode_params["remote_bootstrap_addr"] = self._bootstrap_addr
        return True, decode_params

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvferryWorkerMetadata) and meta.failed_loads:
            for request_id, reason in meta.failed_loads.items():
                transfer_id = self._load_transfer.get(request_id)
                if transfer_id is not None and self._load_failures is not None:
                    self._load_failures.record(transfer_id, reason)
        for request_id in connector_output.finished_recving or ():
            self._load_transfer.pop(request_id, None)
        # A settled receive (success or failure) ends tracking: the worker stopped renewing.
        for request_id in connector_output.finished_recving or ():
            self._tracked.pop(request_id, None)
        for request_id in connector_output.failed_recving or ():
            self._tracked.pop(request_id, None)
        for request_id in connector_output.finished_sending or ():
            transfer_id = self._holding.pop(request_id, None)
            if transfer_id is not None and self._owner.get(transfer_id) == request_id:
                del self._owner[transfer_id]
        if isinstance(meta, KvferryWorkerMetadata) and meta.dropped_transfers:
            logger.warning(
                "the prefill runtime dropped %d transfer(s) before their prefill finished "
                "(their decoder released them or stopped renewing): %s; vLLM lets a connector "
                "abort nothing, so their KV is freed when each prefill ends",
                len(meta.dropped_transfers),
                ", ".join(meta.dropped_transfers[:8]),
            )

    def shutdown(self) -> None:
        if self._load_failures is not None:
            self._load_failures.stop()
            self._load_failures = None

    @property
    def load_failure_port(self) -> int | None:
        return self._load_failures.port if self._load_failures is not None else None

    # -- introspection for tests and logs ------------------------------------------------------

    @property
    def tracked_requests(self) -> frozenset[str]:
        return frozenset(self._tracked)

    @property
    def holding_requests(self) -> frozenset[str]:
        return frozenset(self._holding)
