"""Clocks. The core never reads time itself: a clock is injected (the simulator brings a virtual one)."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "SystemClock", "VirtualClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (not wall time)."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """A clock the simulator or a test moves by hand."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"virtual time cannot go back: {t} < {self._t}")
        self._t = t

    def advance(self, dt: float) -> None:
        self.set(self._t + dt)
