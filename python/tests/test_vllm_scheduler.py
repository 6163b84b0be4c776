"""The scheduler half of KvferryConnector against vLLM's real v1 Scheduler: P and D schedulers
in one process, the model runner faked (no GPU, no model)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: run scripts/install-python.sh and use .venv/bin/python"
)

from vllm.v1.request import RequestStatus  # noqa: E402

from kvferry.vllm import KvferryConnector  # noqa: E402
from kvferry.vllm.config import ConfigError  # noqa: E402
from kvferry.vllm.metadata import HoldSpec, KvferryConnectorMetadata  # noqa: E402
from kvferry.vllm.native import RemoteSource  # noqa: E402
from vllm_harness import (  # noqa: E402
    NUM_BLOCKS,
    assert_scheduler_empty,
    d_params,
    make_request,
    make_scheduler,
    make_vllm_config,
    p_params,
    step,
)

PROMPT = 40  # three blocks of 16, the last one partial


def scheduler_for(model_dir, role, **kw):
    return make_scheduler(make_vllm_config(model_dir, role, **kw))


def meta_of(scheduler_output) -> KvferryConnectorMetadata:
    meta = scheduler_output.kv_connector_metadata
    assert isinstance(meta, KvferryConnectorMetadata), type(meta)
    return meta


def test_vllm_loads_our_connector_by_module_path(model_dir):
    for role in ("kv_producer", "kv_consumer", "kv_both"):
        scheduler = scheduler_for(model_dir, role)
        assert isinstance(scheduler.connector, KvferryConnector)
        assert scheduler.connector.connector_worker is None


def test_d_request_waits_for_remote_kv_then_runs_from_prompt_minus_one(model_dir):
    d = scheduler_for(model_dir, "kv_consumer")
    d.add_request(make_request("d1", PROMPT, d_params("xfer-1"), max_tokens=3))
    source = RemoteSource("prefill-0", "http://127.0.0.1:8998", "xfer-1")

    out, _ = step(d)
    request = d.requests["d1"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.total_num_scheduled_tokens == 0
    meta = meta_of(out)
    # Renewals start when the request is seen, and its load names its blocks and its source.
    assert meta.track == {"d1": source}
    (blocks,) = d.kv_cache_manager.get_block_ids("d1")
    assert len(blocks) == 3
    assert meta.load["d1"].source == source
    assert meta.load["d1"].block_ids == [blocks]
    assert "d1" in d.connector.connector_scheduler.tracked_requests

    # Nothing arrives: it keeps waiting, and the metadata is not repeated.
    for _ in range(3):
        out, _ = step(d)
        assert meta_of(out).is_empty()
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    step(d, finished_recving={"d1"})
    assert "d1" not in d.connector.connector_scheduler.tracked_requests
    out, outputs = step(d)
    assert request.status == RequestStatus.RUNNING
    # The last prompt token is recomputed on D to sample the first output token.
    assert out.num_scheduled_tokens == {"d1": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == PROMPT - 1
    assert outputs["d1"].new_token_ids == [500]
    while d.requests:
        out, outputs = step(d)
        assert meta_of(out).release == []  # a finished receive needs no release
    assert_scheduler_empty(d)


def test_p_keeps_blocks_until_finished_sending(model_dir):
    p = scheduler_for(model_dir, "kv_producer", engine_id="prefill-0")
    p.add_request(make_request("p1", PROMPT, p_params("xfer-1"), max_tokens=1))

    out, outputs = step(p)
    assert meta_of(out).admit == {"p1": "xfer-1"}
    request = p.requests["p1"]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # What D needs to pull, for a router that sends D's request after P's (vLLM adds its own
    # keys, such as remote_prefill_cached_tokens).
    returned = outputs["p1"].kv_transfer_params
    assert returned["do_remote_prefill"] is True and returned["do_remote_decode"] is False
    assert returned["remote_engine_id"] == "prefill-0" and returned["transfer_id"] == "xfer-1"
    (blocks,) = p.kv_cache_manager.get_block_ids("p1")
    assert len(blocks) == 3
    free_while_held = p.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free_while_held == NUM_BLOCKS - 1 - 3

    out, _ = step(p)
    assert meta_of(out).hold == {"p1": HoldSpec("xfer-1", [blocks])}
    for _ in range(3):  # the blocks stay held for as long as the transfer runs
        out, _ = step(p)
        assert meta_of(out).is_empty()
        assert "p1" in p.requests
        assert p.kv_cache_manager.block_pool.get_num_free_blocks() == free_while_held

    step(p, finished_sending={"p1"})
    assert_scheduler_empty(p)
    assert not p.connector.connector_scheduler.holding_requests


LAYER_WRITES = {"layer_writes": True}


def test_the_step_that_completes_a_p_prompt_names_its_blocks_for_layer_writes(model_dir):
    p = scheduler_for(model_dir, "kv_producer", engine_id="prefill-0", extra_config=LAYER_WRITES)
    p.add_request(make_request("p1", PROMPT, p_params("xfer-1"), max_tokens=1))
    out, _ = step(p)
    (blocks,) = p.kv_cache_manager.get_block_ids("p1")
    meta = meta_of(out)
    # The worker admits it first, then sends each layer as this step computes it.
    assert meta.admit == {"p1": "xfer-1"}
    assert meta.layers == {"p1": HoldSpec("xfer-1", [list(blocks)])}
    out, _ = step(p)
    assert meta_of(out).layers == {}
    # What prefill_done then names: the blocks the layers went from.
    assert meta_of(out).hold == {"p1": HoldSpec("xfer-1", [list(blocks)])}


def test_a_chunked_p_prompt_names_its_blocks_only_in_its_last_chunk(model_dir):
    # 480 tokens at 256 a step: chunks of 256 and 224; only the last computes every layer of
    # the whole prompt (the first chunk's layers are final, but the last tokens' are not yet).
    p = scheduler_for(model_dir, "kv_producer", engine_id="prefill-0", extra_config=LAYER_WRITES)
    p.add_request(make_request("p1", 480, p_params("xfer-1"), max_tokens=1))
    seen = []
    for _ in range(2):
        out, _ = step(p)
        seen.append(meta_of(out).layers)
    (blocks,) = p.kv_cache_manager.get_block_ids("p1")
    assert len(blocks) == 30  # the first chunk's 16 and the second's 14
    assert seen == [{}, {"p1": HoldSpec("xfer-1", [list(blocks)])}]
    out, _ = step(p)
    assert meta_of(out).hold == {"p1": HoldSpec("xfer-1", [list(blocks)])}


def test_layer_writes_off_by_default_names_no_layers(model_dir):
    p = scheduler_for(model_dir, "kv_producer", engine_id="prefill-0")
    p.add_request(make_request("p1", PROMPT, p_params("xfer-1"), max_tokens=1))
    out, _ = step(p)
    assert meta_of(out).admit == {"p1": "xfer-1"}
    assert meta_of(out).layers == {}
    assert not p.connector.connector_scheduler._prefilling


def test_p_and_d_together_leave_both_schedulers_empty(model_dir):
    p = scheduler_for(model_dir, "kv_producer", engine_id="prefill-0")
    d = scheduler_for(model_dir, "kv_consumer")
    for i in range(4):  # the proxy sends P and D at once
        p.add_request(make_request(f"p{i}", PROMPT + 7 * i, p_params(f"xfer-{i}"), max_tokens=1))
        d.add_request(make_request(f"d{i}", PROMPT + 7 * i, d_params(f"xfer-{i}"), max_tokens=2))
    held, loading = {}, {}
    for _ in range(3):
        out_p, _ = step(p)
        out_d, _ = step(d)
        held.update(meta_of(out_p).hold)
        loading.update(meta_of(out_d).load)
    assert {h.transfer_id for h in held.values()} == {f"xfer-{i}" for i in range(4)}
    assert {spec.source.transfer_id for spec in loading.values()} == set(held_ids := {
        h.transfer_id for h in held.values()})
    # Each D request's destination has as many blocks as P holds for the same transfer.
    by_transfer = {spec.source.transfer_id: spec.block_ids for spec in loading.values()}
    for hold in held.values():
        assert [len(g) for g in by_transfer[hold.transfer_id]] == [len(g) for g in hold.block_ids]
    assert held_ids
    step(p, finished_sending=set(held))
    step(d, finished_recving=set(loading))
    while d.requests:
        step(d)
    assert_scheduler_empty(p)
    assert_scheduler_empty(d)


def test_aborted_queued_d_request_is_released_in_the_next_metadata(model_dir):
    # Capacity for one request only: the second one queues for blocks.
    d = make_scheduler(make_vllm_config(model_dir, "kv_consumer"), num_blocks=5)
    d.add_request(make_request("big", 60, d_params("xfer-big"), max_tokens=2))
    d.add_request(make_request("queued", 60, d_params("xfer-q"), max_tokens=2))
    out, _ = step(d)
    meta = meta_of(out)
    assert set(meta.track) == {"big", "queued"}  # both renewed from arrival
    assert set(meta.load) == {"big"}
    assert d.requests["queued"].status == RequestStatus.WAITING

    d.finish_requests("queued", RequestStatus.FINISHED_ABORTED)
    out, _ = step(d)
    assert meta_of(out).release == ["queued"]
    assert "queued" not in d.requests
    out, _ = step(d)
    assert meta_of(out).release == []  # said once

    # Aborted while receiving: released too, and vLLM keeps its blocks until the worker says
    # no P rank can write to them anymore (reported as finished receiving).
    d.finish_requests("big", RequestStatus.FINISHED_ABORTED)
    out, _ = step(d)
    assert meta_of(out).release == ["big"]
    assert "big" in d.requests
    step(d, finished_recving={"big"})
    assert_scheduler_empty(d, num_blocks=5)


def test_request_aborted_before_it_was_ever_scheduled_is_released(model_dir):
    d = scheduler_for(model_dir, "kv_consumer")
    d.add_request(make_request("gone", PROMPT, d_params("xfer-gone")))
    d.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    out, _ = step(d)
    meta = meta_of(out)
    assert set(meta.track) == {"gone"} and meta.release == ["gone"] and not meta.load
    assert_scheduler_empty(d)


def test_p_request_aborted_tells_the_runtime_and_frees_at_once(model_dir):
    p = scheduler_for(model_dir, "kv_producer")
    p.add_request(make_request("p1", 300, p_params("xfer-1"), max_tokens=1))
    out, _ = step(p)  # a partial prefill (256-token budget)
    assert p.requests["p1"].status == RequestStatus.RUNNING
    p.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    out, _ = step(p)
    assert meta_of(out).drop == {"p1": "xfer-1"}
    assert not meta_of(out).hold
    assert_scheduler_empty(p)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_load_failure_follows_kv_load_failure_policy(model_dir, policy):
    d = scheduler_for(model_dir, "kv_consumer", kv_load_failure_policy=policy)
    d.add_request(make_request("d1", PROMPT, d_params("xfer-1"), max_tokens=2))
    step(d)
    assert d.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS

    # What the worker half reports for a failed load: finished, and failed.
    _, outputs = step(d, finished_recving={"d1"}, failed_recving={"d1"})
    if policy == "fail":
        assert outputs["d1"].finish_reason is not None
        assert str(outputs["d1"].finish_reason) in ("error", "FinishReason.ERROR")
        assert_scheduler_empty(d)
        return
    assert "d1" not in outputs
    out, _ = step(d)
    # Recompute: the whole prompt is prefilled here, from the first token.
    assert d.requests["d1"].status == RequestStatus.RUNNING
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"d1": PROMPT}
    while d.requests:
        step(d)
    assert_scheduler_empty(d)


def test_local_prefix_hit_loads_only_the_blocks_d_lacks(model_dir):
    d = scheduler_for(model_dir, "kv_consumer")
    # A first request computes 48 tokens locally and caches its full blocks.
    local = make_request("local", 48, None, max_tokens=1)
    d.add_request(local)
    while d.requests:
        step(d)
    # The same prompt plus 16 tokens from P: vLLM reuses the three cached blocks and the
    # connector loads only the fourth.
    prompt = list(local.prompt_token_ids) + list(range(700, 716))
    d.add_request(make_request("hit", 64, d_params("xfer-1"), max_tokens=1, prompt=prompt))
    out, _ = step(d)
    (blocks,) = d.kv_cache_manager.get_block_ids("hit")
    assert len(blocks) == 4
    assert meta_of(out).load["hit"].block_ids == [blocks[3:]]
    assert d.requests["hit"].num_computed_tokens == 64  # 48 local + 16 from P
    step(d, finished_recving={"hit"})
    out, _ = step(d)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 63
    while d.requests:
        step(d)
    assert_scheduler_empty(d)


def test_incomplete_remote_prefill_params_prefill_locally(model_dir):
    d = scheduler_for(model_dir, "kv_consumer")
    params = d_params("xfer-1")
    del params["remote_engine_id"]
    d.add_request(make_request("d1", PROMPT, params, max_tokens=1))
    out, _ = step(d)
    assert out.num_scheduled_tokens == {"d1": PROMPT}
    assert meta_of(out).is_empty()
    assert_scheduler_empty(d)


def test_lease_and_timeouts_are_parsed_with_bounds_at_engine_start(model_dir):
    scheduler = scheduler_for(
        model_dir,
        "kv_consumer",
        extra_config={"kv_lease_duration": 30, "abort_request_timeout": 20, "bootstrap_port": 0},
    )
    settings = scheduler.connector.settings
    assert settings.kv_lease_duration == 30.0 and settings.lease_enabled
    assert settings.abort_request_timeout == 20.0
    assert settings.bootstrap_port == 0
    for bad in (-1, "30", True, float("nan"), 86401):
        with pytest.raises(ConfigError, match="kv_lease_duration"):
            scheduler_for(model_dir, "kv_consumer", extra_config={"kv_lease_duration": bad})
    with pytest.raises(ConfigError, match="abort_request_timeout"):
        scheduler_for(model_dir, "kv_producer", extra_config={"abort_request_timeout": 0})
