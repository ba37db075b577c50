"""A command's child processes, read from /proc: for tests that a CLI which starts a fleet stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> set[int]:
    """Pids whose parent is ``pid`` (the benches start each child in its own session)."""
    kids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (fields := _stat(int(d.name))) is not None and int(fields[1]) == pid:
            kids.add(int(d.name))
    return kids


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def sigterm_when(proc: subprocess.Popen[bytes], ready: Callable[[], bool], *, timeout_s: float = 60.0) -> int:
    """Once ``ready()`` holds (polled), SIGTERM ``proc``; assert that it exits non-zero within 30 s
    and that every child it had started is gone within 15 s more. Returns its exit code. Whatever
    is left is killed, so a failing test leaves no fleet behind."""
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None and not ready():
            time.sleep(0.2)
        kids = children(proc.pid)
        assert proc.poll() is None, f"exited ({proc.returncode}) before it was ready"
        assert kids, "it started no child process"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        assert rc != 0  # interrupted, not a finished run
        deadline = time.monotonic() + 15
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [k for k in kids if alive(k)], "its fleet outlived it"
        return rc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for k in kids:
            if alive(k):
                os.killpg(k, signal.SIGKILL)
