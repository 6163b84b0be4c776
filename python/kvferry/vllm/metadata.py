"""What the scheduler half tells the worker half each engine step, and what the workers tell the
scheduler half back. Plain picklable dataclasses: vLLM serializes them across processes."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvferry.vllm.native import RemoteSource

BlockIds = list[list[int]]  # one list per KV-cache transfer group


@dataclass
class LoadSpec:
    source: RemoteSource
    block_ids: BlockIds


@dataclass
class HoldSpec:
    transfer_id: str
    block_ids: BlockIds


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker half. Every field holds only what happened since the
    previous step's metadata (build_connector_meta resets the scheduler half's pending state)."""

    # D: requests that entered the waiting queue and will pull: start renewing their transfer
    # (on_new_request), while they may still wait for blocks.
    track: dict[str, RemoteSource] = field(default_factory=dict)
    # D: requests whose blocks were allocated: pull P's KV into these block ids.
    load: dict[str, LoadSpec] = field(default_factory=dict)
    # D: requests that no longer need their transfer (finished, aborted while queued or
    # receiving, or a full local prefix hit): stop renewing, release to P.
    release: list[str] = field(default_factory=list)
    # P: requests admitted with do_remote_decode: request id -> transfer_id.
    admit: dict[str, str] = field(default_factory=dict)
    # P: requests whose prefill finished and whose blocks the scheduler now keeps until the
    # worker reports them in finished_sending.
    hold: dict[str, HoldSpec] = field(default_factory=dict)
    # P: requests that finished without KV to hand over (aborted, error): request -> transfer_id.
    drop: dict[str, str] = field(default_factory=dict)
    # P: admitted requests whose prompt this step completes, with the blocks it is computed
    # into: each layer's KV goes to the pulls already waiting as it is computed (save_kv_layer).
    layers: dict[str, HoldSpec] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (
            self.track or self.load or self.release or self.admit or self.hold or self.drop
            or self.layers
        )


@dataclass
class KvferryWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker to scheduler: transfers P's native worker dropped before their prefill finished
    (a dead or departed decoder: vLLM gives a connector no way to abort a request, so the
    scheduler half can only log them; their blocks are freed when the prefill finishes), and
    on D why loads failed (for the load-failure service a router asks)."""

    dropped_transfers: list[str] = field(default_factory=list)
    failed_loads: dict[str, str] = field(default_factory=dict)  # request id -> reason

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvferryWorkerMetadata)
        seen = set(self.dropped_transfers)
        merged = self.dropped_transfers + [t for t in other.dropped_transfers if t not in seen]
        # The first rank's reason of a request stays (each rank says why its own load failed).
        failed = {**other.failed_loads, **self.failed_loads}
        return KvferryWorkerMetadata(dropped_transfers=merged, failed_loads=failed)
