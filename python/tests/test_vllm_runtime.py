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


def test_a_kv_cache_off_the_host_is_refused_before_anything_is_registered():
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm", reason="kvferry.vllm.worker imports vLLM")
    from kvferry.vllm.worker import kv_regions

    on_device = torch.empty((2, 8, 16, 2, 8), device="meta")  # no host memory behind it
    with pytest.raises(ValueError, match="host memory only"):
        kv_regions("layer.0", on_device, 0, 8)


def test_token_major_blocks_are_registered_but_never_head_sliced():
    token_major = [KvRegion("l", "kv", 0, 0x10000, 8 * 256, 8, 256, 256, heads_outermost=False)]
    assert planes_of(token_major, kv_heads=8)[1] == 256  # moved whole between equal TPs
    assert not head_slices(token_major, kv_heads=8)
    assert head_slices(token_major, kv_heads=1), "replicated KV is never cut"
    assert head_slices([region(0x10000, 256, 256)], kv_heads=8)
