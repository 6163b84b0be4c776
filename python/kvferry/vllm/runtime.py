"""kvferry._native behind the interface native.py specifies: what the connector's worker half
calls, turned into calls on the C++ runtime (python/src/native.cc).

What this layer decides:

- **Planes.** The runtime moves a rank's KV as planes that share block ids and a block size
  (runtime/kv_memory.h): block ``b`` of a plane is ``block_len`` bytes at ``base + b * block_len``.
  Regions whose blocks are dense (stride = bytes: vLLM's heads-outermost LBHNC layout, one plane
  per layer; flash-attention's K and V halves) become one plane each. Regions that tile one
  block holding every layer's page (stride > bytes, side by side) become a single plane of
  ``stride`` bytes — only for a model whose KV is replicated across TP ranks (MLA: one KV head),
  since a head slice of such a block is not one byte range. Anything else is refused with the
  reason at registration. A dense block whose heads are not outermost (token-major, vLLM's
  LBNHC, when a backend cannot honour the LBHNC the connector asks for) is registered, but the
  runtime is told it cannot be head-sliced: transfers between different TP sizes then fail with
  the reason instead of moving the wrong bytes.
- **One KV-cache group.** The runtime moves one list of block ids per request; a hybrid model's
  several groups are refused at registration (vLLM then runs without the connector's HMA).
- **P's bootstrap service** runs in P's rank-0 worker (port ``bootstrap_port``) unless
  ``bootstrap_server_address`` names one elsewhere; every rank registers with it.
- **The engine glue is native.** Both workers run kvferry's engine adapters
  (protocol::PrefillAdapter, protocol::DecodeAdapter: the code `kvferry serve` and the simulator
  run): vLLM may tell an ending twice, and a transfer may be gone (released by D, expired)
  before the engine reports it; such calls settle at once instead of raising, and a prefill
  done for a transfer nothing holds is reported free at once, so its blocks go back to the
  pool.
"""

from __future__ import annotations

import importlib
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from kvferry.vllm.native import (
    DecodeFinished,
    KvRegion,
    NativeModule,
    RemoteSource,
    WorkerOptions,
)

logger = logging.getLogger("kvferry.vllm")


class LayoutError(ValueError):
    """The KV cache's layout is one kvferry cannot move correctly."""


def head_slices(regions: Sequence[KvRegion], kv_heads: int) -> bool:
    """Whether the runtime may move head slices of these blocks (P and D of different TP
    sizes): always for replicated KV (one head is never split), else only when every block keeps
    each head's bytes together. False makes the runtime refuse such transfers with the reason
    (prefill_worker.h, decode_worker.h: head_slices) rather than move the wrong bytes."""
    return kv_heads == 1 or all(r.heads_outermost for r in regions)


def memory_of(regions: Sequence[KvRegion]) -> str:
    """The one memory ("host" or "cuda") every region lives in; the runtime registers one kind
    per rank."""
    kinds = sorted({r.memory for r in regions})
    if len(kinds) != 1:
        raise LayoutError(f"KV regions in several memories ({', '.join(kinds)}): kvferry "
                          "registers a rank's KV in one")
    return kinds[0]


def planes_of(regions: Sequence[KvRegion], kv_heads: int) -> tuple[list[tuple[int, int]], int, int]:
    """(planes as (address, bytes), block_len, num_blocks) for the runtime; see the module doc."""
    if not regions:
        raise LayoutError("no KV cache region to register")
    groups = sorted({r.group for r in regions})
    if len(groups) > 1:
        raise LayoutError(
            f"the KV cache has {len(groups)} KV-cache groups (a hybrid model); kvferry moves one "
            "group's blocks per request: run vLLM with --disable-hybrid-kv-cache-manager or a "
            "model with one attention type"
        )
    num_blocks = regions[0].num_blocks
    if any(r.num_blocks != num_blocks for r in regions):
        raise LayoutError("KV cache regions disagree on the number of blocks")
    if all(r.block_stride == r.block_bytes for r in regions):
        sizes = sorted({r.block_bytes for r in regions})
        if len(sizes) > 1:
            raise LayoutError(
                f"layers with different block sizes ({sizes[0]} .. {sizes[-1]} bytes): kvferry "
                "moves planes of one block size"
            )
        return [(r.data_ptr, num_blocks * r.block_bytes) for r in regions], sizes[0], num_blocks
    # Blocks that hold every layer's page: the regions must tile one block exactly.
    stride = regions[0].block_stride
    ordered = sorted(regions, key=lambda r: r.data_ptr)
    tiles = all(r.block_stride == stride for r in regions)
    for a, b in zip(ordered, ordered[1:]):
        tiles = tiles and a.data_ptr + a.block_bytes == b.data_ptr
    tiles = tiles and ordered[-1].data_ptr + ordered[-1].block_bytes - ordered[0].data_ptr == stride
    if not tiles:
        raise LayoutError(
            "the KV cache's blocks are neither dense per layer nor one block across every layer "
            f"(strides {sorted({r.block_stride for r in regions})}, "
            f"block bytes {sorted({r.block_bytes for r in regions})})"
        )
    if kv_heads != 1:
        raise LayoutError(
            "each block holds every layer's page (a cross-layer layout), and a TP head slice of "
            "such a block is not one byte range: kvferry needs the heads-outermost layout "
            "(vLLM's LBHNC, which KvferryConnector asks for) for a model with several KV heads"
        )
    return [(ordered[0].data_ptr, num_blocks * stride)], stride, num_blocks



def _source(source: RemoteSource) -> dict[str, str]:
    return {
        "transfer_id": source.transfer_id,
        "engine_id": source.engine_id,
        "bootstrap_address": source.bootstrap_addr,
    }


def _single_group(block_ids: Sequence[Sequence[int]]) -> list[int]:
    if len(block_ids) != 1:
        raise LayoutError(f"{len(block_ids)} KV-cache groups in one request; kvferry moves one")
    return list(block_ids[0])


class PrefillRuntime:
    """One P rank (PrefillWorker in native.py)."""

    def __init__(self, native: Any, regions: Sequence[KvRegion], options: WorkerOptions):
        self._native = native
        planes, block_len, num_blocks = planes_of(regions, options.kv_heads)
        self._bootstrap = None
        address = options.bootstrap_server_address
        if not address:
            if options.tp_rank == 0:
                # Reachable from D and the proxy on other hosts, as MooncakeConnector's is.
                # It refuses any other incarnation of this engine while it runs, so nobody can
                # take this P's traffic over with one POST /register (docs/security.md).
                self._bootstrap = native.BootstrapServer(
                    host="0.0.0.0", port=options.bootstrap_port,
                    cluster_secret_file=options.cluster_secret_file,
                    engine_id=options.engine_id, incarnation=options.incarnation)
                port = self._bootstrap.port
            elif options.bootstrap_port == 0:
                raise ValueError("bootstrap_port 0 (any free port) works only with TP 1: the "
                                 "other ranks must know where rank 0's service listens")
            else:
                port = options.bootstrap_port
            address = f"127.0.0.1:{port}"
        self.bootstrap_port = self._bootstrap.port if self._bootstrap is not None else None
        try:
            self._worker = native.PrefillWorker(
                engine_id=options.engine_id, tp_size=options.tp_size, tp_rank=options.tp_rank,
                kv_heads=options.kv_heads, block_len=block_len, num_blocks=num_blocks,
                planes=planes, lease_s=options.kv_lease_duration,
                abort_request_timeout_s=options.abort_request_timeout,
                bootstrap_address=address, side_channel_host=options.side_channel_host,
                incarnation=options.incarnation, data_plane=options.data_plane,
                cluster_secret_file=options.cluster_secret_file,
                head_slices=head_slices(regions, options.kv_heads), memory=memory_of(regions))
        except BaseException:
            if self._bootstrap is not None:
                self._bootstrap.stop()
            raise
        self._handles = itertools.count(1)
        self._admitted: dict[str, int] = {}  # transfer id -> its admission's handle
        # The planes of each layer, when every region is a plane of its own (dense blocks); a
        # block holding every layer's page is one plane, which no layer can be sent alone.
        self._layer_planes: dict[str, list[int]] = {}
        if len(planes) == len(regions):
            for index, region in enumerate(regions):
                self._layer_planes.setdefault(region.layer_name, []).append(index)

    # The native worker runs protocol::PrefillAdapter (admission, hand-off, frees, drops: the
    # glue `kvferry serve` and the simulator run too); these calls only translate vLLM's.

    def admit(self, transfer_id: str, handle: str) -> None:
        handle = next(self._handles)
        try:
            self._worker.admit(transfer_id, handle)
            self._admitted[transfer_id] = handle
        except self._native.KvferryError as e:
            # Released by D or expired before P admitted it (TOMBSTONED), or a duplicate id:
            # nothing is held; its prefill_done is answered "free" at once.
            logger.warning("kvferry: P did not admit transfer %s (request %s): %s",
                           transfer_id, handle, e)

    def layers_ready(
        self, transfer_id: str, block_ids: Sequence[Sequence[int]], layer_name: str
    ) -> bool:
        planes = self._layer_planes.get(layer_name)
        handle = self._admitted.get(transfer_id)
        if not planes or handle is None:
            return False
        try:
            return bool(self._worker.layers_ready(transfer_id, _single_group(block_ids), planes,
                                                  handle))
        except (self._native.KvferryError, LayoutError) as e:  # stopped meanwhile; groups
            logger.debug("kvferry: layers_ready(%s, %s): %s", transfer_id, layer_name, e)
            return False

    def prefill_done(self, transfer_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        self._admitted.pop(transfer_id, None)
        try:
            self._worker.prefill_done(transfer_id, _single_group(block_ids))
        except self._native.KvferryError as e:
            # Never admitted here (a duplicate id the scheduler let through): nothing holds it.
            logger.error("kvferry: prefill_done(%s): %s", transfer_id, e)

    def engine_finished(self, transfer_id: str) -> None:
        self._admitted.pop(transfer_id, None)
        try:
            self._worker.engine_finished(transfer_id)
        except self._native.KvferryError as e:  # stopped meanwhile
            logger.debug("kvferry: engine_finished(%s): %s", transfer_id, e)

    def refuse(self, transfer_id: str, why: str) -> None:
        """P's engine dropped the request before admitting it: nobody here will prefill it. A
        pull already waiting for it fails now, and later ones at once (tombstoned), instead of
        parking for abort_request_timeout with D's blocks."""
        try:
            self._worker.refuse(transfer_id, why)
        except self._native.KvferryError as e:  # stopped meanwhile
            logger.debug("kvferry: refuse(%s): %s", transfer_id, e)

    def take_events(self) -> list[tuple[str, str, str]]:
        return [tuple(event) for event in self._worker.take_events()]

    def stats(self) -> dict[str, int]:
        return self._worker.stats()

    def stop(self) -> None:
        try:
            self._worker.stop()
        finally:
            if self._bootstrap is not None:
                self._bootstrap.stop()
                self._bootstrap = None


class DecodeRuntime:
    """One D rank (DecodeWorker in native.py). The native worker runs protocol::DecodeAdapter
    (the engine glue ``kvferry serve`` and the simulator run too: duplicate ids, P's abort
    notice, the quarantine gate); this class only translates its events into vLLM's terms."""

    def __init__(self, native: Any, regions: Sequence[KvRegion], options: WorkerOptions):
        self._native = native
        planes, block_len, num_blocks = planes_of(regions, options.kv_heads)
        self._worker = native.DecodeWorker(
            engine_id=options.engine_id, tp_size=options.tp_size, tp_rank=options.tp_rank,
            block_len=block_len, num_blocks=num_blocks, planes=planes,
            lease_s=options.kv_lease_duration,
            abort_request_timeout_s=options.abort_request_timeout,
            data_plane=options.data_plane, cluster_secret_file=options.cluster_secret_file,
            send_releases=options.kv_release, head_slices=head_slices(regions, options.kv_heads),
            fence_writes=options.fence_writes, memory=memory_of(regions))
        # Loads refused before the adapter started them: nothing was sent, nothing can write.
        self._refused: list[tuple[str, str, bool]] = []

    def on_new_request(self, request_id: str, source: RemoteSource) -> None:
        try:
            self._worker.on_new_request(request_id, _source(source))
        except self._native.KvferryError as e:
            # A duplicate id or a source without ids: the request is not renewed (P's lease or
            # abort_request_timeout bounds what it holds); its load decides the rest.
            logger.warning("kvferry: request %s is not tracked: %s", request_id, e)

    def start_load(self, request_id: str, source: RemoteSource,
                   block_ids: Sequence[Sequence[int]]) -> None:
        try:
            self._worker.start_load(request_id, _source(source), _single_group(block_ids))
        except LayoutError as e:
            self._refused.append((request_id, str(e), False))
        except self._native.KvferryError as e:
            if getattr(e, "code", "") == "ALREADY_EXISTS":
                # The first load of this id goes on and reports for it: failing the request
                # now would let vLLM reuse blocks that load may still write.
                logger.error("kvferry: a second load for request %s ignored: %s", request_id, e)
                return
            self._refused.append((request_id, str(e), False))

    def request_finished(self, request_id: str) -> None:
        self._worker.request_finished(request_id)

    def take_finished(self) -> DecodeFinished:
        got = self._worker.take_finished()
        received: list[str] = []
        failed, self._refused = self._refused, []
        for request_id, ok, error, quarantined in got["loaded"]:
            if ok:
                received.append(request_id)
            else:
                failed.append((request_id, error, bool(quarantined)))
        # Only loads reported held: the others' blocks were never withheld from vLLM.
        released = [request_id for request_id, after_quarantine in got["reusable"]
                    if after_quarantine]
        # A transfer P dropped while its request still queues here: vLLM cannot end a waiting
        # request from a connector, so the load fails (at once, unpulled) when it is scheduled.
        for request_id, why in got["dropped"]:
            logger.info("kvferry: P dropped the transfer of queued request %s: %s", request_id, why)
        return DecodeFinished(received=received, failed=failed, released=released)

    def stats(self) -> dict[str, int]:
        return self._worker.stats()

    def stop(self) -> None:
        self._worker.stop()


class NativeRuntime:
    """The NativeModule of native.py over kvferry._native."""

    def __init__(self, native: Any):
        self._native = native

    def PrefillWorker(self, regions: list[KvRegion], options: WorkerOptions) -> PrefillRuntime:  # noqa: N802
        return PrefillRuntime(self._native, regions, options)

    def DecodeWorker(self, regions: list[KvRegion], options: WorkerOptions) -> DecodeRuntime:  # noqa: N802
        return DecodeRuntime(self._native, regions, options)


def load_native() -> NativeModule:
    """``kvferry._native`` behind native.py's interface; raises ImportError saying what is
    missing. (Here, not in native.py: the interface module imports nothing of its
    implementation.)"""
    try:
        module = importlib.import_module("kvferry._native")
    except ImportError as e:
        raise ImportError(
            "kvferry's native module kvferry._native is not available, so the worker half of "
            "KvferryConnector cannot run (the scheduler half needs no native module). Build "
            "and install the kvferry package with the native module (CMake option "
            f"KVFERRY_PYTHON=ON, see pyproject.toml). Import error: {e}"
        ) from e
    # Which UCX the loader picked (Debian's or a libucx wheel's) decides whether GPU-direct
    # registration can work: said once, where a refusal's reader will look.
    logger.info("kvferry._native runs on UCX %s", module.ucx_version())
    return NativeRuntime(module)
