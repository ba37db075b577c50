"""``loadtests.procs``: children whose pipes are drained never block on a full pipe."""

from __future__ import annotations

import asyncio
import sys

from loadtests.procs import Procs, read_line

# writes a ready line, then ~400 kB of log to stderr (six times a pipe's 64 KiB), then exits
_CHATTY = (
    "import sys; print('ready', flush=True); "
    "[sys.stderr.write(f'warning {i} ' + 'x' * 1000 + chr(10)) for i in range(400)]; sys.stderr.flush()"
)


async def test_a_drained_child_logs_without_blocking() -> None:
    procs = Procs()
    try:
        p = procs.start([sys.executable, "-c", _CHATTY], stderr_pipe=True)
        assert await read_line(p.stdout) == "ready"
        tail = procs.drain(p, keep=5)
        assert p.wait(20) == 0  # an undrained stderr pipe would hold it in its write
        for _ in range(200):  # the pump threads read to the end of the pipe
            if tail and tail[-1].startswith(b"warning 399 "):
                break
            await asyncio.sleep(0.01)
        assert len(tail) == 5 and tail[-1].startswith(b"warning 399 ")
    finally:
        procs.cleanup()
