"""runtime.py's decisions, without vLLM: which KV regions become which planes, and what is
refused because moving it would put bytes in the wrong place."""

from __future__ import annotations

import pytest

from kvferry.vllm.native import KvRegion
from kvferry.vllm.runtime import LayoutError, head_slices, planes_of


def region(ptr, stride, size, group=0, blocks=8, part="kv"):
    return KvRegion("l", part, group, ptr, (blocks - 1) * stride + size, blocks, stride, size)


def test_dense_layers_become_one_plane_each():
    regions = [region(0x10000, 256, 256), region(0x20000, 256, 256, part="k")]
    planes, block_len, blocks = planes_of(regions, kv_heads=8)
    assert planes == [(0x10000, 8 * 256), (0x20000, 8 * 256)]
    assert (block_len, blocks) == (256, 8)


def test_a_cross_layer_block_becomes_one_plane_for_replicated_mla_kv():
    # Three layers side by side in every 3 x 128-byte block (vLLM's block-outermost layout).
    regions = [region(0x10000 + 128 * i, 384, 128) for i in (2, 0, 1)]
    planes, block_len, blocks = planes_of(regions, kv_heads=1)
    assert planes == [(0x10000, 8 * 384)]
    assert block_len == 384


def test_a_cross_layer_block_is_refused_when_heads_may_be_sliced():
    regions = [region(0x10000 + 128 * i, 384, 128) for i in range(3)]
    with pytest.raises(LayoutError, match="LBHNC"):
        planes_of(regions, kv_heads=8)


def test_regions_that_do_not_tile_their_block_are_refused():
    gap = [region(0x10000, 384, 128), region(0x10000 + 256, 384, 128)]  # a hole in each block
    with pytest.raises(LayoutError, match="neither dense"):
        planes_of(gap, kv_heads=1)


def test_several_kv_cache_groups_are_refused():
    with pytest.raises(LayoutError, match="groups"):
        planes_of([region(0x10000, 256, 256, group=0), region(0x20000, 256, 256, group=1)], 8)


def test_layers_of_different_block_sizes_are_refused():
    with pytest.raises(LayoutError, match="block sizes"):
        planes_of([region(0x10000, 256, 256), region(0x20000, 512, 512)], 8)


def test_no_region_is_refused():
    with pytest.raises(LayoutError):
        planes_of([], 8)


def test_token_major_blocks_are_registered_but_never_head_sliced():
    token_major = [KvRegion("l", "kv", 0, 0x10000, 8 * 256, 8, 256, 256, heads_outermost=False)]
    assert planes_of(token_major, kv_heads=8)[1] == 256  # moved whole between equal TPs
    assert not head_slices(token_major, kv_heads=8)
    assert head_slices(token_major, kv_heads=1), "replicated KV is never cut"
    assert head_slices([region(0x10000, 256, 256)], kv_heads=8)


class _FakeNative:
    class KvferryError(Exception):
        def __init__(self, message, code):
            super().__init__(message)
            self.code = code

    class DecodeWorker:
        """kvferry._native.DecodeWorker's calls and adapter events, scripted."""

        def __init__(self, **kwargs):
            self.calls: list[tuple] = []
            self.refuse: dict[str, Exception] = {}  # start_load raises for these
            self.pending = {"loaded": [], "reusable": [], "dropped": []}

        def start_load(self, request_id, source, blocks):
            self.calls.append(("start_load", request_id))
            if request_id in self.refuse:
                raise self.refuse[request_id]

        def request_finished(self, request_id):
            self.calls.append(("request_finished", request_id))

        def take_finished(self):
            out, self.pending = self.pending, {"loaded": [], "reusable": [], "dropped": []}
            return out


def _decode_runtime():
    from kvferry.vllm.native import RemoteSource, WorkerOptions
    from kvferry.vllm.runtime import DecodeRuntime

    options = WorkerOptions(engine_id="d", tp_rank=0, tp_size=1, kv_lease_duration=5,
                            abort_request_timeout=30, bootstrap_port=0,
                            bootstrap_server_address=None, kv_release=True)
    runtime = DecodeRuntime(_FakeNative, [region(0x10000, 256, 256)], options)
    return runtime, runtime._worker, RemoteSource("p", "http://p:8998", "x")


def test_a_failed_load_is_reported_at_once_and_its_held_blocks_once_released():
    # The engine-adapter issue's hole 3: a load whose writer is unknown (a deadline passed, its
    # P went away mid-pull) was reported only once its blocks left quarantine — never, for a
    # P that never answers. It is reported failed at once now, held; then released.
    runtime, native, source = _decode_runtime()
    runtime.start_load("r1", source, [[1, 2]])
    native.pending["loaded"] = [("r1", False, "TIMEOUT: no answer", True)]
    got = runtime.take_finished()
    assert got.failed == [("r1", "TIMEOUT: no answer", True)] and got.released == []
    native.pending["reusable"] = [("r1", True)]
    assert runtime.take_finished().released == ["r1"]


def test_only_loads_reported_held_are_reported_released():
    runtime, native, source = _decode_runtime()
    native.pending["loaded"] = [("ok", True, "", False), ("bad", False, "NOT_FOUND: x", False)]
    native.pending["reusable"] = [("ok", False), ("bad", False)]
    got = runtime.take_finished()
    assert got.received == ["ok"]
    assert got.failed == [("bad", "NOT_FOUND: x", False)]
    assert got.released == [], "vLLM never held these blocks back: nothing to release"


def test_a_refused_load_fails_unpulled_but_a_second_load_of_one_id_changes_nothing():
    runtime, native, source = _decode_runtime()
    native.refuse["r1"] = _FakeNative.KvferryError("block 9 outside the region", "OUT_OF_RANGE")
    runtime.start_load("r1", source, [[9]])
    assert runtime.take_finished().failed == [("r1", "block 9 outside the region", False)]
    # A second load of an id still loading: the first load's outcome is the request's, so
    # nothing is reported now (a failure would let vLLM reuse blocks the first load writes).
    native.refuse["r2"] = _FakeNative.KvferryError("request r2 is loading", "ALREADY_EXISTS")
    runtime.start_load("r2", source, [[3]])
    got = runtime.take_finished()
    assert got.failed == [] and got.received == []
