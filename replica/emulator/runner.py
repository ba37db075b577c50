"""Run emulated replicas in-process: ``start_emulators`` / ``stop_emulators`` / ``running_emulators``.

    async with running_emulators(2, config=EmulatorConfig(profile=get_profile("small-test"),
                                                         time_scale=0.01)) as reps:
        urls = [r.url for r in reps]
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from aiohttp import web

from replica.emulator.kv_events import for_replica as kv_events_for_replica
from replica.emulator.server import REPLICA_KEY, EmulatorConfig, Replica, make_emulator_app

__all__ = ["Running", "running_emulators", "start_emulators", "stop_emulators"]


class _DropH2Probe(logging.Filter):
    """sglang-router probes every worker with an HTTP/2 preface (``PRI * HTTP/2.0``) before using
    HTTP/1.1; aiohttp logs that as an ERROR with a traceback. It is expected: drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and type(exc).__name__ == "BadHttpMessage" and "PRI" in str(exc))


_H2_FILTER = _DropH2Probe()


@dataclass(frozen=True, slots=True)
class Running:
    name: str
    url: str
    port: int
    app: web.Application
    runner: web.AppRunner

    @property
    def replica(self) -> Replica:
        return self.app[REPLICA_KEY]


async def start_emulators(
    n: int,
    host: str = "127.0.0.1",
    base_port: int = 0,
    config: EmulatorConfig | None = None,
    first_index: int = 0,
) -> list[Running]:
    """Serve ``n`` replicas on ``host``; ports ``base_port + i`` (or free ports if ``base_port`` is 0).
    Replica i is named ``replica-{first_index + i}``."""
    base = config or EmulatorConfig()
    server_log = logging.getLogger("aiohttp.server")
    if _H2_FILTER not in server_log.filters:
        server_log.addFilter(_H2_FILTER)
    out: list[Running] = []
    try:
        for i in range(n):
            port = 0 if base_port == 0 else base_port + i
            name = f"replica-{first_index + i}"
            kv = base.kv_events_config
            if kv is not None:  # each replica publishes on its own ports, one per rank
                kv = kv_events_for_replica(kv, first_index + i, stride=2 * base.dp_size)
            cfg = dataclasses.replace(base, name=name, host=host, port=port, kv_events_config=kv)
            app = make_emulator_app(cfg)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, host, port, reuse_address=True)
            try:
                await site.start()
            except BaseException:
                await runner.cleanup()  # not in ``out`` yet: the except below would miss it
                raise
            actual = _bound_port(runner) or port
            out.append(Running(name, f"http://{_url_host(host)}:{actual}", actual, app, runner))
    except BaseException:
        await stop_emulators(out)
        raise
    return out


async def stop_emulators(running: Sequence[Running]) -> None:
    for r in running:
        await r.runner.cleanup()


@contextlib.asynccontextmanager
async def running_emulators(
    n: int, host: str = "127.0.0.1", base_port: int = 0, config: EmulatorConfig | None = None
) -> AsyncIterator[list[Running]]:
    reps = await start_emulators(n, host, base_port, config)
    try:
        yield reps
    finally:
        await stop_emulators(reps)


def _bound_port(runner: web.AppRunner) -> int | None:
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return int(addr[1])
    return None


def _url_host(host: str) -> str:
    if host in {"0.0.0.0", ""}:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
