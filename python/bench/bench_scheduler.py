"""Scheduler-side connector cost: vLLM's real Scheduler driving P and D requests with
KvferryConnector, with vLLM's MooncakeConnector, and with no connector, side by side in one run.

The same load for each: N requests of a 256-token prompt; P prefills them (max_tokens 1) and
holds their blocks until the fake model runner reports each sent; D receives them (the runner
reports each received the step after its load started) and decodes 16 tokens. The time of
schedule() + update_from_output() per step and per request is the scheduler's plus its
connector's; no model runs, so the difference between rows is the connector's cost.

    HF_HUB_OFFLINE=1 .venv/bin/python python/bench/bench_scheduler.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parents[1] / "tests")]

from vllm_harness import (  # noqa: E402
    d_params,
    make_request,
    make_scheduler,
    make_vllm_config,
    p_params,
    runner_output,
    write_model_dir,
)

CONNECTORS = {
    "none": {"kv_connector": None},
    "MooncakeConnector": {"kv_connector": "MooncakeConnector", "kv_connector_module_path": None},
    "KvferryConnector": {},
}


def config(model_dir, role, connector):
    kw = CONNECTORS[connector]
    if kw.get("kv_connector", "x") is None:
        cfg = make_vllm_config(model_dir, role)
        cfg.kv_transfer_config = None
        return cfg
    return make_vllm_config(model_dir, role, **kw)


def run(model_dir, role: str, connector: str, requests: int) -> tuple[float, float, int]:
    """(µs per step, µs per request, steps) for one role's whole load."""
    scheduler = make_scheduler(config(model_dir, role, connector), num_blocks=4096)
    with_kv = connector != "none"
    for i in range(requests):
        params = None
        if with_kv:
            params = p_params(f"x{i}") if role == "kv_producer" else d_params(f"x{i}")
        max_tokens = 1 if role == "kv_producer" else 16
        scheduler.add_request(make_request(f"r{i}", 256, params, max_tokens=max_tokens))
    pending_send: set[str] = set()
    pending_recv: set[str] = set()
    steps, busy = 0, 0.0
    while scheduler.requests:
        start = time.perf_counter()
        out = scheduler.schedule()
        # The runner reports what the connector started last step as done now.
        sending, recving = pending_send, pending_recv
        kw = {}
        if with_kv and (sending or recving):
            kw = {"finished_sending": sending or None, "finished_recving": recving or None}
        result = runner_output(out, **kw)
        scheduler.update_from_output(out, result)
        busy += time.perf_counter() - start
        steps += 1
        pending_send, pending_recv = set(), set()
        if with_kv:
            if role == "kv_producer":
                pending_send = {r for r in out.finished_req_ids if r in scheduler.requests}
            else:
                meta = out.kv_connector_metadata
                loads = getattr(meta, "load", None)
                if loads is None:  # MooncakeConnector's metadata
                    loads = {r for reqs in meta.reqs_to_recv.values() for r in reqs}
                pending_recv = set(loads)
        assert steps < 100000
    return busy / steps * 1e6, busy / requests * 1e6, steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    model_dir = write_model_dir(Path(tempfile.mkdtemp()) / "tiny")
    print(f"{args.requests} requests of 256 prompt tokens, best of {args.repeat}; "
          "schedule() + update_from_output()")
    print(f"{'role':<5} {'connector':<18} {'µs/step':>8} {'µs/request':>11} {'steps':>6} "
          f"{'vs none':>8}")
    for role, name in (("kv_producer", "P"), ("kv_consumer", "D")):
        base = None
        for connector in CONNECTORS:
            runs = [run(model_dir, role, connector, args.requests) for _ in range(args.repeat)]
            per_step = min(r[0] for r in runs)
            per_request = min(r[1] for r in runs)
            steps = runs[0][2]
            if base is None:
                base = per_request
            extra = f"{per_request - base:+7.1f}" if connector != "none" else "       -"
            print(f"{name:<5} {connector:<18} {per_step:8.1f} {per_request:11.1f} {steps:6d} "
                  f"{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
