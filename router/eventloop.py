"""Which asyncio event loop kvroute's processes run on (gateway, emulator, load driver).

uvloop when it is installed (a Linux/macOS dependency; about a third less CPU per proxied request),
else asyncio's default. ``KVROUTE_NO_UVLOOP=1`` opts out. No I/O here: the caller passes its env.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

__all__ = ["event_loop_factory", "run"]

T = TypeVar("T")


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
