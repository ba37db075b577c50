"""Child processes of the benchmarks and functional tests (emulators, gateways, sidecars).

``Procs`` starts each child with unbuffered output and quiet logs, remembers it, and ``cleanup()``
SIGKILLs whatever is still running (by the child's own pid) and closes its pipes, so a failed run
never leaves servers behind. ``read_line`` reads one line of a child's pipe without blocking the loop.
Once the caller has read what it waits for (a URL, "listening on"), ``drain`` keeps reading the
child's pipes: a pipe nobody reads fills (64 KiB) and then blocks the child on its next log line,
which froze a gateway mid-campaign in ``kvroute bench faults`` (warnings for ~260 cut streams).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import threading
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

    def drain(self, p: subprocess.Popen[bytes], keep: int = 200) -> collections.deque[bytes]:
        """Read ``p``'s pipes until they close (daemon threads); returns the last ``keep`` lines of
        its stderr (for a failure message). Call it once the caller reads nothing more itself."""
        tail: collections.deque[bytes] = collections.deque(maxlen=keep)
        for stream, sink in ((p.stdout, None), (p.stderr, tail)):
            if stream is not None:
                threading.Thread(target=_pump, args=(stream, sink), daemon=True).start()
        return tail

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


def _pump(stream: IO[bytes], sink: collections.deque[bytes] | None) -> None:
    with contextlib.suppress(OSError, ValueError):  # closed by cleanup()
        for line in stream:
            if sink is not None:
                sink.append(line)


async def read_line(stream: IO[bytes] | None, timeout_s: float = 60.0) -> str:
    """One line of a child's pipe (stripped); ``TimeoutError`` if none comes in time."""
    if stream is None:
        raise ValueError("the stream was not piped")
    line = await asyncio.wait_for(asyncio.to_thread(stream.readline), timeout_s)
    return bytes(line).decode().strip()
