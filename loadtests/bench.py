"""``kvroute bench <peers|parity|overhead|emulator|redis|faults|restart|soak|probes|kv-events|sim|sweep>``: one entry for the benchmarks.

Each benchmark prints JSON (and a table on stderr); modules are imported lazily so that
``kvroute bench overhead`` does not import matplotlib and ``bench emulator`` imports no router.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["BENCHES", "cli_main", "emit_json"]

BENCHES: dict[str, tuple[str, str, str]] = {
    "peers": ("loadtests.bench_peers", "bench_peers_main", "kvroute vs sglang-router and vllm-router, same workload"),
    "parity": ("loadtests.parity", "cli_main", "the simulator against the live gateway, same workload"),
    "overhead": ("loadtests.overhead", "cli_main", "added latency and throughput: direct vs routers"),
    "emulator": ("loadtests.bench_emulator", "cli_main", "emulator CPU per request outside modelled time"),
    "redis": ("loadtests.bench_redis", "cli_main", "Redis round trips per request, Redis vs memory store"),
    "faults": ("loadtests.faults", "cli_main", "fault campaign under load: completed / clean errors / lost"),
    "restart": ("loadtests.bench_restart", "cli_main", "a gateway on embedded state restarts: where sessions go next"),
    "soak": ("loadtests.soak", "cli_main", "connection scale: idle + active streams against one gateway"),
    "probes": ("loadtests.bench_probes", "cli_main", "what probing many replicas costs relayed requests"),
    "kv-events": ("loadtests.bench_kv_events", "cli_main", "exact residency: cost per KV event, memory per session"),
    "sweep": ("loadtests.sweep", "cli_main", "policy variants vs the default, paired by seed, simulated bench"),
    "sim": ("loadtests.bench_sim", "cli_main", "the simulator on 1,000 replicas: wall, CPU, peak RSS, measures"),
}


def emit_json(doc: Any, path: str | Path | None = None) -> None:
    """A benchmark's result: JSON on stdout and, when ``path`` is given, the same in that file."""
    text = json.dumps(doc, indent=2)
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


def _usage() -> str:
    lines = ["usage: kvroute bench <benchmark> [options]", "", "benchmarks:"]
    lines += [f"  {name:<9} {help_}" for name, (_, _, help_) in BENCHES.items()]
    return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    name = argv[0]
    if name not in BENCHES:
        print(f"kvroute bench: unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func, _ = BENCHES[name]
    module = importlib.import_module(module_name)
    rc: int = getattr(module, func)(argv[1:])
    return rc
