"""A plain ``pip install .`` (no extras) into a fresh venv gives a working gateway, sidecar and emulator
without matplotlib, numpy or rich; the commands that need them say which extra to install.

Real venv, real pip, real subprocesses: what a user of the gateway alone gets.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def plain_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("plain") / "venv"
    made = _run(sys.executable, "-m", "venv", venv)
    assert made.returncode == 0, made.stderr
    pip = _run(venv / "bin" / "python", "-m", "pip", "install", "-q", ROOT, timeout=600)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    return venv


@pytest.mark.slow
def test_plain_install_has_no_bench_dependencies(plain_venv: Path) -> None:
    code = "import importlib.util as u; print(sorted(m for m in ('matplotlib', 'numpy', 'rich') if u.find_spec(m)))"
    out = _run(plain_venv / "bin" / "python", "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", ["serve", "sidecar", "emulate", "launch"])
def test_gateway_sidecar_and_emulator_run_without_them(plain_venv: Path, command: str) -> None:
    out = _run(plain_venv / "bin" / "kvroute", command, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout.lower()


@pytest.mark.slow
def test_the_modules_of_the_gateway_sidecar_and_emulator_import(plain_venv: Path) -> None:
    code = "import router.gateway.serve, router.store.redis, replica.agent, replica.emulator.server"
    out = _run(plain_venv / "bin" / "python", "-c", code)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["demo", "bench", "sim", "load"])
def test_bench_commands_name_the_extra(plain_venv: Path, command: str) -> None:
    out = _run(plain_venv / "bin" / "kvroute", command, "--help")
    assert out.returncode == 2 and "kvroute[bench]" in out.stderr, out.stdout + out.stderr
