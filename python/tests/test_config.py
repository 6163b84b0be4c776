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
def test_reads_every_case_of_the_parsers_case_file(case):
    # The C++ parser's own cases (connector_config_test.cc runs them on it): here through the
    # binding and ConnectorSettings, so that no key is lost or misread on the way to Python.
    if case.get("error"):
        with pytest.raises(config.ConfigError, match=next(iter(case["extra"]))):
            config.parse_settings(case["extra"], env={})
        return
    s = config.parse_settings(case["extra"], env={})
    for key, want in case["want"].items():
        if key in config.CONNECTOR_IGNORES_KEYS:
            assert key in s.ignored_keys  # checked, then ignored: the connector has no etcd
            continue
        if key == "ignored_keys":
            want = tuple(want)
        if key == "fence_writes" and want is None:
            want = False  # unset: the connector does not fence (kvferry serve lets etcd decide)
        assert getattr(s, key) == want, key


def test_a_value_json_cannot_hold_is_refused_naming_its_key():
    with pytest.raises(config.ConfigError, match="kv_lease_duration"):
        config.parse_settings({"kv_lease_duration": math.nan}, env={})
    with pytest.raises(config.ConfigError, match="not JSON-representable"):
        config.parse_settings({"kv_staging": object()}, env={})
    with pytest.raises(config.ConfigError, match="nests deeper"):
        deep = 1
        for _ in range(100):
            deep = [deep]
        config.parse_settings({"kv_lease_duration": deep}, env={})


def test_only_the_fallback_variables_reach_the_parser():
    # The whole environment is not copied into C++ on every parse; an unrelated bad variable
    # changes nothing.
    s = config.parse_settings({}, env={"KVFERRY_LEASE": "x", "VLLM_MOONCAKE_BOOTSTRAP_PORT": "9"})
    assert s.bootstrap_port == 9
