"""The code base stays typed (mypy strict on router/, replica/, loadtests/) and lint-clean (ruff).

Both tools are in the ``dev`` extra, which ``scripts/test.sh`` installs; a missing tool is a failure
under CI and a skip elsewhere.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci import missing

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        missing(f"{name} is not installed (pip install -e '.[dev]')")
    return path


@pytest.mark.slow
def test_mypy_strict_is_clean() -> None:
    out = subprocess.run([_tool("mypy")], check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_is_clean() -> None:
    out = subprocess.run(
        [_tool("ruff"), "check", "router", "replica", "loadtests", "tests"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:]
