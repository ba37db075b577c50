"""Child processes of the benchmarks and functional tests (emulators, gateways, sidecars).

``Procs`` starts each child with unbuffered output and quiet logs, remembers it, and ``cleanup()``
SIGKILLs whatever is still running (by the child's own pid) and closes its pipes, so a failed run
never leaves servers behind. ``read_line`` reads one line of a child's pipe without blocking the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping
from typing import IO

__all__ = ["Procs", "read_line"]


class Procs:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.items: list[subprocess.Popen[bytes]] = []
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVROUTE_LOG_LEVEL": "warning", **(env or {})}

    def start(self, args: list[str], stderr_pipe: bool = False) -> subprocess.Popen[bytes]:
        """Start ``args`` with stdout piped; stderr piped only when asked (else discarded)."""
        p = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if stderr_pipe else subprocess.DEVNULL,
            env=self._env,
        )
        self.items.append(p)
        return p

    def cleanup(self) -> None:
        for p in self.items:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.items:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()


async def read_line(stream: IO[bytes] | None, timeout_s: float = 60.0) -> str:
    """One line of a child's pipe (stripped); ``TimeoutError`` if none comes in time."""
    if stream is None:
        raise ValueError("the stream was not piped")
    line = await asyncio.wait_for(asyncio.to_thread(stream.readline), timeout_s)
    return bytes(line).decode().strip()
