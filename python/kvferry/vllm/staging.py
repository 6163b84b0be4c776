"""Host staging: how the connector moves a KV cache that kvferry's data plane does not register
(a GPU's), through host memory that it does.

kvferry's data plane here registers host memory only (the binding's UCX has no CUDA: its engine
refuses transport::MemoryKind kCuda), and every real vLLM deployment keeps its KV cache on a
GPU. With staging, each worker registers a host twin of its KV regions instead —
``kv_staging_blocks`` slots per KV-cache group, each slot one block of every region of its
group, byte for byte — and copies between the two:

- P: when a request's prefill is done, its blocks are copied into staging slots, and P's runtime
  holds the *slots* (under the lease, as it would hold the blocks); vLLM gets the blocks back as
  soon as the copy is done, so P's GPU KV is never held for a decoder, busy or dead. The slots
  are freed when the runtime frees the transfer.
- D: a load is pulled into staging slots, then copied into the request's blocks; vLLM hears
  that the load finished only once that copy is done. A failed load fails its request at once
  even when P may still write (the runtime keeps the transfer quarantined): P only ever writes
  the slots, which stay allocated until the runtime releases them, never the blocks.

Slots are a budget. A request waits (first come, first served) while fewer slots than it needs
are free, and is refused at once, with its reason, if it needs more than the budget holds. P's
slots free as pulls complete and leases end, D's as loads land — so the two sides' waits can
wait on each other. A router that sends D's copy of a request together with P's (``kvferry
proxy``, vLLM's Mooncake proxy) lets D take slots for a load whose KV P has not staged yet; if
P's staging is short because its slots hold KV for loads that wait for those same D slots,
neither side moves until abort_request_timeout fails the parked pulls. A CI run met it: 16
concurrent requests stood still for 2 minutes, D's 24 slots taken by 6 loads P could not stage,
P's 64 by 7 transfers whose loads waited for D's slots. With D's budget at its default (the KV
cache's blocks) D's staging does not wait: a load holds no more slots than vLLM gave it blocks,
and slots are handed out wherever they lie (quarantined slots aside). A smaller D budget is safe
beside a P whose staging holds what D can leave waiting (docs/vllm.md, "Staging budgets"); the
worker warns when a wait stands still.

No copy races vLLM reusing a block: a block goes back to vLLM (P's ``finished_sending``, D's
``finished_recving``) only once the copy that reads or writes it has completed, and vLLM
preempts neither a finished request on P nor a request waiting for its KV on D.

The classes here have no clock, thread or socket; the copy is an object passed in (``Copier``),
whose ``done`` the worker polls each step. ``BlockCopier`` is the real one: batched copies per
region (one gather or scatter per region and request, one copy per run of consecutive slots, the
shape of vLLM's ``CopyBlocksOp``), synchronous for host tensors, on a side stream behind an event
for CUDA tensors.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from kvferry.vllm.native import KvRegion

BlockIds = list[list[int]]  # per KV-cache group


class SlotPool:
    """Slots ``0..size-1`` of one KV-cache group. A request takes the first run of free slots
    long enough for it (its blocks then move in one copy per region), else the lowest free slots
    wherever they lie (one copy per run of them): a request waits only while fewer slots than it
    needs are free, never because the free ones lie apart. That is what lets a budget of the
    cache's own size never wait on D (docs/vllm.md, "Staging budgets")."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a staging pool needs at least one slot, not {size}")
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (start, count), sorted, coalesced
        self._free_count = size

    @property
    def free(self) -> int:
        return self._free_count

    def take(self, count: int) -> list[int] | None:
        """``count`` free slots, now taken; None (nothing taken) when fewer are free."""
        if count < 1:
            return []
        if count > self._free_count:
            return None
        for i, (start, run) in enumerate(self._free):
            if run >= count:
                if run == count:
                    del self._free[i]
                else:
                    self._free[i] = (start + count, run - count)
                self._free_count -= count
                return list(range(start, start + count))
        taken: list[int] = []
        while len(taken) < count:
            start, run = self._free[0]
            use = min(run, count - len(taken))
            taken.extend(range(start, start + use))
            if use == run:
                del self._free[0]
            else:
                self._free[0] = (start + use, run - use)
        self._free_count -= count
        return taken

    def give_back(self, slots: Sequence[int]) -> None:
        """Returns ``slots``, which ``take`` handed out; ValueError, with nothing returned, for a
        slot outside the pool, named twice or already free (a double free would hand one slot
        to two requests)."""
        ordered = sorted(slots)
        if any(s < 0 or s >= self.size for s in ordered):
            raise ValueError(f"slots {ordered} are outside the pool of {self.size}")
        if any(a == b for a, b in zip(ordered, ordered[1:])):
            raise ValueError(f"slots {ordered} name a slot twice")
        runs = slot_runs(ordered)
        for start, count, _ in runs:
            i = bisect.bisect_right(self._free, (start, self.size + 1)) - 1
            if (i >= 0 and sum(self._free[i]) > start) or (
                i + 1 < len(self._free) and start + count > self._free[i + 1][0]
            ):
                raise ValueError(f"slots {start}+{count} are (partly) free already")
        for start, count, _ in runs:
            self._insert(start, count)
        self._free_count += len(ordered)

    def _insert(self, start: int, count: int) -> None:
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, count))
        if i + 1 < len(self._free) and start + count == self._free[i + 1][0]:
            self._free[i] = (start, count + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and sum(self._free[i - 1]) == start:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``slots`` (in the request's block order) as runs of consecutive slots: (first slot,
    count, index in ``slots`` of its first)."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
        else:
            runs.append((s, 1, i))
    return runs


class StagingSlots:
    """One pool per KV-cache group; a request takes its slots in every group at once or not at
    all (a partial hold could starve two requests of each other's slots)."""

    def __init__(self, num_groups: int, slots_per_group: int):
        self.pools = [SlotPool(slots_per_group) for _ in range(num_groups)]
        self.moves = 0  # requests that took or gave back slots, ever (WaitWatch reads it)

    def refusal(self, block_ids: BlockIds, lost: Sequence[int] = ()) -> str | None:
        """Why a request with these blocks cannot be staged while ``lost[g]`` slots of group g
        are out of use for an unknown time (quarantined), or None."""
        if len(block_ids) != len(self.pools):
            return f"{len(block_ids)} KV-cache groups, staging has {len(self.pools)}"
        for group, ids in enumerate(block_ids):
            size = self.pools[group].size
            if len(ids) > size:
                return (f"{len(ids)} blocks in KV-cache group {group}, more than its "
                        f"{size} staging slots (kv_staging_blocks)")
            out = lost[group] if group < len(lost) else 0
            if out and len(ids) > size - out:
                return (f"{len(ids)} blocks in KV-cache group {group}, and quarantined slots "
                        f"({out} of {size}: failed writes P may still land, fence_writes gives "
                        f"them back) leave {size - out}")
        return None

    def take(self, block_ids: BlockIds) -> BlockIds | None:
        """Per group, the slots of the request's blocks (in their order); None (nothing taken)
        if some group has too few free."""
        taken: BlockIds = []
        for group, ids in enumerate(block_ids):
            slots = self.pools[group].take(len(ids)) if ids else []
            if slots is None:
                # Rolled back through the pools, not give_back: a take that failed moved
                # nothing, and counting it would keep WaitWatch from ever seeing a standstill
                # while new requests keep arriving.
                for g, got in enumerate(taken):
                    if got:
                        self.pools[g].give_back(got)
                return None
            taken.append(slots)
        self.moves += 1
        return taken

    def give_back(self, slot_ids: BlockIds) -> None:
        for group, slots in enumerate(slot_ids):
            if slots:
                self.pools[group].give_back(slots)
        self.moves += 1


class Copier(Protocol):
    """Copies a request's blocks between the KV cache and its staging slots."""

    def to_staging(self, block_ids: BlockIds, slot_ids: BlockIds) -> Any:
        """Starts copying each block into its slot (the same index in ``slot_ids``); returns a
        token."""

    def from_staging(self, slot_ids: BlockIds, block_ids: BlockIds) -> Any:
        """Starts copying each slot into its block; returns a token."""

    def done(self, token: Any) -> bool:
        """Whether the copy behind ``token`` has finished (its destination is safe to read)."""


@dataclass
class _Entry:
    key: str  # P: the transfer id; D: the request id
    request_id: str
    block_ids: BlockIds
    payload: Any = None  # D: where to pull from
    slot_ids: BlockIds | None = None  # per group, the slot of each block, while taken
    copy: Any = None


class _SlotQueue:
    """What P's and D's staging share: requests waiting for slots (first come, first served:
    a later one never overtakes the head, so none starves), copies in flight, and what ``poll``
    returns. A subclass says what happens once an entry has its slots (``_slots_taken``)."""

    def __init__(self, slots: StagingSlots, copier: Copier):
        self.slots = slots
        self._copier = copier
        self._waiting: deque[_Entry] = deque()
        self._copying: list[_Entry] = []
        self._out: list = []

    @property
    def waiting(self) -> int:
        """Requests waiting for slots."""
        return len(self._waiting)

    def _slots_taken(self, entry: _Entry) -> None:
        raise NotImplementedError

    def _advance(self) -> None:
        while self._waiting:
            taken = self.slots.take(self._waiting[0].block_ids)
            if taken is None:
                return
            entry = self._waiting.popleft()
            entry.slot_ids = taken
            self._slots_taken(entry)

    def _finished_copies(self) -> list[_Entry]:
        """The copies in flight that are done now, each once."""
        done, still = [], []
        for entry in self._copying:
            (done if self._copier.done(entry.copy) else still).append(entry)
        self._copying = still
        for entry in done:
            entry.copy = None
        return done

    def _take_out(self) -> list:
        out, self._out = self._out, []
        return out


class Handed(NamedTuple):
    """P: the request's KV is in staging: hand ``slot_ids`` to the runtime to hold and give
    vLLM the request's blocks back."""
    transfer_id: str
    request_id: str
    slot_ids: BlockIds


class Refused(NamedTuple):
    """P: the request cannot be staged (``reason``): end its transfer, give its blocks back."""
    transfer_id: str
    request_id: str
    reason: str


class PrefillStaging(_SlotQueue):
    """P's staging: finished requests' blocks to slots, slots held until the runtime frees them.
    ``poll`` returns what the worker must act on, each once."""

    def __init__(self, slots: StagingSlots, copier: Copier):
        super().__init__(slots, copier)
        self._held: dict[str, _Entry] = {}  # transfer id -> entry, slots held by the runtime

    def hold(self, transfer_id: str, request_id: str, block_ids: BlockIds) -> None:
        """The request's prefill is done and its KV lies in ``block_ids``."""
        reason = self.slots.refusal(block_ids)
        if reason is not None:
            self._out.append(Refused(transfer_id, request_id, reason))
            return
        self._waiting.append(_Entry(transfer_id, request_id, block_ids))
        self._advance()

    def freed(self, transfer_id: str) -> bool:
        """The runtime freed the transfer: its slots are free. False for a transfer whose slots
        staging did not hand out (the worker's, when staging started later)."""
        entry = self._held.pop(transfer_id, None)
        if entry is None:
            return False
        assert entry.slot_ids is not None
        self.slots.give_back(entry.slot_ids)
        self._advance()
        return True

    def poll(self) -> list[Handed | Refused]:
        for entry in self._finished_copies():
            assert entry.slot_ids is not None
            self._held[entry.key] = entry
            self._out.append(Handed(entry.key, entry.request_id, entry.slot_ids))
        return self._take_out()

    def counts(self) -> dict[str, int]:
        return {"staging_waiting": len(self._waiting), "staging_copying": len(self._copying),
                "staging_held": len(self._held)}

    def _slots_taken(self, entry: _Entry) -> None:
        assert entry.slot_ids is not None
        entry.copy = self._copier.to_staging(entry.block_ids, entry.slot_ids)
        self._copying.append(entry)


class Start(NamedTuple):
    """D: pull the request's KV from ``source`` into ``slot_ids``."""
    request_id: str
    source: Any
    slot_ids: BlockIds


class Loaded(NamedTuple):
    """D: the request's KV is in its blocks: report the load finished."""
    request_id: str


class LoadFailed(NamedTuple):
    """D: the request's load failed (``reason``) and nothing writes its blocks: report it."""
    request_id: str
    reason: str


class DecodeStaging(_SlotQueue):
    """D's staging: loads pulled into slots, then copied into the request's blocks."""

    def __init__(self, slots: StagingSlots, copier: Copier):
        super().__init__(slots, copier)
        self._receiving: dict[str, _Entry] = {}  # request id -> entry, pulled into its slots
        self._quarantined: dict[str, _Entry] = {}  # failed while P may still write its slots
        # Per group: how many slots the quarantined entries keep.
        self._lost: list[int] = [0 for _ in slots.pools]

    def load(self, request_id: str, source: Any, block_ids: BlockIds) -> None:
        """vLLM allocated ``block_ids`` for the request's KV, to come from ``source``. A load
        that needs more slots than are not quarantined fails at once: it could wait forever
        (without fence_writes, quarantined slots come back only when P answers)."""
        reason = self.slots.refusal(block_ids, self._lost)
        if reason is not None:
            self._out.append(LoadFailed(request_id, f"cannot stage the load: {reason}"))
            return
        self._waiting.append(_Entry(request_id, request_id, block_ids, payload=source))
        self._advance()

    def cancel(self, request_id: str) -> None:
        """The request ended: a load still waiting for slots fails now (no pull was sent); one
        under way is the runtime's to end."""
        for entry in self._waiting:
            if entry.key == request_id:
                self._waiting.remove(entry)
                self._out.append(LoadFailed(request_id, "the request ended before its load "
                                                        "started (waiting for staging slots)"))
                self._advance()  # the head may have left: the next ones may fit now
                return

    def received(self, request_id: str) -> bool:
        """The runtime landed the request's KV in its slots: copy it up. False for a request
        staging did not start."""
        entry = self._receiving.pop(request_id, None)
        if entry is None:
            return False
        assert entry.slot_ids is not None
        entry.copy = self._copier.from_staging(entry.slot_ids, entry.block_ids)
        self._copying.append(entry)
        return True

    def failed(self, request_id: str, held: bool) -> bool:
        """The runtime failed the load; ``held``: a P rank may still write its slots, which stay
        taken until ``released``. Either way the request's blocks were never written."""
        entry = self._receiving.pop(request_id, None)
        if entry is None:
            return False
        if held:
            self._quarantined[request_id] = entry
            for group, ids in enumerate(entry.block_ids):
                self._lost[group] += len(ids)
            self._fail_the_unservable()
        else:
            self._give_back(entry)
        return True

    def released(self, request_id: str) -> bool:
        """No P rank can write the quarantined slots any more."""
        entry = self._quarantined.pop(request_id, None)
        if entry is None:
            return False
        for group, ids in enumerate(entry.block_ids):
            self._lost[group] -= len(ids)
        self._give_back(entry)
        return True

    def poll(self) -> list[Start | Loaded | LoadFailed]:
        for entry in self._finished_copies():
            self._out.append(Loaded(entry.request_id))
            self._give_back(entry)
        return self._take_out()

    def counts(self) -> dict[str, int]:
        return {"staging_waiting": len(self._waiting), "staging_receiving": len(self._receiving),
                "staging_copying": len(self._copying),
                "staging_quarantined": len(self._quarantined),
                "staging_quarantined_slots": sum(self._lost)}

    def _fail_the_unservable(self) -> None:
        """Waiting loads that the slots not quarantined can no longer hold fail now."""
        for entry in list(self._waiting):
            reason = self.slots.refusal(entry.block_ids, self._lost)
            if reason is not None:
                self._waiting.remove(entry)
                self._out.append(LoadFailed(entry.request_id, f"cannot stage the load: {reason}"))
        self._advance()  # a failed head no longer blocks the loads behind it

    def _give_back(self, entry: _Entry) -> None:
        assert entry.slot_ids is not None
        self.slots.give_back(entry.slot_ids)
        entry.slot_ids = None
        self._advance()

    def _slots_taken(self, entry: _Entry) -> None:
        assert entry.slot_ids is not None
        self._receiving[entry.key] = entry
        self._out.append(Start(entry.key, entry.payload, entry.slot_ids))


class WaitWatch:
    """When the worker logs about one side's waits for slots: ``"short"`` when requests start
    waiting, ``"stalled"`` once a wait has stood still for ``stall_after_s`` (no request took or
    gave back slots meanwhile: the waits may be waiting on each other, see the module doc),
    ``"clear"`` when none waits any more; each once per wait. ``now`` in seconds, any epoch."""

    def __init__(self, stall_after_s: float):
        self.stall_after_s = stall_after_s
        self._short = False
        self._stalled = False
        self._moves = -1
        self._still_since = 0.0

    def look(self, queue: _SlotQueue, now: float) -> str | None:
        moves = queue.slots.moves
        if moves != self._moves:
            self._moves, self._still_since, self._stalled = moves, now, False
        if queue.waiting == 0:
            if not self._short:
                return None
            self._short = False
            return "clear"
        if not self._short:
            # A wait starts now: slots that sat unmoved before it are not a standstill of it.
            self._short, self._still_since, self._stalled = True, now, False
            return "short"
        if not self._stalled and now - self._still_since >= self.stall_after_s:
            self._stalled = True
            return "stalled"
        return None


# -- memory --------------------------------------------------------------------------------------


def byte_view(cache: torch.Tensor, region: KvRegion) -> torch.Tensor:
    """``region``'s blocks in ``cache``'s memory as a ``[num_blocks, block_bytes]`` uint8 view
    (each block's bytes are one dense run, which kv_regions checked)."""
    storage = cache.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage)
    offset = region.data_ptr - storage.data_ptr()
    if offset < 0 or offset + region.nbytes > storage.nbytes():
        raise ValueError(f"layer {region.layer_name}: region outside its tensor's memory")
    return raw.as_strided((region.num_blocks, region.block_bytes), (region.block_stride, 1),
                          offset)


@dataclass
class StagedRegions:
    """The KV regions' byte views (``caches``) and their host twins (``staging``), index for
    index; ``regions`` is what the runtime registers instead of the KV cache."""
    caches: list[torch.Tensor]
    staging: list[torch.Tensor]
    regions: list[KvRegion] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.staging)


def stage_regions(
    regions: Sequence[KvRegion], tensors: Sequence[torch.Tensor], slots: int
) -> StagedRegions:
    """Host twins of ``regions`` (each backed by the tensor at the same index): ``slots`` blocks
    each, pinned when CUDA is there (async copies need it). A twin's block keeps the cache's
    bytes in the cache's order, so its region differs only in where blocks lie."""
    devices = {str(t.device) for t in tensors}
    if len(devices) > 1:
        # One copier moves every region's blocks with index tensors on one device.
        raise ValueError(f"the KV cache lies on several devices ({', '.join(sorted(devices))}); "
                         "kvferry stages one device's cache per worker")
    pin = torch.cuda.is_available()
    total = slots * sum(r.block_bytes for r in regions)
    out = StagedRegions(caches=[], staging=[])
    for region, tensor in zip(regions, tensors):
        out.caches.append(byte_view(tensor, region))
        try:
            twin = torch.zeros((slots, region.block_bytes), dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as e:  # out of (pinnable) host memory
            raise ValueError(
                f"cannot allocate {total / (1 << 20):.1f} MiB of host staging "
                f"({slots} slots per KV-cache group, kv_staging_blocks): {e}") from e
        out.staging.append(twin)
        out.regions.append(dataclasses.replace(
            region, data_ptr=twin.data_ptr(), nbytes=twin.numel(), num_blocks=slots,
            block_stride=region.block_bytes))
    return out


class BlockCopier:
    """The real Copier: one gather (or scatter) per region and request, one copy per run of
    consecutive slots (one run unless the pool had to hand out scattered slots). Host caches
    copy at once; a CUDA cache copies on a side stream that first waits for the compute stream
    (the KV the engine wrote), and ``done`` asks the event recorded after the copy."""

    def __init__(self, staged: StagedRegions):
        self.staged = staged
        device = staged.caches[0].device if staged.caches else torch.device("cpu")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = device

    def _regions(self, block_ids: BlockIds, slot_ids: BlockIds):
        """Per region with blocks to move: its cache view, its twin, the blocks' index on the
        cache's device and the runs of their slots (slot_runs)."""
        for cache, twin, region in zip(self.staged.caches, self.staged.staging,
                                       self.staged.regions):
            ids = block_ids[region.group]
            if ids:
                index = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
                yield cache, twin, index, slot_runs(slot_ids[region.group])

    def to_staging(self, block_ids: BlockIds, slot_ids: BlockIds) -> Any:
        def copies() -> None:
            for cache, twin, index, runs in self._regions(block_ids, slot_ids):
                gathered = cache.index_select(0, index)
                for start, count, first in runs:
                    twin[start:start + count].copy_(gathered[first:first + count],
                                                    non_blocking=True)
        return self._run(copies)

    def from_staging(self, slot_ids: BlockIds, block_ids: BlockIds) -> Any:
        def copies() -> None:
            for cache, twin, index, runs in self._regions(block_ids, slot_ids):
                for start, count, first in runs:
                    cache.index_copy_(0, index[first:first + count],
                                      twin[start:start + count].to(self.device, non_blocking=True))
        return self._run(copies)

    def _run(self, copies: Any) -> Any:
        if self.stream is None:
            copies()
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copies()
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def done(self, token: Any) -> bool:
        return token is None or token.query()
