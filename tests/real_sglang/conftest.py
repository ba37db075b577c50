"""Real SGLang 0.5.23 servers for this package's tests (``loadtests/real_sglang.py``): two for the
fleet, each pinned to one CPU with ``OMP_NUM_THREADS=1``, a small KV pool (``POOL_TOKENS``), the tiny
random Qwen2 of ``replica/build_sglang_cpu_env.sh``, plus a spare one a test may kill and one whose
scheduler lets decodes step between prefill chunks (``INTERVAL_SETS``). Started once,
together (20-90 s on a busy machine), shared by every test here. Under CI a missing runtime or a
server that does not start is a failure; elsewhere the tests skip with the reason.

``RecordingProxy`` sits between the gateway and an engine and keeps the bytes the engine sent, so a
test can compare them with what the client received.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loadtests.procs import free_port
from loadtests.real_sglang import (
    RealServer,
    flush_caches,
    real_sglang_fleet,
    runtime_missing,
    start_real_server,
    stop_real_server,
    wait_healthy,
)
from tests.ci import missing
from tests.router.conftest import fake_replicas, gateway_factory  # noqa: F401 - fixtures used here

POOL_TOKENS = 12_000  # small enough that the cache test evicts, big enough for every prompt here
CONTEXT_TOKENS = 8_192
# the Responses API's store (previous_response_id, GET /v1/responses/{id}): a stored response lives
# in the engine that made it, which the gateway must find again
ENGINE_FLAGS = ("--enable-response-store",)


# the scheduler test's server (test_scheduler_fidelity.py): small prefill chunks, and after each one
# INTERVAL decode rounds while at least INTERVAL_MIN_BS requests decode
CHUNK_TOKENS, INTERVAL, INTERVAL_MIN_BS = 256, 4, 2
INTERVAL_SETS = (f"chunked-prefill-size={CHUNK_TOKENS}", f"prefill-decode-interval={INTERVAL}",
                 f"prefill-decode-interval-min-bs={INTERVAL_MIN_BS}")  # fmt: skip


@pytest.fixture(scope="package")
def real_servers() -> Iterator[list[RealServer]]:
    """Four servers started together (start-up dominates the wall time): the two of the fleet, one
    on each CPU, a third that a test may kill, and a fourth with ``INTERVAL_SETS``. Stopped when
    this package's tests are done."""
    why = runtime_missing()
    if why is not None:
        missing(why)
    with tempfile.TemporaryDirectory(prefix="kvroute-real-sglang-") as tmp:
        cpus = sorted(os.sched_getaffinity(0))
        interval = start_real_server(free_port(), cpus[-1], log_dir=Path(tmp), max_total_tokens=POOL_TOKENS,
                                     context_length=CONTEXT_TOKENS, sets=INTERVAL_SETS)  # fmt: skip
        try:
            with real_sglang_fleet(
                3,
                log_dir=Path(tmp),
                max_total_tokens=POOL_TOKENS,
                context_length=CONTEXT_TOKENS,
                extra_flags=ENGINE_FLAGS,
            ) as servers:
                wait_healthy([interval])
                yield [*servers, interval]
        except RuntimeError as exc:
            missing(f"real SGLang servers did not start: {exc}")
        finally:
            stop_real_server(interval)


def _cold(servers: list[RealServer]) -> list[RealServer]:
    """``servers``, each still running, with their radix caches emptied."""
    for s in servers:
        if s.proc.poll() is not None:
            pytest.fail(f"real SGLang on :{s.port} died earlier in the session:\n{s.log_tail()}")
    flush_caches([s.url for s in servers])
    return servers


@pytest.fixture
def fleet(real_servers: list[RealServer]) -> list[RealServer]:
    """The two fleet servers with empty radix caches (each test starts cold)."""
    return _cold(real_servers[:2])


@pytest.fixture
def interval_server(real_servers: list[RealServer]) -> RealServer:
    """The fourth server (``INTERVAL_SETS``), its radix cache empty."""
    return _cold(real_servers[3:])[0]


@pytest.fixture
def victim(real_servers: list[RealServer]) -> RealServer:
    """The third server, for a test that kills it (only one may)."""
    v = real_servers[2]
    if v.proc.poll() is not None:
        pytest.fail(f"the spare real SGLang on :{v.port} is already gone")
    return v


# ---- recording proxy -------------------------------------------------------------------------------


@dataclass
class RecordingProxy:
    """TCP proxy to ``target_port`` that records, per connection, every byte the target sent."""

    target_port: int
    down: list[bytearray] = field(default_factory=list)  # one buffer per accepted connection
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> RecordingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        buf = bytearray()
        self.down.append(buf)
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, rec: bytearray | None) -> None:
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                while data := await r.read(65536):
                    if rec is not None:
                        rec += data
                    w.write(data)
                    await w.drain()
            with contextlib.suppress(ConnectionError, OSError):
                w.close()

        tasks = [asyncio.create_task(pipe(cr, uw, None)), asyncio.create_task(pipe(ur, cw, buf))]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.difference_update(tasks)

    def responses(self) -> list[tuple[str, bytes]]:
        """Every HTTP response the target sent, in order: (head, de-chunked body)."""
        out: list[tuple[str, bytes]] = []
        for raw in self.down:
            data = bytes(raw)
            while data:
                head, sep, rest = data.partition(b"\r\n\r\n")
                if not sep:
                    break
                text = head.decode("latin-1")
                m = re.search(r"(?im)^content-length:\s*(\d+)", text)
                if m is not None:
                    n = int(m.group(1))
                    out.append((text, rest[:n]))
                    data = rest[n:]
                elif re.search(r"(?im)^transfer-encoding:\s*chunked", text):
                    body = bytearray()
                    while True:
                        size_line, _, rest = rest.partition(b"\r\n")
                        size = int(size_line.split(b";")[0], 16)
                        if size == 0:
                            rest = rest.partition(b"\r\n")[2]
                            break
                        body += rest[:size]
                        rest = rest[size + 2 :]
                    out.append((text, bytes(body)))
                    data = rest
                else:
                    out.append((text, rest))
                    data = b""
        return out


@pytest.fixture
async def recording_proxy() -> AsyncIterator[Callable[[int], Awaitable[RecordingProxy]]]:
    """A factory: ``await recording_proxy(engine_port)`` -> a started proxy (closed at teardown)."""
    started: list[RecordingProxy] = []

    async def make(port: int) -> RecordingProxy:
        proxy = await RecordingProxy(port).start()
        started.append(proxy)
        return proxy

    yield make
    for p in started:
        await p.close()
