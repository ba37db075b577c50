"""The fault campaign (``loadtests/faults.py``) end to end with real processes, bounded in time.

Two ``kvroute serve`` gateways on one real redis-server (behind the test TCP proxy), one ``kvroute
emulate`` process per replica, closed-loop streaming sessions; each fault runs for one short phase. For
every fault: no request is lost (each one completed or got a clear error), no phantom load remains in
the store or on the replicas, and CHR comes back to where it was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.faults import ALL_FAULTS, run_campaign

pytestmark = pytest.mark.slow


async def test_every_fault_loses_nothing_and_leaves_no_phantom_load() -> None:
    # short phases: sessions moved off a slow/killed replica are still warming up in the 2 s after
    out = await run_campaign(ALL_FAULTS, replicas=3, clients=10, phase_s=2.0, time_scale=0.2, seed=3, chr_tolerance=0.1)
    by = {r["fault"]: r for r in out["faults"]}
    assert list(by) == list(ALL_FAULTS)
    for name, r in by.items():
        assert r["lost"] == 0, (name, r)
        assert r["phantom_after"] == 0, (name, r)
        assert r["completed"] > 20, (name, r)  # the load really ran through the fault
        assert r["chr_before"] is not None and r["chr_before"] > 0.5, (name, r)
        assert r["chr_recovered"], (name, r)
    # faults the client can see are seen, and only as clean errors
    assert by["replica_break_midstream"]["error_kinds"].get("sse_error_event", 0) > 0
    assert by["replica_503"]["clean_errors"] <= by["replica_503"]["completed"] // 10  # retried elsewhere
    # a replica killed while clients were mid-stream on it: those streams end with an SSE error event,
    # the gateway itself stays up (no transport error reaches a client), the rest is retried
    kill = by["replica_sigkill"]
    assert kill["victim_streams_mid_way_at_kill"] >= 1, kill
    assert set(kill["error_kinds"]) <= {"sse_error_event"}, kill
    # only streams already under way on the victim (counted after the fact: at the kill, a stream's
    # first bytes can still sit in a socket buffer, so the count above is a lower bound)
    assert kill["stream_errors_not_under_way_at_kill"] == 0, kill
    # a killed gateway is seen by its clients only as transport errors, never as a silent loss
    assert by["gateway_sigkill"]["streams_mid_way_at_kill"] >= 1
    assert set(by["gateway_sigkill"]["error_kinds"]) <= {"ClientConnectorError", "ClientOSError",
                                                         "ServerDisconnectedError", "ClientPayloadError"}  # fmt: skip
    assert by["scale_up"]["admin_status"] == 201 and by["drain"]["admin_status"] == 200
    assert out["all_ok"] and out["total_lost"] == 0


def test_cli_rejects_unknown_faults() -> None:
    p = subprocess.run([sys.executable, "-m", "loadtests.faults", "--faults", "meteor_strike"],
                       capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert p.returncode == 2 and "meteor_strike" in p.stderr
    p = subprocess.run([sys.executable, "-m", "loadtests.faults", "--chr-tolerance", "2"],
                       capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert p.returncode == 2 and "bad arguments" in p.stderr


def test_cli_prints_json_for_one_fault(tmp_path: Path) -> None:
    # 1 s phases hold ~40 requests each: CHR before/after differ by a few hundredths by chance (seen in
    # CI: a 0.05 tolerance failed once), so this smoke run widens the tolerance; the campaign test
    # above checks recovery at the default with longer phases. The installed command, run outside the
    # checkout, as a user runs it (it once imported its TCP proxy from tests/)
    kvroute = str(Path(sys.executable).parent / "kvroute")
    p = subprocess.run([kvroute, "bench", "faults", "--faults", "replica_503", "--replicas", "2",
                        "--clients", "4", "--phase-s", "1", "--chr-tolerance", "0.25"],
                       capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["bench"] == "faults" and [r["fault"] for r in out["faults"]] == ["replica_503"]
    assert out["faults"][0]["lost"] == 0 and out["faults"][0]["completed"] > 0
    assert out["faults"][0]["chr_recovered"] is True and out["all_ok"] is True
