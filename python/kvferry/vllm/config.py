"""kvferry's settings in vLLM's ``--kv-transfer-config``, with MooncakeConnector's names, so that a
MooncakeConnector user switches by changing ``kv_connector`` and ``kv_connector_module_path``
only. They are parsed by the one parser ``kvferry serve`` uses too
(src/runtime/connector_config.cc, through ``kvferry._native.parse_connector_config``): a key
cannot be read one way here and another there. tests/data/kv_connector_extra_config_cases.json
holds the parser's cases; the C++ tests run them on the parser, test_config.py through this module.

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
``layer_writes``
    P: in the step that completes a prompt, each layer's KV leaves for a decoder whose pull
    already waits as soon as that layer is computed (vLLM's ``save_kv_layer``), so only the last
    layers are left to move when the prefill ends; default false. Only for a KV cache registered
    as it is in host memory: a staged or GPU cache moves after the prefill, as with false. Host
    KV means a CPU engine, whose forward pass the writes then compete with for the cores: on 2
    cores it made time-to-first-token worse (docs/performance.md), hence off by default.
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
``etcd_endpoints``, ``etcd_prefix``, ``etcd_lease_ttl``
    ``kvferry serve``'s etcd registry: checked, then ignored (logged) by the connector, which
    finds P through its bootstrap service only.

This module imports nothing from vLLM, so the parsing is testable anywhere; it needs
``kvferry._native``, which the worker half needs anyway.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STAGING_MODES = ("auto", "host", "off")

# Keys the parser knows that the connector does not act on (reported in ignored_keys).
CONNECTOR_IGNORES_KEYS = ("etcd_endpoints", "etcd_prefix", "etcd_lease_ttl")

# The environment variables the parser falls back on (connector_config.h).
ENVIRONMENT_FALLBACKS = (
    "KVFERRY_ABORT_REQUEST_TIMEOUT",
    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT",
    "VLLM_MOONCAKE_BOOTSTRAP_PORT",
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
    layer_writes: bool = False
    load_failure_port: int | None = None
    kv_staging: str = "auto"  # one of STAGING_MODES
    kv_staging_blocks: int | None = None  # None: the KV cache's number of blocks
    # Extra-config keys kvferry does not know, and CONNECTOR_IGNORES_KEYS given (logged).
    ignored_keys: tuple[str, ...] = ()

    @property
    def lease_enabled(self) -> bool:
        return self.kv_lease_duration > 0


def _native_module():
    try:
        import kvferry._native as native
    except ImportError as e:
        raise ImportError(
            "kvferry's native module kvferry._native is not available, so kvferry's connector "
            f"config cannot be read ({e}); build it with the CMake option KVFERRY_PYTHON=ON or "
            "install the kvferry wheel"
        ) from e
    return native


def parse_settings(
    extra_config: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> ConnectorSettings:
    """Reads kvferry's keys of ``kv_connector_extra_config``; raises ConfigError on a bad one."""
    env = os.environ if env is None else env
    extra = dict(extra_config or {})
    for key, value in extra.items():
        # NaN and infinity have no JSON spelling; they are out of range for every key.
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} = {value!r} is out of range")
    try:
        text = json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"kv_connector_extra_config is not JSON-representable: {e}") from None
    native = _native_module()
    try:
        parsed = native.parse_connector_config(
            text,
            {name: env[name] for name in ENVIRONMENT_FALLBACKS if name in env},
            list(CONNECTOR_IGNORES_KEYS),
        )
    except native.KvferryError as e:
        raise ConfigError(str(e)) from None
    return ConnectorSettings(
        kv_lease_duration=parsed["kv_lease_duration"],
        abort_request_timeout=parsed["abort_request_timeout"],
        bootstrap_port=parsed["bootstrap_port"],
        bootstrap_server_address=parsed["bootstrap_server_address"],
        kv_release=parsed["kv_release"],
        cluster_secret_file=parsed["cluster_secret_file"],
        # The connector has no etcd, where kvferry serve turns fencing on by default.
        fence_writes=bool(parsed["fence_writes"]),
        layer_writes=parsed["layer_writes"],
        load_failure_port=parsed["load_failure_port"],
        kv_staging=parsed["kv_staging"],
        kv_staging_blocks=parsed["kv_staging_blocks"],
        ignored_keys=tuple(parsed["ignored_keys"]),
    )
