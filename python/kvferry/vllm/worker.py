"""The worker half of KvferryConnector: runs in each vLLM worker process (one per TP rank),
registers the KV cache with kvferry's native runtime and turns each step's metadata into calls on
it (native.py specifies that interface), and its results into what vLLM's scheduler expects.

vLLM's rules this half enforces, because breaking them crashes vLLM's scheduler:
- a request id appears in ``finished_recving`` only if the scheduler allocated blocks for its
  load, and exactly once (the scheduler asserts the request still exists);
- a request id appears in ``finished_sending`` only after its request finished and its blocks
  were handed to P's runtime to hold, and exactly once.
"""

from __future__ import annotations

import dataclasses

import hashlib
import logging
import os
import time
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvferry.vllm.config import ConnectorSettings
from kvferry.vllm.metadata import KvferryConnectorMetadata, KvferryWorkerMetadata
from kvferry.vllm.native import (
    DecodeWorker,
    KvRegion,
    NativeModule,
    PrefillWorker,
    WorkerOptions,
)
from kvferry.vllm.runtime import load_native
from kvferry.vllm.staging import (
    BlockCopier,
    DecodeStaging,
    Handed,
    LoadFailed,
    Loaded,
    PrefillStaging,
    Refused,
    StagingSlots,
    Start,
    WaitWatch,
    stage_regions,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvferry.vllm")

# How long a wait for staging slots may stand still (no request taking or giving back slots)
# before the worker warns: a load lands in milliseconds to seconds and a lease ends within one
# lease, so half a minute without either means the waits depend on each other or on a peer gone
# silent (staging.py; a CI run stood still for 2 minutes, docs/vllm.md "Staging budgets").
STAGING_STALL_S = 30.0

# Why P dropped a transfer before a decoder took it (the hold table's reasons, native.py take_events).
_UNCLAIMED = {
    "expired": "its decoder neither pulled nor renewed it for a whole lease ({lease:g} s)",
    "dead_decoder": "its decoder stopped renewing it for a whole lease ({lease:g} s) before "
                    "its prefill finished",
    "wait_timeout": "a decoder's pull waited abort_request_timeout for a prefill that never "
                    "finished",
}


def _dense_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t`` if its elements fill one contiguous run in some dimension order (a
    permuted layout such as HND inside a block), else None."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return t.numel() * t.element_size()


def kv_regions(
    layer_name: str, cache: torch.Tensor, group: int, num_blocks: int
) -> list[KvRegion]:
    """The regions of one layer's KV cache tensor, for the layouts vLLM hands connectors:

    - block-major, ``cache.shape[0]`` blocks: vLLM 0.32's per-layer ``[B, H, N, C]`` views
      (C in bytes), MLA's latent cache ``[num_blocks, block_size, head_size]``, and kernel
      blocks that split each scheduler block into ``cache.shape[0] // num_blocks`` pieces;
    - flash-attention's separate K and V: ``[2, num_blocks, block_size, heads, head_size]``.

    Each block's bytes must be one dense run (any order inside it), or ValueError names why.
    The regions describe the tensor wherever it lives; whether they are registered as they are
    (host memory) or through staging is the worker's choice (``kv_staging``).
    """
    element = cache.element_size()
    # Where the heads are among a part's logical dims (after the block dim): flash-attention's
    # [2, B, N, H, D] halves are [B, N, H, D]; vLLM 0.32's views are [B, H, N, C] (its logical
    # order whatever the physical layout, kv_cache_layout.py); MLA's [B, N, D] has none.
    if cache.dim() == 5 and cache.shape[0] == 2 and cache.shape[1] == num_blocks:
        parts = [("k", cache[0]), ("v", cache[1])]
        heads_dim: int | None = 2
    elif cache.dim() >= 2 and cache.shape[0] % num_blocks == 0:
        parts = [("kv", cache)]
        heads_dim = 1 if cache.dim() == 4 else None
    else:
        raise ValueError(
            f"layer {layer_name}: KV cache of shape {tuple(cache.shape)} is neither block-major "
            f"({num_blocks} blocks in dim 0) nor flash-attention's [2, {num_blocks}, ...]"
        )
    regions = []
    for part, t in parts:
        per_block = t.shape[0] // num_blocks  # kernel blocks per scheduler block
        block = t[:per_block]
        block_bytes = _dense_bytes(block)
        if block_bytes is None:
            raise ValueError(
                f"layer {layer_name}: a block's KV is not one contiguous run "
                f"(shape {tuple(t.shape)}, strides {t.stride()}); use a block-contiguous "
                "KV cache layout such as LBHNC"
            )
        block_stride = t.stride(0) * per_block * element
        heads_outermost = _heads_outermost(block, heads_dim)
        regions.append(
            KvRegion(
                layer_name=layer_name,
                part=part,
                group=group,
                data_ptr=t.data_ptr(),
                nbytes=(num_blocks - 1) * block_stride + block_bytes,
                num_blocks=num_blocks,
                block_stride=block_stride,
                block_bytes=block_bytes,
                heads_outermost=heads_outermost,
            )
        )
    return regions


def _heads_outermost(block: torch.Tensor, heads_dim: int | None) -> bool:
    """Whether, inside one block (dense), each head's bytes are one run: the heads dim has the
    largest stride of the dims after the block dim. A block without a heads dim (MLA) or with
    one head is trivially so; a shape this does not know is not (the runtime then refuses
    head slices rather than guess)."""
    if heads_dim is None:
        return block.dim() == 3  # MLA's [B, N, D]: no head to slice
    if block.shape[heads_dim] == 1:
        return True
    others = [block.stride(i) for i in range(1, block.dim())
              if i != heads_dim and block.shape[i] > 1]
    return all(block.stride(heads_dim) > stride for stride in others)


def _kv_heads(vllm_config: VllmConfig) -> int:
    """The model's KV heads, which TP ranks split (1 for MLA: its latent KV is replicated)."""
    model = vllm_config.model_config
    if model is None:
        return 0
    if getattr(model, "use_mla", False):
        return 1
    try:
        return int(model.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return 0  # unknown: the runtime assumes as many as the larger TP of a pair


def _incarnation(engine_id: str, vllm_config: VllmConfig) -> str:
    """The same for every TP rank of one engine start and new at the next: vLLM draws
    ``instance_id`` once per configuration in the engine's process and hands it to every
    worker with the configuration."""
    digest = hashlib.sha256(f"{engine_id}/{vllm_config.instance_id}".encode()).hexdigest()
    return digest[:16]


def _host_ip() -> str:
    """Where D reaches P's side channel: vLLM's own choice of this host's address
    (``VLLM_HOST_IP`` when set), as MooncakeConnector advertises it."""
    try:
        from vllm.utils.network_utils import get_ip

        return get_ip()
    except ImportError:
        return os.environ.get("VLLM_HOST_IP", "127.0.0.1")



def kv_registration(mode: str, devices: set[str]) -> str:
    """How a worker registers a KV cache held on ``devices`` (torch's names) under ``kv_staging``
    ``mode``: ``"host"`` (the cache itself, host memory), ``"cuda"`` (the cache itself,
    GPU-direct) or ``"stage"`` (host staging twins, staging.py). ValueError for a cache kvferry
    cannot register: off the host and not on CUDA devices with staging off."""
    on_host = devices == {"cpu"}
    if mode == "host" or (mode == "auto" and not on_host):
        return "stage"
    if on_host:
        return "host"
    if all(d.startswith("cuda") for d in devices):
        return "cuda"
    raise ValueError(
        f"the KV cache lives on {', '.join(sorted(devices))} and kv_staging is off: kvferry "
        "registers host memory or, GPU-direct, CUDA memory; use kv_staging auto or host")

class KvferryConnectorWorker:
    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        settings: ConnectorSettings,
        native: NativeModule | None = None,
    ):
        # The native module is needed from here on: fail at construction, with its reason.
        self._native = native if native is not None else load_native()
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        self.kv_cache_config = kv_cache_config
        self.is_producer = transfer_config.is_kv_producer
        self.is_consumer = transfer_config.is_kv_consumer
        parallel = vllm_config.parallel_config
        self.options = WorkerOptions(
            engine_id=engine_id,
            tp_rank=getattr(parallel, "rank", 0) % max(parallel.tensor_parallel_size, 1),
            tp_size=parallel.tensor_parallel_size,
            kv_lease_duration=settings.kv_lease_duration,
            abort_request_timeout=settings.abort_request_timeout,
            bootstrap_port=settings.bootstrap_port,
            bootstrap_server_address=settings.bootstrap_server_address,
            kv_release=settings.kv_release,
            kv_heads=_kv_heads(vllm_config),
            incarnation=_incarnation(engine_id, vllm_config),
            side_channel_host=_host_ip(),
            cluster_secret_file=settings.cluster_secret_file,
            fence_writes=settings.fence_writes,
        )
        self.settings = settings
        self.regions: list[KvRegion] = []
        self.prefill: PrefillWorker | None = None
        self.decode: DecodeWorker | None = None
        # With host staging (staging.py): P's and D's halves of it.
        self._p_staging: PrefillStaging | None = None
        self._d_staging: DecodeStaging | None = None
        self._staging_watch = {"P": WaitWatch(STAGING_STALL_S), "D": WaitWatch(STAGING_STALL_S)}

        # D: requests whose load was started and not yet reported to vLLM, with their blocks.
        self._loading: dict[str, list[list[int]]] = {}
        # D: failed loads already reported (the request ended) whose blocks a P rank may still
        # write: vLLM keeps them until they are reported finished, once no rank can. (Once
        # named like P's table below: an engine both P and D mixed the two.)
        self._quarantined: dict[str, list[list[int]]] = {}
        # P: transfer id -> request id, for requests whose blocks (or slots) P's runtime holds.
        self._held: dict[str, str] = {}
        # P: transfer ids admitted but not yet held (to tell a drop from a stray event).
        self._admitted: dict[str, str] = {}
        # P, layer writes (config.py: layer_writes): whether this worker sends layers as they
        # are computed (its KV cache is registered as it is, in host memory), and the
        # (transfer, blocks) of the prompts the current step completes.
        self._layer_writes = False
        self._layers_now: list[tuple[str, list[list[int]]]] = []
        self._step_meta: KvferryConnectorMetadata | None = None  # _begin_prefill_step's
        # Results not yet handed to vLLM.
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: dict[str, list[list[int]]] = {}
        self._failed_released: set[str] = set()  # held failures whose blocks are free now
        self._invalid_block_ids: set[int] = set()
        self._dropped: list[str] = []
        self._failure_reasons: dict[str, str] = {}  # D: for the scheduler half (worker meta)

    # -- registration -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        group_of = self.kv_cache_config.transfer_group_index_by_layer
        num_blocks = self.kv_cache_config.num_blocks
        regions: list[KvRegion] = []
        tensors: list[torch.Tensor] = []
        seen: set[tuple[int, str]] = set()
        for layer_name, cache in kv_caches.items():
            if layer_name not in group_of:
                continue  # a layer that takes no part in transfers (vLLM decides)
            for region in kv_regions(layer_name, cache, group_of[layer_name], num_blocks):
                # Layers that share a cache (cross-layer KV sharing) are registered once.
                if (region.data_ptr, region.part) in seen:
                    continue
                seen.add((region.data_ptr, region.part))
                regions.append(region)
                tensors.append(cache)
        if not regions:
            raise ValueError("KvferryConnector: no KV cache tensor to register")
        self.regions = regions
        regions = self._maybe_stage(regions, tensors, num_blocks)
        if self.is_producer:
            self.prefill = self._native.PrefillWorker(regions, self.options)
            # A staged cache reaches the staging memory only at the hand-off, and a GPU
            # computes a layer after save_kv_layer returns: both move after the prefill.
            self._layer_writes = (self.settings.layer_writes and self._p_staging is None
                                  and all(r.memory == "host" for r in regions))
        if self.is_consumer:
            self.decode = self._native.DecodeWorker(regions, self.options)
        logger.info(
            "kvferry registered %d KV regions (%d blocks, %d bytes per block of the first)",
            len(regions),
            num_blocks,
            regions[0].block_bytes,
        )

    def _maybe_stage(
        self, regions: list[KvRegion], tensors: list[torch.Tensor], num_blocks: int
    ) -> list[KvRegion]:
        """The regions the runtime registers: the KV cache's, or its host staging twins."""
        devices = {str(t.device) for t in tensors}
        how = kv_registration(self.settings.kv_staging, devices)
        if how == "host":
            return regions
        if how == "cuda":
            # GPU-direct: the data plane registers the GPU's memory itself, or the worker's
            # start raises with the reason (a UCX without CUDA: kv_staging auto stages instead).
            logger.info("kvferry registers the KV cache GPU-direct (kv_staging off; it is on %s)",
                        ", ".join(sorted(devices)))
            return [dataclasses.replace(r, memory="cuda") for r in regions]
        slots = self.settings.kv_staging_blocks or num_blocks
        staged = stage_regions(regions, tensors, slots)
        copier = BlockCopier(staged)
        # One pool per transfer group: block ids come one list per transfer group.
        groups = max(len(self.kv_cache_config.transfer_group_ids),
                     1 + max(r.group for r in regions))
        # One pool for one staging memory: an engine both P and D (kv_both) hands each slot to
        # a transfer it holds or to a load it pulls, never to both at once.
        pool = StagingSlots(groups, slots)
        if self.is_producer:
            self._p_staging = PrefillStaging(pool, copier)
        if self.is_consumer:
            self._d_staging = DecodeStaging(pool, copier)
        logger.info(
            "kvferry stages KV through host memory: %d slots per KV-cache group, %.1f MiB "
            "(the KV cache is on %s)", slots, staged.nbytes / (1 << 20), ", ".join(sorted(devices)))
        return staged.regions

    # -- each step ------------------------------------------------------------------------------

    def start_load_kv(self, meta: KvferryConnectorMetadata) -> None:
        if self.decode is not None:
            for request_id, source in meta.track.items():
                self.decode.on_new_request(request_id, source)
            for request_id, spec in meta.load.items():
                self._loading[request_id] = spec.block_ids
                if self._d_staging is not None:
                    self._d_staging.load(request_id, spec.source, spec.block_ids)
                else:
                    self.decode.start_load(request_id, spec.source, spec.block_ids)
            for request_id in meta.release:
                self.decode.request_finished(request_id)
                if self._d_staging is not None:
                    self._d_staging.cancel(request_id)
            self._pump_decode_staging()
        if self.prefill is not None:
            self._begin_prefill_step(meta)
            for request_id, spec in meta.hold.items():
                self._admitted.pop(spec.transfer_id, None)
                if self._p_staging is not None:
                    self._p_staging.hold(spec.transfer_id, request_id, spec.block_ids)
                else:
                    self._held[spec.transfer_id] = request_id
                    self.prefill.prefill_done(spec.transfer_id, spec.block_ids)
            for request_id, transfer_id in meta.drop.items():
                if self._admitted.pop(transfer_id, None) is not None:
                    self.prefill.engine_finished(transfer_id)
                else:
                    # Dropped before it was admitted (aborted or finished while it queued):
                    # without a tombstone, D's pull for it would park for
                    # abort_request_timeout holding D's blocks.
                    self.prefill.refuse(
                        transfer_id, f"the prefill instance dropped request {request_id} before "
                        "it was scheduled (aborted or finished while it queued)")
            self._pump_prefill_staging()

    def _begin_prefill_step(self, meta: KvferryConnectorMetadata) -> None:
        """P, once per step, at the first of save_kv_layer and start_load_kv: the admissions,
        and the prompts the step completes. vLLM 0.32 calls start_load_kv after the forward pass
        when no load of the step is synchronous (kv_connector_model_runner_mixin), so the
        layers' requests must be admitted by the first save_kv_layer, or the runtime would not
        know them yet."""
        if self._step_meta is meta:
            return
        self._step_meta = meta
        for request_id, transfer_id in meta.admit.items():
            self.prefill.admit(transfer_id, request_id)
            self._admitted[transfer_id] = request_id
        self._layers_now = [
            (spec.transfer_id, spec.block_ids) for request_id, spec in meta.layers.items()
            if self._layer_writes and self._admitted.get(spec.transfer_id) == request_id
        ]

    def save_kv_layer(self, layer_name: str, meta: KvferryConnectorMetadata) -> None:
        """P: layer ``layer_name`` of this step is computed: the prompts the step completes
        send it to the pulls already waiting for them (the rest follows prefill_done)."""
        if self.prefill is None or not self._layer_writes:
            return  # the step's admissions wait for start_load_kv, as without layer writes
        self._begin_prefill_step(meta)
        for transfer_id, block_ids in self._layers_now:
            self.prefill.layers_ready(transfer_id, block_ids, layer_name)

    def wait_for_save(self) -> None:
        """The step is over (after its forward pass and start_load_kv): its layers were all
        offered."""
        self._layers_now = []
        self._step_meta = None

    def _note_staging_wait(self, side: str, staging: PrefillStaging | DecodeStaging) -> None:
        """Logs when requests start waiting for staging slots, when such a wait stands still,
        and when none waits again: a budget that is often short is an operator's to raise
        (kv_staging_blocks)."""
        note = self._staging_watch[side].look(staging, time.monotonic())
        if note == "short":
            logger.info("kvferry: %s staging slots are short: %d request(s) wait for them (%s; "
                        "raise kv_staging_blocks if this is frequent)", side, staging.waiting,
                        staging.counts())
        elif note == "stalled":
            logger.warning(
                "kvferry: %s staging has not moved for %.0f s: %d request(s) wait for slots "
                "that no load or transfer gave back (%s). D's loads may be waiting for KV P "
                "cannot stage while P's slots hold KV for loads waiting on D's slots; then "
                "nothing moves until abort_request_timeout fails the waiting pulls. Raise this "
                "engine's kv_staging_blocks (%d now; %s) (docs/vllm.md, \"Staging budgets\")",
                side, STAGING_STALL_S, staging.waiting, staging.counts(),
                staging.slots.pools[0].size,
                "at its default, the KV cache's blocks, D's loads never wait" if side == "D"
                else "P's must hold what its decoders can leave waiting")
        elif note == "clear":
            logger.info("kvferry: no request waits for %s staging slots any more", side)

    def _pump_prefill_staging(self) -> None:
        """P: hands staged requests to the runtime and their blocks back to vLLM."""
        if self._p_staging is None or self.prefill is None:
            return
        self._note_staging_wait("P", self._p_staging)
        for out in self._p_staging.poll():
            if isinstance(out, Handed):
                self._held[out.transfer_id] = out.request_id
                self.prefill.prefill_done(out.transfer_id, out.slot_ids)
            else:
                assert isinstance(out, Refused)
                logger.warning("KV of request %s is not handed over: %s", out.request_id,
                               out.reason)
                self.prefill.engine_finished(out.transfer_id)
            self._finished_sending.add(out.request_id)

    def _pump_decode_staging(self) -> None:
        """D: starts loads that found staging slots, reports those copied up or failed."""
        if self._d_staging is None or self.decode is None:
            return
        self._note_staging_wait("D", self._d_staging)
        for out in self._d_staging.poll():
            if isinstance(out, Start):
                self.decode.start_load(out.request_id, out.source, out.slot_ids)
            elif isinstance(out, Loaded):
                if self._loading.pop(out.request_id, None) is not None:
                    self._finished_recving.add(out.request_id)
            else:
                assert isinstance(out, LoadFailed)
                self._load_failed(out.request_id, out.reason, held=False)

    def _load_failed(self, request_id: str, reason: str, held: bool) -> None:
        block_ids = self._loading.pop(request_id, None)
        if block_ids is None:
            return
        logger.warning("KV load of request %s failed: %s", request_id, reason)
        self._failure_reasons[request_id] = reason
        if not held:
            self._finished_recving.add(request_id)
            self._failed_recving[request_id] = block_ids
            return
        # The request ends now (engine-adapter issue, hole 3: it waited for remote KV for as
        # long as a silent P kept its blocks quarantined — forever for a dead one). Its blocks,
        # named invalid, fail it (or mark it for recomputation) at once on every rank's
        # scheduler; vLLM keeps them allocated while the load is not finished, which it is only
        # once no P rank can write them (released).
        self._quarantined[request_id] = block_ids
        for group in block_ids:
            self._invalid_block_ids.update(group)

    def _collect(self) -> None:
        if self.decode is not None:
            staging = self._d_staging
            finished = self.decode.take_finished()
            for request_id in finished.received:
                if staging is not None and staging.received(request_id):
                    continue  # reported once copied up into its blocks
                if self._loading.pop(request_id, None) is not None:
                    self._finished_recving.add(request_id)
            for request_id, reason, held in finished.failed:
                # Staged: P writes the slots only, never the blocks (which stay taken while
                # a P rank may still write them).
                if staging is not None and staging.failed(request_id, held):
                    held = False
                self._load_failed(request_id, reason, held)
            for request_id in finished.released:
                if staging is not None and staging.released(request_id):
                    continue
                if self._quarantined.pop(request_id, None) is not None:
                    self._finished_recving.add(request_id)
                    self._failed_released.add(request_id)
            self._pump_decode_staging()
        if self.prefill is not None:
            # Frees of KV no decoder took, by reason. Aborts are not counted: the scheduler half
            # already warns of transfers dropped before their prefill finished.
            unclaimed: dict[str, list[str]] = {}
            for kind, transfer_id, reason in self.prefill.take_events():
                if kind == "free":
                    if self._p_staging is not None and self._p_staging.freed(transfer_id):
                        self._held.pop(transfer_id, None)
                        if reason in _UNCLAIMED:
                            unclaimed.setdefault(reason, []).append(transfer_id)
                        continue  # its slots are free; vLLM had the blocks back when staged
                    request_id = self._held.pop(transfer_id, None)
                    if request_id is None:
                        logger.error("P runtime freed %s, which it did not hold", transfer_id)
                    else:
                        self._finished_sending.add(request_id)
                        if reason in _UNCLAIMED:
                            unclaimed.setdefault(reason, []).append(transfer_id)
                elif kind == "abort":
                    if self._admitted.pop(transfer_id, None) is not None:
                        self._dropped.append(transfer_id)
                else:
                    logger.error("P runtime sent an unknown event %r for %s", kind, transfer_id)
            self._note_unclaimed(unclaimed)
            self._pump_prefill_staging()

    def _note_unclaimed(self, unclaimed: dict[str, list[str]]) -> None:
        """P dropped KV before a decoder took it: a decoder died or was cut off from this
        prefiller, or a prefill never finished while a decoder's pull waited. The operator hears
        of it once per pass and reason, from rank 0 (every rank drops the same transfers)."""
        if self.options.tp_rank != 0:
            return
        lease = self.options.kv_lease_duration
        for reason, transfers in unclaimed.items():
            why = (_UNCLAIMED[reason].format(lease=lease) if lease > 0 or reason != "expired"
                   else f"no decoder pulled it within abort_request_timeout "
                        f"({self.options.abort_request_timeout:g} s)")
            logger.warning("kvferry: P dropped the KV of %d transfer(s) before a decoder took it: "
                           "%s (e.g. %s)", len(transfers), why, ", ".join(transfers[:3]))

    def get_transfer_results(self) -> KVConnectorTransferResults:
        """vLLM 0.32's path: failed loads are named per request (failed_recving), which stays
        unambiguous when several KV-cache groups share block ids."""
        self._collect()
        results = KVConnectorTransferResults(
            finished_sending=self._finished_sending,
            finished_recving=self._finished_recving,
            failed_recving=set(self._failed_recving) | self._failed_released,
        )
        self._finished_sending, self._finished_recving, self._failed_recving = set(), set(), {}
        self._failed_released = set()
        return results

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """The older two-set path: a failed load is reported finished, and its blocks through
        get_block_ids_with_load_errors (possible only with one KV-cache group)."""
        self._collect()
        for request_id, block_ids in self._failed_recving.items():
            if len(block_ids) == 1:
                self._invalid_block_ids.update(block_ids[0])
            else:
                logger.error(
                    "request %s failed to load, but with %d KV-cache groups its blocks cannot "
                    "be named by id; use vLLM's get_transfer_results path",
                    request_id,
                    len(block_ids),
                )
        sending, recving = self._finished_sending, self._finished_recving
        self._finished_sending, self._finished_recving, self._failed_recving = set(), set(), {}
        self._failed_released = set()  # their blocks were named invalid when they failed
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def build_worker_meta(self) -> KvferryWorkerMetadata | None:
        if not self._dropped and not self._failure_reasons:
            return None
        meta = KvferryWorkerMetadata(dropped_transfers=self._dropped,
                                     failed_loads=self._failure_reasons)
        self._dropped, self._failure_reasons = [], {}
        return meta

    def shutdown(self) -> None:
        # vLLM calls this from its worker's shutdown (SIGTERM, or the engine stopping). stop()
        # returns only once the native worker's threads are gone: a decoder releases what it
        # still tracks to the prefill engines first, so they free that KV now rather than at
        # their lease; a prefiller drains its writes in flight.
        if self.decode is not None:
            stats = self.decode.stats()
            logger.info(
                "kvferry: stopping the decode worker of rank %d: %d transfer(s) still tracked are "
                "released to their prefill engines, %d load(s) in flight end",
                self.options.tp_rank, stats.get("tracked", 0), stats.get("receiving", 0))
            started = time.monotonic()
            self.decode.stop()
            logger.info("kvferry: decode worker of rank %d stopped in %.2f s",
                        self.options.tp_rank, time.monotonic() - started)
        if self.prefill is not None:
            started = time.monotonic()
            self.prefill.stop()
            logger.info("kvferry: prefill worker of rank %d stopped in %.2f s",
                        self.options.tp_rank, time.monotonic() - started)
        self.decode = None
        self.prefill = None
