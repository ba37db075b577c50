"""``loadtests.procs``: children whose pipes are drained never block on a full pipe; free ports."""

from __future__ import annotations

import asyncio
import json
import socket
import sys

from loadtests.procs import Procs, read_line
from loadtests.real_sglang import kv_events_config

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


def test_kv_events_ports_are_free_for_every_rank() -> None:
    """``kv_events_config(n)``: rank r binds the events and replay bases + r, so all 2n ports are
    free when it returns and the two blocks do not overlap (CI once failed on a rank's port that a
    client connection held: only the base had been checked)."""
    for n in (1, 2, 4):
        doc = json.loads(kv_events_config(n))
        bases = [int(doc[k].rsplit(":", 1)[1]) for k in ("endpoint", "replay_endpoint")]
        ports = [b + r for b in bases for r in range(n)]
        assert len(set(ports)) == 2 * n, ports
        socks = []
        try:
            for p in ports:  # bound at once: every rank's publisher and replay socket could start
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
        finally:
            for s in socks:
                s.close()
