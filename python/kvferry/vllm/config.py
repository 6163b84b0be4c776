"""kvferry's settings in vLLM's ``--kv-transfer-config``, parsed with the same names and bounds as
``kvferry serve`` (src/harness/serve_config.cc), so that a MooncakeConnector user switches by
changing ``kv_connector`` and ``kv_connector_module_path`` only. The two parsers are held to
one set of cases for the keys both read (tests/data/kv_connector_extra_config_cases.json, run
by the C++ and the Python tests alike).

Keys of ``kv_connector_extra_config``:

``kv_lease_duration``
    Seconds, 0 or absent = off (today's behaviour). With it, D renews every request it has seen
    and P frees KV whose renewals stopped after one lease. Set the same value on P and D.
``abort_request_timeout``
    Seconds, default 480. When absent: env ``KVFERRY_ABORT_REQUEST_TIMEOUT``, then
    ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` (MooncakeConnector's name for it), then 480.
``bootstrap_port``
    The port of P's bootstrap service, 0..65535 (0: pick a free one). When absent:
    ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (MooncakeConnector's only way to set it), then 8998.
``bootstrap_server_address``
    ``host:port`` of a bootstrap service running elsewhere; P registers there instead of
    starting its own (MooncakeConnector's key).
``kv_release``
    D releases a transfer to P the moment its request no longer needs it; default true.
``fence_writes``
    D's data plane fences its writers (no one-sided puts into D; every pull carries a write key
    D can revoke), so D releases the blocks of a P that died or went silent mid-pull without
    waiting for its answer; default false (the put path stays available).
``load_failure_port``
    D: the port of its load-failure service (0: any free one; absent: none), where a router
    asks why a request's KV load failed (``GET /load_failure?transfer_id=ID``): vLLM answers
    such a request with a bare "Internal server error". ``kvferry proxy --decode URL PORT``
    passes the reason to the client.
``kv_staging``
    ``"auto"`` (default), ``"host"`` or ``"off"``: whether the worker moves KV through host
    staging (staging.py) instead of registering the KV cache itself. ``auto`` stages a cache
    that is not in host memory (a GPU's); ``host`` stages any cache (a host cache too: how the
    tests run the staging path without a GPU); ``off`` registers the cache as it is: a GPU's
    cache GPU-direct, which needs kvferry's module built against a UCX with CUDA on a machine
    whose driver it loads (the libucx wheels), and no ``fence_writes``; otherwise the worker's
    start fails with the reason (docs/vllm.md).
``kv_staging_blocks``
    Staging slots per KV-cache group, 1..16777216; default: as many as the KV cache has blocks
    (a request that needs more than this is refused, one that finds too few free waits). Host
    memory: this many blocks of every registered layer.
``cluster_secret_file``
    A file (mode 0600, 32..4096 bytes) holding the cluster secret: signed bootstrap traffic and a
    CURVE side channel (docs/security.md), as ``kvferry serve`` takes it. Absent: an open cluster.

This module imports nothing from vLLM, so the parsing is testable anywhere.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Durations are seconds; anything above a day is a typo, not a lease (as in serve_config.cc).
MAX_SECONDS = 86400.0
DEFAULT_ABORT_REQUEST_TIMEOUT = 480.0
DEFAULT_BOOTSTRAP_PORT = 8998
STAGING_MODES = ("auto", "host", "off")
MAX_STAGING_BLOCKS = 1 << 24

KNOWN_KEYS = frozenset(
    {
        "kv_lease_duration",
        "abort_request_timeout",
        "bootstrap_port",
        "bootstrap_server_address",
        "kv_release",
        "fence_writes",
        "cluster_secret_file",
        "load_failure_port",
        "kv_staging",
        "kv_staging_blocks",
    }
)


class ConfigError(ValueError):
    """A kvferry key of kv_connector_extra_config (or its environment fallback) is invalid."""


@dataclass(frozen=True)
class ConnectorSettings:
    kv_lease_duration: float  # seconds; 0.0 = no lease
    abort_request_timeout: float  # seconds, > 0
    bootstrap_port: int
    bootstrap_server_address: str | None
    kv_release: bool
    cluster_secret_file: str | None = None
    fence_writes: bool = False
    load_failure_port: int | None = None
    kv_staging: str = "auto"  # one of STAGING_MODES
    kv_staging_blocks: int | None = None  # None: the KV cache's number of blocks
    ignored_keys: tuple[str, ...] = ()  # extra-config keys kvferry does not know (logged)

    @property
    def lease_enabled(self) -> bool:
        return self.kv_lease_duration > 0


def _seconds(value: Any, key: str, *, allow_zero: bool) -> float:
    # bool is an int in Python; JSON true is not a number of seconds.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number of seconds, not {value!r}")
    seconds = float(value)
    if (
        not math.isfinite(seconds)
        or seconds < 0
        or (seconds == 0 and not allow_zero)
        or seconds > MAX_SECONDS
    ):
        low = "[0" if allow_zero else "(0"
        raise ConfigError(f"{key} = {value!r} is out of range {low}, {MAX_SECONDS:g}] s")
    return seconds


def _env_seconds(env: Mapping[str, str], name: str) -> float | None:
    text = env.get(name, "")
    if text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number") from None
    return _seconds(value, name, allow_zero=False)


def _port(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(f"{key} must be an integer 0..65535, not {value!r}")
    return value


def parse_settings(
    extra_config: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> ConnectorSettings:
    """Reads kvferry's keys of ``kv_connector_extra_config``; raises ConfigError on a bad one."""
    extra = dict(extra_config or {})
    env = os.environ if env is None else env

    lease = 0.0
    if "kv_lease_duration" in extra:
        lease = _seconds(extra["kv_lease_duration"], "kv_lease_duration", allow_zero=True)

    if "abort_request_timeout" in extra:
        timeout = _seconds(
            extra["abort_request_timeout"], "abort_request_timeout", allow_zero=False
        )
    else:
        timeout = (
            _env_seconds(env, "KVFERRY_ABORT_REQUEST_TIMEOUT")
            or _env_seconds(env, "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT")
            or DEFAULT_ABORT_REQUEST_TIMEOUT
        )

    if "bootstrap_port" in extra:
        port = _port(extra["bootstrap_port"], "bootstrap_port")
    elif env.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", "") != "":
        text = env["VLLM_MOONCAKE_BOOTSTRAP_PORT"]
        try:
            port = _port(int(text), "VLLM_MOONCAKE_BOOTSTRAP_PORT")
        except ValueError:
            raise ConfigError(
                f"VLLM_MOONCAKE_BOOTSTRAP_PORT={text!r} is not an integer 0..65535"
            ) from None
    else:
        port = DEFAULT_BOOTSTRAP_PORT

    address = extra.get("bootstrap_server_address")
    if "bootstrap_server_address" in extra:
        if not isinstance(address, str) or not 0 < len(address) <= 256:
            raise ConfigError(
                f"bootstrap_server_address must be a 'host:port' string, not {address!r}"
            )
        host, sep, addr_port = address.removeprefix("http://").rpartition(":")
        if not sep or not host or not addr_port.isdigit() or not 0 < int(addr_port) <= 65535:
            raise ConfigError(f"bootstrap_server_address {address!r} is not 'host:port'")

    release = extra.get("kv_release", True)
    if not isinstance(release, bool):
        raise ConfigError(f"kv_release must be true or false, not {release!r}")

    fence = extra.get("fence_writes", False)
    if not isinstance(fence, bool):
        raise ConfigError(f"fence_writes must be true or false, not {fence!r}")

    failure_port = None
    if "load_failure_port" in extra:
        failure_port = _port(extra["load_failure_port"], "load_failure_port")

    secret = extra.get("cluster_secret_file")
    if "cluster_secret_file" in extra and (
        not isinstance(secret, str) or not 0 < len(secret) <= 4096
    ):
        raise ConfigError(f"cluster_secret_file must be a path, not {secret!r}")

    staging = extra.get("kv_staging", "auto")
    if staging not in STAGING_MODES:
        raise ConfigError(f"kv_staging must be one of {', '.join(STAGING_MODES)}, not {staging!r}")

    staging_blocks = extra.get("kv_staging_blocks")
    if "kv_staging_blocks" in extra and (
        isinstance(staging_blocks, bool)
        or not isinstance(staging_blocks, int)
        or not 1 <= staging_blocks <= MAX_STAGING_BLOCKS
    ):
        raise ConfigError(
            f"kv_staging_blocks must be an integer 1..{MAX_STAGING_BLOCKS}, not {staging_blocks!r}"
        )

    return ConnectorSettings(
        kv_staging=staging,
        kv_staging_blocks=staging_blocks,
        cluster_secret_file=secret,
        kv_lease_duration=lease,
        abort_request_timeout=timeout,
        bootstrap_port=port,
        bootstrap_server_address=address,
        kv_release=release,
        fence_writes=fence,
        load_failure_port=failure_port,
        ignored_keys=tuple(sorted(k for k in extra if k not in KNOWN_KEYS)),
    )
