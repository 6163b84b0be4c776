"""kvferry._native against itself: real P and D ranks in this process, moving torch CPU tensors
over UCX on loopback (the data plane the connector uses), with P's bootstrap service.

What the binding adds to the C++ runtime is tested here: planes from tensors, the GIL released
while waiting, Status errors raised as KvferryError, hold events taken without Python on kvferry
threads. The lifetime rules themselves are the C++ tests' (docs/design.md, rule -> test).
"""

import os
import re
import threading
import time
import uuid

import pytest

torch = pytest.importorskip("torch")
native = pytest.importorskip("kvferry._native", reason="kvferry._native not built (scripts/test.sh builds it)")

NUM_BLOCKS = 32
BLOCK_SIZE = 16  # tokens per block
HEADS = 2
HEAD_SIZE = 8
LAYERS = 3


def kv_tensors(fill=None):
    """vLLM's flash-attention layout: one [2, blocks, block_size, heads, head_size] per layer."""
    tensors = []
    for layer in range(LAYERS):
        t = torch.zeros((2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE), dtype=torch.float16)
        if fill is not None:
            for half in range(2):
                for b in range(NUM_BLOCKS):
                    t[half, b].fill_(fill(layer, half, b))
        tensors.append(t)
    return tensors


def planes(tensors):
    """Each layer's K half and V half: one plane each, every block block_len bytes."""
    out = []
    for t in tensors:
        for half in range(2):
            view = t[half]
            out.append((view.data_ptr(), view.numel() * view.element_size()))
    return out


BLOCK_LEN = BLOCK_SIZE * HEADS * HEAD_SIZE * 2  # float16


def receive(d, request_id, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        finished = d.wait_finished(0.5)
        for result in finished["loaded"]:
            if result[0] == request_id:
                return result
    raise AssertionError(f"no result for {request_id} within {timeout_s} s")


def make_pair(lease_s=5.0, d_lease_s=None, p_kv=None, d_kv=None, fence_writes=False):
    bootstrap = native.BootstrapServer(host="127.0.0.1", port=0)
    engine_id = "p-" + uuid.uuid4().hex[:8]
    p_kv = p_kv if p_kv is not None else kv_tensors(lambda layer, half, b: layer * 20 + half * 10 + b % 10)
    d_kv = d_kv if d_kv is not None else kv_tensors()
    p = native.PrefillWorker(engine_id=engine_id, block_len=BLOCK_LEN, num_blocks=NUM_BLOCKS,
                             planes=planes(p_kv), lease_s=lease_s, abort_request_timeout_s=30.0,
                             bootstrap_address=f"127.0.0.1:{bootstrap.port}",
                             incarnation=uuid.uuid4().hex)
    d = native.DecodeWorker(engine_id="d-" + uuid.uuid4().hex[:8], block_len=BLOCK_LEN,
                            num_blocks=NUM_BLOCKS, planes=planes(d_kv),
                            lease_s=lease_s if d_lease_s is None else d_lease_s,
                            abort_request_timeout_s=30.0, fence_writes=fence_writes)
    src = lambda xfer: {"transfer_id": xfer, "engine_id": engine_id,
                        "bootstrap_address": f"127.0.0.1:{bootstrap.port}"}
    return bootstrap, p, d, p_kv, d_kv, src


def stop(*things):
    for thing in things:
        thing.stop()


def test_every_plane_of_p_tensors_lands_in_d_tensors_and_p_frees_after_the_pull():
    bootstrap, p, d, p_kv, d_kv, src = make_pair()
    try:
        p.admit("xfer-1", 7)
        p.prefill_done("xfer-1", [3, 4, 5])
        d.on_new_request("req-1", src("xfer-1"))
        d.start_load("req-1", src("xfer-1"), [10, 11, 12])
        request, ok, error, quarantined = receive(d, "req-1")
        assert ok, error
        assert not quarantined
        for layer in range(LAYERS):
            assert torch.equal(d_kv[layer][:, 10:13], p_kv[layer][:, 3:6]), f"layer {layer}"
            assert not d_kv[layer][:, :10].any(), "D blocks nobody asked for were written"
        d.request_finished("req-1")
        deadline = time.monotonic() + 5
        events = []
        while time.monotonic() < deadline and not events:
            events = p.take_events()
            time.sleep(0.01)
        assert events == [("free", "xfer-1", "sent")]
        stats = p.stats()
        assert stats["bytes_written"] == 3 * BLOCK_LEN * 2 * LAYERS
        # The hold table's counters, from their declarations (core/hold_table.h).
        assert stats["hold_released_by_reason"]["sent"] == 1, stats
        assert sum(stats["hold_released_by_reason"].values()) == 1, stats
        assert stats["hold_entries_by_state"] == {"placeholder": 0, "prefilling": 0, "ready": 0}
        assert stats["hold_sending"] == 0 and stats["tombstones"] == 1, stats
    finally:
        stop(d, p, bootstrap)


def test_layers_ready_writes_those_planes_into_a_waiting_pull_before_the_prefill_ends():
    bootstrap, p, d, p_kv, d_kv, src = make_pair()
    try:
        p.admit("xfer-1", 7)
        d.on_new_request("req-1", src("xfer-1"))
        d.start_load("req-1", src("xfer-1"), [10, 11, 12])
        deadline = time.monotonic() + 10
        while p.stats()["requests_parked"] == 0:  # D's pull waits on P for the prefill
            assert time.monotonic() < deadline, p.stats()
            time.sleep(0.01)
        # Layer 0 (planes 0 and 1: its K and V halves) is computed.
        assert p.layers_ready("xfer-1", [3, 4, 5], [0, 1], 7)
        assert not p.layers_ready("xfer-1", [3, 4, 5], [2], 8)  # another request's handle
        while not torch.equal(d_kv[0][:, 10:13], p_kv[0][:, 3:6]):
            assert time.monotonic() < deadline, "layer 0 did not land before the prefill ended"
            time.sleep(0.01)
        assert not d_kv[1].any() and not d_kv[2].any(), "layers not computed yet were written"
        assert d.wait_finished(0.2)["loaded"] == []  # the load is not done: P has not answered
        p.prefill_done("xfer-1", [3, 4, 5])
        request, ok, error, quarantined = receive(d, "req-1")
        assert ok, error
        for layer in range(LAYERS):
            assert torch.equal(d_kv[layer][:, 10:13], p_kv[layer][:, 3:6]), f"layer {layer}"
        stats = p.stats()
        assert stats["layer_writes"] == 1, stats
        assert stats["bytes_written"] == 3 * BLOCK_LEN * 2 * LAYERS  # no plane written twice
        with pytest.raises(native.KvferryError, match="plane 6 outside"):
            p.layers_ready("xfer-1", [3], [6], 7)
        with pytest.raises(native.KvferryError, match="block 32 outside"):
            p.layers_ready("xfer-1", [32], [0], 7)
    finally:
        stop(d, p, bootstrap)


def test_a_decoder_that_fences_its_writers_receives_every_plane_through_write_keys():
    # fence_writes: D's descriptors carry no remote keys and D refuses unkeyed writes, so this
    # transfer lands only because the pull's write key reached P's writer and its batches.
    bootstrap, p, d, p_kv, d_kv, src = make_pair(fence_writes=True)
    try:
        p.admit("xfer-1", 7)
        p.prefill_done("xfer-1", [3, 4, 5])
        d.start_load("req-1", src("xfer-1"), [10, 11, 12])
        request, ok, error, quarantined = receive(d, "req-1")
        assert ok, error
        for layer in range(LAYERS):
            assert torch.equal(d_kv[layer][:, 10:13], p_kv[layer][:, 3:6]), f"layer {layer}"
    finally:
        stop(d, p, bootstrap)


def test_a_pull_of_a_freed_transfer_fails_at_once_with_the_tombstone():
    bootstrap, p, d, p_kv, d_kv, src = make_pair()
    try:
        p.admit("xfer-1", 1)
        p.prefill_done("xfer-1", [0])
        d.start_load("req-1", src("xfer-1"), [1])
        assert receive(d, "req-1")[1]
        d.request_finished("req-1")
        start = time.monotonic()
        d.start_load("req-2", src("xfer-1"), [2])
        request, ok, error, quarantined = receive(d, "req-2")
        assert not ok
        assert "TOMBSTONED" in error, error
        assert time.monotonic() - start < 2.0
        assert not quarantined
    finally:
        stop(d, p, bootstrap)


def test_a_second_load_of_a_loading_request_is_refused_and_the_first_one_lands():
    # The engine adapter's duplicate-id decision through the binding: refused with
    # ALREADY_EXISTS, nothing pulled for it, and the first load reports for the request.
    bootstrap, p, d, p_kv, d_kv, src = make_pair()
    try:
        d.on_new_request("req-1", src("xfer-1"))
        with pytest.raises(native.KvferryError) as error:
            d.on_new_request("req-1", src("xfer-1"))
        assert error.value.code == "ALREADY_EXISTS"
        d.start_load("req-1", src("xfer-1"), [10])
        with pytest.raises(native.KvferryError) as error:
            d.start_load("req-1", src("xfer-1"), [11])
        assert error.value.code == "ALREADY_EXISTS"
        p.admit("xfer-1", 1)
        p.prefill_done("xfer-1", [3])
        request, ok, error, quarantined = receive(d, "req-1")
        assert ok, error
        for layer in range(LAYERS):
            assert torch.equal(d_kv[layer][:, 10], p_kv[layer][:, 3]), f"layer {layer}"
            assert not d_kv[layer][:, 11].any(), "the refused load wrote its blocks"
        assert d.stats()["pulls_sent"] == 1
    finally:
        stop(d, p, bootstrap)


def test_a_transfer_p_refused_to_admit_is_freed_at_its_prefill_done_and_never_held():
    # The engine adapter on P through the binding: a refused admission holds nothing, and the
    # prefill vLLM runs anyway gives its blocks back at once, touching no hold table.
    bootstrap, p, d, p_kv, d_kv, src = make_pair()
    try:
        p.refuse("xfer-1", "the prefill instance dropped it while it queued")
        with pytest.raises(native.KvferryError) as error:
            p.admit("xfer-1", 1)
        assert error.value.code == "TOMBSTONED", error.value
        assert p.stats()["admitted_transfers"] == 1  # known, refused, until its prefill ends
        p.prefill_done("xfer-1", [0, 1])
        assert p.take_events() == [("free", "xfer-1", "aborted_by_engine")]
        stats = p.stats()
        assert stats["admitted_transfers"] == 0 and stats["held_transfers"] == 0, stats
        # The tombstone stands: D's pull fails at once.
        d.start_load("req-1", src("xfer-1"), [4])
        request, ok, error, quarantined = receive(d, "req-1")
        assert not ok and not quarantined
        assert error.startswith("TOMBSTONED"), error
    finally:
        stop(d, p, bootstrap)


def test_a_lease_mismatch_fails_naming_both_values():
    bootstrap, p, d, p_kv, d_kv, src = make_pair(lease_s=5.0, d_lease_s=7.0)
    try:
        p.admit("xfer-1", 1)
        p.prefill_done("xfer-1", [0])
        d.start_load("req-1", src("xfer-1"), [1])
        request, ok, error, quarantined = receive(d, "req-1")
        assert not ok
        assert "5" in error and "7" in error, error
    finally:
        stop(d, p, bootstrap)


def test_the_module_says_which_ucx_it_loaded():
    version = native.ucx_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    # scripts/test.sh runs these tests again on the wheel's UCX, and says which it expects.
    expected = os.environ.get("KVFERRY_EXPECT_UCX")
    if expected:
        assert version.startswith(expected + "."), (version, expected)


def test_gpu_direct_registration_of_memory_ucx_cannot_register_as_cuda_is_refused_with_why():
    # Debian's UCX has no CUDA; the wheel's has, but loads no CUDA module without a driver; and
    # where it does, this host tensor is not device memory. Every case refuses, naming CUDA.
    host = torch.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=torch.uint8)
    for make in (native.DecodeWorker, native.PrefillWorker):
        extra = {"incarnation": "i", "data_plane": "ucx"} if make is native.PrefillWorker else {}
        with pytest.raises(native.KvferryError) as error:
            make(engine_id=f"gpu-direct-{uuid.uuid4().hex[:6]}", block_len=BLOCK_LEN,
                 num_blocks=NUM_BLOCKS, planes=[(host.data_ptr(), host.numel())], memory="cuda",
                 **extra)
        assert error.value.code == "INVALID_ARGUMENT"
        assert "CUDA" in str(error.value), str(error.value)
    with pytest.raises(native.KvferryError, match="memory must be 'host' or 'cuda'"):
        native.DecodeWorker(engine_id="d", block_len=BLOCK_LEN, num_blocks=NUM_BLOCKS,
                            planes=[(host.data_ptr(), host.numel())], memory="gpu")


def test_bad_arguments_raise_kvferry_error_with_the_status_code():
    short = torch.zeros(NUM_BLOCKS * BLOCK_LEN - 1, dtype=torch.uint8)
    with pytest.raises(native.KvferryError) as error:
        native.DecodeWorker(engine_id="d", block_len=BLOCK_LEN, num_blocks=NUM_BLOCKS,
                            planes=[(short.data_ptr(), short.numel())])
    assert error.value.code == "INVALID_ARGUMENT"
    assert "plane 0" in str(error.value)
    with pytest.raises(native.KvferryError) as error:
        native.DecodeWorker(engine_id="d", block_len=BLOCK_LEN, num_blocks=NUM_BLOCKS,
                            planes=[], lease_s=-1)
    assert error.value.code == "INVALID_ARGUMENT"
    with pytest.raises(native.KvferryError, match="data_plane"):
        native.DecodeWorker(engine_id="d", block_len=BLOCK_LEN, num_blocks=NUM_BLOCKS,
                            planes=[], data_plane="rdma")
    with pytest.raises(TypeError):
        native.DecodeWorker(engine_id="d", block_len=-1, num_blocks=NUM_BLOCKS, planes=[])
    bootstrap, p, d, p_kv, d_kv, src = make_pair()
    try:
        with pytest.raises(native.KvferryError) as error:
            p.prefill_done("never-admitted", [0])
        assert error.value.code == "NOT_FOUND"
        p.admit("xfer-1", 1)
        with pytest.raises(native.KvferryError) as error:
            p.admit("xfer-1", 2)
        assert error.value.code == "ALREADY_EXISTS"
        with pytest.raises(native.KvferryError) as error:
            p.prefill_done("xfer-1", [NUM_BLOCKS])
        assert error.value.code == "OUT_OF_RANGE"
        with pytest.raises(native.KvferryError) as error:
            d.start_load("req-1", {"transfer_id": "x"}, [0])
        assert "engine_id" in str(error.value)
        # A block outside the region: the rank refuses it and the load ends failed at once,
        # with nothing sent (so nothing held), as every rank's refusal does (DecodeAdapter).
        d.start_load("req-1", src("xfer-1"), [NUM_BLOCKS])
        request, ok, error, quarantined = d.take_finished()["loaded"][0]
        assert (request, ok, quarantined) == ("req-1", False, False)
        assert error.startswith("OUT_OF_RANGE"), error
        assert d.stats()["pulls_sent"] == 0
    finally:
        stop(d, p, bootstrap)
    with pytest.raises(native.KvferryError) as error:
        p.admit("xfer-2", 3)
    assert error.value.code == "CANCELLED", "a stopped worker says so"


def test_waiting_releases_the_gil():
    bootstrap, p, d, p_kv, d_kv, src = make_pair()
    try:
        ticks = []
        stop_flag = threading.Event()

        def tick():
            while not stop_flag.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.005)

        ticker = threading.Thread(target=tick)
        ticker.start()
        start = time.monotonic()
        d.wait_finished(0.5)  # nothing to wait for: returns at its deadline
        waited = time.monotonic() - start
        stop_flag.set()
        ticker.join()
        assert waited >= 0.45
        during = [t for t in ticks if start <= t <= start + waited]
        assert len(during) >= 20, f"only {len(during)} ticks while waiting: the GIL was held"
    finally:
        stop(d, p, bootstrap)


def test_concurrent_stops_are_safe_and_a_stopped_worker_says_so():
    for _ in range(20):
        kv = torch.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=torch.uint8)
        p = native.PrefillWorker(engine_id="p-stop", block_len=BLOCK_LEN, num_blocks=NUM_BLOCKS,
                                 planes=[(kv.data_ptr(), kv.numel())], incarnation="i",
                                 data_plane="inprocess")
        d = native.DecodeWorker(engine_id="d-stop", block_len=BLOCK_LEN, num_blocks=NUM_BLOCKS,
                                planes=[], data_plane="inprocess")
        waiter = threading.Thread(target=lambda: d.wait_finished(0.2))
        waiter.start()
        threads = [threading.Thread(target=w.stop) for w in (p, p, p, d, d)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        waiter.join()
        with pytest.raises(native.KvferryError) as error:
            d.take_finished()
        assert error.value.code == "CANCELLED"


def test_stop_releases_what_the_decoder_tracks_and_returns_only_once_it_stopped():
    # Issue 20 item 4. P holds two prefilled transfers that D tracks and never loaded; a wait
    # holds D on another thread. stop() releases both to P (P frees them now, not at its lease)
    # and returns only once nothing of D runs: the waiter has returned and a later call says
    # the worker is stopped.
    bootstrap, p, d, p_kv, d_kv, src = make_pair(lease_s=30.0)
    try:
        for xfer in ("xfer-1", "xfer-2"):
            p.admit(xfer, 1)
            p.prefill_done(xfer, [1, 2])
            d.on_new_request("req-" + xfer, src(xfer))
        waiter_done = threading.Event()

        def waiter():
            d.wait_finished(30.0)
            waiter_done.set()

        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.2)  # the waiter holds the worker
        started = time.monotonic()
        d.stop()
        stopped_in = time.monotonic() - started
        assert waiter_done.is_set(), "stop() returned while a wait still held the decoder"
        thread.join(5)
        with pytest.raises(native.KvferryError) as error:
            d.take_finished()
        assert error.value.code == "CANCELLED"
        assert stopped_in < 5.0
        deadline = time.monotonic() + 5
        freed = []
        while time.monotonic() < deadline and len(freed) < 2:
            freed += [e for e in p.take_events() if e[0] == "free"]
            time.sleep(0.01)
        assert sorted((e[1], e[2]) for e in freed) == [("xfer-1", "released_by_decoder"),
                                                        ("xfer-2", "released_by_decoder")], freed
    finally:
        stop(d, p, bootstrap)


def test_a_prefill_done_with_another_requests_handle_is_refused():
    bootstrap, p, d, p_kv, d_kv, src = make_pair()
    try:
        p.admit("xfer-1", 1)
        with pytest.raises(native.KvferryError) as error:
            p.prefill_done("xfer-1", [0, 1], handle=2)
        assert error.value.code == "ALREADY_EXISTS"
        p.prefill_done("xfer-1", [0, 1], handle=1)
    finally:
        stop(d, p, bootstrap)


def test_requests_finished_before_their_prefill_leave_nothing_behind():
    bootstrap, p, d, p_kv, d_kv, src = make_pair()
    try:
        for i in range(2000):
            p.admit(f"x{i}", i + 1)
            p.engine_finished(f"x{i}")
        deadline = time.monotonic() + 5
        while p.stats()["admitted_transfers"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = p.stats()
        assert stats["admitted_transfers"] == 0, stats
        assert stats["held_transfers"] == 0, stats
    finally:
        stop(d, p, bootstrap)


def test_a_p_restarted_on_a_new_side_channel_gets_the_load_whose_pull_never_left():
    # The engine-adapter issue's hole 9 through the binding: P restarts (same engine id and
    # bootstrap, a new incarnation on a new side-channel port). The pull of a load D begins
    # before it knows never leaves (nothing listens at the old address; nothing can be
    # writing), so D looks the engine up again and sends the load to the new process, which
    # serves it; later loads go there at once.
    bootstrap, p, d, p_kv, d_kv, src = make_pair(lease_s=0)
    engine_id = src("x")["engine_id"]
    p2 = None
    try:
        p.admit("xfer-1", 1)
        p.prefill_done("xfer-1", [0])
        d.start_load("req-1", src("xfer-1"), [1])
        assert receive(d, "req-1")[1]
        p.stop()
        p2 = native.PrefillWorker(engine_id=engine_id, block_len=BLOCK_LEN, num_blocks=NUM_BLOCKS,
                                  planes=planes(p_kv), lease_s=0, abort_request_timeout_s=30.0,
                                  bootstrap_address=f"127.0.0.1:{bootstrap.port}",
                                  incarnation=uuid.uuid4().hex)
        p2.admit("xfer-2", 2)
        p2.prefill_done("xfer-2", [4])
        d.start_load("req-2", src("xfer-2"), [2])
        request, ok, error, quarantined = receive(d, "req-2")
        assert ok, error
        assert d.stats()["loads_retried"] == 1
        for layer in range(LAYERS):
            assert torch.equal(d_kv[layer][:, 2], p_kv[layer][:, 4]), f"layer {layer}"
        p2.admit("xfer-3", 3)
        p2.prefill_done("xfer-3", [5])
        d.start_load("req-3", src("xfer-3"), [6])
        request, ok, error, quarantined = receive(d, "req-3")
        assert ok, error
        for layer in range(LAYERS):
            assert torch.equal(d_kv[layer][:, 6], p_kv[layer][:, 5]), f"layer {layer}"
    finally:
        stop(*(w for w in (d, p2, p, bootstrap) if w is not None))


def _register(port, engine_id, incarnation, side_channel, dp_rank=0):
    import json
    import urllib.error
    import urllib.request

    body = {"engine_id": engine_id, "dp_rank": dp_rank, "tp_rank": 0, "pp_rank": 0, "tp_size": 1,
            "pp_size": 1, "side_channel": side_channel, "data_plane": "",
            "kv_lease_duration": 0, "protocol_version": 1, "incarnation": incarnation}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/register",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_bootstrap_that_p_embeds_refuses_another_incarnation_of_ps_engine():
    # The engine-adapter issue's hole 1: P's bootstrap in the binding (what the connector runs in
    # vLLM) now knows the engine it serves; one POST /register cannot take P's traffic over.
    with pytest.raises(native.KvferryError, match="go together"):
        native.BootstrapServer(port=0, engine_id="p")
    bootstrap = native.BootstrapServer(port=0, engine_id="p-owned", incarnation="real")
    try:
        status, body = _register(bootstrap.port, "p-owned", "real", "tcp://127.0.0.1:5000")
        assert status == 200, body
        status, body = _register(bootstrap.port, "p-owned", "intruder", "tcp://10.6.6.6:6666")
        assert status == 409, body
        assert "incarnation" in body
        status, body = _register(bootstrap.port, "someone-else", "x", "tcp://127.0.0.1:5001",
                                 dp_rank=1)
        assert status == 200, "other engines may still register (a shared bootstrap)"
    finally:
        bootstrap.stop()


def test_a_decoder_survives_two_thousand_p_addresses_with_bounded_side_channels():
    # The engine-adapter issue's hole 2: D kept a socket for every P side-channel address it
    # ever reached, and died (EMFILE thrown in its I/O thread) at the 1,024th; every P restart
    # binds a new port. 2,000 engines, each at its own address where nothing listens: every
    # load fails unsent, D lives, and it keeps at most 256 idle side channels open.
    bootstraps = [native.BootstrapServer(port=0) for _ in range(2)]
    real_bootstrap, p, d, p_kv, d_kv, src = make_pair(lease_s=0)
    try:
        engines = []
        for b, bootstrap in enumerate(bootstraps):
            for i in range(1000):
                engine = f"gone-{b}-{i}"
                # Port 9 of an address of its own: nothing listens there (an ephemeral port
                # of 127.0.0.1 might be this test's own P).
                address = f"tcp://127.{1 + b}.{i // 250}.{1 + i % 250}:9"
                status, body = _register(bootstrap.port, engine, "i", address, dp_rank=i)
                assert status == 200, body
                engines.append((engine, bootstrap.port))
        for n, (engine, port) in enumerate(engines):
            d.start_load(f"req-{n}", {"transfer_id": f"x-{n}", "engine_id": engine,
                                      "bootstrap_address": f"127.0.0.1:{port}"}, [n % NUM_BLOCKS])
        failed = set()
        deadline = time.monotonic() + 60
        while len(failed) < len(engines) and time.monotonic() < deadline:
            for request, ok, error, quarantined in d.wait_finished(0.5)["loaded"]:
                assert not ok and not quarantined, (request, error)
                failed.add(request)
        assert len(failed) == len(engines), f"{len(failed)} of {len(engines)} loads ended"
        d.wait_finished(0.2)  # the I/O thread closes what went idle
        stats = d.stats()
        assert stats["endpoints"] <= 256, stats
        assert stats["endpoints_closed"] >= len(engines) - 256, stats
        # And the decoder still works.
        p.admit("xfer-ok", 1)
        p.prefill_done("xfer-ok", [2])
        d.start_load("req-ok", src("xfer-ok"), [3])
        assert receive(d, "req-ok")[1]
    finally:
        stop(d, p, real_bootstrap, *bootstraps)


def test_the_load_failure_service_answers_a_recorded_reason_over_http():
    import json
    import urllib.error
    import urllib.request

    service = native.LoadFailureService(port=0)
    try:
        service.record("xfer-1", "TOMBSTONED: released on P")
        assert service.find("xfer-1") == "TOMBSTONED: released on P"
        url = f"http://127.0.0.1:{service.port}/load_failure?transfer_id=xfer-1"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert json.loads(response.read())["reason"] == "TOMBSTONED: released on P"
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(url.replace("xfer-1", "xfer-2"), timeout=5)
        assert missing.value.code == 404
    finally:
        service.stop()
