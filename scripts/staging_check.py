#!/usr/bin/env python3
"""Host staging's check and benchmark (python/kvferry/vllm/staging.py), on a GPU when there is
one: requests' KV blocks go from P's cache to P's staging slots, across (a host copy stands in
for kvferry's data plane, which moves host memory and is measured in docs/performance.md), and
from D's staging slots up into D's cache, through the same PrefillStaging, DecodeStaging and
BlockCopier the connector runs. Every byte of D's blocks is checked against P's; the copies'
GB/s are printed beside a copy of the same blocks inside the device and a host memcpy.

    PYTHONPATH=python python3 scripts/staging_check.py [--device cuda|cpu] [--layers N] ...

Needs torch only (no vLLM, no kvferry._native). Exit status 0 when every byte matched.
scripts/gpu-check.sh runs it on a machine with a GPU; python/tests/test_staging.py runs it small
on the CPU, so it does not rot between GPU runs.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvferry.vllm.native import KvRegion
from kvferry.vllm.staging import (
    BlockCopier,
    DecodeStaging,
    Handed,
    Loaded,
    PrefillStaging,
    StagingSlots,
    Start,
    slot_runs,
    stage_regions,
)


def kv_cache(layers: int, blocks: int, block_size: int, heads: int, head_dim: int,
             device: torch.device, seed: int) -> list[torch.Tensor]:
    """Per layer, flash-attention's [2, blocks, block_size, heads, head_dim] in float16, random."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn((2, blocks, block_size, heads, head_dim), generator=generator,
                        dtype=torch.float32).to(torch.float16).to(device)
            for _ in range(layers)]


def regions_of(caches: list[torch.Tensor]) -> tuple[list[KvRegion], list[torch.Tensor]]:
    regions, tensors = [], []
    for i, cache in enumerate(caches):
        for part, t in (("k", cache[0]), ("v", cache[1])):
            block_bytes = t[0].numel() * t.element_size()
            stride = t.stride(0) * t.element_size()
            regions.append(KvRegion(f"layer.{i}", part, 0, t.data_ptr(),
                                    (t.shape[0] - 1) * stride + block_bytes, t.shape[0], stride,
                                    block_bytes))
            tensors.append(cache)
    return regions, tensors


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wait(poll, want: type, count: int, timeout_s: float = 60.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        got += [out for out in poll() if isinstance(out, want)]
        if time.monotonic() > deadline:
            raise SystemExit(f"staging_check: {want.__name__} not seen {count} times in "
                             f"{timeout_s:g} s (a copy whose event never completes?)")
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=256, help="blocks of each cache")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--request-blocks", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds; the best is shown")
    parser.add_argument("--scattered", action="store_true",
                        help="D's loads get every other slot (a pool whose free slots lie apart: "
                             "one copy per slot instead of one per request)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.requests * args.request_blocks > args.blocks:
        parser.error("--requests x --request-blocks must fit in --blocks")

    p_cache = kv_cache(args.layers, args.blocks, args.block_size, args.heads, args.head_dim,
                       device, seed=1)
    d_cache = kv_cache(args.layers, args.blocks, args.block_size, args.heads, args.head_dim,
                       device, seed=2)
    slots = args.requests * args.request_blocks
    p_regions, p_tensors = regions_of(p_cache)
    d_regions, d_tensors = regions_of(d_cache)
    p_staged = stage_regions(p_regions, p_tensors, slots)
    # Scattered: D's staging twice the size, every other slot taken before the loads come.
    d_slots = 2 * slots if args.scattered else slots
    d_staged = stage_regions(d_regions, d_tensors, d_slots)
    if device.type == "cuda" and not all(t.is_pinned() for t in p_staged.staging):
        print("staging_check: FAIL: staging on a CUDA host is not pinned")
        return 1
    p_copier, d_copier = BlockCopier(p_staged), BlockCopier(d_staged)
    request_bytes = sum(r.block_bytes for r in p_regions) * args.request_blocks
    total = request_bytes * args.requests
    print(f"staging_check: device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host'}), "
          f"torch {torch.__version__}; {args.requests} requests x {args.request_blocks} blocks x "
          f"{len(p_regions)} regions = {total / 2**20:.1f} MiB a round")

    # Each request's blocks, scattered over the cache as a real cache's are: P's and D's differ.
    generator = torch.Generator().manual_seed(3)
    p_perm, d_perm = (torch.randperm(args.blocks, generator=generator).tolist() for _ in "pd")
    n = args.request_blocks
    p_blocks = [p_perm[i * n:(i + 1) * n] for i in range(args.requests)]
    d_blocks = [d_perm[i * n:(i + 1) * n] for i in range(args.requests)]

    timings: dict[str, float] = {}

    def timed(name: str, run) -> None:
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        seconds = time.perf_counter() - start
        timings[name] = min(timings.get(name, seconds), seconds)

    for _ in range(args.rounds):
        p = PrefillStaging(StagingSlots(1, slots), p_copier)
        d = DecodeStaging(StagingSlots(1, d_slots), d_copier)
        if args.scattered:
            pool = d.slots.pools[0]
            every = pool.take(d_slots)
            assert every is not None
            pool.give_back(every[1::2])
        handed: list = []
        starts: list = []

        def p_side() -> None:
            for i, ids in enumerate(p_blocks):
                p.hold(f"xfer-{i}", f"req-{i}", [ids])
            handed[:] = wait(p.poll, Handed, args.requests)

        def wire() -> None:  # kvferry's data plane: P's slots into D's slots, host to host
            for (_, _, p_slot_ids), (_, _, d_slot_ids) in zip(handed, starts):
                src = torch.tensor(p_slot_ids[0])
                dst = torch.tensor(d_slot_ids[0])
                for p_twin, d_twin in zip(p_staged.staging, d_staged.staging):
                    d_twin[dst] = p_twin[src]

        def d_side() -> None:
            for i in range(args.requests):
                assert d.received(f"req-{i}")
            wait(d.poll, Loaded, args.requests)

        timed("P: cache -> staging", p_side)
        for i, ids in enumerate(d_blocks):
            d.load(f"req-{i}", "source", [ids])
        starts[:] = wait(d.poll, Start, args.requests)
        if args.scattered and any(len(slot_runs(ids[0])) != len(ids[0]) for _, _, ids in starts):
            print("staging_check: FAIL: --scattered handed D runs of slots")
            return 1
        timed("host: P's slots -> D's slots (memcpy)", wire)
        for dc in d_cache:
            dc.zero_()  # what D's blocks hold now came through staging, or the check fails
        timed("D: staging -> cache", d_side)
        for i in range(args.requests):
            assert p.freed(f"xfer-{i}")
        for pc, dc in zip(p_cache, d_cache):
            for src, dst in zip(p_blocks, d_blocks):
                if not torch.equal(pc[:, src].view(torch.int16), dc[:, dst].view(torch.int16)):
                    print("staging_check: FAIL: D's blocks differ from P's")
                    return 1

        def device_copy() -> None:  # the same blocks, inside the device
            for pc, dc in zip(p_cache, d_cache):
                for src, dst in zip(p_blocks, d_blocks):
                    dc[:, torch.tensor(dst, device=device)] = pc[:, torch.tensor(src,
                                                                                 device=device)]

        timed(f"{device.type}: P's cache -> D's cache (one device)", device_copy)

    base = timings[f"{device.type}: P's cache -> D's cache (one device)"]
    print(f"{'copy':<42} {'ms':>8} {'GB/s':>8} {'vs device copy':>15}")
    for name, seconds in timings.items():
        print(f"{name:<42} {seconds * 1e3:8.2f} {total / seconds / 1e9:8.2f} "
              f"{base / seconds:15.2f}")
    print(f"staging_check: every byte of {args.requests} requests' blocks on D equals P's "
          f"({total * args.rounds / 2**20:.0f} MiB moved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
