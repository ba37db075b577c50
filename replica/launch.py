"""``kvroute launch``: start a real SGLang replica from a named deployment profile.

Rules:
  1. The command is built by pure functions (:func:`load_profile`, :func:`build_command`); only
     :func:`cli_main` touches argv, the environment and ``os.execvpe``.
  2. sglang is never imported here (this module is reachable from the ``kvroute`` console script,
     which the gateway shares). ``--check`` validates a command with SGLang's own parser by running
     ``prepare_server_args`` in a *separate* interpreter that has sglang installed
     (``--sglang-python``, ``$KVROUTE_SGLANG_PYTHON``, else the CPU SGLang environment that
     ``replica/build_sglang_cpu_env.sh`` builds under ``$KVROUTE_SGLANG_HOME``).
  3. Profiles are YAML files in ``replica/profiles/`` (or any path). Flag names are SGLang's, without
     the leading ``--``. ``true`` emits a bare flag, ``false``/``null`` omits it, mappings are
     emitted as compact JSON, lists as repeated values. String values may use ``${VAR}`` or
     ``${VAR:-default}``, expanded from the environment at launch (a missing ``${VAR}`` is an error
     naming it). ``${KVROUTE_SGLANG_HOME}`` always has a value: the variable, else
     ``${XDG_CACHE_HOME:-~/.cache}/kvroute/sglang-cpu`` (:func:`sglang_home`); so has
     ``${KVROUTE_SGLANG_CPU_DTYPE}``: the variable, else the dtype this CPU runs fastest (:func:`cpu_dtype`).

Profile schema::

    name: kimi-k2.6-b200-tp4
    description: one line
    module: sglang.launch_server      # run as ``python -m <module>``
    python: path                      # optional interpreter (``--python`` wins); placeholders expand
    env: {NAME: value}                # exported to the server process
    args: {model-path: ..., tp-size: 4, enable-metrics: true, ...}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from router.errors import ConfigError

__all__ = [
    "PROFILES_DIR",
    "SGLANG_HOME_ENV",
    "LaunchCommand",
    "LaunchProfile",
    "ParserCheck",
    "available_profiles",
    "build_command",
    "check_with_sglang",
    "cli_main",
    "cpu_dtype",
    "cpu_flags",
    "launch_environ",
    "load_profile",
    "render_flags",
    "sglang_home",
    "sglang_python",
]

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
SGLANG_PYTHON_ENV = "KVROUTE_SGLANG_PYTHON"  # an explicit sglang interpreter (overrides the home's)
SGLANG_HOME_ENV = "KVROUTE_SGLANG_HOME"
CPU_DTYPE_ENV = "KVROUTE_SGLANG_CPU_DTYPE"  # the CPU profile's --dtype (default: cpu_dtype of this CPU)
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})

_FLAG_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")

ArgValue = str | int | float | bool | None | list[Any] | dict[str, Any]


@dataclass(frozen=True, slots=True)
class LaunchProfile:
    name: str
    description: str = ""
    module: str = "sglang.launch_server"
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[tuple[str, ArgValue], ...] = ()  # in file order
    source: str = ""  # path it was read from
    python: str = ""  # interpreter the profile wants ("" = the caller's --python)


@dataclass(frozen=True, slots=True)
class LaunchCommand:
    argv: tuple[str, ...]  # full argv: python -m module flags...
    env: tuple[tuple[str, str], ...] = ()  # variables set on top of the inherited environment

    @property
    def server_flags(self) -> tuple[str, ...]:
        """The flags after ``python -m module`` (what SGLang's parser sees)."""
        return self.argv[3:]

    def shell(self) -> str:
        prefix = [f"{k}={shlex.quote(v)}" for k, v in self.env]
        return " ".join([*prefix, *(shlex.quote(a) for a in self.argv)])


@dataclass(frozen=True, slots=True)
class ParserCheck:
    ok: bool
    output: str  # what the sglang interpreter printed (JSON summary or the parser's error)
    resolved: dict[str, Any] = field(default_factory=dict)


# ---- pure core -------------------------------------------------------------------------------------


def sglang_home(environ: Mapping[str, str]) -> Path:
    """Where ``replica/build_sglang_cpu_env.sh`` keeps the CPU SGLang runtime (venv + tiny model):
    ``$KVROUTE_SGLANG_HOME``, else ``${XDG_CACHE_HOME:-~/.cache}/kvroute/sglang-cpu``."""
    explicit = environ.get(SGLANG_HOME_ENV)
    if explicit:
        return Path(explicit)
    cache = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(cache) / "kvroute" / "sglang-cpu"


def sglang_python(environ: Mapping[str, str]) -> str | None:
    """An interpreter with sglang installed: ``$KVROUTE_SGLANG_PYTHON``, else the built runtime's
    (only once its build finished: ``READY`` is written last), else ``None``."""
    explicit = environ.get(SGLANG_PYTHON_ENV)
    if explicit:
        return explicit
    home = sglang_home(environ)
    py = home / "venv" / "bin" / "python"
    return str(py) if (home / "READY").is_file() and py.exists() else None


def cpu_dtype(cpu_flags: frozenset[str]) -> str:
    """The dtype a CPU runs fastest: ``bfloat16`` only where it has bf16 instructions (AVX512-BF16 or
    AMX); without them torch emulates bf16 and the tiny engine runs 1.4x slower than in float32
    (docs/REAL_SGLANG.md §1)."""
    return "bfloat16" if cpu_flags & _BF16_FLAGS else "float32"


def launch_environ(environ: Mapping[str, str], cpu_flags: frozenset[str]) -> dict[str, str]:
    """``environ`` with what profiles expand always set: ``KVROUTE_SGLANG_HOME`` (:func:`sglang_home`)
    and ``KVROUTE_SGLANG_CPU_DTYPE`` (the variable, else :func:`cpu_dtype` of ``cpu_flags``)."""
    return {
        **environ,
        SGLANG_HOME_ENV: str(sglang_home(environ)),
        CPU_DTYPE_ENV: environ.get(CPU_DTYPE_ENV) or cpu_dtype(cpu_flags),
    }


def available_profiles(directory: Path = PROFILES_DIR) -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in directory.glob("*.yaml")))


def _resolve_profile_path(name_or_path: str, directory: Path) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in {".yaml", ".yml"} or os.sep in name_or_path:
        if not candidate.is_file():
            raise ConfigError(f"launch profile file not found: {name_or_path}")
        return candidate
    path = directory / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(available_profiles(directory)) or "(none)"
        raise ConfigError(f"unknown launch profile {name_or_path!r}; known: {known}")
    return path


def parse_profile(data: Any, source: str = "<memory>") -> LaunchProfile:
    """Validate a decoded YAML document into a :class:`LaunchProfile` (errors name the key)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a profile must be a mapping")
    unknown = set(data) - {"name", "description", "module", "python", "env", "args"}
    if unknown:
        raise ConfigError(f"{source}: unknown profile keys {sorted(unknown)}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{source}: 'name' must be a non-empty string")
    module = data.get("module", "sglang.launch_server")
    if not isinstance(module, str) or not re.fullmatch(r"[A-Za-z_][\w.]*", module):
        raise ConfigError(f"{source}: 'module' must be a dotted module name")
    env_raw = data.get("env") or {}
    if not isinstance(env_raw, Mapping):
        raise ConfigError(f"{source}: 'env' must be a mapping")
    env: list[tuple[str, str]] = []
    for k, v in env_raw.items():
        if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ConfigError(f"{source}: env name {k!r} is not a valid variable name")
        if isinstance(v, bool):
            v = "1" if v else "0"
        if not isinstance(v, str | int | float):
            raise ConfigError(f"{source}: env.{k} must be a scalar")
        env.append((k, str(v)))
    args_raw = data.get("args") or {}
    if not isinstance(args_raw, Mapping):
        raise ConfigError(f"{source}: 'args' must be a mapping of flag name -> value")
    args: list[tuple[str, ArgValue]] = []
    for k, v in args_raw.items():
        if not isinstance(k, str) or not _FLAG_NAME.fullmatch(k):
            raise ConfigError(f"{source}: args key {k!r} must be a flag name like 'tp-size' (no leading --)")
        if not isinstance(v, str | int | float | bool | list | dict) and v is not None:
            raise ConfigError(f"{source}: args.{k} has unsupported type {type(v).__name__}")
        args.append((k, v))
    description = data.get("description", "")
    python = data.get("python", "")
    if not isinstance(python, str):
        raise ConfigError(f"{source}: 'python' must be a path")
    return LaunchProfile(
        name=name,
        description=str(description),
        module=module,
        env=tuple(env),
        args=tuple(args),
        source=source,
        python=python,
    )


def load_profile(name_or_path: str, directory: Path = PROFILES_DIR) -> LaunchProfile:
    path = _resolve_profile_path(name_or_path, directory)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    return parse_profile(data, source=str(path))


def expand_placeholders(value: str, environ: Mapping[str, str], where: str) -> str:
    def sub(m: re.Match[str]) -> str:
        var, default = m.group(1), m.group(2)
        if var in environ and environ[var] != "":
            return environ[var]
        if default is not None:
            return default
        raise ConfigError(f"{where} needs environment variable {var} (no default)")

    return _PLACEHOLDER.sub(sub, value)


def _scalar(value: str | float, environ: Mapping[str, str], where: str) -> str:
    if isinstance(value, str):
        return expand_placeholders(value, environ, where)
    return str(value)


def render_flags(
    args: Sequence[tuple[str, ArgValue]], environ: Mapping[str, str], source: str = "profile"
) -> list[str]:
    """Profile ``args`` -> argv flags, in order."""
    out: list[str] = []
    for name, value in args:
        flag = f"--{name}"
        where = f"{source}: args.{name}"
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"), sort_keys=True)]
        elif isinstance(value, list):
            if not value:
                continue
            items = []
            for item in value:
                if not isinstance(item, str | int | float) or isinstance(item, bool):
                    raise ConfigError(f"{where}: list items must be strings or numbers")
                items.append(_scalar(item, environ, where))
            out += [flag, *items]
        else:
            out += [flag, _scalar(value, environ, where)]
    return out


def _flag_names(flags: Sequence[str]) -> set[str]:
    return {f.split("=", 1)[0] for f in flags if f.startswith("--")}


def build_command(
    profile: LaunchProfile,
    *,
    python: str,
    environ: Mapping[str, str],
    overrides: Sequence[tuple[str, ArgValue]] = (),
    extra: Sequence[str] = (),
) -> LaunchCommand:
    """The full server command.

    ``overrides`` replace (or add) profile args by flag name, keeping the profile's order.
    ``extra`` are raw flags appended last; a profile flag that ``extra`` repeats verbatim is dropped
    so the command names each flag once (aliases such as ``--tp`` resolve last-wins in argparse).
    """
    merged: dict[str, ArgValue] = dict(profile.args)
    for name, value in overrides:
        merged[name] = value
    flags = render_flags(list(merged.items()), environ, profile.source or profile.name)
    if extra:
        repeated = _flag_names(extra)
        kept: list[str] = []
        skip_values = False
        for tok in flags:
            if tok.startswith("--"):
                skip_values = tok.split("=", 1)[0] in repeated
                if not skip_values:
                    kept.append(tok)
            elif not skip_values:
                kept.append(tok)
        flags = kept + list(extra)
    env = tuple(
        (k, expand_placeholders(v, environ, f"{profile.source or profile.name}: env.{k}"))
        for k, v in profile.env
    )
    return LaunchCommand(argv=(python, "-m", profile.module, *flags), env=env)


# SGLang's own parser, run inside the sglang interpreter. Prints one JSON line.
_CHECK_SCRIPT = r"""
import json, sys
flags = json.loads(sys.argv[1])
try:
    from sglang.srt.server_args import prepare_server_args
except Exception as exc:  # noqa: BLE001 - report any import failure as a check failure
    print(json.dumps({"ok": False, "error": f"cannot import sglang: {exc!r}"}))
    sys.exit(3)
try:
    args = prepare_server_args(flags)
except SystemExit as exc:
    print(json.dumps({"ok": False, "error": f"argparse exited with {exc.code}"}))
    sys.exit(2)
except Exception as exc:  # noqa: BLE001
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(2)
import sglang
keys = ["model_path", "served_model_name", "tp_size", "quantization", "dtype", "kv_cache_dtype",
        "enable_hierarchical_cache", "hicache_ratio", "hicache_write_policy", "speculative_algorithm",
        "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_num_draft_tokens", "reasoning_parser", "tool_call_parser", "enable_metrics",
        "enable_cache_report", "context_length", "mem_fraction_static", "chunked_prefill_size",
        "max_running_requests", "host", "port"]
resolved = {k: getattr(args, k, None) for k in keys}
print(json.dumps({"ok": True, "sglang": sglang.__version__, "resolved": resolved}, default=str))
"""


def check_with_sglang(command: LaunchCommand, sglang_python: str, timeout_s: float = 120.0) -> ParserCheck:
    """Parse ``command``'s flags with SGLang's ``prepare_server_args`` in ``sglang_python``."""
    proc = subprocess.run(
        [sglang_python, "-c", _CHECK_SCRIPT, json.dumps(list(command.server_flags))],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    summary: dict[str, Any] = {}
    if lines:
        try:
            summary = json.loads(lines[-1])
        except json.JSONDecodeError:
            summary = {}
    # argparse prints the whole 500-flag usage before its one-line verdict: keep the verdict.
    err_lines = proc.stderr.strip().splitlines()
    verdict = [ln for ln in err_lines if ": error:" in ln] or err_lines[-20:]
    output = "\n".join([*lines[-1:], *verdict]).strip()
    ok = proc.returncode == 0 and bool(summary.get("ok"))
    return ParserCheck(ok=ok, output=output, resolved=dict(summary.get("resolved") or {}))


# ---- shell -----------------------------------------------------------------------------------------


def _parse_set(items: Sequence[str]) -> list[tuple[str, ArgValue]]:
    out: list[tuple[str, ArgValue]] = []
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.removeprefix("--")
        if not sep or not _FLAG_NAME.fullmatch(name):
            raise ConfigError(f"--set expects flag-name=value, got {item!r}")
        value: ArgValue = yaml.safe_load(raw) if raw else ""
        if not isinstance(value, str | int | float | bool | list | dict) and value is not None:
            raise ConfigError(f"--set {name}: unsupported value {raw!r}")
        out.append((name, value))
    return out


def _parse_cpus(text: str) -> set[int]:
    """``0``, ``0,2`` or ``0-3`` (taskset -c's list form) -> a set of CPU numbers."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise ConfigError(f"--cpus expects a list like 0 or 0,1 or 0-3, got {text!r}") from None
    if not cpus or min(cpus) < 0:
        raise ConfigError(f"--cpus expects a list like 0 or 0,1 or 0-3, got {text!r}")
    return cpus


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute launch",
        description="Build and exec `python -m sglang.launch_server` from a deployment profile. "
        "Flags after `--` are passed to SGLang verbatim (and win over the profile's).",
    )
    p.add_argument("--profile", default="kimi-k2.6-b200-tp4", help="profile name or YAML path")
    p.add_argument("--profiles-dir", type=Path, default=PROFILES_DIR, help="where named profiles live")
    p.add_argument("--list", action="store_true", help="list the available profiles and exit")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("--json", action="store_true", help="with --dry-run: print {argv, env} as JSON")
    p.add_argument("--host", help="override the profile's --host")
    p.add_argument("--port", type=int, help="override the profile's --port")
    p.add_argument("--model-path", help="override the profile's --model-path (e.g. a local volume)")
    p.add_argument(
        "--set", action="append", default=[], metavar="FLAG=VALUE", help="override one profile arg"
    )
    p.add_argument(
        "--python",
        default=None,
        help="interpreter that has sglang installed (default: the profile's, else this one)",
    )
    p.add_argument(
        "--cpus",
        default=None,
        metavar="LIST",
        help="pin the server to these CPUs, e.g. 0 or 0,1 (like taskset -c; Linux only)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="validate the command with SGLang's own parser (in --sglang-python) and exit",
    )
    p.add_argument(
        "--sglang-python",
        default=None,
        help=f"interpreter for --check (default ${SGLANG_PYTHON_ENV}, else the built CPU runtime's "
        f"under ${SGLANG_HOME_ENV}, else --python)",
    )
    return p


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``; none known elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cli_main(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        own, extra = argv[:cut], argv[cut + 1 :]
    else:
        own, extra = argv, []
    args = _parser().parse_args(own)
    environ = launch_environ(os.environ, cpu_flags())
    try:
        if args.list:
            for name in available_profiles(args.profiles_dir):
                prof = load_profile(name, args.profiles_dir)
                print(f"{name:<32} {prof.description}")
            return 0
        profile = load_profile(args.profile, args.profiles_dir)
        overrides = _parse_set(args.set)
        if args.host is not None:
            overrides.append(("host", args.host))
        if args.port is not None:
            if not 0 < args.port < 65536:
                raise ConfigError(f"--port must be 1..65535, got {args.port}")
            overrides.append(("port", args.port))
        if args.model_path is not None:
            overrides.append(("model-path", args.model_path))
        python = args.python or (
            expand_placeholders(profile.python, environ, f"{profile.source}: python")
            if profile.python
            else sys.executable
        )
        cpus = _parse_cpus(args.cpus) if args.cpus is not None else None
        command = build_command(profile, python=python, environ=environ, overrides=overrides, extra=extra)
    except ConfigError as exc:
        print(f"kvroute launch: {exc}", file=sys.stderr)
        return 2

    if args.check:
        sglang_py = args.sglang_python or sglang_python(environ) or python
        result = check_with_sglang(command, sglang_py)
        print(result.output)
        return 0 if result.ok else 1
    if args.dry_run:
        if args.json:
            print(json.dumps({"argv": list(command.argv), "env": dict(command.env)}, indent=2))
        else:
            print(command.shell())
        return 0
    child_env = {**environ, **dict(command.env)}
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)  # inherited through exec by the server and its children
        except (OSError, AttributeError) as exc:
            print(f"kvroute launch: cannot pin to CPUs {sorted(cpus)}: {exc}", file=sys.stderr)
            return 2
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command.argv[0], list(command.argv), child_env)  # does not return
    except OSError as exc:
        print(f"kvroute launch: cannot run {command.argv[0]}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
