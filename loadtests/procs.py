"""Child processes of the benchmarks and functional tests (emulators, gateways, routers, sidecars),
and the free ports they listen on. The only place in the tree that starts processes or picks ports.

Rules:
  1. A child is stopped by the pid (or process group) we recorded, never by name.
  2. ``start_process`` (async): the child runs in its own process group with its output in a log
     file (stdout piped on request: ``read_urls``); ``stop_process`` sends SIGTERM to the group,
     then SIGKILL after a grace period.
  3. ``Procs`` (sync, for harnesses that read a child's pipes line by line): each child with
     unbuffered output and quiet logs; ``cleanup()`` SIGKILLs whatever still runs and closes its
     pipes, so a failed run never leaves servers behind. Once the caller has read what it waits for,
     ``drain`` keeps reading the child's pipes: a pipe nobody reads fills (64 KiB) and then blocks the
     child on its next log line.
  4. ``free_port``: a port the OS considers free right now (a small race remains; each child gets
     its own).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = [
    "Procs",
    "RunningProcess",
    "free_port",
    "read_line",
    "read_urls",
    "start_process",
    "stop_process",
]


def free_port(max_port: int = 65535) -> int:
    """A free TCP port on 127.0.0.1, at most ``max_port`` (a Redis Cluster node also needs port + 10000)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port <= max_port:
            return port
    raise OSError(f"no free port <= {max_port}")


def free_port_block(n: int, max_port: int = 65535) -> int:
    """The first of ``n`` consecutive TCP ports on 127.0.0.1 that are free now (for a publisher per
    data-parallel rank at port + rank)."""
    for _ in range(200):
        base = free_port(max_port - n + 1)
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"no {n} consecutive free ports")


@dataclass(slots=True)
class RunningProcess:
    name: str
    proc: asyncio.subprocess.Process
    log_path: Path
    url: str = ""
    urls: list[str] = field(default_factory=list)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


async def start_process(
    name: str,
    argv: Sequence[str],
    *,
    log_dir: Path,
    pipe_stdout: bool = False,
    env: Mapping[str, str] | None = None,
) -> RunningProcess:
    """``argv`` in its own process group, output to ``log_dir``; ``env`` is added to ours."""
    log_path = log_dir / f"{name.replace(' ', '_').replace('/', '_')}.log"
    log = log_path.open("wb")
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=None if env is None else {**os.environ, **env},
            stdout=asyncio.subprocess.PIPE if pipe_stdout else log,
            stderr=log,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # its own process group: we stop exactly what we started
        )
    finally:
        log.close()
    return RunningProcess(name=name, proc=proc, log_path=log_path)


async def stop_process(p: RunningProcess, grace_s: float = 10.0) -> None:
    """SIGTERM the process group we started, SIGKILL it after ``grace_s``."""
    if p.proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(p.proc.wait(), timeout=grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.proc.pid, signal.SIGKILL)
        await p.proc.wait()


async def read_urls(p: RunningProcess, n: int, timeout_s: float) -> None:
    """Fill ``p.urls`` from the ``http...`` lines a child started with ``pipe_stdout`` prints, one
    per server, once each listens (``kvroute emulate``, ``bench probes``' static replicas)."""
    assert p.proc.stdout is not None
    while len(p.urls) < n:
        line = await asyncio.wait_for(p.proc.stdout.readline(), timeout=timeout_s)
        if not line:
            raise RuntimeError(f"{p.name} exited ({p.proc.returncode}):\n{p.log_tail()}")
        text = line.decode().strip()
        if text.startswith("http"):
            p.urls.append(text)
    p.url = p.urls[0]




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
