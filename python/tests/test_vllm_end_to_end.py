"""KvferryConnector end to end: a P and a D, each with vLLM's real Scheduler and both connector
halves, KV tensors allocated by vLLM's own allocate_kv_cache (the heads-outermost layout the
connector asks for), and a real kvferry transfer through kvferry._native over UCX on loopback.

A fake model runner stands in for the GPU: after P's prefill step it fills P's blocks of the
request with bytes derived from (layer, block position, byte), and nothing else touches the
tensors. Checked: D's blocks hold exactly P's bytes; P frees only after the send finished;
both schedulers end empty; a late pull fails at once; a lease mismatch fails naming both values;
an abort during a load frees D's blocks only once the load settled. (P and D as two processes,
and a decoder killed outright: test_vllm_processes.py.)
"""

from __future__ import annotations

import logging
import time
import uuid

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: run scripts/install-python.sh and use .venv/bin/python"
)
pytest.importorskip(
    "kvferry._native", reason="kvferry._native is not built (scripts/test.sh builds it)"
)

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvferry.vllm import KvferryConnector  # noqa: E402
from vllm_harness import (  # noqa: E402
    BLOCK_SIZE,
    assert_scheduler_empty,
    make_request,
    make_scheduler,
    make_vllm_config,
    p_params,
    runner_output,
)

LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float32)


def worker_kv_config(num_blocks: int) -> KVCacheConfig:
    """What vLLM's worker allocates: every layer's blocks in one tensor, layer-outermost."""
    page = SPEC.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=page * num_blocks * len(LAYERS), layers=LAYERS,
                          layer_stride=page * num_blocks, block_stride=page)
        ],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, SPEC)],
    )


class Engine:
    """One vLLM instance: its Scheduler and the two halves of its connector, in this process."""

    def __init__(self, model_dir, role: str, *, num_blocks: int, extra: dict, engine_id: str,
                 policy: str = "fail"):
        config = make_vllm_config(model_dir, role, extra_config=extra, engine_id=engine_id,
                                  kv_load_failure_policy=policy)
        self.scheduler = make_scheduler(config, num_blocks)
        kv_config = worker_kv_config(num_blocks)
        self.worker = KvferryConnector(config, KVConnectorRole.WORKER, kv_config)
        self.kv = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        self.worker.register_kv_caches(self.kv)
        self.num_blocks = num_blocks

    def step(self, after_step=None):
        """One engine step through both halves; `after_step(scheduler_output)` plays the model
        (P fills the blocks it just computed)."""
        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        if after_step is not None:
            after_step(out)
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(out.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
        )
        self.worker.clear_connector_metadata()
        outputs = self.scheduler.update_from_output(out, runner_output(out, kv_output=kv_output))
        return out, results, outputs

    def blocks(self, request_id: str) -> list[int]:
        (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        return list(blocks)

    def block_bytes(self, layer: str, block: int) -> torch.Tensor:
        return self.kv[layer][block].clone()

    def shutdown(self):
        self.worker.shutdown()


def fill_block(kv: dict, block: int, position: int, salt: float = 0.0) -> None:
    """The fake model's KV for the request's `position`-th block, in every layer."""
    for index, layer in enumerate(LAYERS):
        view = kv[layer][block]
        values = torch.arange(view.numel(), dtype=torch.float32).reshape(view.shape)
        view.copy_(values + 1000.0 * (index + 1) + 100000.0 * (position + 1) + salt)


def d_params(transfer_id: str, p: Engine, engine_id: str) -> dict:
    """What vLLM's Mooncake proxy sends to D, naming P's bootstrap service."""
    port = p.worker.connector_worker.prefill.bootstrap_port
    return {"do_remote_decode": False, "do_remote_prefill": True,
            "remote_bootstrap_addr": f"http://127.0.0.1:{port}",
            "remote_engine_id": engine_id, "transfer_id": transfer_id}


def pair(model_dir, *, p_lease=5, d_lease=5, d_blocks=64, policy="fail"):
    engine_id = "prefill-" + uuid.uuid4().hex[:8]
    p = Engine(model_dir, "kv_producer", num_blocks=64, engine_id=engine_id,
               extra={"kv_lease_duration": p_lease, "bootstrap_port": 0,
                      "abort_request_timeout": 30})
    d = Engine(model_dir, "kv_consumer", num_blocks=d_blocks,
               engine_id="decode-" + uuid.uuid4().hex[:8], policy=policy,
               extra={"kv_lease_duration": d_lease, "abort_request_timeout": 30})
    return p, d, engine_id


def prefill(p: Engine, request_id: str, transfer_id: str, prompt: list[int],
            salt: float = 0.0) -> list[int]:
    """Runs P's prefill of one request (max_tokens 1, as the proxy asks) and plays the model:
    returns P's blocks of it, filled (`salt` tells two requests' KV apart)."""
    p.scheduler.add_request(make_request(request_id, len(prompt), p_params(transfer_id),
                                         max_tokens=1, prompt=prompt))
    blocks: list[int] = []

    def model(out):
        if request_id in out.num_scheduled_tokens:
            blocks[:] = p.blocks(request_id)
            for position, block in enumerate(blocks):
                fill_block(p.kv, block, position, salt)

    p.step(model)
    assert blocks, "P did not schedule the prefill"
    return blocks


def run_until(engines, done, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        for engine in engines:
            engine.step()
        time.sleep(0.005)


PROMPT = [10 + (7 * i) % 900 for i in range(40)]  # 40 tokens: 3 blocks of 16


def test_d_blocks_hold_exactly_ps_bytes_and_both_schedulers_end_empty(model_dir):
    p, d, engine_id = pair(model_dir)
    try:
        p_blocks = prefill(p, "p1", "xfer-1", PROMPT)
        assert len(p_blocks) == 3
        assert "p1" in p.scheduler.requests, "P keeps the blocks until the send finished"
        d.scheduler.add_request(make_request("d1", len(PROMPT), d_params("xfer-1", p, engine_id),
                                             max_tokens=3, prompt=PROMPT))
        d_blocks: list[int] = []

        def d_step(out=None):
            if not d_blocks and "d1" in d.scheduler.requests:
                d_blocks[:] = d.blocks("d1")

        d.step(d_step)
        assert d.scheduler.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        sent_at = None
        compared = False
        deadline = time.monotonic() + 10
        while d.scheduler.requests or p.scheduler.requests:
            assert time.monotonic() < deadline, (list(d.scheduler.requests),
                                                 list(p.scheduler.requests))
            _, d_results, _ = d.step()
            if "d1" in d_results.finished_recving:
                # The moment D may read: every byte of every layer is P's.
                assert not d_results.failed_recving
                for layer in LAYERS:
                    for position, (pb, db) in enumerate(zip(p_blocks, d_blocks)):
                        assert torch.equal(d.kv[layer][db], p.kv[layer][pb]), (layer, position)
                        assert d.kv[layer][db].any(), "compared blocks nobody wrote"
                compared = True
            _, p_results, _ = p.step()
            if "p1" in p_results.finished_sending:
                sent_at = time.monotonic()
            time.sleep(0.002)
        assert compared, "D never reported the receive"
        assert sent_at is not None, "P never reported the send finished"
        assert len(d_blocks) == 3
        assert_scheduler_empty(p.scheduler, 64)
        assert_scheduler_empty(d.scheduler, 64)
        stats = p.worker.connector_worker.prefill.stats()
        assert stats["held_transfers"] == 0
        assert stats["bytes_written"] == 3 * SPEC.page_size_bytes * len(LAYERS)
    finally:
        d.shutdown()
        p.shutdown()


def test_a_late_pull_fails_at_once_and_vllm_fails_the_request(model_dir, caplog):
    p, d, engine_id = pair(model_dir)
    try:
        prefill(p, "p1", "xfer-1", PROMPT)
        d.scheduler.add_request(make_request("d1", len(PROMPT), d_params("xfer-1", p, engine_id),
                                             max_tokens=2, prompt=PROMPT))
        run_until([d, p], lambda: not d.scheduler.requests and not p.scheduler.requests)
        # The same transfer again (a retried request): P freed it, so the pull fails at once.
        d.scheduler.add_request(make_request("d2", len(PROMPT), d_params("xfer-1", p, engine_id),
                                             max_tokens=2, prompt=PROMPT))
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
            run_until([d], lambda: "d2" not in d.scheduler.requests)
        assert time.monotonic() - start < 2.0
        assert "TOMBSTONED" in caplog.text, caplog.text
        assert_scheduler_empty(d.scheduler, 64)
    finally:
        d.shutdown()
        p.shutdown()


def test_a_lease_mismatch_fails_the_load_naming_both_values(model_dir, caplog):
    p, d, engine_id = pair(model_dir, p_lease=5, d_lease=7)
    try:
        prefill(p, "p1", "xfer-1", PROMPT)
        d.scheduler.add_request(make_request("d1", len(PROMPT), d_params("xfer-1", p, engine_id),
                                             max_tokens=2, prompt=PROMPT))
        with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
            run_until([d, p], lambda: "d1" not in d.scheduler.requests)
        failure = [r.getMessage() for r in caplog.records if "d1" in r.getMessage()]
        assert failure and "5" in failure[0] and "7" in failure[0], failure
        assert_scheduler_empty(d.scheduler, 64)
    finally:
        d.shutdown()
        p.shutdown()


def test_an_abort_during_the_load_frees_ds_blocks_only_once_it_settled(model_dir):
    p, d, engine_id = pair(model_dir)
    try:
        # D asks before P has prefilled: its pull parks at P, so the load is in flight.
        d.scheduler.add_request(make_request("d1", len(PROMPT), d_params("xfer-1", p, engine_id),
                                             max_tokens=2, prompt=PROMPT))
        d.step()
        assert d.scheduler.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        d.scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        d.step()
        assert "d1" in d.scheduler.requests, "D freed blocks a P peer may still write"
        # P's prefill lands (the parked pull is served), or D's release reaches P first:
        # either way the load settles and vLLM frees the blocks.
        prefill(p, "p1", "xfer-1", PROMPT)
        run_until([d, p], lambda: not d.scheduler.requests and not p.scheduler.requests)
        assert_scheduler_empty(d.scheduler, 64)
        assert_scheduler_empty(p.scheduler, 64)
    finally:
        d.shutdown()
        p.shutdown()


HOSTILE_D_PARAMS = [
    {"do_remote_prefill": "yes", "remote_engine_id": 7, "remote_bootstrap_addr": None,
     "transfer_id": ["x"]},                                   # mistyped: prefilled here
    {"do_remote_prefill": True, "transfer_id": "xfer-h1"},    # fields missing: prefilled here
    {"do_remote_prefill": True, "remote_engine_id": "e" * 100000,
     "remote_bootstrap_addr": "http://127.0.0.1:1", "transfer_id": "t" * 100000},  # huge ids
    {"do_remote_prefill": True, "remote_engine_id": "prefill-nowhere",
     "remote_bootstrap_addr": "http://127.0.0.1:1", "transfer_id": "xfer-h3"},  # no bootstrap
    {"do_remote_prefill": True, "remote_engine_id": "prefill-x",
     "remote_bootstrap_addr": "gopher://[::1", "transfer_id": "xfer-h4"},  # not an address
]


def test_hostile_kv_transfer_params_fail_their_request_and_crash_nothing(model_dir):
    """What an HTTP client puts in kv_transfer_params reaches the connector unchecked by vLLM
    (beyond being a dict): every request either prefills locally or fails with a reason, the
    engine keeps serving, and nothing leaks."""
    p, d, engine_id = pair(model_dir)
    try:
        for i, params in enumerate(HOSTILE_D_PARAMS):
            d.scheduler.add_request(make_request(f"h{i}", len(PROMPT), params, max_tokens=2,
                                                 prompt=PROMPT))
        run_until([d], lambda: not d.scheduler.requests, timeout_s=20)
        # P: a transfer id far beyond the wire's bound is refused by the runtime, and the
        # request's blocks still go back to vLLM.
        prefill(p, "p-huge", "x" * 100000, PROMPT)
        run_until([p], lambda: not p.scheduler.requests)
        # Both still serve a well-formed transfer afterwards.
        prefill(p, "p1", "xfer-ok", PROMPT)
        d.scheduler.add_request(make_request("d-ok", len(PROMPT),
                                             d_params("xfer-ok", p, engine_id), max_tokens=2,
                                             prompt=PROMPT))
        received = []

        def watch():
            _, results, _ = d.step()
            received.extend(results.finished_recving - results.failed_recving)
            p.step()

        deadline = time.monotonic() + 10
        while d.scheduler.requests or p.scheduler.requests:
            assert time.monotonic() < deadline
            watch()
            time.sleep(0.005)
        assert received == ["d-ok"]
        assert_scheduler_empty(d.scheduler, 64)
        assert_scheduler_empty(p.scheduler, 64)
    finally:
        d.shutdown()
        p.shutdown()


def test_a_second_request_naming_a_live_transfer_id_never_lends_its_blocks(model_dir):
    """A router's retry, or a client reaching P directly, names a transfer id another request
    already holds: the second request runs as a plain one, D gets the first one's KV, and
    nothing leaks (found by review: D read the second request's freed blocks, and the first
    request's blocks were never freed)."""
    p, d, engine_id = pair(model_dir)
    try:
        a_blocks = prefill(p, "pA", "xfer-dup", PROMPT, salt=0.5)
        snapshot = {layer: [p.kv[layer][b].clone() for b in a_blocks] for layer in LAYERS}
        other = [t + 1 for t in PROMPT]
        prefill(p, "pB", "xfer-dup", other, salt=0.25)
        run_until([p], lambda: "pB" not in p.scheduler.requests)
        assert "pA" in p.scheduler.requests, "the first owner still holds its KV for D"
        d.scheduler.add_request(make_request("d1", len(PROMPT), d_params("xfer-dup", p, engine_id),
                                             max_tokens=2, prompt=PROMPT))
        d.step()
        d_blocks = d.blocks("d1")
        checked = False
        deadline = time.monotonic() + 10
        while d.scheduler.requests or p.scheduler.requests:
            assert time.monotonic() < deadline, (list(d.scheduler.requests),
                                                 list(p.scheduler.requests))
            _, results, _ = d.step()
            if "d1" in results.finished_recving:
                for layer in LAYERS:
                    for position, block in enumerate(d_blocks):
                        assert torch.equal(d.kv[layer][block], snapshot[layer][position])
                checked = True
            p.step()
            time.sleep(0.002)
        assert checked
        assert_scheduler_empty(p.scheduler, 64)
        assert_scheduler_empty(d.scheduler, 64)
    finally:
        d.shutdown()
        p.shutdown()
