"""Which asyncio event loop kvroute's processes run on (gateway, emulator, load driver), and how
their background tasks stop.

uvloop when it is installed (a Linux/macOS dependency; about a third less CPU per proxied request),
else asyncio's default. ``KVROUTE_NO_UVLOOP=1`` opts out. No I/O here: the caller passes its env.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

__all__ = ["RECANCEL_S", "event_loop_factory", "run", "stop_tasks"]

T = TypeVar("T")

RECANCEL_S = 0.1  # a task still running this long after its cancel is asked again


def event_loop_factory(env: Mapping[str, str]) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if env.get("KVROUTE_NO_UVLOOP", "") not in ("", "0"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], env: Mapping[str, str]) -> T:
    """``asyncio.run`` on the loop ``event_loop_factory(env)`` picks."""
    with asyncio.Runner(loop_factory=event_loop_factory(env)) as runner:
        return runner.run(main)


async def stop_tasks(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the running ``tasks`` (``None`` and finished ones are left alone) and wait until every
    one has ended; then raise the first exception one ended with other than its cancellation.

    A cancellation can be lost: on Python 3.11, ``asyncio.wait_for`` returns its result when the
    inner call finishes as the cancel lands, and redis-py sends every command through one when a
    socket timeout is set. A loop whose cancel was lost runs on and a plain ``await task`` waits for
    ever, so a task still running ``RECANCEL_S`` after its cancel is cancelled again."""
    running = [t for t in tasks if t is not None and not t.done()]
    for t in running:
        t.cancel()
    pending = set(running)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
        for t in pending:
            t.cancel()
    for t in running:
        exc = None if t.cancelled() else t.exception()
        if exc is not None:
            raise exc
