"""The worker half of KvferryConnector, alone: these tests give the worker a recording stand-in
(FakeNative, below) of the interface native.py specifies, and check
the worker's side of the contract: which native calls each step's metadata makes, how KV tensors
become regions, and that vLLM's real Scheduler accepts what the worker reports (each request
exactly once, failures per kv_load_failure_policy)."""

from __future__ import annotations

import ctypes
import logging
import sys

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: run scripts/install-python.sh and use .venv/bin/python"
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

import kvferry.vllm.worker as worker_module  # noqa: E402
from kvferry.vllm import KvferryConnector  # noqa: E402
from kvferry.vllm.native import DecodeFinished, RemoteSource  # noqa: E402
from kvferry.vllm.worker import kv_regions  # noqa: E402
from vllm_harness import (  # noqa: E402
    BLOCK_SIZE,
    assert_scheduler_empty,
    d_params,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    p_params,
    runner_output,
)


class FakeDecode:
    def __init__(self, regions, options):
        self.regions, self.options = regions, options
        self.calls: list[tuple] = []
        self.pending = DecodeFinished([], [], [])  # received, failed, released

    def on_new_request(self, request_id, source):
        self.calls.append(("on_new_request", request_id, source))

    def start_load(self, request_id, source, block_ids):
        self.calls.append(("start_load", request_id, source, block_ids))

    def request_finished(self, request_id):
        self.calls.append(("request_finished", request_id))

    def take_finished(self):
        out, self.pending = self.pending, DecodeFinished([], [], [])
        return out

    def stats(self):
        return {"tracked": 0, "receiving": 0}

    def stop(self):
        self.calls.append(("stop",))


class FakePrefill:
    def __init__(self, regions, options):
        self.regions, self.options = regions, options
        self.calls: list[tuple] = []
        self.events: list[tuple[str, str, str]] = []

    def admit(self, transfer_id, handle):
        self.calls.append(("admit", transfer_id, handle))

    def prefill_done(self, transfer_id, block_ids):
        self.calls.append(("prefill_done", transfer_id, block_ids))

    def layers_ready(self, transfer_id, block_ids, layer_name):
        self.calls.append(("layers_ready", transfer_id, block_ids, layer_name))
        return True

    def engine_finished(self, transfer_id):
        self.calls.append(("engine_finished", transfer_id))

    def refuse(self, transfer_id, why):
        self.calls.append(("refuse", transfer_id))

    def take_events(self):
        out, self.events = self.events, []
        return out

    def stop(self):
        self.calls.append(("stop",))


class FakeNative:
    PrefillWorker = FakePrefill
    DecodeWorker = FakeDecode


def worker_connector(model_dir, role, monkeypatch, **kw):
    monkeypatch.setattr(worker_module, "load_native", lambda: FakeNative)
    config = make_vllm_config(model_dir, role, **kw)
    connector = KvferryConnector(config, KVConnectorRole.WORKER, make_kv_cache_config())
    caches = {"layer.0": torch.zeros(2, 200, BLOCK_SIZE, 1, 1)}
    connector.register_kv_caches(caches)
    return connector


def engine_step(scheduler, connector, before_results=None, layers=(), start_after_forward=False):
    """One step through both halves: the scheduler's metadata goes to the worker, the forward
    pass saves `layers` in order (what vLLM's attention layers call; vLLM 0.32 calls
    start_load_kv after it when no load of the step is synchronous), the worker's results
    (after the native reported, by before_results) come back to the scheduler."""
    out = scheduler.schedule()
    connector.bind_connector_metadata(out.kv_connector_metadata)
    if not start_after_forward:
        connector.start_load_kv(None)
    for layer_name in layers:
        connector.save_kv_layer(layer_name, None, None)
    if start_after_forward:
        connector.start_load_kv(None)
    connector.wait_for_save()
    if before_results is not None:
        before_results()
    results = connector.get_transfer_results(out.finished_req_ids)
    kv_output = KVConnectorOutput(
        finished_sending=results.finished_sending,
        finished_recving=results.finished_recving,
        failed_recving=results.failed_recving,
        invalid_block_ids=connector.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=connector.build_connector_worker_meta(),
    )
    connector.clear_connector_metadata()
    scheduler.update_from_output(out, runner_output(out, kv_output=kv_output))
    return out, results


def test_worker_role_without_the_native_module_is_a_clear_import_error(model_dir, monkeypatch):
    # A package installed without the native module: importing it fails.
    monkeypatch.setitem(sys.modules, "kvferry._native", None)
    config = make_vllm_config(model_dir, "kv_consumer")
    with pytest.raises(ImportError, match=r"kvferry\._native"):
        KvferryConnector(config, KVConnectorRole.WORKER, make_kv_cache_config())


def test_d_worker_loads_and_reports_each_request_once(model_dir, monkeypatch):
    d = make_scheduler(make_vllm_config(model_dir, "kv_consumer"))
    connector = worker_connector(model_dir, "kv_consumer", monkeypatch)
    native = connector.connector_worker.decode
    assert connector.connector_worker.prefill is None
    d.add_request(make_request("d1", 40, d_params("xfer-1"), max_tokens=2))
    engine_step(d, connector)
    source = RemoteSource("prefill-0", "http://127.0.0.1:8998", "xfer-1")
    (blocks,) = d.kv_cache_manager.get_block_ids("d1")
    assert native.calls == [
        ("on_new_request", "d1", source),
        ("start_load", "d1", source, [blocks]),
    ]

    def received():
        # The runtime reports the request received, and again, and one it never loaded.
        native.pending = DecodeFinished(["d1", "d1", "stranger"], [], ["d1"])

    _, results = engine_step(d, connector, received)
    assert results.finished_recving == {"d1"} and not results.failed_recving
    out, results = engine_step(d, connector, lambda: setattr(
        native, "pending", DecodeFinished(["d1"], [("d1", "late duplicate", False)], [])))
    assert not results.finished_recving  # reported once only: vLLM asserts on a repeat
    assert out.scheduled_new_reqs[0].num_computed_tokens == 39
    while d.requests:
        engine_step(d, connector)
    assert_scheduler_empty(d)
    connector.shutdown()
    assert native.calls[-1] == ("stop",)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_d_worker_reports_a_failed_load_per_policy(model_dir, monkeypatch, policy):
    d = make_scheduler(make_vllm_config(model_dir, "kv_consumer", kv_load_failure_policy=policy))
    connector = worker_connector(model_dir, "kv_consumer", monkeypatch)
    native = connector.connector_worker.decode
    d.add_request(make_request("d1", 40, d_params("xfer-1"), max_tokens=2))
    engine_step(d, connector)

    def failed():
        native.pending = DecodeFinished([], [("d1", "TOMBSTONED: P freed xfer-1", False)], [])

    _, results = engine_step(d, connector, failed)
    assert results.finished_recving == {"d1"} and results.failed_recving == {"d1"}
    if policy == "fail":
        assert "d1" not in d.requests
    else:
        out, _ = engine_step(d, connector)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # recomputed here
        while d.requests:
            engine_step(d, connector)
    assert_scheduler_empty(d)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_d_worker_ends_a_request_whose_failed_load_holds_its_blocks_at_once(
    model_dir, monkeypatch, policy
):
    # Hole 3 of the engine-adapter issue: a failed load whose writer is unknown (a P that died
    # mid-pull, a deadline) left the request waiting for remote KV until its blocks left
    # quarantine: forever, for a P that never answers. Now the request fails (or is marked
    # for recomputation) at once, and vLLM keeps its blocks until no P rank can write them.
    d = make_scheduler(make_vllm_config(model_dir, "kv_consumer", kv_load_failure_policy=policy))
    connector = worker_connector(model_dir, "kv_consumer", monkeypatch)
    native = connector.connector_worker.decode
    d.add_request(make_request("d1", 40, d_params("xfer-1"), max_tokens=2))
    engine_step(d, connector)
    (blocks,) = d.kv_cache_manager.get_block_ids("d1")
    free = d.kv_cache_manager.block_pool.get_num_free_blocks()
    _, results = engine_step(d, connector, lambda: setattr(
        native, "pending", DecodeFinished([], [("d1", "TIMEOUT: no answer", True)], [])))
    assert not results.finished_recving, "not before no P rank can write the blocks"
    if policy == "fail":
        assert d.requests["d1"].is_finished(), "the request ended at once"
    for _ in range(3):
        engine_step(d, connector)
    assert d.kv_cache_manager.block_pool.get_num_free_blocks() == free, "the blocks stay held"
    _, results = engine_step(d, connector, lambda: setattr(
        native, "pending", DecodeFinished([], [], ["d1"])))
    assert results.finished_recving == {"d1"}
    if policy == "recompute":
        out, _ = engine_step(d, connector)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # recomputed here
        while d.requests:
            engine_step(d, connector)
    assert_scheduler_empty(d)


def test_d_worker_releases_an_aborted_receive_and_vllm_frees_after_it_settles(
    model_dir, monkeypatch
):
    d = make_scheduler(make_vllm_config(model_dir, "kv_consumer"))
    connector = worker_connector(model_dir, "kv_consumer", monkeypatch)
    native = connector.connector_worker.decode
    d.add_request(make_request("d1", 40, d_params("xfer-1")))
    engine_step(d, connector)
    d.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    engine_step(d, connector)
    assert native.calls[-1] == ("request_finished", "d1")
    assert "d1" in d.requests  # a P rank may still write: vLLM keeps the blocks
    # Its pull ends (here: it completed after all): vLLM frees the blocks now.
    engine_step(d, connector, lambda: setattr(native, "pending", DecodeFinished(["d1"], [], [])))
    assert_scheduler_empty(d)


def test_old_two_set_path_names_failed_blocks(model_dir, monkeypatch):
    d = make_scheduler(make_vllm_config(model_dir, "kv_consumer"))
    connector = worker_connector(model_dir, "kv_consumer", monkeypatch)
    native = connector.connector_worker.decode
    d.add_request(make_request("d1", 40, d_params("xfer-1")))
    out = d.schedule()
    connector.bind_connector_metadata(out.kv_connector_metadata)
    connector.start_load_kv(None)
    native.pending = DecodeFinished([], [("d1", "peer failed", False)], [])
    sending, recving = connector.get_finished(set())
    assert sending is None and recving == {"d1"}
    (blocks,) = d.kv_cache_manager.get_block_ids("d1")
    assert connector.get_block_ids_with_load_errors() == set(blocks)
    assert connector.get_block_ids_with_load_errors() == set()


def test_p_worker_holds_until_the_runtime_frees(model_dir, monkeypatch, caplog):
    p = make_scheduler(make_vllm_config(model_dir, "kv_producer"))
    connector = worker_connector(model_dir, "kv_producer", monkeypatch)
    native = connector.connector_worker.prefill
    assert connector.connector_worker.decode is None
    p.add_request(make_request("p1", 40, p_params("xfer-1"), max_tokens=1))
    p.add_request(make_request("p2", 40, p_params("xfer-2"), max_tokens=1))
    engine_step(p, connector)
    assert native.calls == [("admit", "xfer-1", "p1"), ("admit", "xfer-2", "p2")]
    (blocks,) = p.kv_cache_manager.get_block_ids("p1")
    engine_step(p, connector)
    assert ("prefill_done", "xfer-1", [blocks]) in native.calls
    for _ in range(2):
        engine_step(p, connector)
    assert set(p.requests) == {"p1", "p2"}

    # A stray "free" for a transfer never held is not passed on (vLLM would free a request
    # that is not finished, or none at all).
    _, results = engine_step(p, connector, lambda: native.events.extend(
        [("free", "xfer-1", "sent"), ("free", "xfer-9", "sent")]))
    assert results.finished_sending == {"p1"}
    assert set(p.requests) == {"p2"}
    engine_step(p, connector, lambda: native.events.append(("free", "xfer-2", "sent")))
    assert_scheduler_empty(p)


@pytest.mark.parametrize("start_after_forward", [False, True])
def test_p_worker_offers_each_layer_of_the_step_that_completes_a_prompt(
        model_dir, monkeypatch, start_after_forward):
    extra = {"layer_writes": True}
    p = make_scheduler(make_vllm_config(model_dir, "kv_producer", extra_config=extra))
    connector = worker_connector(model_dir, "kv_producer", monkeypatch, extra_config=extra)
    native = connector.connector_worker.prefill
    p.add_request(make_request("p1", 40, p_params("xfer-1"), max_tokens=1))
    engine_step(p, connector, layers=["layer.0"], start_after_forward=start_after_forward)
    (blocks,) = p.kv_cache_manager.get_block_ids("p1")
    # Admitted first, then the layer as the forward pass computed it.
    assert native.calls == [("admit", "xfer-1", "p1"),
                            ("layers_ready", "xfer-1", [list(blocks)], "layer.0")]
    native.calls.clear()
    # The hand-off step: no prompt completes.
    engine_step(p, connector, layers=["layer.0"], start_after_forward=start_after_forward)
    assert native.calls == [("prefill_done", "xfer-1", [list(blocks)])]


@pytest.mark.parametrize("extra", [{}, {"layer_writes": True, "kv_staging": "host"}])
def test_p_worker_offers_no_layers_when_off_or_staged(model_dir, monkeypatch, extra):
    p = make_scheduler(make_vllm_config(model_dir, "kv_producer", extra_config=extra))
    connector = worker_connector(model_dir, "kv_producer", monkeypatch, extra_config=extra)
    native = connector.connector_worker.prefill
    p.add_request(make_request("p1", 40, p_params("xfer-1"), max_tokens=1))
    for _ in range(2):
        engine_step(p, connector, layers=["layer.0"])
    assert [c for c in native.calls if c[0] == "layers_ready"] == []
    assert any(c[0] in ("prefill_done", "admit") for c in native.calls)


def test_p_warns_once_per_pass_of_kv_no_decoder_took_naming_why(model_dir, monkeypatch, caplog):
    # A decoder that died or was cut off stops renewing: P frees its transfers at the end of
    # the lease. The operator hears of it, a line per pass and reason rather than per transfer.
    lease = {"kv_lease_duration": 12}
    p = make_scheduler(make_vllm_config(model_dir, "kv_producer", extra_config=lease))
    connector = worker_connector(model_dir, "kv_producer", monkeypatch, extra_config=lease)
    native = connector.connector_worker.prefill
    for n in (1, 2, 3):
        p.add_request(make_request(f"p{n}", 40, p_params(f"xfer-{n}"), max_tokens=1))
    for _ in range(3):
        engine_step(p, connector)
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        _, results = engine_step(p, connector, lambda: native.events.extend(
            [("free", "xfer-1", "expired"), ("free", "xfer-2", "expired"),
             ("free", "xfer-9", "sent")]))
    assert results.finished_sending == {"p1", "p2"}
    lines = [r.getMessage() for r in caplog.records if "before a decoder took it" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "2 transfer(s)" in lines[0] and "xfer-1, xfer-2" in lines[0], lines[0]
    assert "for a whole lease (12 s)" in lines[0], lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        engine_step(p, connector, lambda: native.events.append(("free", "xfer-3", "sent")))
    assert "before a decoder took it" not in caplog.text  # pulled: nothing to say
    assert_scheduler_empty(p)


def test_p_worker_passes_dropped_transfers_to_the_scheduler_half(model_dir, monkeypatch, caplog):
    p = make_scheduler(make_vllm_config(model_dir, "kv_producer"))
    connector = worker_connector(model_dir, "kv_producer", monkeypatch)
    native = connector.connector_worker.prefill
    p.add_request(make_request("p1", 300, p_params("xfer-1"), max_tokens=1))
    engine_step(p, connector)  # admitted, its prefill runs over two steps
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        engine_step(p, connector,
                    lambda: native.events.append(("abort", "xfer-1", "released_by_decoder")))
    assert "xfer-1" in caplog.text and "dropped 1 transfer" in caplog.text
    engine_step(p, connector)  # the prefill finishes; the runtime frees a dropped one at once
    engine_step(p, connector, lambda: native.events.append(("free", "xfer-1", "sent")))
    assert_scheduler_empty(p)


def test_p_worker_tombstones_a_transfer_dropped_before_it_was_admitted(model_dir, monkeypatch):
    # Hole 5 of the engine-adapter issue: a request P drops while it still queues (never
    # admitted: no blocks yet) left no tombstone, so D's pull for it parked for
    # abort_request_timeout holding D's blocks. It is refused now; an admitted one is ended.
    p = make_scheduler(make_vllm_config(model_dir, "kv_producer"))
    connector = worker_connector(model_dir, "kv_producer", monkeypatch)
    native = connector.connector_worker.prefill
    p.add_request(make_request("p1", 300, p_params("xfer-1"), max_tokens=1))
    engine_step(p, connector)  # p1 is admitted; its prefill runs over two steps
    p.add_request(make_request("p2", 40, p_params("xfer-2"), max_tokens=1))
    p.finish_requests({"p1", "p2"}, RequestStatus.FINISHED_ABORTED)  # p2 never scheduled
    engine_step(p, connector)
    assert ("engine_finished", "xfer-1") in native.calls
    assert ("refuse", "xfer-2") in native.calls
    assert ("engine_finished", "xfer-2") not in native.calls
    assert_scheduler_empty(p)


# ---- host staging (kv_staging): host tensors stand in for a GPU's KV cache ----


def staged_connector(model_dir, role, monkeypatch, slots):
    """A worker forced to stage its (host) KV cache, with ``slots`` staging slots; returns the
    connector and the cache tensor ([2, blocks, 16, 1, 1]: K and V), filled with distinct
    values."""
    monkeypatch.setattr(worker_module, "load_native", lambda: FakeNative)
    config = make_vllm_config(model_dir, role,
                              extra_config={"kv_staging": "host", "kv_staging_blocks": slots})
    connector = KvferryConnector(config, KVConnectorRole.WORKER, make_kv_cache_config())
    cache = torch.arange(2 * 200 * BLOCK_SIZE, dtype=torch.float32).reshape(2, 200, BLOCK_SIZE, 1,
                                                                              1)
    connector.register_kv_caches({"layer.0": cache})
    return connector, cache


def block_values(region, slot):
    return torch.frombuffer(bytearray(layer_bytes(region, slot)), dtype=torch.float32)


def test_a_staged_p_hands_slots_to_the_runtime_and_the_blocks_back_to_vllm_at_once(
        model_dir, monkeypatch):
    p = make_scheduler(make_vllm_config(model_dir, "kv_producer"))
    connector, cache = staged_connector(model_dir, "kv_producer", monkeypatch, slots=8)
    native = connector.connector_worker.prefill
    # The runtime registered the staging twins (8 blocks each), not the 200-block cache.
    assert [(r.part, r.num_blocks) for r in native.regions] == [("k", 8), ("v", 8)]
    assert all(r.data_ptr != cache.data_ptr() for r in native.regions)
    p.add_request(make_request("p1", 40, p_params("xfer-1"), max_tokens=1))
    engine_step(p, connector)
    (blocks,) = p.kv_cache_manager.get_block_ids("p1")
    _, results = engine_step(p, connector)
    # One step: staged, handed over as slots, and the request's blocks given back to vLLM.
    assert ("prefill_done", "xfer-1", [[0, 1, 2]]) in native.calls
    assert results.finished_sending == {"p1"}
    assert_scheduler_empty(p)
    for slot, block in enumerate(blocks):
        assert torch.equal(block_values(native.regions[0], slot), cache[0, block].flatten())
        assert torch.equal(block_values(native.regions[1], slot), cache[1, block].flatten())
    # The runtime frees the transfer: its slots, not a request vLLM has long freed.
    _, results = engine_step(p, connector,
                             lambda: native.events.append(("free", "xfer-1", "sent")))
    assert not results.finished_sending
    assert connector.connector_worker._p_staging.slots.pools[0].free == 8


def test_an_engine_both_p_and_d_stages_through_one_pool_of_slots(model_dir, monkeypatch):
    # One staging memory, so one pool: a slot P holds for a decoder is never also a slot D
    # pulls a load into.
    connector, _ = staged_connector(model_dir, "kv_both", monkeypatch, slots=8)
    worker = connector.connector_worker
    assert worker._p_staging.slots is worker._d_staging.slots
    p_slots = worker._p_staging.slots.take([[0, 1, 2]])
    worker._d_staging.load("r1", "source", [[5, 6]])
    (start,) = worker._d_staging.poll()
    assert not set(start.slot_ids[0]) & set(p_slots[0])


def test_a_staged_d_whose_wait_stands_still_warns_once_naming_its_budget(
        model_dir, monkeypatch, caplog):
    connector, _ = staged_connector(model_dir, "kv_consumer", monkeypatch, slots=4)
    worker = connector.connector_worker
    clock = [1000.0]
    monkeypatch.setattr(worker_module.time, "monotonic", lambda: clock[0])
    worker._d_staging.load("r1", "source", [[1, 2, 3]])
    worker._d_staging.load("r2", "source", [[4, 5]])  # waits for r1's slots
    with caplog.at_level(logging.INFO, logger="kvferry.vllm"):
        for now in (1000.0, 1029.0, 1031.0, 1100.0):
            clock[0] = now
            worker._note_staging_wait("D", worker._d_staging)
    stalled = [r.getMessage() for r in caplog.records if "has not moved" in r.getMessage()]
    assert len(stalled) == 1, caplog.text
    assert "kv_staging_blocks (4 now" in stalled[0] and "D's loads never wait" in stalled[0]


def test_a_staged_p_refuses_a_request_larger_than_its_staging(model_dir, monkeypatch, caplog):
    p = make_scheduler(make_vllm_config(model_dir, "kv_producer"))
    connector, _ = staged_connector(model_dir, "kv_producer", monkeypatch, slots=2)
    native = connector.connector_worker.prefill
    p.add_request(make_request("p1", 40, p_params("xfer-1"), max_tokens=1))  # 3 blocks
    engine_step(p, connector)
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        _, results = engine_step(p, connector)
    assert ("engine_finished", "xfer-1") in native.calls  # D's pull fails, not parks
    assert not any(c[0] == "prefill_done" for c in native.calls)
    assert results.finished_sending == {"p1"}
    assert "kv_staging_blocks" in caplog.text
    assert_scheduler_empty(p)


def test_a_staged_d_reports_a_load_only_once_copied_up_into_its_blocks(model_dir, monkeypatch):
    d = make_scheduler(make_vllm_config(model_dir, "kv_consumer"))
    connector, cache = staged_connector(model_dir, "kv_consumer", monkeypatch, slots=4)
    native = connector.connector_worker.decode
    d.add_request(make_request("d1", 40, d_params("xfer-1"), max_tokens=2))  # 3 blocks
    d.add_request(make_request("d2", 40, d_params("xfer-2"), max_tokens=2))  # waits for slots
    engine_step(d, connector)
    (blocks,) = d.kv_cache_manager.get_block_ids("d1")
    loads = [c for c in native.calls if c[0] == "start_load"]
    assert [(c[1], c[3]) for c in loads] == [("d1", [[0, 1, 2]])]
    # P "writes" the slots; the runtime reports d1 received: the slots are copied up and only
    # then is the load finished, and d2's load starts in the slots d1 gave back.
    for region in native.regions:
        for slot in range(3):
            ctypes.memmove(region.data_ptr + slot * region.block_stride,
                           (ctypes.c_float * BLOCK_SIZE)(*[1000.0 + slot] * BLOCK_SIZE),
                           region.block_bytes)
    _, results = engine_step(d, connector, lambda: setattr(
        native, "pending", DecodeFinished(["d1"], [], [])))
    assert results.finished_recving == {"d1"}
    for slot, block in enumerate(blocks):
        assert torch.equal(cache[:, block].flatten(), torch.full((2 * BLOCK_SIZE,), 1000.0 + slot))
    loads = [c for c in native.calls if c[0] == "start_load"]
    assert [(c[1], c[3]) for c in loads][1:] == [("d2", [[0, 1, 2]])]
    engine_step(d, connector, lambda: setattr(native, "pending", DecodeFinished(["d2"], [], [])))
    while d.requests:
        engine_step(d, connector)
    assert_scheduler_empty(d)


def test_a_staged_d_fails_a_held_load_at_once_and_keeps_only_its_slots(model_dir, monkeypatch):
    # Unstaged, a load that failed while P may still write keeps its request's blocks until
    # released; staged, P writes the slots only: the request fails at once, its blocks free,
    # and the slots stay taken until the runtime releases them.
    d = make_scheduler(make_vllm_config(model_dir, "kv_consumer"))
    connector, _ = staged_connector(model_dir, "kv_consumer", monkeypatch, slots=4)
    native = connector.connector_worker.decode
    staging = connector.connector_worker._d_staging
    d.add_request(make_request("d1", 40, d_params("xfer-1"), max_tokens=2))
    engine_step(d, connector)
    _, results = engine_step(d, connector, lambda: setattr(
        native, "pending", DecodeFinished([], [("d1", "UNAVAILABLE: P is gone", True)], [])))
    assert results.finished_recving == {"d1"} and results.failed_recving == {"d1"}
    assert_scheduler_empty(d)
    assert staging.slots.pools[0].free == 1
    _, results = engine_step(d, connector, lambda: setattr(
        native, "pending", DecodeFinished([], [], ["d1"])))
    assert not results.finished_recving  # reported once, when it failed
    assert staging.slots.pools[0].free == 4


def test_a_gpu_kv_cache_with_staging_off_is_refused_before_anything_is_registered(
        model_dir, monkeypatch):
    monkeypatch.setattr(worker_module, "load_native", lambda: FakeNative)
    config = make_vllm_config(model_dir, "kv_consumer", extra_config={"kv_staging": "off"})
    connector = KvferryConnector(config, KVConnectorRole.WORKER, make_kv_cache_config())
    meta = torch.zeros(2, 200, BLOCK_SIZE, 1, 1, device="meta")  # a cache off the host
    with pytest.raises(ValueError, match="kv_staging is off"):
        connector.register_kv_caches({"layer.0": meta})
    assert connector.connector_worker.decode is None


def test_kv_staging_decides_between_the_cache_itself_gpu_direct_and_staging():
    assert worker_module.kv_registration("auto", {"cpu"}) == "host"
    assert worker_module.kv_registration("off", {"cpu"}) == "host"
    assert worker_module.kv_registration("host", {"cpu"}) == "stage"
    assert worker_module.kv_registration("auto", {"cuda:0"}) == "stage"  # staging: the default
    assert worker_module.kv_registration("host", {"cuda:0"}) == "stage"
    assert worker_module.kv_registration("off", {"cuda:0"}) == "cuda"
    with pytest.raises(ValueError, match="kv_staging is off"):
        worker_module.kv_registration("off", {"meta"})
    with pytest.raises(ValueError, match="kv_staging is off"):
        worker_module.kv_registration("off", {"cuda:0", "cpu"})


def test_a_gpu_direct_cache_reaches_the_data_plane_as_cuda_memory_which_refuses_it_here(
        model_dir, monkeypatch):
    # The real native module and UCX: the worker registers a (host-standing-in) cache as CUDA
    # memory, and this machine's UCX, which has no CUDA, refuses it before anything runs.
    native = pytest.importorskip("kvferry._native")
    monkeypatch.setattr(worker_module, "kv_registration", lambda mode, devices: "cuda")
    config = make_vllm_config(model_dir, "kv_consumer", extra_config={"kv_staging": "off"})
    connector = KvferryConnector(config, KVConnectorRole.WORKER, make_kv_cache_config())
    cache = torch.zeros(2, 200, BLOCK_SIZE, 1, 1)
    with pytest.raises(native.KvferryError, match="CUDA") as error:
        connector.register_kv_caches({"layer.0": cache})
    assert error.value.code == "INVALID_ARGUMENT"
    assert connector.connector_worker.decode is None


def layer_bytes(region, block):
    """The bytes of one block of one region, read through its pointer as the runtime will."""
    return ctypes.string_at(region.data_ptr + block * region.block_stride, region.block_bytes)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC,
                                    KVCacheLayout.LBNHC])
def test_regions_of_vllm_032_layer_views(layout):
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    page, num_blocks, layers = spec.page_size_bytes, 6, ["l0", "l1", "l2"]
    if layout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC):
        placement = dict(layer_stride=page * num_blocks, block_stride=page)
    else:  # block-outermost: a block holds every layer's page
        placement = dict(layer_stride=page, block_stride=page * len(layers))
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=page * num_blocks * len(layers), layers=layers, **placement)
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    views = allocate_kv_cache(config, torch.device("cpu"), layout)
    for name, view in views.items():
        regions = kv_regions(name, view, 0, num_blocks)
        assert len(regions) == 1
        (region,) = regions
        assert region.block_bytes == page
        assert region.block_stride == placement["block_stride"]
        assert region.nbytes == (num_blocks - 1) * region.block_stride + page
        # Token-major blocks (LBNHC) cannot be cut by head: the runtime is told so.
        assert region.heads_outermost == (layout != KVCacheLayout.LBNHC)
        # Each block of the region is exactly that layer's block b: write, read back by pointer.
        for b in range(num_blocks):
            pattern = torch.arange(view[b].numel(), dtype=view.dtype) + b
            view[b].copy_(pattern.reshape(view[b].shape))
        for b in range(num_blocks):
            # The block's bytes in memory order (its dims by decreasing stride).
            block = view[b]
            physical = block.permute(*sorted(range(block.dim()), key=lambda i: -block.stride(i)))
            assert layer_bytes(region, b) == physical.contiguous().numpy().tobytes()


def test_regions_of_flash_attention_kv_and_mla_tensors():
    nb, bs, heads, dim = 7, 16, 2, 8
    fa = torch.zeros(2, nb, bs, heads, dim, dtype=torch.float16)
    k, v = kv_regions("fa", fa, 0, nb)
    assert (k.part, v.part) == ("k", "v")
    assert k.block_stride == k.block_bytes == bs * heads * dim * 2
    assert v.data_ptr - k.data_ptr == nb * k.block_stride
    assert not k.heads_outermost, "flash-attention's NHD blocks are token-major"
    # HND inside each block (heads before tokens in memory) is still one run per block.
    hnd = torch.zeros(2, nb, heads, bs, dim).permute(0, 1, 3, 2, 4)
    assert kv_regions("hnd", hnd, 0, nb)[0].block_bytes == bs * heads * dim * 4
    assert kv_regions("hnd", hnd, 0, nb)[0].heads_outermost
    (mla,) = kv_regions("mla", torch.zeros(nb, bs, 576, dtype=torch.bfloat16), 1, nb)
    assert (mla.part, mla.group, mla.block_bytes) == ("kv", 1, bs * 576 * 2)
    assert mla.heads_outermost
    # Heads outermost across blocks: a block is not one run; the error says what to use.
    heads_outer = torch.zeros(heads, nb, bs, dim).permute(1, 0, 2, 3)
    with pytest.raises(ValueError, match="LBHNC"):
        kv_regions("bad", heads_outer, 0, nb)
    with pytest.raises(ValueError, match="block-major"):
        kv_regions("bad", torch.zeros(5, 3), 0, nb)
