"""kvferry's kv_connector_extra_config keys: names and bounds as kvferry serve reads them.
Needs no vLLM (kvferry.vllm.config imports nothing from it)."""

import json
import math
from pathlib import Path

import pytest

from standalone import load_kvferry_vllm_module

config = load_kvferry_vllm_module("config")


def test_defaults_are_mooncakes():
    s = config.parse_settings({}, env={})
    assert s.kv_lease_duration == 0.0 and not s.lease_enabled
    assert s.abort_request_timeout == 480.0
    assert s.bootstrap_port == 8998
    assert s.bootstrap_server_address is None
    assert s.kv_release is True
    assert s.fence_writes is False


def test_values_are_read():
    s = config.parse_settings(
        {
            "kv_lease_duration": 2.5,
            "abort_request_timeout": 20,
            "bootstrap_port": 9000,
            "bootstrap_server_address": "10.0.0.1:8998",
            "kv_release": False,
            "fence_writes": True,
            "num_workers": 10,  # a MooncakeConnector key kvferry does not use
        },
        env={},
    )
    assert (s.kv_lease_duration, s.abort_request_timeout, s.bootstrap_port) == (2.5, 20.0, 9000)
    assert s.bootstrap_server_address == "10.0.0.1:8998"
    assert s.kv_release is False
    assert s.fence_writes is True
    assert s.ignored_keys == ("num_workers",)


@pytest.mark.parametrize("bad", [-1, -0.5, "30", True, None, [30], math.nan, math.inf, 86401])
def test_lease_out_of_bounds_or_not_a_number_is_an_error(bad):
    with pytest.raises(config.ConfigError, match="kv_lease_duration"):
        config.parse_settings({"kv_lease_duration": bad}, env={})


def test_lease_zero_is_off_and_a_day_is_the_limit():
    assert not config.parse_settings({"kv_lease_duration": 0}, env={}).lease_enabled
    assert config.parse_settings({"kv_lease_duration": 86400}, env={}).kv_lease_duration == 86400


@pytest.mark.parametrize("bad", [0, -5, "480", False, None, 1e9])
def test_abort_request_timeout_must_be_positive_seconds(bad):
    with pytest.raises(config.ConfigError, match="abort_request_timeout"):
        config.parse_settings({"abort_request_timeout": bad}, env={})


def test_abort_request_timeout_from_the_environment():
    env = {"KVFERRY_ABORT_REQUEST_TIMEOUT": "30", "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "40"}
    assert config.parse_settings({}, env=env).abort_request_timeout == 30
    env = {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "40"}
    assert config.parse_settings({}, env=env).abort_request_timeout == 40
    # The JSON wins over the environment.
    assert config.parse_settings({"abort_request_timeout": 5}, env=env).abort_request_timeout == 5
    with pytest.raises(config.ConfigError, match="KVFERRY_ABORT_REQUEST_TIMEOUT"):
        config.parse_settings({}, env={"KVFERRY_ABORT_REQUEST_TIMEOUT": "soon"})
    with pytest.raises(config.ConfigError, match="VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"):
        config.parse_settings({}, env={"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "-3"})


def test_bootstrap_port_key_then_mooncakes_environment():
    assert config.parse_settings({}, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "9100"}).bootstrap_port == 9100
    assert (
        config.parse_settings(
            {"bootstrap_port": 0}, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "9100"}
        ).bootstrap_port
        == 0
    )
    for bad in (-1, 65536, "8998", 1.5, True):
        with pytest.raises(config.ConfigError, match="bootstrap_port"):
            config.parse_settings({"bootstrap_port": bad}, env={})
    with pytest.raises(config.ConfigError, match="VLLM_MOONCAKE_BOOTSTRAP_PORT"):
        config.parse_settings({}, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "x"})


@pytest.mark.parametrize("bad", ["", "host", "host:", ":8998", "host:99999", 8998, None])
def test_bootstrap_server_address_must_be_host_port(bad):
    with pytest.raises(config.ConfigError, match="bootstrap_server_address"):
        config.parse_settings({"bootstrap_server_address": bad}, env={})


def test_kv_release_must_be_a_boolean():
    with pytest.raises(config.ConfigError, match="kv_release"):
        config.parse_settings({"kv_release": "yes"}, env={})


def test_fence_writes_must_be_a_boolean():
    with pytest.raises(config.ConfigError, match="fence_writes"):
        config.parse_settings({"fence_writes": 1}, env={})


def test_load_failure_port_is_off_unless_given_and_must_be_a_port():
    assert config.parse_settings({}, env={}).load_failure_port is None
    assert config.parse_settings({"load_failure_port": 0}, env={}).load_failure_port == 0
    assert config.parse_settings({"load_failure_port": 8999}, env={}).load_failure_port == 8999
    for bad in (-1, 65536, "8999", True, 1.5):
        with pytest.raises(config.ConfigError, match="load_failure_port"):
            config.parse_settings({"load_failure_port": bad}, env={})


def test_staging_is_auto_unless_set_and_its_budget_is_bounded():
    settings = config.parse_settings({}, env={})
    assert (settings.kv_staging, settings.kv_staging_blocks) == ("auto", None)
    for mode in ("auto", "host", "off"):
        assert config.parse_settings({"kv_staging": mode}, env={}).kv_staging == mode
    for bad in ("cuda", "", True, None, 1):
        with pytest.raises(config.ConfigError, match="kv_staging must be one of"):
            config.parse_settings({"kv_staging": bad}, env={})
    assert config.parse_settings({"kv_staging_blocks": 1}, env={}).kv_staging_blocks == 1
    assert config.parse_settings({"kv_staging_blocks": 1 << 24}, env={}).kv_staging_blocks == 1 << 24
    for bad in (0, -3, (1 << 24) + 1, 2.0, "64", True):
        with pytest.raises(config.ConfigError, match="kv_staging_blocks"):
            config.parse_settings({"kv_staging_blocks": bad}, env={})
    assert config.parse_settings({"kv_staging": "host"}, env={}).ignored_keys == ()


CASES = json.loads(
    (Path(__file__).resolve().parents[2] / "tests/data/kv_connector_extra_config_cases.json")
    .read_text()
)["cases"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: json.dumps(c["extra"]))
def test_agrees_with_kvferry_serve_on_every_shared_case(case):
    # The same cases as harness_unit_test.cc's KvTransferConfig test: the keys both parsers
    # read are accepted, refused and read alike.
    if case.get("error"):
        with pytest.raises(config.ConfigError):
            config.parse_settings(case["extra"], env={})
        return
    s = config.parse_settings(case["extra"], env={})
    for key, want in case["want"].items():
        got = getattr(s, key)
        if key == "cluster_secret_file" and got is None:
            got = ""  # absent: kvferry serve's empty path
        assert got == want, key
