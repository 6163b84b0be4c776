"""kvferry beside vLLM's own MooncakeConnector and NixlConnector, through real ``vllm serve``
engines: the same vLLM build (0.32.0, CPU), the same tiny model, the same engine flags and load
for each; the seed experiments A, B and E (SPEC §8) time-scaled to run on 2 cores.

    PYTHONPATH=python:build/python .venv/bin/python python/bench/bench_vllm_connectors.py
        [--connectors kvferry,mooncake,nixl] [--out out/vllm] [--extra-path DIR]
        [--lease 10] [--mooncake-timeout 60] [--mooncake-timeout-b 10] [--cases ident,ttft,E,B,A]

About 11 minutes on 2 cores (most of it engine starts and Mooncake's 60 s timeout, twice).
Prints a table per case beside the seed's figures and writes ``OUT/results.json``,
``OUT/case_{a,b,e}.csv`` (P's KV usage over time, one column per connector), ``OUT/events.gp``
and, with gnuplot, ``OUT/case_{a,b,e}.png`` (``scripts/plot_vllm_connectors.gp``). Engine logs go
to a new directory under ``/tmp/bench-runs`` (printed), which also holds every engine's
VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR and TMPDIR.

What each connector needs beyond the vLLM in ``.venv`` (``python/requirements.txt``) is pinned in
``python/requirements-bench.txt`` (MooncakeConnector: ``mooncake-transfer-engine-non-cuda`` and
``msgpack``; NixlConnector: ``nixl`` and ``nixl-cu12``); ``scripts/install-python.sh --bench`` puts
them in ``.venv``. ``--extra-path DIR`` (default ``$KVFERRY_BENCH_EXTRA_PATH``) adds a directory
made with ``pip install --no-deps --target DIR`` to the engines' PYTHONPATH instead.

A connector whose packages do not import is skipped with the reason. MooncakeConnector also gets
``python/bench/cpu_shim`` on its PYTHONPATH: a ``sitecustomize`` that answers the one call of its
worker that CPU torch cannot (``torch.accelerator.current_device_index()``), a bench setup shim
(see the file); nothing in vLLM is edited.

The setups (every engine: ``--dtype float32 --max-model-len 512 --enforce-eager --block-size 32``;
P ``--num-gpu-blocks-override 248``; D ``--num-gpu-blocks-override 17 --max-num-seqs 1``, so that D
runs one request at a time, pulls at most one ahead, and the rest queue on D with their KV held on
P; the plain reference instance as P):

* kvferry: KvferryConnector, ``kv_lease_duration`` = --lease on P and D, ``abort_request_timeout``
  = --mooncake-timeout, UCX over tcp (Mooncake's transport here);
* mooncake: MooncakeConnector over tcp, ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` = --mooncake-timeout
  (cases ident, TTFT, E, A); for case B a second pair with --mooncake-timeout-b (the seed's B sets
  the timeout equal to the lease);
* nixl: NixlConnector (``kv_role`` kv_both, ``kv_buffer_device`` cpu, UCX as NIXL sets it up),
  ``kv_lease_duration`` = --lease.

Every request goes through this file's proxy (``proxy`` subcommand, aiohttp), the same code for
all: kvferry and Mooncake take vLLM's Mooncake flow (P and D get the request at once, P's half
fire-and-forget, D's streamed back), NIXL takes its sequential flow (P with ``max_tokens`` 1 and
``do_remote_decode``, then D with the ``kv_transfer_params`` P returned), the plain instance a
plain forward. One proxy for all keeps the proxy's own cost out of the comparison; the flows differ
because the connectors need them to. The proxy timestamps each request (P's answer, D's first
byte) and serves them at ``GET /bench/requests``.

The cases (times in seconds; the seed's full-scale figures beside them in the printed tables):

* ident: greedy outputs through P and D equal the plain instance's, token for token, streamed and
  not (prompts of 1..400 tokens);
* ttft: one request at a time, streamed: client TTFT through the proxy; P's time (proxy: request
  in -> P's answer); handoff (proxy: P's answer -> D's first byte: D's scheduling, the KV transfer
  and D's first decode step; in Mooncake's flow D started waiting before P answered);
* E: 10 requests (288-token prompts, 224 tokens out); once P answered all of them (their KV held
  on P) and D runs one, 30% of the clients (3, chosen at random among those queued on D: P
  answered, D sent no token yet) close their connections; P's KV over time from its
  ``vllm:kv_cache_usage_perc`` every 0.5 s, until it is 0 after the last live request (or the
  lease/timeout + 15 s);
* B: 16 such requests at once; D serves one at a time, so the last waits on D several times the
  lease; successes and failures per connector;
* A: 32 such requests (27 fit in P's KV); once P's KV is >= 93% used and at most 2 requests still
  queue on P itself, D is SIGKILLed (its whole process group); a plain 480-token probe straight to
  P every 2.5 s with its latency (it does not fit beside 26 held requests); P's KV until it is free (or lease/timeout + 15 s). The requests
  still queued on P are prefilled once the first wave is freed, for a D that is gone: a second,
  smaller wave held for one more lease/timeout, as in the seed's run.

Beside each case: the longest stall of the bench's own event loop and the CPU's busy/steal shares
(a 2-core machine shared with other work stalls now and then), and the log lines that tell how
P's KV was freed (NIXL's "Releasing expired KV blocks", Mooncake's "timed out ... Freeing its
blocks", kvferry's D told "expired on P before it was pulled").
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
sys.path[:0] = [str(REPO / "python"), str(REPO / "python" / "tests")]
if (REPO / "build" / "python").is_dir():  # kvferry._native of a source build
    sys.path.insert(1, str(REPO / "build" / "python"))

from kvferry.vllm.launch import (  # noqa: E402
    Child,
    LaunchError,
    VllmEngine,
    free_port,
    kvferry_transfer_config,
    metric,
    parse_metrics,
)

CPU_SHIM = HERE.parent / "cpu_shim"
ENGINE_ARGS = ("--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
               "--block-size", "32")
P_BLOCKS = 248  # 27 requests of 9 blocks, and 5 blocks more
P_ARGS = ("--num-gpu-blocks-override", str(P_BLOCKS))
D_ARGS = ("--num-gpu-blocks-override", "17", "--max-num-seqs", "1")
START_TIMEOUT_S = 600.0  # an engine start on 2 cores shared with other work: 30-300 s
SAMPLE_S = 0.5

# The loads (tokens). A request of the cases: a 288-token prompt (9 blocks of 32) and 224 tokens
# out (16 blocks in all, the model's 512): D holds one running request and has no room to pull
# another ahead (its 17 blocks), so the rest queue on D with their KV held on P (27 fit in P's 248
# blocks). D takes ~2 s a request on a quiet machine, so 16 of them make the last wait ~3 leases.
PROMPT = 288
OUTPUT = 224
PROMPT_BLOCKS = -(-PROMPT // 32)
E_REQUESTS, E_CANCEL_SHARE = 10, 0.3
B_REQUESTS = 16
A_REQUESTS = 32
A_QUEUED_ON_P = 2  # D is killed once at most this many still queue on P (see case_a)
A_FULL = 0.93  # ... and P's KV is at least this full: 26 or 27 held requests, no room for a probe
# A probe (480 tokens: 15 blocks) does not fit beside 26 or 27 held requests (14 or 5 blocks free).
PROBE_PROMPT, PROBE_EVERY_S = 480, 2.5
IDENT_LENGTHS = (1, 32, 33, 100, 400)
TTFT_LENGTHS = (64, 128, 256, 448) * 2

SEED = {
    "A": "P TP1/D TP1, 128 req x 3,000-token prompts x 1,000 out = 2.4x D's KV; D killed at "
         "t~23 s. 480 s timeout: P's KV at 99% until t~484 s, a probe waits 475 s. 30 s lease: "
         "P's KV < 5% at t~103 s (80 s after the kill), that probe 61 s, later probes 36-46 ms.",
    "B": "requests wait on D up to ~80 s; 20 s timeout: 79/128 fail; 20 s lease: 128/128 succeed.",
    "E": "simulator, full scale (docs/simulation.md): 30% of clients cancel on D; the timeout "
         "holds their KV 480 s, a 30 s lease up to 30 s, the lease + D's release frees it at once.",
}


def now() -> float:
    return time.time()


# ---------------------------------------------------------------------------------------------
# The proxy (a subprocess: `bench_vllm_connectors.py proxy ...`)
# ---------------------------------------------------------------------------------------------


def run_proxy(argv: list[str]) -> int:
    import aiohttp
    from aiohttp import web

    parser = argparse.ArgumentParser(prog="bench_vllm_connectors.py proxy")
    parser.add_argument("--mode", choices=("concurrent", "sequential", "direct"), required=True)
    parser.add_argument("--port-file", required=True,
                        help="where to write the port it listens on (it binds a free one)")
    parser.add_argument("--prefill", help="P's URL (concurrent, sequential)")
    parser.add_argument("--bootstrap-port", type=int, help="P's bootstrap (concurrent)")
    parser.add_argument("--decode", required=True, help="D's URL (or the plain instance's)")
    args = parser.parse_args(argv)

    records: dict[str, dict[str, Any]] = {}
    state: dict[str, Any] = {"engine_id": None, "background": set()}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)

    async def learn_engine_id(app: web.Application) -> None:
        # P's engine id from its bootstrap service (GET /query), as vLLM's Mooncake proxy does.
        url = f"http://127.0.0.1:{args.bootstrap_port}/query"
        while state["engine_id"] is None:
            try:
                async with app["session"].get(url) as r:
                    if r.status == 200:
                        listing = await r.json(content_type=None)
                        if listing:
                            state["engine_id"] = listing[sorted(listing)[0]]["engine_id"]
                            break
            except (aiohttp.ClientError, OSError, ValueError):
                pass
            await asyncio.sleep(0.25)

    async def on_startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True))
        if args.mode == "concurrent":
            state["learner"] = asyncio.create_task(learn_engine_id(app))
        else:
            state["engine_id"] = "-"

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=200 if state["engine_id"] else 503)

    async def bench_requests(_request: web.Request) -> web.Response:
        return web.json_response(records)

    async def call_prefill(session, body: dict, headers: dict, rec: dict) -> tuple[int, Any]:
        try:
            async with session.post(args.prefill + "/v1/completions", json=body,
                                    headers=headers) as r:
                text = await r.text()
                rec["p_status"] = r.status
                rec["t_p_done"] = now()
                try:
                    return r.status, json.loads(text)
                except ValueError:
                    return r.status, text
        except (aiohttp.ClientError, OSError) as e:
            rec["p_status"] = 0
            rec["t_p_done"] = now()
            return 0, str(e)

    async def forward_decode(request: web.Request, body: dict, headers: dict,
                             rec: dict) -> web.StreamResponse:
        rec["t_d_sent"] = now()
        session = request.app["session"]
        try:
            up = await session.post(args.decode + "/v1/completions", json=body, headers=headers)
        except (aiohttp.ClientError, OSError) as e:
            rec["d_status"] = 0
            rec["t_end"] = now()
            return web.json_response({"error": {"message": f"D: {e}", "code": 502}}, status=502)
        try:
            rec["d_status"] = up.status
            if up.status != 200 or not body.get("stream"):
                data = await up.read()
                rec["t_d_first"] = rec["t_end"] = now()
                return web.Response(status=up.status, body=data,
                                    content_type=up.content_type or "application/json")
            out = web.StreamResponse(status=200)
            out.content_type = up.content_type or "text/event-stream"
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                if "t_d_first" not in rec and chunk.strip():
                    rec["t_d_first"] = now()
                await out.write(chunk)
            await out.write_eof()
            rec["t_end"] = now()
            return out
        except asyncio.CancelledError:
            rec["cancelled"] = now()
            raise
        except (aiohttp.ClientError, OSError) as e:
            rec["d_error"] = str(e)
            rec["t_end"] = now()
            raise
        finally:
            up.close()  # a response not read to its end: close D's connection (D aborts)

    async def completions(request: web.Request) -> web.StreamResponse:
        if not state["engine_id"]:
            return web.json_response({"error": {"message": "P's engine id is not known yet"}},
                                     status=503)
        body = await request.json()
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        rec = records.setdefault(rid, {})
        rec["t_in"] = now()
        headers = {"X-Request-Id": rid}
        session = request.app["session"]
        if args.mode == "direct":
            return await forward_decode(request, body, headers, rec)
        p_body = dict(body, max_tokens=1, stream=False)
        p_body.pop("stream_options", None)
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        if args.mode == "concurrent":
            transfer_id = f"xfer-{rid}"
            p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                            "transfer_id": transfer_id}
            # P's half runs on its own, as in vLLM's Mooncake proxy: not cancelled with the client.
            task = asyncio.create_task(call_prefill(session, p_body, headers, rec))
            state["background"].add(task)
            task.add_done_callback(state["background"].discard)
            d_params = {"do_remote_decode": False, "do_remote_prefill": True,
                        "transfer_id": transfer_id, "remote_engine_id": state["engine_id"],
                        "remote_bootstrap_addr": f"http://127.0.0.1:{args.bootstrap_port}"}
            return await forward_decode(request, dict(body, kv_transfer_params=d_params),
                                        headers, rec)
        # sequential (NIXL): P first, then D with what P returned.
        p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        try:
            status, answer = await call_prefill(session, p_body, headers, rec)
        except asyncio.CancelledError:
            rec["cancelled"] = now()
            raise
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if status != 200 or not params:
            rec["t_end"] = now()
            return web.json_response(
                {"error": {"message": f"P answered {status}: {str(answer)[:300]}",
                           "code": status or 502}}, status=status if status >= 400 else 502)
        return await forward_decode(request, dict(body, kv_transfer_params=params), headers, rec)

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/health", health)
    app.router.add_get("/bench/requests", bench_requests)
    app.router.add_post("/v1/completions", completions)
    async def serve() -> None:
        # handler_cancellation: a client that leaves cancels its handler, which closes D's
        # connection (D aborts the request).
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


# ---------------------------------------------------------------------------------------------
# Engines and setups
# ---------------------------------------------------------------------------------------------


def engine_env(run_dir: Path) -> dict[str, str]:
    """What every engine runs with (as python/tests/vllm_serve.py's engine_env)."""
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1", "VLLM_HOST_IP": "127.0.0.1", "UCX_NET_DEVICES": "lo",
        "VLLM_LOGGING_LEVEL": "INFO", "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(run_dir / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(run_dir / "inductor"),
        "TMPDIR": str(run_dir / "tmp"),
    })
    (run_dir / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def with_path(env: dict[str, str], *dirs: str) -> dict[str, str]:
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, *[d for d in dirs if d]]))
    return env


def importable(code: str, extra_path: str | None) -> str | None:
    """None when ``code`` runs in an engine's interpreter and path, else the reason it does not."""
    env = with_path(dict(os.environ), extra_path or "")
    try:
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=120)
    except subprocess.TimeoutExpired:
        return f"`{code}` did not finish in 120 s"
    if r.returncode == 0:
        return None
    last = (r.stderr.strip().splitlines() or ["?"])[-1]
    return last[:200]


@dataclass
class Setup:
    name: str             # the column in tables and CSVs
    label: str            # how the tables name it
    connector: str        # kvferry | mooncake | nixl | plain
    cases: tuple[str, ...]
    hold_s: float         # P's bound on holding KV for a D that never comes (lease or timeout)
    note: str = ""


class Pair:
    """P, D (or one plain instance) and the bench proxy in front, for one setup."""

    def __init__(self, setup: Setup, model: str, run_dir: Path, args: argparse.Namespace):
        self.setup = setup
        self.model = model
        self.dir = run_dir / setup.name
        self.dir.mkdir(parents=True, exist_ok=True)
        base = engine_env(run_dir)
        lease = args.lease
        c = setup.connector
        p_env, d_env = dict(base), dict(base)
        self.bootstrap_port = None
        mode = "concurrent"
        if c == "plain":
            p_cfg = d_cfg = None
            mode = "direct"
        elif c == "kvferry":
            self.bootstrap_port = free_port()
            # abort_request_timeout as Mooncake's in A and E (with a lease it bounds only the
            # wait for an unfinished prefill and how long freed ids are remembered).
            common = {"kv_lease_duration": lease, "abort_request_timeout": args.mooncake_timeout}
            p_cfg = kvferry_transfer_config("prefill", {**common,
                                                        "bootstrap_port": self.bootstrap_port})
            d_cfg = kvferry_transfer_config("decode", common)
            for env in (p_env, d_env):
                env["UCX_TLS"] = args.kvferry_ucx_tls
        elif c == "mooncake":
            self.bootstrap_port = free_port()
            extra = {"mooncake_protocol": "tcp"}
            p_cfg = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                     "kv_connector_extra_config": extra}
            d_cfg = dict(p_cfg, kv_role="kv_consumer")
            for env in (p_env, d_env):
                env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(self.bootstrap_port)
                env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(int(setup.hold_s))
                env["KVFERRY_BENCH_CPU_SHIM"] = "1"
        elif c == "nixl":
            mode = "sequential"
            cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                   "kv_buffer_device": "cpu", "kv_connector_extra_config":
                   {"kv_lease_duration": int(lease), **json.loads(args.nixl_extra)}}
            p_cfg = d_cfg = cfg
            for env in (p_env, d_env):
                env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
                env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
                if args.nixl_ucx_tls:
                    env["UCX_TLS"] = args.nixl_ucx_tls
        else:
            raise ValueError(c)
        self.p = VllmEngine(f"{setup.name}-prefill", model, free_port(), self.dir / "prefill.log",
                            p_cfg, [*ENGINE_ARGS, *P_ARGS], p_env)
        self.d = None
        if c != "plain":
            self.d = VllmEngine(f"{setup.name}-decode", model, free_port(),
                                self.dir / "decode.log", d_cfg, [*ENGINE_ARGS, *D_ARGS], d_env)
        for spec in args.engine_env:  # ROLE:KEY=VALUE, ROLE p or d (debugging)
            role, _, kv = spec.partition(":")
            key, _, value = kv.partition("=")
            engine = {"p": self.p, "d": self.d}.get(role)
            if engine is not None and key:
                engine.env[key] = value
        # VllmEngine builds PYTHONPATH from this process's; the extra packages and the shim go after.
        for engine in self.engines():
            with_path(engine.env, args.extra_path or "",
                      str(CPU_SHIM) if c == "mooncake" else "")
        self.proxy_port = 0  # the proxy binds a free port and writes it to port_file
        self.port_file = self.dir / "proxy.port"
        argv = [sys.executable, str(HERE), "proxy", "--mode", mode,
                "--port-file", str(self.port_file), "--decode", (self.d or self.p).url]
        if mode != "direct":
            argv += ["--prefill", self.p.url]
        if mode == "concurrent":
            argv += ["--bootstrap-port", str(self.bootstrap_port)]
        self.proxy = Child(f"{setup.name}-proxy", argv, self.dir / "proxy.log",
                           with_path(dict(base), str(REPO / "python")))
        self.started_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def engines(self) -> list[VllmEngine]:
        return [e for e in (self.p, self.d) if e is not None]

    def children(self) -> list[Child]:
        return [self.proxy, *self.engines()]

    def launch(self) -> None:
        for engine in self.engines():
            engine.start()

    def wait_ready(self) -> None:
        start = time.monotonic()
        for engine in self.engines():
            engine.wait_ready(START_TIMEOUT_S)
        self.port_file.unlink(missing_ok=True)
        self.proxy.start()
        deadline = time.monotonic() + 60.0
        while not self.port_file.exists():
            if not self.proxy.alive() or time.monotonic() > deadline:
                raise LaunchError(f"the bench proxy did not start; {self.proxy.log}:\n"
                                  f"{self.proxy.log_tail()}")
            time.sleep(0.1)
        self.proxy_port = int(self.port_file.read_text())
        self.proxy.wait_http(self.url + "/health", 60.0)
        self.started_s = time.monotonic() - start

    def stop(self) -> None:
        import threading

        threads = [threading.Thread(target=c.stop, args=(10.0,)) for c in self.children()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def tail(self) -> str:
        return "\n".join(f"---- {c.name} ({c.log}) ----\n{c.log_tail(25)}"
                         for c in self.children())


# ---------------------------------------------------------------------------------------------
# The client side (asyncio + aiohttp)
# ---------------------------------------------------------------------------------------------


@dataclass
class Reply:
    rid: str
    status: int = 0
    tokens: list[int] = field(default_factory=list)
    error: str = ""
    finish_reason: str | None = None
    t_send: float = 0.0
    t_first: float | None = None
    t_end: float | None = None
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and not self.cancelled

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send


def make_prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1024) for _ in range(n)] for n in lengths]


async def complete(session, url: str, model: str, prompt: list[int], max_tokens: int,
                   reply: Reply, *, stream: bool = True, timeout_s: float | None = None) -> Reply:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "stream": stream, "ignore_eos": True}
    reply.t_send = now()
    try:
        async with session.post(url + "/v1/completions", json=body,
                                headers={"X-Request-Id": reply.rid},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            reply.status = r.status
            if r.status != 200:
                reply.error = (await r.text())[:300]
            elif not stream:
                answer = await r.json(content_type=None)
                choice = answer["choices"][0]
                reply.tokens = list(choice.get("token_ids") or [])
                reply.finish_reason = choice.get("finish_reason")
                reply.t_first = now()
            else:
                async for raw in r.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        reply.error = json.dumps(event["error"])[:300]
                        break
                    for choice in event.get("choices", ()):
                        ids = choice.get("token_ids") or []
                        if ids and reply.t_first is None:
                            reply.t_first = now()
                        reply.tokens += ids
                        reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    except asyncio.CancelledError:
        reply.cancelled = True
        reply.t_end = now()
        raise
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
        reply.error = reply.error or f"{type(e).__name__}: {e}"[:300]
    reply.t_end = now()
    if reply.status == 200 and not reply.error and len(reply.tokens) < max_tokens:
        reply.error = f"{len(reply.tokens)} of {max_tokens} tokens (finish {reply.finish_reason})"
    return reply


async def get_json(session, url: str, timeout_s: float = 3.0) -> Any:
    import aiohttp

    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return await r.json(content_type=None) if r.status == 200 else None
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
        return None


async def get_metrics(session, engine: VllmEngine, timeout_s: float = 2.0) -> dict[str, float]:
    import aiohttp

    try:
        async with session.get(engine.url + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return parse_metrics(await r.text()) if r.status == 200 else {}
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return {}


class Sampler:
    """P's KV usage and queue every SAMPLE_S from its /metrics, and D's on a loop of its own (a
    busy D answers late; P's samples keep their pace)."""

    def __init__(self, session, pair: Pair):
        self.session, self.pair = session, pair
        self.rows: list[dict[str, float]] = []
        self.d_rows: list[dict[str, float]] = []
        self._tasks: list[asyncio.Task] = []

    async def _run(self, engine: VllmEngine, rows: list, prefix: str) -> None:
        while True:
            t = now()
            m = await get_metrics(self.session, engine)
            if m:
                rows.append({"t": t, f"{prefix}_kv": metric(m, "vllm:kv_cache_usage_perc"),
                             f"{prefix}_running": metric(m, "vllm:num_requests_running"),
                             f"{prefix}_waiting": metric(m, "vllm:num_requests_waiting")})
            await asyncio.sleep(max(0.0, SAMPLE_S - (now() - t)))

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run(self.pair.p, self.rows, "p")))
        if self.pair.d is not None:
            self._tasks.append(asyncio.create_task(self._run(self.pair.d, self.d_rows, "d")))

    async def stop(self) -> None:
        await drain(self._tasks)

    def last(self) -> dict[str, float]:
        return self.rows[-1] if self.rows else {}

    def p_kv_at(self, t: float) -> float | None:
        """P's KV of the last sample at or before t."""
        best = None
        for row in self.rows:
            if row["t"] <= t:
                best = row["p_kv"]
        return best

    def first_time(self, after: float, pred) -> float | None:
        for row in self.rows:
            if row["t"] >= after and pred(row):
                return row["t"]
        return None


class Health:
    """What else happened on the machine during a case: the longest stall of this process's event
    loop (a 0.1 s sleep that took longer) and the CPU's busy and steal shares (/proc/stat)."""

    def __init__(self):
        self.max_stall_s = 0.0
        self._task: asyncio.Task | None = None
        self._cpu0 = self._cpu()
        self._load0 = self._load()

    @staticmethod
    def _load() -> float:
        try:
            with open("/proc/loadavg") as f:
                return float(f.read().split()[0])
        except (OSError, ValueError):
            return 0.0

    @staticmethod
    def _cpu() -> list[int]:
        try:
            with open("/proc/stat") as f:
                return [int(x) for x in f.readline().split()[1:9]]
        except OSError:
            return [0] * 8

    async def _run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.1)
            self.max_stall_s = max(self.max_stall_s, time.monotonic() - t - 0.1)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> dict[str, float]:
        if self._task:
            await drain([self._task])
        d = [b - a for a, b in zip(self._cpu0, self._cpu())]
        total = sum(d) or 1
        # user nice system idle iowait irq softirq steal
        return {"max_loop_stall_s": round(self.max_stall_s, 2),
                "load_1min": round(max(self._load0, self._load()), 1),
                "cpu_busy": round((total - d[3] - d[4]) / total, 2),
                "cpu_steal": round(d[7] / total, 3)}


def session_factory():
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def wait_until(pred, timeout_s: float, poll_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():
            return True
        await asyncio.sleep(poll_s)
    return False


async def p_idle(session, pair: Pair) -> bool:
    m = await get_metrics(session, pair.p)
    return bool(m) and metric(m, "vllm:kv_cache_usage_perc") == 0 and \
        metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:num_requests_waiting") == 0


# Log lines that say how P's KV was freed, counted per case in each engine's log.
LOG_EVENTS = {
    # NIXL's P: a lease ran out (base_worker.py), and a read that came after it.
    "p_lease_expired": ("p", "Releasing expired KV blocks"),
    "p_read_after_expiry": ("p", "Potentially invalid KV blocks"),
    # Mooncake's P: its abort timeout ran out.
    "p_timeout_freed": ("p", "without being sent. Freeing its blocks"),
    # kvferry's D, told by P that a queued request's transfer expired there.
    "d_told_expired": ("d", "expired on P before it was pulled"),
    "p_error_lines": ("p", " ERROR "),
    "d_error_lines": ("d", " ERROR "),
}


def log_marks(pair: Pair) -> dict[str, int]:
    marks = {}
    for role, engine in (("p", pair.p), ("d", pair.d)):
        try:
            marks[role] = engine.log.stat().st_size if engine else 0
        except OSError:
            marks[role] = 0
    return marks


def log_events(pair: Pair, marks: dict[str, int]) -> dict[str, int]:
    texts = {}
    for role, engine in (("p", pair.p), ("d", pair.d)):
        texts[role] = ""
        if engine is not None:
            try:
                with open(engine.log, "rb") as f:
                    f.seek(marks.get(role, 0))
                    texts[role] = f.read().decode(errors="replace")
            except OSError:
                pass
    return {name: texts[role].count(needle) for name, (role, needle) in LOG_EVENTS.items()}


async def measured(pair: Pair, fn) -> dict[str, Any]:
    """Runs one case with the machine's health and the engines' log events beside it."""
    health = Health()
    health.start()
    marks = log_marks(pair)
    result = await fn()
    machine = await health.stop()
    result.setdefault("machine", machine)
    result["log_events"] = log_events(pair, marks)
    return result


def rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def secs(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def p90(xs) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else None


# ---------------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------------


B_SEED = 4
E_SEED = 3


async def case_reference(pair: Pair) -> dict[str, Any]:
    """The plain instance's greedy outputs (straight to it): the ident prompts' (16 tokens, by
    prompt length) and cases B's and E's (OUTPUT tokens, in order)."""
    out: dict[str, Any] = {}
    async with session_factory() as s:
        for prompt in make_prompts(1, IDENT_LENGTHS):
            r = await complete(s, pair.p.url, pair.model, prompt, 16, Reply(rid("ref")),
                               stream=False, timeout_s=120)
            if not r.ok:
                raise RuntimeError(f"the plain instance failed a reference request: {r.error}")
            out[str(len(prompt))] = r.tokens
        for case, seed, n in (("B", B_SEED, B_REQUESTS), ("E", E_SEED, E_REQUESTS)):
            replies = await asyncio.gather(*[
                complete(s, pair.p.url, pair.model, prompt, OUTPUT, Reply(rid("ref")),
                         stream=False, timeout_s=300)
                for prompt in make_prompts(seed, [PROMPT] * n)])
            if not all(r.ok for r in replies):
                raise RuntimeError(f"the plain instance failed a reference request of case {case}")
            out[case] = [r.tokens for r in replies]
    return out


async def case_ident(pair: Pair, reference: dict[str, list[int]]) -> dict[str, Any]:
    result = {"compared": 0, "identical": 0, "mismatches": [], "first_request_s": None}
    async with session_factory() as s:
        for i, prompt in enumerate(make_prompts(1, IDENT_LENGTHS)):
            for stream in (False, True):
                r = await complete(s, pair.url, pair.model, prompt, 16, Reply(rid("ident")),
                                   stream=stream, timeout_s=120)
                if result["first_request_s"] is None:
                    result["first_request_s"] = r.t_end - r.t_send
                result["compared"] += 1
                if r.ok and r.tokens == reference[str(len(prompt))]:
                    result["identical"] += 1
                else:
                    result["mismatches"].append({"prompt_tokens": len(prompt), "stream": stream,
                                                 "error": r.error, "got": r.tokens[:16]})
    return result


async def case_ttft(pair: Pair) -> dict[str, Any]:
    rows = []
    async with session_factory() as s:
        # One request first, not counted (the engines' first of a kind after the other cases).
        await complete(s, pair.url, pair.model, make_prompts(12, [100])[0], 8, Reply(rid("warm")),
                       timeout_s=120)
        for prompt in make_prompts(2, TTFT_LENGTHS):
            r = await complete(s, pair.url, pair.model, prompt, 8, Reply(rid("ttft")),
                               timeout_s=120)
            rows.append(r)
        recs = await get_json(s, pair.url + "/bench/requests") or {}
    out = []
    for r in rows:
        rec = recs.get(r.rid, {})
        p_s = (rec["t_p_done"] - rec["t_in"]) if "t_p_done" in rec and "t_in" in rec else None
        handoff = (rec["t_d_first"] - rec["t_p_done"]) \
            if "t_d_first" in rec and "t_p_done" in rec else None
        out.append({"prompt_tokens": 0, "ok": r.ok, "error": r.error, "ttft_s": r.ttft,
                    "p_s": p_s, "handoff_s": handoff})
    for o, n in zip(out, TTFT_LENGTHS):
        o["prompt_tokens"] = n
    return {
        "requests": out,
        "ok": sum(o["ok"] for o in out),
        "ttft_median_s": median(o["ttft_s"] for o in out),
        "ttft_p90_s": p90(o["ttft_s"] for o in out),
        "p_median_s": median(o["p_s"] for o in out),
        "handoff_median_s": median(o["handoff_s"] for o in out),
        "handoff_p90_s": p90(o["handoff_s"] for o in out),
    }


def timeline(sampler: Sampler, t0: float) -> list[dict[str, float]]:
    return [{**row, "t": row["t"] - t0} for row in sampler.rows]


def timeline_d(sampler: Sampler, t0: float) -> list[dict[str, float]]:
    return [{**row, "t": row["t"] - t0} for row in sampler.d_rows]


async def drain(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        if not t.done():
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def begin_load(s, pair: Pair, health: "Health") -> "Sampler":
    """What every load case starts with: the machine's health and a sampler of P's and D's
    state running, one second of samples before the load."""
    health.start()
    sampler = Sampler(s, pair)
    sampler.start()
    await asyncio.sleep(1.0)
    return sampler


def send_load(s, pair: Pair, prefix: str, n: int, seed: int,
              timeout_s: float) -> tuple[list["Reply"], list[asyncio.Task]]:
    """n streamed PROMPT-token requests (OUTPUT out) through the proxy, sent at once."""
    replies = [Reply(rid(prefix)) for _ in range(n)]
    tasks = [asyncio.create_task(complete(s, pair.url, pair.model, p, OUTPUT, r,
                                          timeout_s=timeout_s))
             for r, p in zip(replies, make_prompts(seed, [PROMPT] * n))]
    return replies, tasks


def identical_to(reference: dict[str, Any] | None, case: str, replies: list["Reply"],
                 skip: frozenset[str] = frozenset()) -> int | None:
    """How many replies (but those in `skip`) equal the plain instance's; None without one."""
    want = (reference or {}).get(case)
    if want is None:
        return None
    return sum(r.ok and r.tokens == w for r, w in zip(replies, want) if r.rid not in skip)


async def case_e(pair: Pair, hold_s: float, reference: dict[str, Any] | None) -> dict[str, Any]:
    """30% of clients leave while their requests queue on D."""
    health = Health()
    async with session_factory() as s:
        sampler = await begin_load(s, pair, health)
        t_load = now()
        replies, sent = send_load(s, pair, "e", E_REQUESTS, E_SEED, hold_s + 120)
        tasks = {r.rid: t for r, t in zip(replies, sent)}
        n_cancel = round(E_CANCEL_SHARE * E_REQUESTS)
        queued: list[str] = []

        async def all_on_p_and_queued() -> bool:
            # Every request's P half answered (its KV held on P), and enough of them queued on D
            # (D has not sent their first token).
            nonlocal queued
            recs = await get_json(s, pair.url + "/bench/requests") or {}
            answered = [k for k in tasks if recs.get(k, {}).get("p_status") == 200]
            queued = [k for k in answered if "t_d_first" not in recs[k]
                      and "t_end" not in recs[k]]
            return len(answered) == len(tasks) and len(queued) >= n_cancel + 2

        await wait_until(all_on_p_and_queued, 60.0)
        await asyncio.sleep(1.0)  # a sample or two of P's KV before they leave
        await all_on_p_and_queued()
        chosen = random.Random(5).sample(queued, min(n_cancel, len(queued)))
        kv_before = sampler.last().get("p_kv")
        t_cancel = now()
        for k in chosen:
            tasks[k].cancel()
        live = [t for k, t in tasks.items() if k not in chosen]
        await asyncio.gather(*live, return_exceptions=True)
        t_live_done = now()

        async def freed() -> bool:
            row = sampler.last()
            return row.get("p_kv", 1) == 0 and row["t"] > t_live_done + 1.0
        await wait_until(freed, max(t_cancel + hold_s + 15, t_live_done + 3) - now())
        await asyncio.sleep(1.0)
        await sampler.stop()
        await drain(list(tasks.values()))
        machine = await health.stop()
    by_rid = {r.rid: r for r in replies}
    live_same = identical_to(reference, "E", replies, frozenset(chosen))
    t_free = sampler.first_time(t_cancel, lambda row: row["p_kv"] == 0)
    kv_after = min((row["p_kv"] for row in sampler.rows if t_cancel <= row["t"] <= t_cancel + 1.5),
                   default=None)
    return {
        "requests": E_REQUESTS, "cancelled": len(chosen), "queued_on_d_at_cancel": len(queued),
        "cancelled_share_of_p_kv": len(chosen) * PROMPT_BLOCKS / P_BLOCKS,
        "live_ok": sum(by_rid[k].ok for k in tasks if k not in chosen),
        "live_ok_identical_to_plain": live_same,
        "live": E_REQUESTS - len(chosen),
        "t_cancel": t_cancel - t_load,
        "p_kv_before_cancel": kv_before, "p_kv_within_1_5s": kv_after,
        "last_live_done_after_cancel_s": t_live_done - t_cancel,
        "p_kv_when_last_live_done": sampler.p_kv_at(t_live_done + 0.6),
        "p_kv_zero_after_cancel_s": None if t_free is None else t_free - t_cancel,
        "machine": machine,
        "timeline": timeline(sampler, t_cancel),
        "d_timeline": timeline_d(sampler, t_cancel),
        "live_errors": sorted({by_rid[k].error[:160] for k in tasks
                               if k not in chosen and not by_rid[k].ok}),
    }


class Prober:
    """A plain request (PROBE_PROMPT tokens, 4 out, no kv_transfer_params) straight to P every
    PROBE_EVERY_S, each on its own: P's other traffic, and how long it waits for blocks."""

    def __init__(self, session, pair: Pair, seed: int, timeout_s: float):
        self.session, self.pair, self.timeout_s = session, pair, timeout_s
        self.probes: list[dict[str, Any]] = []
        self._prompts = iter(make_prompts(seed, [PROBE_PROMPT] * 400))
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.Task | None = None

    async def _probe(self) -> None:
        r = Reply(rid("probe"))
        entry: dict[str, Any] = {"t_send": now(), "latency_s": None, "ok": False}
        self.probes.append(entry)
        await complete(self.session, self.pair.p.url, self.pair.model, next(self._prompts), 4, r,
                       stream=False, timeout_s=self.timeout_s)
        entry.update(latency_s=r.t_end - r.t_send, ok=r.ok, error=r.error)

    async def _run(self) -> None:
        while True:
            self._tasks.append(asyncio.create_task(self._probe()))
            await asyncio.sleep(PROBE_EVERY_S)

    def start(self) -> None:
        self._loop = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._loop is not None:
            await drain([self._loop])
        await drain(self._tasks)

    def answered(self) -> list[float]:
        return [p["latency_s"] for p in self.probes if p["latency_s"] is not None and p["ok"]]


async def case_b(pair: Pair, hold_s: float, reference: dict[str, Any] | None) -> dict[str, Any]:
    """D overloaded, no crash: requests wait on D up to ~2.5x the lease/timeout."""
    health = Health()
    async with session_factory() as s:
        sampler = await begin_load(s, pair, health)
        t_load = now()
        replies, tasks = send_load(s, pair, "b", B_REQUESTS, B_SEED, 240)
        # P keeps serving other requests meanwhile (they fit beside the held KV): blocks P has
        # freed get used again, so a read of freed blocks shows in the outputs.
        prober = Prober(s, pair, 8, 240)
        await asyncio.sleep(3.0)
        prober.start()
        done, pending = await asyncio.wait(tasks, timeout=240)
        t_done = now()
        await prober.stop()
        recs = await get_json(s, pair.url + "/bench/requests") or {}
        await wait_until(lambda: p_idle(s, pair), 10.0)
        await sampler.stop()
        await drain(tasks)
        machine = await health.stop()
    waits = []
    for r in replies:
        rec = recs.get(r.rid, {})
        if "t_p_done" in rec:
            end = rec.get("t_d_first") or r.t_first or r.t_end
            if end:
                waits.append(end - rec["t_p_done"])
    errors: dict[str, int] = {}
    for r in replies:
        if not r.ok:
            key = (r.error or f"status {r.status}")[:140]
            errors[key] = errors.get(key, 0) + 1
    identical = identical_to(reference, "B", replies)
    return {
        "requests": B_REQUESTS, "ok": sum(r.ok for r in replies),
        "ok_identical_to_plain": identical,
        "failed": sum(not r.ok for r in replies), "errors": errors,
        "wait_on_d_max_s": max(waits) if waits else None,
        "wait_on_d_median_s": median(waits),
        "duration_s": t_done - t_load,
        "probes": len(prober.probes), "probe_p50_s": median(prober.answered()),
        "probe_max_s": max(prober.answered(), default=None),
        "ok_by_arrival": [r.ok for r in replies],
        "machine": machine,
        "timeline": timeline(sampler, t_load),
        "d_timeline": timeline_d(sampler, t_load),
    }


async def case_a(pair: Pair, hold_s: float, on_kill=None) -> dict[str, Any]:
    """D SIGKILLed while requests queue on it with their KV held on P; probes straight to P."""
    health = Health()
    async with session_factory() as s:
        sampler = await begin_load(s, pair, health)
        t_load = now()
        replies, tasks = send_load(s, pair, "a", A_REQUESTS, 6, hold_s + 120)
        prober = Prober(s, pair, 7, hold_s + 120)
        probes = prober.probes
        prober.start()

        answered = 0

        async def p_full() -> bool:
            # P's KV (nearly) full of requests queued on D, and at most A_QUEUED_ON_P still queued
            # on P itself (their P halves unanswered): they are the second wave, prefilled once
            # the first is freed, for a D that is gone.
            nonlocal answered
            recs = await get_json(s, pair.url + "/bench/requests") or {}
            answered = sum(1 for r in replies if recs.get(r.rid, {}).get("p_status") == 200)
            return answered >= A_REQUESTS - A_QUEUED_ON_P and \
                sampler.last().get("p_kv", 0) >= A_FULL
        await wait_until(p_full, 40.0)
        kv_at_kill = sampler.last().get("p_kv")
        t_kill = now()
        # SIGKILL to D's process group; the wait for it to be reaped runs off the event loop.
        await asyncio.to_thread(pair.d.kill)
        kill_s = now() - t_kill
        if on_kill is not None:
            on_kill()

        async def settled() -> bool:
            row = sampler.last()
            answered = [p for p in probes if p["t_send"] > t_kill and p["latency_s"] is not None]
            return row.get("p_kv", 1) < 0.05 and bool(answered) and \
                all(p["latency_s"] is not None for p in probes)
        await wait_until(settled, hold_s + 15.0)
        await asyncio.sleep(PROBE_EVERY_S)
        t_end = now()
        await prober.stop()
        await sampler.stop()
        await drain(tasks)
        machine = await health.stop()
    below5 = sampler.first_time(t_kill, lambda row: row["p_kv"] < 0.05)
    zero = sampler.first_time(t_kill, lambda row: row["p_kv"] == 0)
    for p in probes:
        p["t"] = p["t_send"] - t_kill
        if p["latency_s"] is None:
            p["latency_s_at_least"] = t_end - p["t_send"]
    after = [p for p in probes if p["t"] > 0]
    first_after = after[0] if after else None
    later = [p["latency_s"] for p in after[1:] if p["latency_s"] is not None and p["ok"]
             and below5 is not None and p["t_send"] > below5]
    return {
        "requests": A_REQUESTS, "kill_after_load_s": t_kill - t_load, "kill_took_s": kill_s,
        "queued_on_p_at_kill": A_REQUESTS - answered,
        "p_kv_at_kill": kv_at_kill,
        "p_kv_below_5pct_after_kill_s": None if below5 is None else below5 - t_kill,
        "p_kv_zero_after_kill_s": None if zero is None else zero - t_kill,
        "window_after_kill_s": t_end - t_kill,
        "p_kv_at_end": sampler.last().get("p_kv"),
        "first_probe_after_kill": first_after,
        "later_probe_latencies_s": later,
        "probes": probes,
        "client_ok": sum(r.ok for r in replies),
        "machine": machine,
        "timeline": timeline(sampler, t_kill),
        "d_timeline": timeline_d(sampler, t_kill),
    }


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def write_timeline_csv(path: Path, series: dict[str, list[dict[str, float]]],
                       labels: dict[str, str]) -> None:
    """One row per 0.5 s step; a column per setup (P's KV usage in %, headed by the setup's
    label), empty where that setup has no sample."""
    grid: dict[float, dict[str, float]] = {}
    for name, rows in series.items():
        for row in rows:
            t = round(row["t"] / SAMPLE_S) * SAMPLE_S
            grid.setdefault(t, {})[name] = 100.0 * row["p_kv"]
    names = list(series)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t", *[labels.get(n, n) for n in names]])
        for t in sorted(grid):
            w.writerow([f"{t:.1f}", *[("" if n not in grid[t] else f"{grid[t][n]:.1f}")
                                      for n in names]])


def plot(out: Path, results: dict[str, Any]) -> list[str]:
    """CSVs of P's KV over time per case, events.gp (what the plot script reads), the PNGs."""
    labels = {s["name"]: s["label"] for s in results["setups"]}
    cfg = results["config"]
    with open(out / "events.gp", "w") as f:
        f.write("# written by python/bench/bench_vllm_connectors.py for "
                "scripts/plot_vllm_connectors.gp\n")
        for case in ("A", "B", "E"):
            series = {name: r[case]["timeline"] for name, r in results["runs"].items()
                      if case in r and "timeline" in r[case]}
            if series:
                write_timeline_csv(out / f"case_{case.lower()}.csv", series, labels)
            f.write(f"{case.lower()}_ncols = {len(series) + 1 if series else 0}\n")
        f.write(f"lease = {cfg['lease']:g}\ntimeout = {cfg['mooncake_timeout']:g}\n"
                f"timeout_b = {cfg['mooncake_timeout_b']:g}\n")
    gp = REPO / "scripts" / "plot_vllm_connectors.gp"
    if not shutil.which("gnuplot"):
        print("gnuplot not found: no PNGs (the CSVs are written)")
        return []
    r = subprocess.run(["gnuplot", "-e", f'outdir="{out}"', str(gp)], capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        print(f"gnuplot failed: {r.stderr[-800:]}")
    return [str(out / f"case_{c}.png") for c in ("a", "b", "e")
            if (out / f"case_{c}.png").exists()]


def machine(m: dict[str, float] | None) -> str:
    if not m:
        return "-"
    return (f"{m['max_loop_stall_s']:.1f} s / {m.get('load_1min', 0):.0f} / "
            f"{100 * m['cpu_steal']:.1f}%")


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    fmt = "| " + " | ".join(f"{{:{w}}}" for w in widths) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt.format(*headers), sep, *[fmt.format(*map(str, r)) for r in rows]])


def report(results: dict[str, Any]) -> str:
    out = []
    runs = results["runs"]
    labels = {s["name"]: s["label"] for s in results["setups"]}
    out.append("== identical outputs (greedy, 16 tokens; the plain instance's as the reference)")
    rows = []
    for name, r in runs.items():
        if "ident" in r:
            i = r["ident"]
            rows.append([labels[name], f"{i['identical']}/{i['compared']}",
                         secs(i["first_request_s"], 2), secs(r.get("start_s"), 0)])
    out.append(table(["setup", "identical", "first request (s)", "start (s)"], rows))
    out.append("\n== TTFT, one request at a time (8 prompts of 64..448 tokens, streamed, "
               "through the bench proxy)")
    rows = []
    for name, r in runs.items():
        if "ttft" in r:
            t = r["ttft"]
            rows.append([labels[name], f"{t['ok']}/{len(t['requests'])}",
                         secs(t["ttft_median_s"] and 1000 * t["ttft_median_s"], 0),
                         secs(t["ttft_p90_s"] and 1000 * t["ttft_p90_s"], 0),
                         secs(t["p_median_s"] and 1000 * t["p_median_s"], 0),
                         secs(t["handoff_median_s"] and 1000 * t["handoff_median_s"], 0),
                         secs(t["handoff_p90_s"] and 1000 * t["handoff_p90_s"], 0)])
    out.append(table(["setup", "ok", "TTFT p50 ms", "TTFT p90 ms", "P p50 ms", "handoff p50 ms",
                      "handoff p90 ms"], rows))
    out.append(f"\n== E: {E_REQUESTS} requests queue on D; 30% of clients leave while queued "
               f"(seed: {SEED['E']})")
    rows = []
    for name, r in runs.items():
        if "E" in r:
            e = r["E"]
            rows.append([labels[name], f"{e['cancelled']} (of {e['queued_on_d_at_cancel']} queued)",
                         pct(e["cancelled_share_of_p_kv"]), pct(e["p_kv_before_cancel"]),
                         pct(e["p_kv_within_1_5s"]), secs(e["last_live_done_after_cancel_s"]),
                         pct(e["p_kv_when_last_live_done"]), secs(e["p_kv_zero_after_cancel_s"]),
                         f"{e['live_ok']}/{e['live']}",
                         "-" if e.get("live_ok_identical_to_plain") is None
                         else f"{e['live_ok_identical_to_plain']}/{e['live_ok']}",
                         machine(e.get("machine"))])
    out.append(table(["setup", "cancelled", "their KV", "P KV before", "P KV +1.5 s",
                      "last live done (s)", "P KV then", "P KV 0 at (s)", "live ok", "ok = plain",
                      "stall/load/steal"], rows))
    out.append(f"\n== B: {B_REQUESTS} requests at once, D serves one at a time, no crash "
               f"(seed: {SEED['B']})")
    rows = []
    for name, r in runs.items():
        if "B" in r:
            b = r["B"]
            same = b.get("ok_identical_to_plain")
            rows.append([labels[name], f"{b['ok']}/{b['requests']}",
                         "-" if same is None else f"{same}/{b['ok']}", str(b["failed"]),
                         secs(b["wait_on_d_median_s"]), secs(b["wait_on_d_max_s"]),
                         secs(b["duration_s"]),
                         f"{b.get('probes', 0)}: {secs(b.get('probe_p50_s'), 2)} / "
                         f"{secs(b.get('probe_max_s'), 2)}",
                         machine(b.get("machine")),
                         "; ".join(f"{n}x {k}" for k, n in b["errors"].items())[:160] or "-"])
    out.append(table(["setup", "ok", "ok = plain", "failed", "D wait p50 (s)", "D wait max (s)",
                      "duration (s)", "probes to P: p50 / max (s)", "stall/load/steal",
                      "failures"], rows))
    out.append(f"\n== A: D SIGKILLed with {A_REQUESTS} requests' KV held on P; probe straight "
               f"to P every {PROBE_EVERY_S} s (seed: {SEED['A']})")
    rows = []
    for name, r in runs.items():
        if "A" in r:
            a = r["A"]
            fp = a["first_probe_after_kill"] or {}
            fp_lat = fp.get("latency_s")
            fp_txt = secs(fp_lat) if fp_lat is not None else \
                f"> {secs(fp.get('latency_s_at_least'))} (unanswered)"
            later = a["later_probe_latencies_s"]
            rows.append([labels[name],
                         f"{pct(a['p_kv_at_kill'])} ({a.get('queued_on_p_at_kill', '-')} on P)",
                         secs(a["p_kv_below_5pct_after_kill_s"]), secs(a["p_kv_zero_after_kill_s"]),
                         fp_txt,
                         (f"{1000 * min(later):.0f}-{1000 * max(later):.0f} ms" if later else "-"),
                         secs(a["window_after_kill_s"], 0), pct(a["p_kv_at_end"]),
                         machine(a.get("machine"))])
    out.append(table(["setup", "P KV at kill (queued on P)", "P KV < 5% at (s)", "P KV 0 at (s)",
                      "first probe after kill (s)", "later probes", "watched (s)",
                      "P KV at end", "stall/load/steal"], rows))
    out.append("\n(stall/load/steal: the longest stall of the bench's event loop, the higher 1-min "
               "load average at the case's start and end (this bench alone: ~4-6 on 2 cores), the "
               "CPU's steal share during the case)")
    out.append("\n== log lines per case: P freed KV at its lease (NIXL) / its timeout (Mooncake); "
               "D read blocks P had freed (NIXL); D told by P that a queued transfer expired "
               "(kvferry); ERROR lines on P / D")
    rows = []
    for name, r in runs.items():
        for case in ("ident", "ttft", "E", "B", "A"):
            ev = r.get(case, {}).get("log_events") if isinstance(r.get(case), dict) else None
            if ev:
                rows.append([labels[name], case, ev["p_lease_expired"], ev["p_timeout_freed"],
                             ev["p_read_after_expiry"], ev["d_told_expired"],
                             f"{ev['p_error_lines']} / {ev['d_error_lines']}",
                             machine(r[case].get("machine"))])
    out.append(table(["setup", "case", "P lease expired", "P timeout freed",
                      "D read after expiry", "D told expired", "ERROR P / D",
                      "stall/load/steal"], rows))
    if results.get("skipped"):
        out.append("\n== skipped")
        out += [f"{k}: skipped: {v}" for k, v in results["skipped"].items()]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def check_engine_prereqs() -> str | None:
    if importable("import vllm", None):
        return "vLLM is not importable in this interpreter (scripts/install-python.sh)"
    try:
        import kvferry._native  # noqa: F401
    except ImportError as e:
        return f"kvferry._native is not built ({e}); build with -DKVFERRY_PYTHON=ON"
    return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["proxy"]:
        return run_proxy(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connectors", default="kvferry,mooncake,nixl")
    parser.add_argument("--cases", default="ident,ttft,E,B,A")
    parser.add_argument("--out", default=str(REPO / "out" / "vllm"))
    parser.add_argument("--extra-path", default=os.environ.get("KVFERRY_BENCH_EXTRA_PATH") or None,
                        help="a directory with the connectors' packages, put on the engines' "
                             "PYTHONPATH (pip install --target)")
    parser.add_argument("--runs-dir", default="/tmp/bench-runs")
    parser.add_argument("--lease", type=float, default=10.0,
                        help="kvferry's and NIXL's kv_lease_duration (s)")
    parser.add_argument("--mooncake-timeout", type=float, default=60.0,
                        help="Mooncake's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT in E and A (s)")
    parser.add_argument("--mooncake-timeout-b", type=float, default=10.0,
                        help="Mooncake's timeout in B (s; the seed's B: equal to the lease)")
    parser.add_argument("--kvferry-ucx-tls", default="tcp", help="UCX_TLS of kvferry's engines")
    parser.add_argument("--engine-env", action="append", default=[], metavar="ROLE:KEY=VALUE",
                        help="an environment variable for every P (ROLE p) or D (d) engine; "
                             "repeatable (e.g. p:VLLM_LOGGING_LEVEL=DEBUG)")
    parser.add_argument("--nixl-extra", default="{}",
                        help="more kv_connector_extra_config keys for NIXL, as JSON")
    parser.add_argument("--nixl-ucx-tls", default="",
                        help="UCX_TLS of NIXL's engines (default: UCX's own choice)")
    args = parser.parse_args(argv)
    wanted = [c.strip() for c in args.connectors.split(",") if c.strip()]
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}

    reason = check_engine_prereqs()
    if reason:
        print(f"skipped: {reason}")
        return 0
    skipped: dict[str, str] = {}
    checks = {"mooncake": "import msgpack, mooncake.engine",
              "nixl": "from nixl._api import nixl_agent"}
    for c in wanted:
        if c in checks:
            why = importable(checks[c], args.extra_path)
            if why:
                skipped[c] = (f"its packages do not import ({why}); scripts/install-python.sh "
                              f"--bench installs them")
                print(f"{c}: skipped: {skipped[c]}", flush=True)

    run_dir = Path(args.runs_dir) / time.strftime("vllm-connectors-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"engine logs and caches: {run_dir}", flush=True)
    from tiny_model import make_model

    model = str(make_model(Path(args.runs_dir) / "models" / "llama", "llama"))

    lease, tmo, tmo_b = args.lease, args.mooncake_timeout, args.mooncake_timeout_b
    all_cases = ("ident", "ttft", "E", "B", "A")
    plan: list[Setup] = []
    if "kvferry" in wanted:
        plan.append(Setup("kvferry", f"kvferry (lease {lease:g} s)", "kvferry", all_cases, lease))
    if "mooncake" in wanted and "mooncake" not in skipped:
        plan.append(Setup("mooncake", f"Mooncake (timeout {tmo:g} s)", "mooncake",
                          ("ident", "ttft", "E", "A"), tmo))
        if "B" in cases:
            plan.append(Setup("mooncake_b", f"Mooncake (timeout {tmo_b:g} s)", "mooncake",
                              ("B",), tmo_b))
    if "nixl" in wanted and "nixl" not in skipped:
        plan.append(Setup("nixl", f"NIXL (lease {int(lease)} s)", "nixl", all_cases, lease))
    plan = [s for s in plan if set(s.cases) & cases]
    plain = Setup("plain", "plain instance (no P/D)", "plain", ("ttft",), 0.0)
    results: dict[str, Any] = {
        "config": {"lease": lease, "mooncake_timeout": tmo, "mooncake_timeout_b": tmo_b,
                   "prompt": PROMPT, "output": OUTPUT, "p_blocks": P_BLOCKS,
                   "engine_args": ENGINE_ARGS, "p_args": P_ARGS, "d_args": D_ARGS,
                   "model": model, "run_dir": str(run_dir)},
        "setups": [asdict(s) for s in [plain, *plan]], "runs": {}, "skipped": skipped}
    bench_start = time.monotonic()
    live: list[Pair] = []          # every pair started and not stopped yet
    prelaunched: dict[str, Pair] = {}

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def stop(pair: Pair) -> None:
        pair.stop()
        if pair in live:
            live.remove(pair)

    signal.signal(signal.SIGTERM, on_term)
    status = 0
    reference = None
    try:
        for i, setup in enumerate(plan):
            following = plan[i + 1] if i + 1 < len(plan) else None
            was_prelaunched = setup.name in prelaunched
            if was_prelaunched:
                pairs = [prelaunched.pop(setup.name)]
                print(f"\n==== {setup.label}: started during the previous case A", flush=True)
            else:
                pairs = [Pair(setup, model, run_dir, args)]
                if i == 0:  # the plain instance starts with the first pair, and stops after it
                    pairs.insert(0, Pair(plain, model, run_dir, args))
                print(f"\n==== {setup.label}: starting "
                      f"{' and '.join(p.setup.name for p in pairs)}", flush=True)
                for p in pairs:
                    live.append(p)
                    p.launch()
            t = time.monotonic()
            try:
                for p in pairs:
                    p.wait_ready()
            except LaunchError as e:
                print(f"{setup.name}: skipped: an engine did not start: {e}", flush=True)
                skipped[setup.name] = f"an engine did not start: {str(e)[:300]}"
                for p in pairs:
                    stop(p)
                continue
            print(f"  ready in {time.monotonic() - t:.0f} s", flush=True)
            run: dict[str, Any] = {"start_s": time.monotonic() - t,
                                   "prelaunched": was_prelaunched}
            if pairs[0].setup.connector == "plain":
                reference = asyncio.run(case_reference(pairs[0]))
                results["reference"] = reference
                if "ttft" in cases:
                    results["runs"]["plain"] = {"ttft": asyncio.run(case_ttft(pairs[0]))}
                    print(f"  plain TTFT p50 "
                          f"{1000 * results['runs']['plain']['ttft']['ttft_median_s']:.0f} ms",
                          flush=True)
                stop(pairs[0])
            results["runs"][setup.name] = run
            pair = pairs[-1]

            def launch_following() -> None:
                # Called at D's kill in a case A whose P then holds the KV for a long timeout
                # (Mooncake's 60 s): the next setup's engines start meanwhile.
                if following is not None and setup.hold_s >= 30 and \
                        following.name not in prelaunched:
                    nxt = Pair(following, model, run_dir, args)
                    live.append(nxt)
                    nxt.launch()
                    prelaunched[following.name] = nxt

            steps = [("ident", lambda: case_ident(pair, reference)),
                     ("ttft", lambda: case_ttft(pair)),
                     ("E", lambda: case_e(pair, setup.hold_s, reference)),
                     ("B", lambda: case_b(pair, setup.hold_s, reference)),
                     ("A", lambda: case_a(pair, setup.hold_s, launch_following))]
            try:
                for case, fn in steps:
                    if case not in setup.cases or case not in cases:
                        continue
                    if case == "ident" and reference is None:
                        continue
                    t = time.monotonic()
                    run[case] = asyncio.run(measured(pair, fn))
                    brief = {k: v for k, v in run[case].items()
                             if k not in ("timeline", "d_timeline", "requests", "probes",
                                          "ok_by_arrival", "mismatches")}
                    print(f"  {case} ({time.monotonic() - t:.0f} s): {json.dumps(brief)[:600]}",
                          flush=True)
                    if case != "A":
                        async def settle(pair=pair) -> bool:
                            async with session_factory() as s:
                                return await wait_until(lambda: p_idle(s, pair), 20.0)
                        asyncio.run(settle())
            except Exception as e:  # a case that broke: say so, keep the others
                status = 1
                run["error"] = f"{type(e).__name__}: {e}"
                print(f"  {setup.name}: error: {run['error']}\n{pair.tail()}", flush=True)
            finally:
                stop(pair)
    except KeyboardInterrupt:
        print("interrupted: stopping every engine", flush=True)
        status = 130
    finally:
        for p in list(live):
            stop(p)
    results["wall_s"] = time.monotonic() - bench_start
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = report(results)
    print("\n" + text)
    pngs = plot(out, results)
    (out / "report.txt").write_text(text + "\n")
    print(f"\nresults: {out / 'results.json'}, {out / 'report.txt'}; plots: "
          f"{', '.join(pngs) or '-'}; logs: {run_dir}; {results['wall_s']:.0f} s in all")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
