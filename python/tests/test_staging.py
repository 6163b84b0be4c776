"""Host staging (kvferry/vllm/staging.py) alone: the slot pools, P's and D's staging state with a
stand-in copier whose copies end when the test says, and the real copier's bytes on host tensors
standing in for a GPU's KV cache."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry.vllm.native import KvRegion
from kvferry.vllm.staging import (
    BlockCopier,
    DecodeStaging,
    Handed,
    LoadFailed,
    Loaded,
    PrefillStaging,
    Refused,
    SlotPool,
    StagingSlots,
    Start,
    WaitWatch,
    byte_view,
    slot_runs,
    stage_regions,
)


class ManualCopier:
    """Copies that end when the test calls ``finish``; records what was asked."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.finished: set[int] = set()

    def to_staging(self, block_ids, slot_ids):
        self.calls.append(("to_staging", block_ids, slot_ids))
        return len(self.calls) - 1

    def from_staging(self, slot_ids, block_ids):
        self.calls.append(("from_staging", slot_ids, block_ids))
        return len(self.calls) - 1

    def done(self, token):
        return token in self.finished

    def finish(self, *tokens):
        self.finished.update(tokens or range(len(self.calls)))


# ---- slot pools ----


def test_a_pool_hands_out_a_run_when_one_is_long_enough_and_coalesces_what_comes_back():
    pool = SlotPool(10)
    a, b, c = pool.take(3), pool.take(3), pool.take(4)
    assert (a, b, c) == ([0, 1, 2], [3, 4, 5], [6, 7, 8, 9])
    assert pool.take(1) is None and pool.free == 0
    pool.give_back(a)
    pool.give_back(c)
    assert pool.take(4) == [6, 7, 8, 9]  # first fit: 0..2 is too short, 6..9 is a run
    pool.give_back([6, 7, 8, 9])
    pool.give_back(b)  # 0..9 free again, as one run
    assert pool.take(10) == list(range(10))


def test_a_pool_hands_out_scattered_slots_rather_than_make_a_request_wait():
    # 6 slots free in runs of 2: a request of 5 gets them (the lowest first); with contiguous
    # ranges only it waited, and on D such a wait can join a cycle with P's (staging.py).
    pool = SlotPool(12)
    taken = [pool.take(2) for _ in range(6)]
    for run in taken[::2]:
        pool.give_back(run)
    assert pool.free == 6
    assert pool.take(5) == [0, 1, 4, 5, 8]
    assert pool.free == 1 and pool.take(2) is None
    assert pool.take(1) == [9]


def test_a_pool_refuses_a_double_free_and_slots_outside_it_and_changes_nothing():
    pool = SlotPool(10)
    slots = pool.take(4)
    pool.give_back(slots)
    with pytest.raises(ValueError, match="free already"):
        pool.give_back(slots)
    pool.take(8)  # 0..7
    pool.give_back([2, 3])
    with pytest.raises(ValueError, match="free already"):
        pool.give_back([5, 3])  # 3 is free
    with pytest.raises(ValueError, match="twice"):
        pool.give_back([4, 4])
    with pytest.raises(ValueError, match="outside"):
        pool.give_back([7, 10])
    assert pool.free == 4  # 2, 3, 8, 9: no refused call returned anything
    with pytest.raises(ValueError):
        SlotPool(0)


def test_random_takes_and_gives_never_hand_one_slot_twice_nor_make_a_fitting_request_wait():
    rng = random.Random(7)
    pool = SlotPool(64)
    taken: list[list[int]] = []
    for _ in range(5000):
        if taken and rng.random() < 0.5:
            pool.give_back(taken.pop(rng.randrange(len(taken))))
        else:
            count = rng.randint(1, 12)
            free = pool.free
            slots = pool.take(count)
            assert (slots is not None) == (count <= free)
            if slots is not None:
                assert len(slots) == count
                taken.append(slots)
        owned = sorted(s for slots in taken for s in slots)
        assert len(owned) == len(set(owned)) and all(0 <= s < 64 for s in owned)
        assert pool.free == 64 - len(owned)


def test_slot_runs_name_each_run_of_consecutive_slots_and_where_it_starts():
    assert slot_runs([4, 5, 6, 0, 1, 9]) == [(4, 3, 0), (0, 2, 3), (9, 1, 5)]
    assert slot_runs([]) == []


def test_a_request_takes_slots_in_every_group_or_in_none():
    slots = StagingSlots(2, 4)
    assert slots.take([[1, 2, 3], [4, 5]]) == [[0, 1, 2], [0, 1]]
    assert slots.take([[6], [7, 8, 9]]) is None  # group 1 has 2 left: group 0 gives its 1 back
    assert [p.free for p in slots.pools] == [1, 2]
    assert slots.refusal([[1] * 5, []]) is not None and "kv_staging_blocks" in \
        slots.refusal([[1] * 5, []])
    assert "groups" in slots.refusal([[1]])


# ---- P ----


def test_p_hands_the_slots_to_the_runtime_only_once_the_copy_is_done():
    copier = ManualCopier()
    p = PrefillStaging(StagingSlots(1, 8), copier)
    p.hold("xfer-1", "r1", [[5, 9, 2]])
    assert copier.calls == [("to_staging", [[5, 9, 2]], [[0, 1, 2]])]
    assert p.poll() == []  # copying: nothing handed, vLLM keeps the blocks
    copier.finish()
    assert p.poll() == [Handed("xfer-1", "r1", [[0, 1, 2]])]
    assert p.poll() == []  # once
    assert p.slots.pools[0].free == 5
    assert p.freed("xfer-1") and p.slots.pools[0].free == 8
    assert not p.freed("xfer-1") and not p.freed("xfer-9")


def test_p_queues_requests_while_slots_are_short_and_serves_them_in_order():
    copier = ManualCopier()
    p = PrefillStaging(StagingSlots(1, 4), copier)
    p.hold("x1", "r1", [[0, 1, 2]])
    p.hold("x2", "r2", [[3, 4]])  # 1 slot free: waits
    p.hold("x3", "r3", [[5]])  # would fit, but waits behind x2 (no overtaking)
    assert len(copier.calls) == 1 and p.counts()["staging_waiting"] == 2
    copier.finish()
    assert p.poll() == [Handed("x1", "r1", [[0, 1, 2]])]
    assert p.freed("x1")
    assert [c[1] for c in copier.calls[1:]] == [[[3, 4]], [[5]]]
    copier.finish()
    assert p.poll() == [Handed("x2", "r2", [[0, 1]]), Handed("x3", "r3", [[2]])]


def test_p_refuses_a_request_larger_than_the_budget_at_once():
    copier = ManualCopier()
    p = PrefillStaging(StagingSlots(1, 4), copier)
    p.hold("x1", "r1", [[0, 1, 2, 3, 4]])
    (out,) = p.poll()
    assert isinstance(out, Refused) and out.transfer_id == "x1" and "5 blocks" in out.reason
    assert copier.calls == [] and p.slots.pools[0].free == 4


# ---- D ----


def test_d_pulls_into_slots_then_copies_up_and_reports_the_load_after_that_copy():
    copier = ManualCopier()
    d = DecodeStaging(StagingSlots(1, 8), copier)
    d.load("r1", "source-1", [[7, 3]])
    assert d.poll() == [Start("r1", "source-1", [[0, 1]])]
    assert d.received("r1")
    assert copier.calls == [("from_staging", [[0, 1]], [[7, 3]])]
    assert d.poll() == []  # copying up: not loaded yet
    copier.finish()
    assert d.poll() == [Loaded("r1")]
    assert d.slots.pools[0].free == 8
    assert not d.received("r1") and not d.received("stranger")


def test_d_keeps_the_slots_of_a_failed_load_p_may_still_write_until_released():
    copier = ManualCopier()
    d = DecodeStaging(StagingSlots(1, 6), copier)
    d.load("r1", "s", [[0, 1, 2]])  # slots 0..2
    d.load("r2", "s", [[3, 4, 5]])  # 3..5
    d.load("r3", "s", [[6, 7]])  # waits: nothing free
    assert [o.request_id for o in d.poll()] == ["r1", "r2"]
    assert d.failed("r1", held=True)
    assert d.poll() == []  # r3 waits: r1's slots may still be written, r2's will come back
    assert d.slots.pools[0].free == 0
    assert d.failed("r2", held=False)  # nothing writes them: back at once, and r3 takes them
    assert d.poll() == [Start("r3", "s", [[3, 4]])]
    assert d.slots.pools[0].free == 1
    assert d.released("r1")
    assert d.slots.pools[0].free == 4
    assert not d.released("r2") and not d.failed("r2", held=True)


def test_d_fails_at_once_the_loads_that_the_slots_not_quarantined_cannot_hold():
    # Without fence_writes a quarantined slot may stay taken for good: a load larger than the
    # slots around it would wait forever, so it fails, with the reason.
    copier = ManualCopier()
    d = DecodeStaging(StagingSlots(1, 10), copier)
    d.load("r1", "s", [[0, 1, 2]])  # slots 0..2
    d.load("r2", "s", [[3, 4]])  # 3..4
    d.load("r3", "s", [[5, 6, 7, 8, 9]])  # 5..9
    d.load("r4", "s", [[1] * 9])  # waits: every slot is taken
    d.load("r5", "s", [[1] * 8])  # waits behind r4
    assert [o.request_id for o in d.poll()] == ["r1", "r2", "r3"]
    assert d.failed("r2", held=True)  # 3..4 quarantined: 8 slots can still be had
    (out,) = d.poll()
    assert isinstance(out, LoadFailed) and out.request_id == "r4"
    assert "quarantined" in out.reason and "leave 8" in out.reason
    d.load("r6", "s", [[1] * 9])
    (out,) = d.poll()
    assert isinstance(out, LoadFailed) and out.request_id == "r6"
    assert d.received("r1") and d.received("r3")
    copier.finish()
    # r5 fits the 8 slots around the quarantined ones, though they do not lie in one run.
    assert d.poll() == [Loaded("r1"), Loaded("r3"), Start("r5", "s", [[0, 1, 2, 5, 6, 7, 8, 9]])]
    assert d.counts()["staging_quarantined_slots"] == 2
    assert d.released("r2")  # P can no longer write 3..4: a 9-slot load can wait again
    d.load("r7", "s", [[1] * 9])
    assert d.poll() == [] and d.waiting == 1
    assert d.counts()["staging_quarantined_slots"] == 0


def test_d_fails_a_load_still_waiting_for_slots_when_its_request_ends():
    copier = ManualCopier()
    d = DecodeStaging(StagingSlots(1, 2), copier)
    d.load("r1", "s", [[0, 1]])
    d.load("r2", "s", [[2]])
    d.poll()
    d.cancel("r2")
    d.cancel("r1")  # under way: the runtime's to end
    (out,) = d.poll()
    assert isinstance(out, LoadFailed) and out.request_id == "r2"
    assert d.counts()["staging_receiving"] == 1


def test_d_refuses_a_load_larger_than_the_budget_at_once():
    d = DecodeStaging(StagingSlots(1, 2), ManualCopier())
    d.load("r1", "s", [[0, 1, 2]])
    (out,) = d.poll()
    assert isinstance(out, LoadFailed) and "3 blocks" in out.reason


def test_a_wait_watch_names_the_start_a_standstill_and_the_end_of_a_wait_each_once():
    d = DecodeStaging(StagingSlots(1, 4), ManualCopier())
    watch = WaitWatch(stall_after_s=30)
    assert watch.look(d, now=0) is None  # nothing waits
    d.load("r1", "s", [[0, 1, 2]])
    d.load("r2", "s", [[3, 4]])  # waits for r1's slots
    assert watch.look(d, now=1) == "short"
    assert watch.look(d, now=30) is None  # 29 s without a move
    assert watch.look(d, now=31) == "stalled"
    assert watch.look(d, now=500) is None  # once per standstill
    d.load("r3", "s", [[5]])  # one slot is free, but r3 waits behind r2 (first come, first served)
    assert d.waiting == 2 and watch.look(d, now=501) is None
    assert d.failed("r1", held=False)  # slots move: r2 and r3 start
    assert watch.look(d, now=502) == "clear"
    d.load("r4", "s", [[6, 7, 8, 9]])
    assert watch.look(d, now=503) == "short"
    d.failed("r2", held=False)  # a move while r4 waits: the standstill clock starts again
    assert watch.look(d, now=520) is None
    assert watch.look(d, now=549) is None and watch.look(d, now=550) == "stalled"


def test_loads_arriving_during_a_standstill_do_not_hide_it():
    # Each new load tries to take slots and fails: that moves nothing, so the standstill that
    # began when r2 started waiting is still one 30 s later.
    d = DecodeStaging(StagingSlots(1, 4), ManualCopier())
    watch = WaitWatch(stall_after_s=30)
    d.load("r1", "s", [[0, 1, 2, 3]])
    d.load("r2", "s", [[4]])
    assert watch.look(d, now=0) == "short"
    d.load("r3", "s", [[5]])
    assert watch.look(d, now=20) is None
    d.load("r4", "s", [[6]])
    assert watch.look(d, now=30) == "stalled"
    assert d.waiting == 3 and d.slots.pools[0].free == 0


def test_a_wait_that_begins_after_a_long_quiet_is_not_a_standstill_at_once():
    d = DecodeStaging(StagingSlots(1, 2), ManualCopier())
    watch = WaitWatch(stall_after_s=30)
    d.load("r1", "s", [[0, 1]])  # takes every slot, and then nothing moves for 100 s
    assert watch.look(d, now=0) is None
    assert watch.look(d, now=100) is None
    d.load("r2", "s", [[2]])
    assert watch.look(d, now=101) == "short"
    assert watch.look(d, now=130) is None
    assert watch.look(d, now=131) == "stalled"


def test_a_head_that_leaves_the_queue_lets_the_loads_behind_it_start():
    # Cancelled: r2 (3 slots) waits at the head, r3 (1 slot) would fit behind it.
    d = DecodeStaging(StagingSlots(1, 3), ManualCopier())
    d.load("r1", "s", [[0, 1]])
    d.load("r2", "s", [[2, 3, 4]])
    d.load("r3", "s", [[5]])
    assert [o.request_id for o in d.poll()] == ["r1"]
    d.cancel("r2")
    out = d.poll()
    assert [type(o) for o in out] == [LoadFailed, Start]
    assert out[0].request_id == "r2" and out[1] == Start("r3", "s", [[2]])
    # Failed as unservable: quarantined slots leave too few for the head, not for the one behind.
    d = DecodeStaging(StagingSlots(1, 4), ManualCopier())
    d.load("r1", "s", [[0]])
    d.load("r2", "s", [[1, 2]])
    d.load("r3", "s", [[3, 4, 5]])  # waits: one slot free
    d.load("r4", "s", [[6]])  # waits behind r3
    assert [o.request_id for o in d.poll()] == ["r1", "r2"]
    assert d.failed("r2", held=True)  # 2 slots quarantined: r3 can never fit
    out = d.poll()
    assert [type(o) for o in out] == [LoadFailed, Start]
    assert out[0].request_id == "r3" and out[1].request_id == "r4"


# ---- bytes ----


def region_of(name, tensor, part="kv", group=0, num_blocks=None):
    num_blocks = num_blocks or tensor.shape[0]
    block_bytes = tensor[0].numel() * tensor.element_size()
    stride = tensor.stride(0) * tensor.element_size()
    return KvRegion(name, part, group, tensor.data_ptr(), (num_blocks - 1) * stride + block_bytes,
                    num_blocks, stride, block_bytes)


def test_the_copier_moves_each_blocks_bytes_between_cache_and_slots_exactly():
    # Two groups; one layer stored as flash-attention's separate K and V ([2, B, ...]), one
    # block-major with its blocks strided (a view of every other block of a larger tensor).
    torch.manual_seed(0)
    kv = torch.randn(2, 12, 4, 2, 3)
    wide = torch.randn(24, 5, 7)
    strided = wide[::2]
    regions = [region_of("l0", kv[0], "k"), region_of("l0", kv[1], "v"),
               region_of("l1", strided, group=1)]
    staged = stage_regions(regions, [kv, kv, wide], slots=6)
    assert [r.num_blocks for r in staged.regions] == [6, 6, 6]
    assert staged.regions[2].block_stride == staged.regions[2].block_bytes == 5 * 7 * 4
    copier = BlockCopier(staged)
    # Group 0's slots in one run, group 1's scattered (as a pool hands them out when the free
    # slots lie apart).
    slots = [[1, 2, 3], [5, 0]]
    assert copier.done(copier.to_staging([[9, 2, 4], [11, 0]], slots))
    for slot, block in zip(slots[0], [9, 2, 4]):
        assert torch.equal(staged.staging[0][slot].view(torch.float32), kv[0][block].flatten())
        assert torch.equal(staged.staging[1][slot].view(torch.float32), kv[1][block].flatten())
    for slot, block in zip(slots[1], [11, 0]):
        assert torch.equal(staged.staging[2][slot].view(torch.float32),
                           strided[block].flatten())
    # And back, into other blocks: only those change.
    before = kv.clone(), wide.clone()
    assert copier.done(copier.from_staging(slots, [[0, 1, 5], [7, 3]]))
    for block, source in zip([0, 1, 5], [9, 2, 4]):
        assert torch.equal(kv[:, block], before[0][:, source])  # K and V alike
    assert torch.equal(strided[7], before[1][::2][11]) and torch.equal(strided[3], before[1][::2][0])
    untouched = [b for b in range(12) if b not in (0, 1, 5)]
    assert torch.equal(kv[:, untouched], before[0][:, untouched])
    assert torch.equal(wide[1::2], before[1][1::2])  # the blocks between never move


def test_staging_refuses_a_cache_on_several_devices_before_allocating():
    host = torch.zeros(4, 8)
    meta = torch.zeros(4, 8, device="meta")  # a second device (no memory behind it)
    with pytest.raises(ValueError, match="several devices"):
        stage_regions([region_of("l0", host), region_of("l1", meta)], [host, meta], slots=2)


def test_staging_that_cannot_be_allocated_is_a_clear_error_naming_its_setting(monkeypatch):
    t = torch.zeros(4, 8)
    region = region_of("l", t)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch, "zeros", out_of_memory)
    with pytest.raises(ValueError, match=r"host staging \(1000000 slots .*kv_staging_blocks\)"):
        stage_regions([region], [t], slots=1_000_000)


def test_a_byte_view_refuses_a_region_outside_its_tensor():
    t = torch.zeros(4, 8)
    good = region_of("l", t)
    assert byte_view(t, good).shape == (4, 32)
    bad = KvRegion("l", "kv", 0, t.data_ptr(), 10 * 32, 10, 32, 32)
    with pytest.raises(ValueError, match="outside"):
        byte_view(t, bad)


def test_the_gpu_checks_staging_script_moves_every_byte_on_the_cpu():
    # scripts/gpu-check.sh runs it on a GPU; run small here so that it works when one is lent.
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "python")}
    for extra in ([], ["--scattered"]):  # D's slots in runs, then one apart from the next
        done = subprocess.run(
            [sys.executable, str(root / "scripts/staging_check.py"), "--device", "cpu",
             "--layers", "2", "--blocks", "64", "--requests", "3", "--request-blocks", "5",
             "--rounds", "1", "--heads", "2", "--head-dim", "16", *extra],
            env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "every byte of 3 requests' blocks on D equals P's" in done.stdout, done.stdout
