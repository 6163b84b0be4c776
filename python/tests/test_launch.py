"""kvferry.vllm.launch.free_port: the ports the launcher's users hand to engines and proxies
minutes before those bind them. Needs no vLLM (launch.py imports nothing from it)."""

import random
import socket

from standalone import load_kvferry_vllm_module

launch = load_kvferry_vllm_module("launch")


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    low = launch._ephemeral_low()
    ports = [launch.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports), (low, min(ports), max(ports))


def test_a_port_someone_listens_on_is_skipped(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    free = launch.free_port()  # a port nothing listens on, to be drawn second
    launch._HANDED_OUT.discard(free)
    draws = iter([busy, free])
    monkeypatch.setattr(random, "randrange", lambda lo, hi: next(draws))
    try:
        assert launch.free_port() == free
    finally:
        taken.close()
