"""``kvroute`` console script: one entry, subcommands dispatched to the module that owns them.

Each subcommand module exposes ``cli_main(argv: list[str]) -> int`` and is imported lazily, so
``kvroute serve`` never imports the simulator, matplotlib or sglang. The demo, simulator, load driver
and benchmarks need the ``bench`` extra (rich, matplotlib); without it they say so and exit 2.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import signal
import sys
from types import FrameType

__all__ = ["SUBCOMMANDS", "main"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.gateway.serve", "run the gateway"),
    "demo": ("loadtests.demo", "gateway + emulated replicas + coding-agent load, live view, report"),
    "emulate": ("replica.emulator.cli", "serve SGLang-compatible emulated replicas"),
    "sim": ("loadtests.sim.cli", "discrete-event fleet simulation of routing policies"),
    "load": ("loadtests.live", "closed-loop HTTP load driver against any OpenAI-compatible URL"),
    "bench": ("loadtests.bench", "benchmarks: peers, parity, overhead, sim, kv-events, redis, faults, ..."),
    "sidecar": ("replica.agent", "replica sidecar: register, heartbeat, drain"),
    "launch": ("replica.launch", "launch a real SGLang replica from a deployment profile"),
}

# commands that start fleets of child processes (each in its own session) and stop them in
# ``finally``: SIGTERM must unwind to those blocks, not end the process and orphan the fleet
_STARTS_FLEETS = frozenset({"bench", "demo"})
# commands whose live views, tables and plots come from the ``bench`` extra
_NEEDS_BENCH_EXTRA = frozenset({"bench", "demo", "load", "sim"})
_BENCH_EXTRA = ("rich", "matplotlib")


_terminated = False


def _unwind_on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _terminated
    if _terminated:  # already unwinding: the ``finally`` blocks have their own SIGKILL deadlines
        return
    _terminated = True
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not inside ``asyncio.run``: unwind from here
        raise SystemExit(128 + signum) from None
    # Inside ``asyncio.run``: cancel its tasks, as Ctrl-C does, so they unwind with the event loop
    # intact. An exception raised from the handler can land inside the loop's own bookkeeping and
    # lose the wake-up that a ``finally`` block's ``await`` is waiting for.
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.call_soon_threadsafe(lambda: None)  # wake the loop if it sleeps in select()


def _usage() -> str:
    lines = ["usage: kvroute <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "kvroute <command> --help for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from router import __version__

        print(f"kvroute {__version__}")
        return 0
    cmd = args[0]
    if cmd not in SUBCOMMANDS:
        print(f"kvroute: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    missing = [m for m in _BENCH_EXTRA if cmd in _NEEDS_BENCH_EXTRA and importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"kvroute {cmd} needs {', '.join(missing)}: pip install 'kvroute[bench]' "
            "(scripts/demo.sh and scripts/test.sh install it)",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(SUBCOMMANDS[cmd][0])
    if cmd not in _STARTS_FLEETS:
        rc: int = module.cli_main(args[1:])
        return rc
    signal.signal(signal.SIGTERM, _unwind_on_sigterm)
    try:
        rc = module.cli_main(args[1:])
    except (asyncio.CancelledError, KeyboardInterrupt):
        if not _terminated:
            raise
        return 128 + signal.SIGTERM
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
