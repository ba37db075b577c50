"""The suite's watchdog (tests/conftest.py): a test that swallows pytest-timeout's failure ends the
run with every thread's stack instead of hanging CI."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HUNG = '''
import time

def test_swallows_the_timeout():
    while True:
        try:
            time.sleep(0.05)
        except BaseException:  # as an event loop's callback does
            pass

def test_after():
    pass
'''


def test_a_test_that_swallows_its_timeout_ends_the_run_with_its_stack(tmp_path: Path) -> None:
    (tmp_path / "test_hung.py").write_text(HUNG)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-o", "timeout=1", "--rootdir", str(tmp_path), str(tmp_path / "test_hung.py")],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert "Timeout" in proc.stderr  # faulthandler's dump
    assert "test_swallows_the_timeout" in proc.stderr
    assert took < 30
    assert "test_after" not in proc.stdout and "passed" not in proc.stdout
