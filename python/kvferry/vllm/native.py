"""The interface the connector's worker half needs from the native module ``kvferry._native``.

``kvferry._native`` (python/src/native.cc) binds the C++ runtime (``src/runtime/``:
``PrefillWorker`` / ``DecodeWorker``, one per vLLM worker process, i.e. per TP rank);
runtime.py adapts it to this interface, which ``KvferryConnectorWorker`` (worker.py) is written
against and nothing else (its tests give it a recording stand-in). The interface::

    PrefillWorker(regions: list[KvRegion], options: WorkerOptions) -> PrefillWorker
    DecodeWorker(regions: list[KvRegion], options: WorkerOptions) -> DecodeWorker

taking the two dataclasses below (it reads their attributes), with the methods of the two
Protocols below. Every method returns at once (the runtime's threads do the work) and may be
called only from the thread that constructed the object (vLLM's model-runner thread); every
method is idempotent for an id it no longer knows, because vLLM may tell the same ending twice.

Identifiers: ``transfer_id`` is the P/D join key the router puts in ``kv_transfer_params``;
``request_id`` / ``handle`` are vLLM's request ids in this engine. Block ids are given per KV-cache
transfer group (``block_ids[g]`` addresses the regions whose ``group`` is ``g``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol


@dataclass(frozen=True)
class KvRegion:
    """One registered span of KV memory of one layer: block ``i`` of this layer is the
    ``block_bytes`` bytes at ``data_ptr + i * block_stride``; ``nbytes`` is the whole span
    (``(num_blocks - 1) * block_stride + block_bytes``). P and D register their layers in the same
    order; a layer stored as separate K and V tensors gives two regions (``part`` "k" and "v")."""

    layer_name: str
    part: str  # "kv" (K and V together, or MLA's latent), "k" or "v"
    group: int  # transfer-group index whose block ids address this region
    data_ptr: int
    nbytes: int
    num_blocks: int
    block_stride: int
    block_bytes: int
    # Whether a block keeps each KV head's bytes together (heads outermost inside the block),
    # so that a TP rank of another size can take a head slice of it as one byte range.
    heads_outermost: bool = True
    # Where the bytes live: "host", or "cuda" (a GPU's memory registered GPU-direct: the data
    # plane's UCX must have CUDA support and see device memory there, else the worker's start
    # raises with the reason; kv_staging off).
    memory: str = "host"


@dataclass(frozen=True)
class WorkerOptions:
    engine_id: str
    tp_rank: int
    tp_size: int
    kv_lease_duration: float  # seconds, 0 = no lease
    abort_request_timeout: float  # seconds
    bootstrap_port: int  # P: the port of the bootstrap service it starts on its rank 0
    bootstrap_server_address: str | None  # P: register there instead (host:port)
    kv_release: bool  # D: release transfers whose request no longer needs them
    kv_heads: int = 0  # the model's KV heads (1 for MLA: replicated on every TP rank)
    # P: the same for every rank of one engine start, new at the next (a restart is a new
    # process to D: runtime/prefill_worker.h).
    incarnation: str = ""
    side_channel_host: str = "127.0.0.1"  # P: the address D reaches this rank's side channel at
    data_plane: str = "ucx"  # "ucx", or "inprocess" for tests within one process
    cluster_secret_file: str | None = None
    fence_writes: bool = False  # D: its data plane fences writers (config.py)


@dataclass(frozen=True)
class RemoteSource:
    """Where D pulls a request's KV from: the fields of D's ``kv_transfer_params``."""

    engine_id: str  # remote_engine_id
    bootstrap_addr: str  # remote_bootstrap_addr, "http://host:port"
    transfer_id: str


EventKind = Literal["free", "abort"]


class PrefillWorker(Protocol):
    def admit(self, transfer_id: str, handle: str) -> None:
        """P's scheduler admitted the request ``handle`` carrying ``transfer_id``: pulls for it
        may park until its prefill is done; with a lease, a decoder's renewals may already
        arrive and D's release can drop it."""

    def prefill_done(self, transfer_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        """Its prefill finished and its KV lies in ``block_ids`` (per group), which P's
        scheduler keeps until this worker reports ``("free", transfer_id)``. The hold starts
        now (lease or abort_request_timeout). For a transfer dropped before (released, expired,
        tombstoned) the worker reports "free" at once."""

    def layers_ready(
        self, transfer_id: str, block_ids: Sequence[Sequence[int]], layer_name: str
    ) -> bool:
        """In the step that completes the admitted request's prompt, layer ``layer_name``'s KV
        is computed into ``block_ids`` (the blocks prefill_done will name): pulls already
        waiting for the transfer get it written now. A hint, never an error: False when nothing
        was passed on (a layer this worker cannot move alone, a transfer not admitted here)."""

    def engine_finished(self, transfer_id: str) -> None:
        """The engine finished the request without KV to hand over (aborted, failed, preempted
        for good): nothing will be held; a pull waiting for it fails at once with that reason,
        and a later one finds a tombstone."""

    def refuse(self, transfer_id: str, why: str) -> None:
        """The engine dropped the request before admitting it (aborted or finished while it
        queued): nobody here will prefill it. A pull waiting for it fails now with ``why`` and
        a later one finds a tombstone; an admitted transfer (another request's) is left alone."""

    def take_events(self) -> list[tuple[EventKind, str, str]]:
        """Events since the last call, in order, each once, as ``(kind, transfer_id, reason)``:

        - ``"free"``: a transfer passed to prefill_done is no longer held; its blocks may be
          freed. ``reason`` says why (the hold table's ReleaseReason names,
          include/kvferry/core/hold_table.h): ``sent`` (every paired D rank pulled it),
          ``released_by_decoder``, ``expired`` (its lease, or abort_request_timeout without a
          lease, ran out: no decoder pulled it in time), ``dead_decoder``, ``wait_timeout``,
          ``lease_mismatch``, ``aborted_by_engine``.
        - ``"abort"``: a transfer admitted but not yet prefill_done was dropped (D released it,
          or its decoder stopped renewing for a whole lease: ``reason`` as above); computing
          its prefill is wasted work.
        """

    def stop(self) -> None:
        """Stops serving: answers parked pulls with an error, waits for in-flight writes to
        finish (or fail), deregisters the memory and joins the threads."""


class DecodeFinished(NamedTuple):
    """What ``DecodeWorker.take_finished`` returns: each request at most once in each list."""

    received: list[str]  # every paired P rank wrote its slice: the blocks hold P's KV
    # (request_id, reason, held): the load failed — report it now, so the request ends. held:
    # a P rank may still write into its blocks (its writer state is unknown: a deadline, a P
    # gone mid-pull), so they must stay allocated until the request appears in `released`.
    failed: list[tuple[str, str, bool]]
    released: list[str]  # failed loads, once held: no P rank can write their blocks any more


class DecodeWorker(Protocol):
    def on_new_request(self, request_id: str, source: RemoteSource) -> None:
        """A request that will pull from ``source`` entered D's queue: with a lease, renew
        ``source.transfer_id`` from now on, while it waits for blocks."""

    def start_load(
        self, request_id: str, source: RemoteSource, block_ids: Sequence[Sequence[int]]
    ) -> None:
        """Blocks are allocated: pull the KV into ``block_ids`` (per group, never all empty).
        The request is settled later in take_finished, as received or failed (and, if its
        blocks were held, released). A load whose transfer P dropped while the request queued
        fails at once with P's reason, without a pull."""

    def request_finished(self, request_id: str) -> None:
        """The request no longer needs its transfer (finished, aborted, refused): stop renewing
        and (kv_release) release it to P. A request with a pull in flight is settled as
        released once no P rank can write to its blocks. A no-op for unknown or settled ids."""

    def take_finished(self) -> DecodeFinished:
        """Requests settled since the last call."""

    def stats(self) -> dict[str, int]:
        """Counters and gauges of the worker's session (``tracked``: transfers renewed,
        ``receiving``: loads in flight, ...); only before ``stop``."""

    def stop(self) -> None:
        """Stops: releases what it tracks, waits until no peer writes to its memory (or fences
        it), deregisters the memory and joins the threads."""


class NativeModule(Protocol):
    def PrefillWorker(  # noqa: N802 (a class in the native module)
        self, regions: list[KvRegion], options: WorkerOptions
    ) -> PrefillWorker: ...

    def DecodeWorker(  # noqa: N802
        self, regions: list[KvRegion], options: WorkerOptions
    ) -> DecodeWorker: ...

