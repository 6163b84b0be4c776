"""Bytes/s through kvferry's Python API (kvferry._native) beside the C++ data plane alone.

Each transfer is the whole path a Python serving engine takes: P admits and reports its prefill
done, D starts the load (pull over the side channel, P writes over UCX, the reply), D waits for
the result, then finishes the request so P frees the transfer. Transfers run back to back for
--seconds per row, moving torch CPU tensors registered as planes. Beside each row, the same size
and op count from `kvferry bench transfer` (the transport engine alone, writer and receiver in
two processes), run in this same invocation.

    UCX_NET_DEVICES=lo PYTHONPATH=python:build/python .venv/bin/python python/bench/bench_native.py

Prints a table; docs/performance.md keeps the latest run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import uuid


def run_python(native, torch, transport: str, ops: int, op_kib: int, seconds: float) -> float:
    """GB/s of `ops` blocks of `op_kib` KiB per transfer, non-contiguous (one op each)."""
    block_len = op_kib * 1024
    num_blocks = 2 * ops
    p_kv = torch.full((num_blocks * block_len,), 7, dtype=torch.uint8)
    d_kv = torch.zeros((num_blocks * block_len,), dtype=torch.uint8)
    bootstrap = native.BootstrapServer(host="127.0.0.1", port=0)
    engine_id = "bench-p-" + uuid.uuid4().hex[:6]
    p = native.PrefillWorker(engine_id=engine_id, block_len=block_len, num_blocks=num_blocks,
                             planes=[(p_kv.data_ptr(), p_kv.numel())], lease_s=30.0,
                             abort_request_timeout_s=60.0,
                             bootstrap_address=f"127.0.0.1:{bootstrap.port}",
                             incarnation=uuid.uuid4().hex)
    d = native.DecodeWorker(engine_id="bench-d", block_len=block_len, num_blocks=num_blocks,
                            planes=[(d_kv.data_ptr(), d_kv.numel())], lease_s=30.0,
                            abort_request_timeout_s=60.0)
    src_blocks = list(range(0, num_blocks, 2))  # every other block: no two coalesce
    dst_blocks = list(range(1, num_blocks, 2))
    try:
        def one(i: int) -> None:
            xfer = f"x{i}"
            p.admit(xfer, i + 1)
            p.prefill_done(xfer, src_blocks)
            source = {"transfer_id": xfer, "engine_id": engine_id,
                      "bootstrap_address": f"127.0.0.1:{bootstrap.port}"}
            d.start_load(f"r{i}", source, dst_blocks)
            while True:
                got = d.wait_finished(10.0)["loaded"]
                if got:
                    assert got[0][1], got[0][2]
                    break
            d.request_finished(f"r{i}")
            p.take_events()

        one(0)  # connect and warm up
        i, moved = 1, 0
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            one(i)
            i += 1
            moved += ops * block_len
        elapsed = time.monotonic() - start
        assert bool((d_kv.view(num_blocks, block_len)[1::2] == 7).all()), "bytes did not land"
        return moved / elapsed / 1e9
    finally:
        d.stop()
        p.stop()
        bootstrap.stop()


def call_costs(native, torch) -> dict[str, float]:
    """µs per call: a binding call that does nothing in C++ (D's take_finished with nothing
    finished), and admit + engine_finished (each a round trip to P's listener thread)."""
    kv = torch.zeros(64 * 1024, dtype=torch.uint8)
    p = native.PrefillWorker(engine_id="bench-calls", block_len=1024, num_blocks=64,
                             planes=[(kv.data_ptr(), kv.numel())], incarnation="i",
                             data_plane="inprocess")
    d = native.DecodeWorker(engine_id="bench-calls-d", block_len=1024, num_blocks=64,
                            planes=[], data_plane="inprocess")
    try:
        n = 20000
        start = time.perf_counter()
        for _ in range(n):
            d.take_finished()
        idle = (time.perf_counter() - start) / n * 1e6
        n = 5000
        start = time.perf_counter()
        for i in range(n):
            p.admit(f"c{i}", i + 1)
            p.engine_finished(f"c{i}")
        pair = (time.perf_counter() - start) / n * 1e6
        return {"take_finished (nothing finished)": idle, "admit + engine_finished": pair}
    finally:
        d.stop()
        p.stop()


def run_cpp(kvferry: str, transport: str, seconds: float) -> dict[tuple[str, str], float]:
    """`kvferry bench transfer` rows by (size, layout), e.g. ("4 MiB", "64 x 64K")."""
    out = subprocess.run([kvferry, "bench", "transfer", "--transport", transport, "--seconds",
                          str(seconds), "--no-baselines"], capture_output=True, text=True,
                         check=True).stdout
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(\w+)\s+(\d+ [KM]iB)\s+(\d+ x 64K|1 op)\s+\S+\s+([\d.]+)\s+yes", line)
        if m and m.group(1) == transport:
            rows[(m.group(2), m.group(3))] = float(m.group(4))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--kvferry", default="build/bin/kvferry")
    args = parser.parse_args()
    # The same UCX transports as the C++ rows (set before UCX starts in this process).
    os.environ["UCX_TLS"] = "tcp" if args.transport == "tcp" else "sm,self"
    import torch  # noqa: E402
    from kvferry import _native as native  # noqa: E402

    cpp = run_cpp(args.kvferry, args.transport, args.seconds)
    print(f"transport {args.transport}, {args.seconds} s per row; GB/s")
    print(f"{'size':<8} {'ops':<11} {'python API':>10} {'C++ data plane':>15} {'ratio':>6}")
    for ops, size in ((16, "1 MiB"), (64, "4 MiB"), (256, "16 MiB")):
        py = run_python(native, torch, args.transport, ops, 64, args.seconds)
        layout = f"{ops} x 64K"
        base = cpp.get((size, layout))
        ratio = f"{py / base:6.0%}" if base else "     -"
        print(f"{size:<8} {layout:<11} {py:10.2f} {base if base else float('nan'):15.2f} {ratio}")
    for name, micros in call_costs(native, torch).items():
        print(f"per call: {name:<34} {micros:7.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
