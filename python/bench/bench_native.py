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


def run_python(native, torch, transport: str, ops: int, op_kib: int, seconds: float,
               in_flight: int = 1) -> float:
    """GB/s of `ops` blocks of `op_kib` KiB per transfer, non-contiguous (one op each), with
    `in_flight` transfers started before the first is waited for (each on its own blocks)."""
    block_len = op_kib * 1024
    per_slot = 2 * ops
    num_blocks = per_slot * in_flight
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
    # Slot k owns blocks [k * per_slot, (k + 1) * per_slot): P's every other block, D's the
    # others, so no two blocks of a transfer coalesce into one op.
    src = [list(range(k * per_slot, (k + 1) * per_slot, 2)) for k in range(in_flight)]
    dst = [list(range(k * per_slot + 1, (k + 1) * per_slot, 2)) for k in range(in_flight)]
    slot_of: dict[str, int] = {}

    def start(i: int, slot: int) -> None:
        xfer = f"x{i}"
        p.admit(xfer, i + 1)
        p.prefill_done(xfer, src[slot])
        source = {"transfer_id": xfer, "engine_id": engine_id,
                  "bootstrap_address": f"127.0.0.1:{bootstrap.port}"}
        d.start_load(f"r{i}", source, dst[slot])
        slot_of[f"r{i}"] = slot

    def settle(keep_going) -> int:
        """Waits for loads; finishes each and starts the next on its slot while keep_going()."""
        nonlocal nxt
        done = 0
        while slot_of:
            for event in d.wait_finished(10.0)["loaded"]:
                request, ok = event[0], event[1]
                assert ok, event
                d.request_finished(request)
                done += 1
                slot = slot_of.pop(request)
                if keep_going():
                    start(nxt, slot)
                    nxt += 1
            p.take_events()
        return done

    try:
        nxt = 0
        for slot in range(in_flight):  # connect and warm up
            start(nxt, slot)
            nxt += 1
        settle(lambda: False)
        for slot in range(in_flight):
            start(nxt, slot)
            nxt += 1
        begin = time.monotonic()
        done = settle(lambda: time.monotonic() - begin < seconds)
        elapsed = time.monotonic() - begin
        assert bool((d_kv.view(num_blocks, block_len)[1::2] == 7).all()), "bytes did not land"
        return done * ops * block_len / elapsed / 1e9
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


def run_cpp(kvferry: str, transport: str, seconds: float,
            in_flight: int = 0) -> dict[tuple[str, str], float]:
    """`kvferry bench transfer` rows by (size, layout), e.g. ("4 MiB", "64 x 64K"); in_flight 0:
    the bench's own window (2..16 batches), 1: one batch at a time, as one handoff moves."""
    out = subprocess.run([kvferry, "bench", "transfer", "--transport", transport, "--seconds",
                          str(seconds), "--no-baselines", "--in-flight", str(in_flight)],
                         capture_output=True, text=True, check=True).stdout
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
    parser.add_argument("--in-flight", type=int, default=8,
                        help="transfers started at once in the second pair of columns")
    parser.add_argument("--kvferry", default="build/bin/kvferry")
    args = parser.parse_args()
    # The C++ rows' UCX transports (set before UCX starts in this process), plus tcp for shm: a
    # worker's endpoints need a transport with a peer failure handler for their active messages,
    # which UCX 1.13's shared-memory transports lack ("sm,self" alone: every write fails with
    # "Destination is unreachable").
    os.environ["UCX_TLS"] = "tcp" if args.transport == "tcp" else "posix,sysv,self,tcp"
    import torch  # noqa: E402
    from kvferry import _native as native  # noqa: E402

    # Two pairs of columns: one transfer at a time beside the data plane with one batch in flight
    # (a handoff's own bound: its pull waits for its writes), and `--in-flight` transfers at once
    # beside the data plane's pipelined bandwidth (what a busy engine's many requests can reach).
    cpp_one = run_cpp(args.kvferry, args.transport, args.seconds, in_flight=1)
    cpp_many = run_cpp(args.kvferry, args.transport, args.seconds)
    print(f"transport {args.transport}, {args.seconds} s per row; GB/s")
    print(f"{'':<20} {'one transfer at a time':^30} | {args.in_flight:>2} transfers at once, "
          f"C++ pipelined")
    print(f"{'size':<8} {'ops':<11} {'python':>8} {'C++ 1 batch':>12} {'ratio':>6} | "
          f"{'python':>8} {'C++':>8} {'ratio':>6}")

    def ratio(a: float, b: float | None) -> str:
        return f"{a / b:6.0%}" if b else "     -"

    for ops, size in ((16, "1 MiB"), (64, "4 MiB"), (256, "16 MiB")):
        layout = f"{ops} x 64K"
        one = run_python(native, torch, args.transport, ops, 64, args.seconds)
        many = run_python(native, torch, args.transport, ops, 64, args.seconds, args.in_flight)
        b1, bn = cpp_one.get((size, layout)), cpp_many.get((size, layout))
        print(f"{size:<8} {layout:<11} {one:8.2f} {b1 or float('nan'):12.2f} {ratio(one, b1)} | "
              f"{many:8.2f} {bn or float('nan'):8.2f} {ratio(many, bn)}")
    for name, micros in call_costs(native, torch).items():
        print(f"per call: {name:<34} {micros:7.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
