"""Time to first token through real ``vllm serve`` engines with and without layer writes
(``layer_writes``: P sends each layer of a prompt's last step to the decoder whose pull already
waits as soon as vLLM computed it; off: the whole KV after the prefill). Issue 22's overlap,
measured on the path users run: vLLM 0.32.0's CPU build, a 32-layer model with 128 KiB of KV a
token (tiny_model.py's ``deep``), two P/D pairs, one after the other, behind ``kvferry proxy`` (Mooncake's
flow: P and D get the request at once), identical but for the key.

    PYTHONPATH=python:build/python .venv/bin/python python/bench/bench_layer_writes.py
        [--tokens 1024] [--reps 8] [--transport tcp|shm] [--out DIR]

The pairs run one after the other (see main). Each rep sends one fresh prompt (random tokens,
prefix caching off: no cache hit), one request at a time, streamed; TTFT is the client's time to
the first token. P alone (its own /v1/completions, one token, a prompt of the same length) is
the prefill's time. Prints the medians and every sample; what layer writes can save is the
transfer time of all layers but the last (the benchmark's KV bytes over the data plane's rate),
less what the transfer already overlapped without them (D's scheduling). The run fails unless
the P of the "on" pair logged a layer write. About 3-5 minutes on 2 cores, most of it the four
engine starts.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

from tiny_model import make_model  # noqa: E402
from vllm_serve import Cluster, complete, engine_env, stream_completion  # noqa: E402

LAYERS = 32
KV_BYTES_PER_TOKEN = LAYERS * 2 * 4 * 128 * 4  # K and V, 4 KV heads of 128, float32
BLOCK = 64


def ttft(url: str, model: str, prompt: list[int]) -> float:
    first = threading.Event()
    box: dict[str, float] = {}

    def watch() -> None:
        import time
        start = time.monotonic()
        first.wait(600)
        box["t"] = time.monotonic() - start

    watcher = threading.Thread(target=watch)
    watcher.start()
    out = stream_completion(url, model, prompt, 2, first)
    watcher.join()
    if out.status != 200 or not out.tokens:
        raise RuntimeError(f"{url}: {out.status} {out.body[:400]}")
    return box["t"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--transport", choices=("tcp", "shm"), default="tcp")
    parser.add_argument("--out", default=None, help="engine logs (default: a new temp dir)")
    args = parser.parse_args()

    root = Path(args.out or tempfile.mkdtemp(prefix="bench-layer-writes-"))
    root.mkdir(parents=True, exist_ok=True)
    model = str(make_model(root / "deep", "deep"))
    blocks = 4 * (args.tokens // BLOCK + 2)
    engine_args = ["--block-size", str(BLOCK), "--num-gpu-blocks-override", str(blocks),
                   "--max-model-len", str(args.tokens + 64), "--max-num-batched-tokens",
                   str(args.tokens + 64), "--no-enable-prefix-caching"]
    env = {"UCX_TLS": "tcp"} if args.transport == "tcp" else {}  # shm: what UCX picks on one host
    rng = random.Random(7)
    fresh = lambda: [rng.randrange(10, 1000) for _ in range(args.tokens)]  # noqa: E731
    times: dict[str, list[float]] = {"on": [], "off": [], "p": []}
    layer_lines = 0
    # One pair at a time: with both pairs' four engines on 2 cores, P's UCX progress thread
    # stalled for 30-40 s in a single ucp_worker_progress call, with layer writes and without
    # (docs/performance.md), and the requests it carried failed.
    for name, on in (("on", True), ("off", False)):
        cluster = Cluster(root, engine_env(root))
        pair = cluster.pair(name, model, extra={"layer_writes": on}, args=engine_args, env=env)
        print(f"engine logs: {root} (pair {name})", flush=True)
        cluster.start()
        try:
            ttft(pair.proxy.url, model, fresh())  # warm-up: UCX connections, first forward
            for _ in range(args.reps):
                times[name].append(ttft(pair.proxy.url, model, fresh()))
                if on:
                    got = complete(pair.prefill.url, model, fresh(), 1)
                    assert got.status == 200, got.body
                    times["p"].append(got.seconds)
            if on:
                layer_lines = (root / "on-prefill.log").read_text(errors="replace").count(
                    "(layer writes)")
        finally:
            cluster.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    kv_mb = args.tokens * KV_BYTES_PER_TOKEN / 1e6
    print(f"\n{args.tokens}-token prompts, {kv_mb:.0f} MB of KV each, UCX {args.transport}, "
          f"{args.reps} reps (medians; all in ms):")
    print("| P alone (prefill, 1 token) | TTFT layer_writes off | TTFT on | off - on |")
    print("|---|---|---|---|")
    print(f"| {med['p'] * 1e3:.0f} | {med['off'] * 1e3:.0f} | {med['on'] * 1e3:.0f} | "
          f"{(med['off'] - med['on']) * 1e3:.0f} |")
    for k in ("p", "off", "on"):
        print(f"  {k}: " + ", ".join(f"{t * 1e3:.0f}" for t in times[k]))
    print(f"P of the 'on' pair logged a layer write: {'yes' if layer_lines else 'NO'}")
    return 0 if layer_lines else 1


if __name__ == "__main__":
    sys.exit(main())
