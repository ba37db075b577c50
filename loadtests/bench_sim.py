"""``kvroute bench sim``: what a large simulated fleet costs to run, and what it measured.

Runs ``kvroute sim`` (by default the 1,000-replica synthetic fleet of issue 22: 300 s, 100 s
warm-up, seed 1, ``kv_aware`` and ``hash``) in a subprocess and prints JSON: wall and CPU seconds,
peak RSS, and per policy the DESIGN §7 measures it got. CPU and RSS come from
``resource.getrusage``: CPU is this process plus its waited-for children (the simulation and its
``--jobs`` workers); ``peak_rss_mb`` is the largest single process among them (``ru_maxrss`` is a
per-process peak, never a sum).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtests.bench import emit_json

__all__ = ["cli_main", "run_bench"]

MEASURES = ("chr", "ideal_chr", "ttft_p99_s", "ttft_floor_p99_s", "engine_queue_p99_s", "engine_queue_share", "requests", "dispersion", "dispersion_floor", "dispersion_sticky", "dispersion_between",
            "p_load_ge12", "sessions_moved", "cold_prefill_by_cause")
"""The fields of each policy's measures the benchmark reports (``loadtests/measures.py``)."""


def sim_argv(ns: argparse.Namespace, json_path: Path) -> list[str]:
    argv = [
        "--workload", "synthetic",
        "--replicas", str(ns.replicas),
        "--duration", str(ns.duration),
        "--warmup", str(ns.warmup),
        "--seed", str(ns.seed),
        "--policies", ns.policies,
        "--gateways", str(ns.gateways),
        "--state-lag-s", str(ns.state_lag_s),
        "--jobs", str(ns.jobs),
        "--json", str(json_path),
        "--quiet",
    ]  # fmt: skip
    return argv


def _cpu_s(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def run_bench(ns: argparse.Namespace) -> dict[str, Any]:
    """Run the simulation once in a child process; the figures as ``cli_main`` prints them."""
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-sim-") as tmp:
        out = Path(tmp) / "sim.json"
        argv = sim_argv(ns, out)
        self0, children0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "loadtests.sim.cli", *argv]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=ns.timeout_s)
        wall = time.perf_counter() - t0
        self1, children1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"kvroute sim exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        measures: dict[str, dict[str, Any]] = json.loads(out.read_text())
    cpu = _cpu_s(self1) - _cpu_s(self0) + _cpu_s(children1) - _cpu_s(children0)
    return {
        "command": "kvroute sim " + " ".join(sim_argv(ns, Path("OUT.json"))),
        "replicas": ns.replicas,
        "gateways": ns.gateways,
        "state_lag_s": ns.state_lag_s,
        "jobs": ns.jobs,
        "duration_s": ns.duration,
        "warmup_s": ns.warmup,
        "seed": ns.seed,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        # ru_maxrss is in KiB on Linux; RUSAGE_CHILDREN's is the largest waited-for descendant
        "peak_rss_mb": round(max(self1.ru_maxrss, children1.ru_maxrss) / 1024, 1),
        "policies": {p: {k: m.get(k) for k in MEASURES} for p, m in measures.items()},
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute bench sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--replicas", type=int, default=1000)
    p.add_argument("--duration", type=float, default=300.0, help="simulated seconds with new turns")
    p.add_argument("--warmup", type=float, default=100.0, help="simulated seconds excluded from the measures")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--policies", default="kv_aware,hash")
    p.add_argument("--gateways", type=int, default=1)
    p.add_argument("--state-lag-s", type=float, default=0.0, help="with --gateways > 1, e.g. 0.1")
    p.add_argument("--jobs", type=int, default=2,
                   help="worker processes for the policies (kvroute sim --jobs; default 2, one per policy)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="bound on the simulation's wall time")
    p.add_argument("--json", type=Path, help="also write the JSON here")
    return p


def cli_main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    if ns.replicas < 1 or ns.gateways < 1 or ns.jobs < 1:
        print("kvroute bench sim: --replicas, --gateways and --jobs must be >= 1", file=sys.stderr)
        return 2
    if ns.duration <= 0 or ns.warmup < 0:
        print("kvroute bench sim: --duration must be > 0 and --warmup >= 0", file=sys.stderr)
        return 2
    try:
        result = run_bench(ns)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"kvroute bench sim: {exc}", file=sys.stderr)
        return 1
    emit_json(result, ns.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
