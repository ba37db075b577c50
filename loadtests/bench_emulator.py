"""``kvroute bench emulator``: CPU the emulator spends per request outside modelled time.

Starts one emulated replica in a subprocess (so the client's CPU is not counted), reads the
replica's own ``time.process_time()`` from ``/_emulator/state`` before and after a bounded run of
streamed chat requests, and prints JSON. Two workloads:

* ``coding``: closed-loop coding-agent sessions, ~100k-token prompts growing ~700 tokens a turn
  (so the prefix cache hits), ~216 output tokens (WEKA median), streamed with usage;
* ``coding_nonstream``: the same without streaming (isolates the per-body cost);
* ``small``: ~1k-token prompts, 32 output tokens, streamed.

Every decode step is streamed as its own SSE chunk (``--min-chunk-interval 0``), as at time
scale 1, so the per-chunk cost is counted; ``--time-scale`` only shortens the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.procs import read_urls, start_process, stop_process

__all__ = ["cli_main"]


@dataclass(frozen=True, slots=True)
class _Workload:
    name: str
    sessions: int
    turns: int
    base_tokens: int
    turn_tokens: int
    max_tokens: int
    stream: bool = True


def _text(n_tokens: int, tag: str) -> str:
    unit = f"[{tag}] def handler(x): return x * 2  # line\n"
    reps = n_tokens * 4 // len(unit) + 1
    return (unit * reps)[: n_tokens * 4]


async def _session(http: aiohttp.ClientSession, url: str, w: _Workload, sid: int, stats: dict[str, float]) -> None:
    msgs: list[dict[str, str]] = [{"role": "system", "content": _text(w.base_tokens, f"{w.name}-{sid}")}]
    await asyncio.sleep(0.05 * sid)  # stagger the sessions a little
    for turn in range(w.turns):
        msgs.append({"role": "user", "content": _text(w.turn_tokens, f"t{turn}")})
        req: dict[str, Any] = {"model": "m", "messages": msgs, "max_tokens": w.max_tokens, "stream": w.stream}
        if w.stream:
            req["stream_options"] = {"include_usage": True}
        body = json.dumps(req).encode()
        async with http.post(f"{url}/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json", "x-smg-routing-key": f"s{sid}"}) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            raw = await r.read()
        if w.stream:
            events = [e for e in raw.split(b"\n\n") if e]
            usage = json.loads(events[-2][6:])["usage"]
            content = "".join(
                (json.loads(e[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or "" for e in events[1:-3]
            )
        else:
            events = [raw]
            doc = json.loads(raw)
            usage, content = doc["usage"], doc["choices"][0]["message"]["content"]
        stats["requests"] += 1
        stats["chunks"] += len(events)
        stats["prompt_tokens"] += usage["prompt_tokens"]
        stats["cached_tokens"] += usage["prompt_tokens_details"]["cached_tokens"]
        msgs.append({"role": "assistant", "content": content})


async def _cpu(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/_emulator/state") as r:
        return float((await r.json())["cpu_s"])


async def _run(ns: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, "-m", "replica.emulator.cli", "--replicas", "1", "--profile", ns.profile,
            "--time-scale", str(ns.time_scale), "--min-chunk-interval", "0"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-emulator-") as tmp:
        proc = await start_process("emulator", argv, log_dir=Path(tmp), pipe_stdout=True)
        try:
            await read_urls(proc, 1, 30.0)
            return await _measure(ns, proc.url)
        finally:
            await stop_process(proc)


async def _measure(ns: argparse.Namespace, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {"profile": ns.profile, "time_scale": ns.time_scale, "workloads": {}}
    timeout = aiohttp.ClientTimeout(total=ns.max_seconds + 60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        c0 = await _cpu(http, url)
        await asyncio.sleep(1.0)
        idle = await _cpu(http, url) - c0
        out["idle_cpu_ms_per_s"] = round(idle * 1000, 3)
        workloads = [
            _Workload("coding", ns.sessions, ns.coding_turns, 100_000, 700, 216),
            _Workload("coding_nonstream", ns.sessions, ns.coding_turns, 100_000, 700, 216, stream=False),
            _Workload("small", ns.sessions, ns.small_turns, 1_000, 50, 32),
        ]
        for w in workloads:
            stats = {"requests": 0.0, "chunks": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0}
            c0 = await _cpu(http, url)
            t0 = time.monotonic()
            await asyncio.wait_for(
                asyncio.gather(*(_session(http, url, w, s, stats) for s in range(w.sessions))), ns.max_seconds
            )
            wall = time.monotonic() - t0
            cpu = await _cpu(http, url) - c0 - idle * wall  # minus the idle baseline
            n = stats["requests"]
            out["workloads"][w.name] = {
                "requests": int(n),
                "cpu_ms_per_request": round(cpu / n * 1000, 3),
                "sse_events_per_request": round(stats["chunks"] / n, 1),
                "prompt_tokens_mean": round(stats["prompt_tokens"] / n),
                "cached_fraction": round(stats["cached_tokens"] / max(1.0, stats["prompt_tokens"]), 4),
                "wall_s": round(wall, 2),
            }
    return out


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvroute bench emulator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="kimi-k2.6-b200-tp4")
    p.add_argument("--time-scale", type=float, default=0.05, help="wall s per modelled s for the run")
    p.add_argument("--sessions", type=int, default=4, help="concurrent closed-loop sessions")
    p.add_argument("--coding-turns", type=int, default=25, help="turns per coding session")
    p.add_argument("--small-turns", type=int, default=100, help="turns per small session")
    p.add_argument("--max-seconds", type=float, default=120.0, help="bound on each workload's wall time")
    ns = p.parse_args(argv)
    print(json.dumps(asyncio.run(_run(ns)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
