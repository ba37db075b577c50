"""``kvroute emulate``: serve N SGLang-compatible emulated replicas.

    kvroute emulate --replicas 4 --base-port 31001 --profile kimi-k2.6-b200-tp4 --time-scale 0.01

Prints one URL per line on stdout once every replica listens, then serves until SIGTERM/SIGINT.
``--processes`` runs one OS process per replica (this process supervises them). Every profile
field is a flag (``--kv-capacity-tokens 400000``); ``--set field=value`` does the same.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from replica.emulator.kv_events import KvEventsConfig
from replica.emulator.profiles import PROFILES, Profile, get_profile, parse_overrides
from replica.emulator.runner import Running, running_emulators, start_emulators, stop_emulators
from replica.emulator.server import EmulatorConfig
from router.eventloop import run as run_on_loop

__all__ = [
    "Running",
    "build_config",
    "cli_main",
    "parser",
    "running_emulators",
    "start_emulators",
    "stop_emulators",
]

_PROFILE_FLAGS = [f for f in dataclasses.fields(Profile) if f.name != "name"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute emulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=1, help="number of replicas (default 1)")
    p.add_argument("--base-port", type=int, default=0, help="port of replica 0; replica i gets base+i (0 = free ports)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--profile", default="kimi-k2.6-b200-tp4", choices=sorted(PROFILES))
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per modelled second (0.01 = 100x faster)")
    p.add_argument("--processes", action="store_true", help="one OS process per replica")
    p.add_argument("--first-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a profile field")
    g = p.add_argument_group("server")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--stream-interval", type=int, default=0, help="tokens per SSE chunk (0 = one chunk per decode step)")
    g.add_argument("--min-chunk-interval", type=float, default=0.002, help="min wall seconds between SSE chunks")
    g.add_argument("--disable-cache-report", action="store_true", help="usage.prompt_tokens_details = null")
    g.add_argument("--stream-response-default-include-usage", action="store_true")
    g.add_argument("--incremental-streaming-output", action="store_true")
    g.add_argument("--default-max-tokens", type=int, default=128)
    g.add_argument(
        "--get-load-format",
        choices=("sglang", "vllm", "off"),
        default="off",
        help="what /get_load answers: off = 404 as SGLang 0.5.23; sglang/vllm = older shapes for "
        "power_of_two peers",
    )
    g.add_argument("--startup-delay", type=float, default=0.0, help="/health is 503 for this many wall seconds")
    g.add_argument("--api-key", default=None)
    g.add_argument("--enable-response-store", action="store_true",
                   help="/v1/responses keeps responses in memory (previous_response_id, background, "
                        "GET/cancel of a stored response), as SGLang's flag")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="SGLang's KV-event publisher config, e.g. '{\"publisher\":\"zmq\",\"endpoint\":"
                        "\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\"}'; replica i adds 2i to both "
                        "ports (2i x --dp-size with ranks, rank r publishes on port + r); a '*' port binds a "
                        "free one (docs/EMULATOR.md)")
    g.add_argument("--dp-size", type=int, default=1,
                   help="SGLang's --dp-size: data-parallel schedulers per replica, each with the profile's "
                        "engine and KV pool; requests go round robin unless they name a rank "
                        "(X-Data-Parallel-Rank, routed_dp_rank)")
    pf = p.add_argument_group("profile fields (override the chosen profile)")
    for f in _PROFILE_FLAGS:
        t = str(f.type)
        pf.add_argument("--" + f.name.replace("_", "-"), dest="pf_" + f.name, default=None,
                        type=int if t == "int" else float if t == "float" else str)
    return p


def build_config(ns: argparse.Namespace) -> EmulatorConfig:
    overrides: dict[str, Any] = dict(parse_overrides(ns.set))
    for f in _PROFILE_FLAGS:
        v = getattr(ns, "pf_" + f.name)
        if v is not None:
            overrides[f.name] = v
    profile = get_profile(ns.profile).with_overrides(**overrides)
    return EmulatorConfig(
        profile=profile,
        served_model_name=ns.served_model_name,
        time_scale=ns.time_scale,
        host=ns.host,
        stream_interval=ns.stream_interval,
        min_chunk_interval_s=ns.min_chunk_interval,
        enable_cache_report=not ns.disable_cache_report,
        stream_response_default_include_usage=ns.stream_response_default_include_usage,
        incremental_streaming_output=ns.incremental_streaming_output,
        default_max_tokens=ns.default_max_tokens,
        get_load_format=ns.get_load_format,
        startup_delay_s=ns.startup_delay,
        api_key=ns.api_key,
        kv_events_config=_kv_events(ns.kv_events_config, ns.dp_size),
        enable_response_store=ns.enable_response_store,
        dp_size=ns.dp_size,
    )


def _kv_events(raw: str | None, dp_size: int) -> str | None:
    if raw is None:
        return None
    KvEventsConfig.from_cli(raw).check_ranks(dp_size)  # a bad config is a usage error, before anything starts
    return raw


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _serve_in_process(ns: argparse.Namespace, config: EmulatorConfig) -> int:
    stop = _stop_event()
    try:
        reps = await start_emulators(ns.replicas, ns.host, ns.base_port, config, first_index=ns.first_index)
    except OSError as exc:  # a port in use, a host not ours: one line, as ``kvroute serve`` says it
        ports = str(ns.base_port) if ns.replicas == 1 else f"{ns.base_port}-{ns.base_port + ns.replicas - 1}"
        # one write: with --processes sibling children share stderr, and print's separate newline
        # write let two children's lines interleave
        sys.stderr.write(f"kvroute emulate: cannot listen on {ns.host}:{ports}: {exc}\n")
        sys.stderr.flush()
        return 1
    try:
        for r in reps:
            print(r.url)
        sys.stdout.flush()
        await stop.wait()
    finally:
        await stop_emulators(reps)
    return 0


async def _serve_processes(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    stop = _stop_event()
    child_args = _strip_args(list(argv), {"--replicas", "--base-port", "--first-index"}, {"--processes"})
    children: list[asyncio.subprocess.Process] = []
    urls: list[str] = []
    rc = 0
    try:
        for i in range(ns.replicas):
            port = 0 if ns.base_port == 0 else ns.base_port + i
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "replica.emulator.cli", *child_args, "--replicas", "1",
                "--base-port", str(port), "--first-index", str(ns.first_index + i),
                stdout=asyncio.subprocess.PIPE,
            )
            children.append(proc)
        for proc in children:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            if not line:
                print("kvroute emulate: a replica process failed to start", file=sys.stderr)
                return 1
            urls.append(line.decode().strip())
        for u in urls:
            print(u)
        sys.stdout.flush()
        waits = [asyncio.ensure_future(p.wait()) for p in children]
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait([stopper, *waits], return_when=asyncio.FIRST_COMPLETED)
        if stopper not in done:
            print("kvroute emulate: a replica process exited", file=sys.stderr)
            rc = 1
        stopper.cancel()
    finally:
        for proc in children:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in children:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    return rc


def _strip_args(argv: list[str], with_value: set[str], flags: set[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            continue
        if name in with_value:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def cli_main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    if ns.replicas < 1:
        print("kvroute emulate: --replicas must be >= 1", file=sys.stderr)
        return 2
    if ns.base_port and not 1 <= ns.base_port <= 65536 - ns.replicas:  # the OS would wrap 99999 to 34463
        print(f"kvroute emulate: --base-port {ns.base_port}: ports base..base+{ns.replicas - 1} must be "
              "1-65535 (0: free ports)", file=sys.stderr)
        return 2
    try:
        config = build_config(ns)
    except ValueError as exc:
        print(f"kvroute emulate: {exc}", file=sys.stderr)
        return 2
    if ns.processes and ns.replicas > 1:
        return run_on_loop(_serve_processes(ns, argv), os.environ)
    return run_on_loop(_serve_in_process(ns, config), os.environ)


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
