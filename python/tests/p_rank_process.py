"""One P rank in its own process, as a vLLM worker process of a TP engine runs it: the runtime
adapter (kvferry.vllm.runtime.PrefillRuntime) over kvferry._native, with per-layer KV planes
(heads outermost in a block, so this rank's block is its head slice of the model's). It finds
kvferry (python/) and kvferry._native (the build's python/) on PYTHONPATH (conftest.py sets it).

Driven by a test through a line protocol on stdin/stdout:
    start:  p_rank_process.py ENGINE_ID TP_SIZE TP_RANK BOOTSTRAP_PORT LEASE_S NUM_BLOCKS
            BLOCK_BYTES LAYERS           prints "ready BOOTSTRAP_PORT"
    admit XFER                 -> "ok" | "err MESSAGE"
    fill BLOCK VALUE           every byte of BLOCK in every layer := (VALUE + layer) % 256
    done XFER B1,B2,...        -> "ok" | "err MESSAGE"
    events                     -> "events JSON" (the runtime's [kind, transfer, reason] since last)
    quit                       stops the rank, prints "bye"
"""

import json
import sys

import torch  # noqa: E402

from kvferry import _native  # noqa: E402
from kvferry.vllm.native import KvRegion, WorkerOptions  # noqa: E402
from kvferry.vllm.runtime import PrefillRuntime  # noqa: E402


def main() -> None:
    engine_id, tp_size, tp_rank, port, lease, num_blocks, block_bytes, layers = sys.argv[1:9]
    tp_size, tp_rank, port = int(tp_size), int(tp_rank), int(port)
    num_blocks, block_bytes, layers = int(num_blocks), int(block_bytes), int(layers)
    kv = [torch.zeros((num_blocks, block_bytes), dtype=torch.uint8) for _ in range(layers)]
    regions = [KvRegion(f"l{i}", "kv", 0, t.data_ptr(), t.numel(), num_blocks, block_bytes,
                        block_bytes) for i, t in enumerate(kv)]
    options = WorkerOptions(engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size,
                            kv_lease_duration=float(lease), abort_request_timeout=30.0,
                            bootstrap_port=port, bootstrap_server_address=None, kv_release=True,
                            kv_heads=tp_size, incarnation="inc-" + engine_id,
                            side_channel_host="127.0.0.1")
    rank = PrefillRuntime(_native, regions, options)
    print(f"ready {rank.bootstrap_port or port}", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            if words[0] == "admit":
                rank.admit(words[1], words[1])
                print("ok", flush=True)
            elif words[0] == "fill":
                for i, t in enumerate(kv):
                    t[int(words[1])].fill_((int(words[2]) + i) % 256)
                print("ok", flush=True)
            elif words[0] == "done":
                rank.prefill_done(words[1], [[int(b) for b in words[2].split(",")]])
                print("ok", flush=True)
            elif words[0] == "events":
                print("events " + json.dumps(rank.take_events()), flush=True)
            elif words[0] == "quit":
                break
        except Exception as e:  # reported to the test, which fails with it
            print(f"err {type(e).__name__}: {e}", flush=True)
    rank.stop()
    print("bye", flush=True)


if __name__ == "__main__":
    main()
