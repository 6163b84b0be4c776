"""vLLM's own MooncakeConnector (scheduler side, no Mooncake installed) beside KvferryConnector on
the same requests: a user switching connectors sees the same P and D scheduling."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: run scripts/install-python.sh and use .venv/bin/python"
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: E402
    MooncakeConnector,
    MooncakeConnectorMetadata,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from kvferry.vllm import KvferryConnector  # noqa: E402
from vllm_harness import (  # noqa: E402
    assert_scheduler_empty,
    d_params,
    make_request,
    make_scheduler,
    make_vllm_config,
    p_params,
    step,
)


def both(model_dir, role):
    """Two schedulers alike but for the connector: MooncakeConnector (vLLM's registry name, no
    module path) and ours. Mooncake's scheduler side needs no TransferEngine."""
    mooncake = make_scheduler(
        make_vllm_config(
            model_dir, role, kv_connector="MooncakeConnector", kv_connector_module_path=None
        )
    )
    ours = make_scheduler(make_vllm_config(model_dir, role))
    assert isinstance(mooncake.connector, MooncakeConnector)
    assert isinstance(ours.connector, KvferryConnector)
    return mooncake, ours


@pytest.mark.parametrize("prompt", [1, 16, 40, 64])
def test_d_matched_tokens_and_blocks_agree(model_dir, prompt):
    mooncake, ours = both(model_dir, "kv_consumer")
    for scheduler in (mooncake, ours):
        scheduler.add_request(make_request("d1", prompt, d_params("xfer-1"), max_tokens=2))
    req_m, req_o = mooncake.requests["d1"], ours.requests["d1"]
    assert mooncake.connector.get_num_new_matched_tokens(
        req_m, 0
    ) == ours.connector.get_num_new_matched_tokens(req_o, 0) == (prompt, True)

    out_m, _ = step(mooncake)
    out_o, _ = step(ours)
    assert req_m.status == req_o.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req_m.num_computed_tokens == req_o.num_computed_tokens == prompt
    meta_m = out_m.kv_connector_metadata
    assert isinstance(meta_m, MooncakeConnectorMetadata)
    (pull,) = meta_m.reqs_to_recv["prefill-0"].values()
    assert out_o.kv_connector_metadata.load["d1"].block_ids == pull.local_block_ids
    assert (pull.transfer_id, pull.remote_bootstrap_addr) == (
        "xfer-1",
        out_o.kv_connector_metadata.load["d1"].source.bootstrap_addr,
    )

    for scheduler in (mooncake, ours):
        step(scheduler, finished_recving={"d1"})
    out_m, _ = step(mooncake)
    out_o, _ = step(ours)
    assert out_m.num_scheduled_tokens == out_o.num_scheduled_tokens == {"d1": 1}
    assert req_m.num_computed_tokens == req_o.num_computed_tokens == prompt
    for scheduler in (mooncake, ours):
        while scheduler.requests:
            step(scheduler)
        assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("outcome", ["length_capped", "aborted_running", "aborted_queued"])
def test_p_delay_free_agrees(model_dir, outcome):
    mooncake, ours = both(model_dir, "kv_producer")
    for scheduler in (mooncake, ours):
        scheduler.add_request(make_request("p1", 40, p_params("xfer-1"), max_tokens=1))
        if outcome == "aborted_queued":
            scheduler.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
        elif outcome == "aborted_running":
            scheduler.schedule()  # admitted, its prefill in flight
            scheduler.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
        else:
            step(scheduler)

    kept = {name: "p1" in s.requests for name, s in (("mooncake", mooncake), ("ours", ours))}
    assert kept["mooncake"] == kept["ours"] == (outcome == "length_capped")
    for scheduler in (mooncake, ours):
        if kept["ours"]:
            step(scheduler)
            step(scheduler, finished_sending={"p1"})
        assert_scheduler_empty(scheduler)


def test_p_keeps_kv_of_a_request_stopped_by_its_only_token_unlike_mooncake(model_dir):
    """The one deliberate difference: P's one sampled token was a stop token. The prompt's KV is
    complete; kvferry keeps it for D (as NixlConnector does), MooncakeConnector frees it and D's
    pull then waits for nothing."""
    mooncake, ours = both(model_dir, "kv_producer")
    results = {}
    for name, scheduler in (("mooncake", mooncake), ("ours", ours)):
        request = make_request("p1", 40, p_params("xfer-1"), max_tokens=1)
        scheduler.add_request(request)
        scheduler.schedule()
        request.status = RequestStatus.FINISHED_STOPPED
        (blocks,) = scheduler.kv_cache_manager.get_block_ids("p1")
        connector = scheduler.connector
        results[name] = connector.request_finished_all_groups(request, (blocks,))[0]
    assert results == {"mooncake": False, "ours": True}
