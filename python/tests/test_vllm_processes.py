"""P and D as two processes, each with vLLM's real Scheduler and KvferryConnector: P in this
process, D in engine_process.py, the KV moved over UCX between them. D is then killed outright
(SIGKILL) while its request queues, and P frees the KV within one lease of D's last renewal."""

from __future__ import annotations

import base64
import contextlib
import json
import signal
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

from test_vllm_end_to_end import (  # noqa: E402
    LAYERS,
    PROMPT,
    Engine,
    d_params,
    prefill,
)
from vllm_harness import assert_scheduler_empty, read_line  # noqa: E402

HERE = Path(__file__).resolve().parent


class EngineProcess:
    """An engine in its own process (engine_process.py); killed by the test's finally."""

    def __init__(self, model_dir, role: str, engine_id: str, num_blocks: int, extra: dict):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "engine_process.py"), role, engine_id, str(num_blocks),
             json.dumps(extra), str(model_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._read()
        assert self.ready.get("ready"), self.ready

    def _read(self) -> dict:
        while True:
            line = read_line(self.proc, "the engine process")
            if line.startswith("{"):
                return json.loads(line)

    def call(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        assert "error" not in answer, answer
        return answer

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@contextlib.contextmanager
def p_here_d_there(model_dir, *, lease: float, d_blocks: int):
    """P in this process and D in its own, with the same lease; yields (P, D, P's engine id).
    D is killed and P shut down at the end, whatever happened."""
    engine_id = "prefill-" + uuid.uuid4().hex[:8]
    p = Engine(model_dir, "kv_producer", num_blocks=64, engine_id=engine_id,
               extra={"kv_lease_duration": lease, "bootstrap_port": 0})
    d = None
    try:
        d = EngineProcess(model_dir, "kv_consumer", "decode-" + uuid.uuid4().hex[:8], d_blocks,
                          {"kv_lease_duration": lease})
        yield p, d, engine_id
    finally:
        if d is not None:
            d.kill()
        p.shutdown()


def test_p_and_d_in_two_processes_move_the_kv_and_both_end_empty(model_dir):
    with p_here_d_there(model_dir, lease=5, d_blocks=64) as (p, d, engine_id):
        p_blocks = prefill(p, "p1", "xfer-1", PROMPT)
        d.call(op="add", id="d1", prompt=PROMPT, params=d_params("xfer-1", p, engine_id),
               max_tokens=3)
        d.call(op="step")
        d_blocks = d.call(op="blocks", id="d1")["blocks"]
        received, requests = False, True
        deadline = time.monotonic() + 20
        while requests or p.scheduler.requests:
            assert time.monotonic() < deadline, "timed out"
            answer = d.call(op="step")
            if "d1" in answer["finished_recving"]:
                assert not answer["failed_recving"]
                kv = d.call(op="kv", blocks=d_blocks)["kv"]
                for layer in LAYERS:
                    for position, block in enumerate(p_blocks):
                        want = p.kv[layer][block].contiguous().numpy().tobytes()
                        assert base64.b64decode(kv[layer][position]) == want, (layer, position)
                received = True
            requests = bool(answer["status"])
            p.step()
            time.sleep(0.002)
        assert received
        assert_scheduler_empty(p.scheduler, 64)
        assert d.call(op="quit") == {"bye": True}


def test_a_killed_decoder_process_lets_p_free_within_one_lease_of_its_last_renewal(model_dir):
    # D has 4 blocks (one is vLLM's null block): a local request takes 3, so d1 waits for
    # blocks while D renews its transfer.
    with p_here_d_there(model_dir, lease=2, d_blocks=4) as (p, d, engine_id):
        prefill(p, "p1", "xfer-1", PROMPT)
        d.call(op="add", id="local", prompt=[5] * 40, params=None, max_tokens=1000)
        d.call(op="step")
        d.call(op="add", id="d1", prompt=PROMPT, params=d_params("xfer-1", p, engine_id),
               max_tokens=3)
        until = time.monotonic() + 3.0  # 1.5 leases: D's renewals keep the KV
        while time.monotonic() < until:
            answer = d.call(op="step")
            assert answer["status"]["d1"] == "WAITING", answer["status"]
            _, p_results, _ = p.step()
            assert not p_results.finished_sending, "P freed KV a live decoder still renews"
            time.sleep(0.01)
        d.kill()  # SIGKILL: no release, no goodbye
        died = time.monotonic()
        freed = None
        while freed is None:
            assert time.monotonic() - died < 5.0, "P still holds the dead decoder's KV"
            _, p_results, _ = p.step()
            if "p1" in p_results.finished_sending:
                freed = time.monotonic() - died
            time.sleep(0.01)
        assert freed < 2.0 + 0.5, freed  # one lease (2 s) of the last renewal + P's pass
        print(f"P freed the killed decoder's KV {freed:.2f} s after SIGKILL (lease 2 s)")
        assert_scheduler_empty(p.scheduler, 64)
