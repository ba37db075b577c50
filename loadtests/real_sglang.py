"""Real SGLang servers on this machine's CPUs, for the conformance tests (``tests/real_sglang``) and
``kvroute bench peers --fleet real-sglang``.

Each server is ``kvroute launch --profile sglang-cpu-tiny`` (the runtime that
``replica/build_sglang_cpu_env.sh`` builds under ``$KVROUTE_SGLANG_HOME``): a real SGLang 0.5.23
serving a tiny random Qwen2, pinned to one CPU with ``OMP_NUM_THREADS=1`` and a small KV pool. It
takes 17-25 s to answer ``/health`` and ~2.4 GiB of memory. Each runs in its own process group (the
launcher execs SGLang, which starts its scheduler and detokenizer as children) and is stopped by that
group's id, by SIGKILL. Nothing is stopped by name.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from loadtests.procs import free_port, free_port_block
from replica.launch import sglang_python

__all__ = [
    "RealServer",
    "flush_caches",
    "get_json",
    "real_sglang_fleet",
    "runtime_missing",
    "start_real_server",
    "stop_real_server",
    "wait_healthy",
]

PROFILE = "sglang-cpu-tiny"


@dataclass
class RealServer:
    port: int
    cpu: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def id(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def runtime_missing() -> str | None:
    """Why no real server can start here (``None``: the runtime is built)."""
    if sglang_python(os.environ) is None:
        return (
            "the CPU SGLang runtime is not built: run `bash replica/build_sglang_cpu_env.sh` "
            "(or set KVROUTE_SGLANG_HOME / KVROUTE_SGLANG_PYTHON)"
        )
    return None


def start_real_server(
    port: int,
    cpu: int,
    *,
    log_dir: Path,
    max_total_tokens: int = 40_000,
    context_length: int | None = None,
    sets: Sequence[str] = (),
    extra_flags: Sequence[str] = (),
    dp_size: int = 1,
) -> RealServer:
    """Start one server (returns at once; :func:`wait_healthy` waits for it). With ``dp_size`` > 1 it
    runs that many data-parallel schedulers (each its own KV pool of ``max_total_tokens``), all on
    ``cpu``."""
    argv = [sys.executable, "-m", "router.cli", "launch", "--profile", PROFILE, "--port", str(port),
            "--cpus", str(cpu), "--set", f"max-total-tokens={max_total_tokens}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if dp_size > 1:
        argv += ["--set", f"dp-size={dp_size}"]
        # SGLang's CPU backend binds each rank's threads: without a list it wants a NUMA node per rank
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join([str(cpu)] * dp_size)
    if context_length is not None:
        argv += ["--set", f"context-length={context_length}"]
    for s in sets:
        argv += ["--set", s]
    if extra_flags:
        argv += ["--", *extra_flags]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"sglang-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group: stopped by that id, never by name
        )
    return RealServer(port=port, cpu=cpu, proc=proc, log_path=log_path, args=tuple(argv))


T = TypeVar("T")


def _blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on a loop of its own in a worker thread: these helpers are called from
    plain code and from coroutines alike (blocking them, as a fixture's setup does)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _request(method: str, url: str, timeout_s: float) -> tuple[int, bytes]:
    """One request on a fresh connection: (status, body); a connection or timeout failure is ``OSError``."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
            http.request(method, url) as r,
        ):
            return r.status, await r.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise OSError(f"{method} {url}: {exc!r}") from exc


def _get(url: str, timeout_s: float) -> tuple[int, bytes]:
    return _blocking(_request("GET", url, timeout_s))


def wait_healthy(servers: Sequence[RealServer], timeout_s: float = 180.0) -> None:
    """Until every server answers ``/health`` 200 (SGLang's takes >= 1 s: it runs a one-token request
    through the scheduler). Raises ``RuntimeError`` with the log tail if one exits or is late."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            if s.proc.poll() is not None:
                raise RuntimeError(f"SGLang on :{s.port} exited with {s.proc.returncode}:\n{s.log_tail()}")
            with contextlib.suppress(OSError):
                if _get(s.url + "/health", 5.0)[0] == 200:
                    pending.remove(s)
        if pending and time.monotonic() > deadline:
            tails = "\n".join(f"--- :{s.port}\n{s.log_tail()}" for s in pending)
            raise RuntimeError(f"SGLang not healthy after {timeout_s:.0f}s:\n{tails}")
        if pending:
            time.sleep(0.5)


def stop_real_server(s: RealServer) -> None:
    """SIGKILL the server's process group (the scheduler/detokenizer children may outlive the
    launcher). Not SIGTERM: nothing here needs SGLang's drain, and on a group SIGTERM its launcher
    sees the scheduler die first and spends 5 s on crash diagnostics (5.7 s to stop an idle server,
    0.2 s by SIGKILL; a test that drains sends its own SIGTERM)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(s.proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        s.proc.wait(10)


def kv_events_config(dp_size: int = 1) -> str:
    """SGLang's ``--kv-events-config`` publishing on free local ports (events and replay); it must
    ``bind``, or SGLang 0.5.23's publisher connects and nobody receives a thing. With ``dp_size`` > 1
    each rank binds both ports + its rank, so both come from one block of ``2 * dp_size`` ports that
    are all free now (checking only the bases once failed a CI run: the port after a free one may be
    a client connection's)."""
    events = free_port_block(2 * dp_size)
    replay = events + dp_size
    doc = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}", "bind": True,
           "replay_endpoint": f"tcp://127.0.0.1:{replay}"}  # fmt: skip
    return json.dumps(doc)


@contextlib.contextmanager
def real_sglang_fleet(
    n: int,
    *,
    log_dir: Path,
    max_total_tokens: int = 40_000,
    context_length: int | None = None,
    sets: Sequence[str] = (),
    extra_flags: Sequence[str] = (),
    kv_events: bool = False,
    timeout_s: float = 240.0,
    dp_size: int = 1,
) -> Iterator[list[RealServer]]:
    """``n`` real servers, server i pinned to the i-th CPU this process may use (round robin),
    started together; stopped (and their whole process groups) when the block exits. ``kv_events``:
    each publishes its KV events (:func:`kv_events_config`, ports of its own)."""
    cpus = sorted(os.sched_getaffinity(0))
    servers: list[RealServer] = []

    def start(i: int) -> RealServer:
        return start_real_server(
            free_port(), cpus[i % len(cpus)], log_dir=log_dir, max_total_tokens=max_total_tokens,
            context_length=context_length, extra_flags=extra_flags, dp_size=dp_size,
            sets=[*sets, f"kv-events-config={kv_events_config(dp_size)}"] if kv_events else sets,
        )  # fmt: skip

    try:
        servers.extend(start(i) for i in range(n))
        try:
            wait_healthy(servers, timeout_s)
        except RuntimeError:
            # SGLang exits when its own warm-up request times out (10 s), which servers starting
            # together on a busy machine can hit: each one that exited is started again, once, alone
            exited = [i for i, s in enumerate(servers) if s.proc.poll() is not None]
            if not exited:
                raise
            for i in exited:
                stop_real_server(servers[i])
                servers[i] = start(i)
                wait_healthy([servers[i]], timeout_s)
            wait_healthy(servers, timeout_s)
        yield servers
    finally:
        for s in servers:
            stop_real_server(s)


def flush_caches(urls: Sequence[str], timeout_s: float = 30.0) -> None:
    """``POST /flush_cache`` on every server (SGLang flushes once nothing is running: retried)."""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            with contextlib.suppress(OSError):
                if _blocking(_request("POST", url + "/flush_cache", 10.0))[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}/flush_cache did not succeed in {timeout_s:.0f}s")
            time.sleep(0.5)


def get_json(url: str, timeout_s: float = 10.0) -> Any:
    status, body = _get(url, timeout_s)
    if status != 200:
        raise RuntimeError(f"GET {url}: HTTP {status}")
    return json.loads(body)
