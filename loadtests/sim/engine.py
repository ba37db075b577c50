"""The event loop: a heap of ``(time, seq, handler, arg)`` (vidur style, STYLE §2).

Handlers are plain callables ``handler(t, arg)`` that may schedule further events. ``seq`` is a
monotone counter, so events at the same time run in the order they were scheduled: a run is a
deterministic function of its inputs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from router.clock import VirtualClock

__all__ = ["EventLoop", "Handler"]

Handler = Callable[[float, Any], None]


class EventLoop:
    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock or VirtualClock()
        self._heap: list[tuple[float, int, Handler, Any]] = []
        self._seq = 0
        self.processed = 0

    @property
    def now(self) -> float:
        return self.clock.now()

    def at(self, t: float, handler: Handler, arg: Any = None) -> None:
        """Run ``handler(t, arg)`` at virtual time ``t`` (not before now)."""
        now = self.clock.now()
        t = max(t, now)
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, handler, arg))

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None) -> None:
        """Process events in time order until the heap is empty or the next one is after ``until``."""
        heap = self._heap
        clock = self.clock
        pop = heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                clock.set(max(clock.now(), until))
                return
            t, _, handler, arg = pop(heap)
            clock.set(t)
            handler(t, arg)
            self.processed += 1
