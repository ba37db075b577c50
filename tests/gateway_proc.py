"""``kvroute serve`` as a real subprocess, for tests of what only the CLI wires up (env config,
admin mounting, start-up errors). Its stderr (the JSON logs) goes to a file the test can read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without any ``KVROUTE_*`` setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env.update(extra)
    return env


class Serve:
    """A running ``kvroute serve``: its URL and its log file."""

    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.asynccontextmanager
async def serve_gateway(*args: str, env: dict[str, str]) -> AsyncIterator[Serve]:
    """Start ``kvroute serve --port 0 --host 127.0.0.1 *args`` under ``clean_env(env)``, wait until
    it listens (30 s), yield it; SIGTERM on exit (SIGKILL after 15 s)."""
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-serve-"))
    log = tmp / "stderr.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router", "serve", "--port", "0", "--host", "127.0.0.1", *args,
            env=clean_env(env), stdout=asyncio.subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        url = ""
        async with asyncio.timeout(30):
            while not url:
                assert proc.returncode is None, log.read_text()
                for line in log.read_text(errors="replace").splitlines():
                    if line.startswith("kvroute gateway listening on "):
                        url = line.rsplit(" ", 1)[1].strip()
                await asyncio.sleep(0.05)
        yield Serve(url, log)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(15):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
