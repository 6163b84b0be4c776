"""P TP2 -> D TP1 with KvferryConnector on D: two P ranks in two processes (as vLLM's worker
processes of one TP engine), each holding its head of every block, and D's real Scheduler and
connector pulling from both over UCX. D's request completes only once both P ranks settled, and
each half of D's blocks holds its P rank's bytes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: run scripts/install-python.sh and use .venv/bin/python"
)
pytest.importorskip(
    "kvferry._native", reason="kvferry._native is not built (scripts/test.sh builds it)"
)

import torch  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from test_vllm_end_to_end import LAYERS, PROMPT, SPEC, Engine  # noqa: E402
from vllm_harness import make_request, read_line  # noqa: E402

HERE = Path(__file__).resolve().parent
NUM_BLOCKS = 64


class PRank:
    """A P rank process (p_rank_process.py); stopped by the test's finally."""

    def __init__(self, engine_id: str, tp_rank: int, port: int, block_bytes: int):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "p_rank_process.py"), engine_id, "2", str(tp_rank),
             str(port), "5", str(NUM_BLOCKS), str(block_bytes), str(len(LAYERS))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        words = self._read().split()
        assert words[0] == "ready", words
        self.port = int(words[1])

    def _read(self) -> str:
        return read_line(self.proc, "the P rank process").strip()

    def call(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        assert not reply.startswith("err"), reply
        return reply

    def events(self) -> list:
        return json.loads(self.call("events").split(" ", 1)[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=15)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def test_p_tp2_to_d_tp1_completes_only_when_both_ranks_settled(model_dir):
    engine_id = "prefill-tp2-" + uuid.uuid4().hex[:6]
    half = SPEC.page_size_bytes // 2  # one of the model's two KV heads
    ranks: list[PRank] = []
    d = None
    try:
        ranks.append(PRank(engine_id, 0, 0, half))
        ranks.append(PRank(engine_id, 1, ranks[0].port, half))
        d = Engine(model_dir, "kv_consumer", num_blocks=NUM_BLOCKS, engine_id="decode-tp1",
                   extra={"kv_lease_duration": 5, "abort_request_timeout": 30})
        for rank in ranks:
            rank.call("admit xfer-1")
        p_blocks = [4, 5, 6]
        for r, rank in enumerate(ranks):
            for position, block in enumerate(p_blocks):
                rank.call(f"fill {block} {16 * (r + 1) + position}")
        params = {"do_remote_decode": False, "do_remote_prefill": True,
                  "remote_bootstrap_addr": f"http://127.0.0.1:{ranks[0].port}",
                  "remote_engine_id": engine_id, "transfer_id": "xfer-1"}
        d.scheduler.add_request(make_request("d1", len(PROMPT), params, max_tokens=2,
                                             prompt=PROMPT))
        d.step()
        d_blocks = d.blocks("d1")
        assert len(d_blocks) == len(p_blocks)
        # Only rank 0's prefill is done: D must not complete on half a block.
        ranks[0].call("done xfer-1 " + ",".join(map(str, p_blocks)))
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            _, results, _ = d.step()
            assert "d1" not in results.finished_recving, "D completed with one P rank unsettled"
            time.sleep(0.01)
        assert d.scheduler.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ranks[1].call("done xfer-1 " + ",".join(map(str, p_blocks)))
        deadline = time.monotonic() + 10
        received = False
        while not received:
            assert time.monotonic() < deadline, "D never received"
            _, results, _ = d.step()
            received = "d1" in results.finished_recving
            assert not results.failed_recving
            time.sleep(0.005)
        for index, layer in enumerate(LAYERS):
            for position, block in enumerate(d_blocks):
                raw = d.kv[layer][block].contiguous().view(torch.uint8).flatten()
                for r in range(2):
                    want = (16 * (r + 1) + position + index) % 256
                    got = raw[r * half:(r + 1) * half]
                    assert bool((got == want).all()), (layer, position, r)
        # Both ranks were pulled by their one paired D rank: both free the transfer.
        deadline = time.monotonic() + 5
        freed = [[], []]
        while not all(freed):
            assert time.monotonic() < deadline, freed
            for r, rank in enumerate(ranks):
                freed[r] += rank.events()
            time.sleep(0.02)
        assert freed == [[["free", "xfer-1", "sent"]], [["free", "xfer-1", "sent"]]]
        while d.scheduler.requests:
            d.step()
    finally:
        if d is not None:
            d.shutdown()
        for rank in ranks:
            rank.stop()
