"""`kvroute launch`: profiles -> SGLang command; validated with SGLang's own parser when available."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from replica.launch import (
    PROFILES_DIR,
    SGLANG_PYTHON_ENV,
    available_profiles,
    build_command,
    check_with_sglang,
    cpu_dtype,
    cpu_flags,
    launch_environ,
    load_profile,
    parse_profile,
    sglang_home,
    sglang_python,
)
from router.errors import ConfigError

# Env needed to expand every shipped profile (DFlash has no public draft model to default to).
PROFILE_ENV = {"KVROUTE_DFLASH_DRAFT_MODEL_PATH": "/models/kimi-k2.6-dflash-draft"}
KVROUTE = [sys.executable, "-m", "router.cli"]


def _flag_value(flags: tuple[str, ...], name: str) -> str | None:
    for i, tok in enumerate(flags):
        if tok == name:
            return flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else ""
    return None


def _sglang_python() -> str | None:
    """An interpreter that can import sglang's parser: ``$KVROUTE_SGLANG_PYTHON``, the CPU runtime
    built under ``$KVROUTE_SGLANG_HOME`` (replica/build_sglang_cpu_env.sh), or this one."""
    c = sglang_python(os.environ)
    if c and Path(c).exists():
        return c
    try:
        import sglang.srt.server_args  # noqa: F401
    except ImportError:
        return None
    return sys.executable


def _require_sglang() -> str:
    """The sglang interpreter; without one a skip locally, a failure under CI (``scripts/test.sh``
    builds it there), so a missing parser cannot hide behind a green run."""
    py = _sglang_python()
    if py is None:
        why = f"sglang not importable and no ${SGLANG_PYTHON_ENV}: build it with replica/build_sglang_cpu_env.sh"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return py


def test_reference_profile_has_the_reference_flags() -> None:
    profile = load_profile("kimi-k2.6-b200-tp4")
    cmd = build_command(profile, python="python", environ={})
    flags = cmd.server_flags
    assert cmd.argv[:3] == ("python", "-m", "sglang.launch_server")
    expected = {
        "--tp-size": "4",
        "--quantization": "modelopt_fp4",
        "--kv-cache-dtype": "fp8_e4m3",
        "--hicache-ratio": "2",
        "--speculative-algorithm": "EAGLE3",
        "--reasoning-parser": "kimi_k2",
        "--tool-call-parser": "kimi_k2",
        "--model-path": "nvidia/Kimi-K2.6-NVFP4",
        "--host": "0.0.0.0",
        "--port": "30000",
    }
    for flag, value in expected.items():
        assert _flag_value(flags, flag) == value, flag
    for bare in (
        "--enable-hierarchical-cache",
        "--enable-metrics",
        "--enable-cache-report",
        "--trust-remote-code",
    ):
        assert _flag_value(flags, bare) == "", bare
    # every flag named once
    names = [t for t in flags if t.startswith("--")]
    assert len(names) == len(set(names))
    assert dict(cmd.env)["HF_HOME"] == "/models/hf"


def test_placeholders_come_from_the_environment() -> None:
    profile = load_profile("kimi-k2.6-b200-tp4")
    cmd = build_command(profile, python="py", environ={"KVROUTE_MODEL_PATH": "/models/k26", "HF_HOME": "/hf"})
    assert _flag_value(cmd.server_flags, "--model-path") == "/models/k26"
    assert dict(cmd.env)["HF_HOME"] == "/hf"


def test_missing_required_placeholder_names_the_variable() -> None:
    profile = load_profile("kimi-k2.6-b200-tp4-dflash")
    with pytest.raises(ConfigError, match="KVROUTE_DFLASH_DRAFT_MODEL_PATH"):
        build_command(profile, python="py", environ={})


def test_overrides_and_extra_flags_replace_profile_flags() -> None:
    profile = load_profile("kimi-k2.6-b200-tp4")
    cmd = build_command(
        profile,
        python="py",
        environ={},
        overrides=[("port", 31001), ("enable-cache-report", False), ("schedule-policy", "lpm")],
        extra=["--max-running-requests", "32", "--mem-fraction-static=0.85"],
    )
    flags = cmd.server_flags
    assert _flag_value(flags, "--port") == "31001"
    assert "--enable-cache-report" not in flags
    assert _flag_value(flags, "--schedule-policy") == "lpm"
    assert flags.count("--max-running-requests") == 1
    assert flags[-3:] == ("--max-running-requests", "32", "--mem-fraction-static=0.85")
    assert _flag_value(flags, "--mem-fraction-static") is None  # dropped from the profile part
    assert "0.9" not in flags


def test_render_value_kinds() -> None:
    profile = parse_profile(
        {
            "name": "t",
            "args": {
                "model-path": "m",
                "extra-metric-labels": {"pool": "a", "az": "b"},
                "lora-paths": ["x", "${LP:-y}"],
                "disable-radix-cache": False,
                "watchdog-timeout": 600,
                "schedule-policy": None,
            },
        }
    )
    flags = build_command(profile, python="py", environ={}).server_flags
    assert flags == (
        "--model-path",
        "m",
        "--extra-metric-labels",
        '{"az":"b","pool":"a"}',
        "--lora-paths",
        "x",
        "y",
        "--watchdog-timeout",
        "600",
    )


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ([], "mapping"),
        ({"args": {}}, "'name'"),
        ({"name": "x", "bogus": 1}, "unknown profile keys"),
        ({"name": "x", "args": {"--tp-size": 4}}, "no leading --"),
        ({"name": "x", "args": {"tp-size": {1, 2}}}, "unsupported type"),
        ({"name": "x", "env": {"1BAD": "v"}}, "valid variable name"),
        ({"name": "x", "module": "not a module"}, "dotted module"),
    ],
)
def test_bad_profiles_are_rejected_with_the_key(doc: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_profile(doc, source="t.yaml")


def test_unknown_profile_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match="kimi-k2.6-b200-tp4"):
        load_profile("no-such-profile")


def test_cli_dry_run_prints_the_command() -> None:
    out = subprocess.run(
        [
            *KVROUTE,
            "launch",
            "--profile",
            "kimi-k2.6-b200-tp4",
            "--dry-run",
            "--json",
            "--port",
            "31005",
            "--",
            "--max-running-requests",
            "16",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    doc = json.loads(out.stdout)
    argv = tuple(doc["argv"])
    assert argv[1:3] == ("-m", "sglang.launch_server")
    assert _flag_value(argv, "--port") == "31005"
    assert _flag_value(argv, "--max-running-requests") == "16"
    assert doc["env"]["HF_HOME"]
    shell = subprocess.run(
        [*KVROUTE, "launch", "--profile", "kimi-k2.6-b200-tp4", "--dry-run"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "-m sglang.launch_server" in shell and "--quantization modelopt_fp4" in shell


def test_cli_errors_exit_2_with_message() -> None:
    res = subprocess.run(
        [*KVROUTE, "launch", "--profile", "kimi-k2.6-b200-tp4-dflash", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "KVROUTE_DFLASH_DRAFT_MODEL_PATH"},
    )
    assert res.returncode == 2
    assert "KVROUTE_DFLASH_DRAFT_MODEL_PATH" in res.stderr


def test_cli_execs_the_server_module(tmp_path: Path) -> None:
    """Without --dry-run the launcher really execs `python -m <module> flags` with the profile env."""
    (tmp_path / "fake_server.py").write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'hf': os.environ.get('HF_HOME'), 'pid': os.getpid()}))\n"
    )
    profile = tmp_path / "fake.yaml"
    profile.write_text(
        "name: fake\nmodule: fake_server\nenv: {HF_HOME: /x/hf}\nargs:\n  model-path: m\n  port: 1\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run(
        [*KVROUTE, "launch", "--profile", str(profile), "--port", "4242", "--", "--enable-metrics"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["argv"] == ["--model-path", "m", "--port", "4242", "--enable-metrics"]
    assert doc["hf"] == "/x/hf"


# ---- SGLang's own parser -------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in available_profiles() if n.startswith("kimi-")])
def test_every_production_profile_passes_sglangs_parser(name: str) -> None:
    py = _require_sglang()
    profile = load_profile(name, PROFILES_DIR)
    cmd = build_command(profile, python="python", environ=PROFILE_ENV)
    result = check_with_sglang(cmd, py)
    assert result.ok, result.output
    resolved = result.resolved
    assert resolved["tp_size"] == 4
    assert resolved["quantization"] == "modelopt_fp4"
    assert resolved["kv_cache_dtype"] == "fp8_e4m3"
    assert resolved["enable_hierarchical_cache"] is True
    assert resolved["hicache_ratio"] == 2.0
    assert resolved["reasoning_parser"] == resolved["tool_call_parser"] == "kimi_k2"
    assert resolved["enable_metrics"] is True and resolved["enable_cache_report"] is True
    assert resolved["speculative_algorithm"] in {"EAGLE3", "DFLASH"}


def test_cpu_tiny_profile_passes_sglangs_parser() -> None:
    py = _require_sglang()
    cmd = build_command(
        load_profile("sglang-cpu-tiny"), python="python",
        environ=launch_environ({"KVROUTE_SGLANG_HOME": "/h"}, frozenset({"avx2"})),
    )
    result = check_with_sglang(cmd, py)
    assert result.ok, result.output
    r = result.resolved
    assert r["model_path"] == "/h/model/tiny-qwen2" and r["tp_size"] == 1 and r["dtype"] == "float32"
    assert r["enable_metrics"] is True and r["enable_cache_report"] is True
    assert r["host"] == "127.0.0.1"


def test_sglangs_parser_rejects_a_bad_choice() -> None:
    """The check is real: `--quantization nvfp4` is not an SGLang choice (nvfp4 is a KV dtype only)."""
    py = _require_sglang()
    cmd = build_command(
        load_profile("kimi-k2.6-b200-tp4"), python="python", environ={}, overrides=[("quantization", "nvfp4")]
    )
    result = check_with_sglang(cmd, py)
    assert not result.ok
    assert "invalid choice: 'nvfp4'" in result.output


def test_cli_check_uses_the_sglang_interpreter() -> None:
    py = _require_sglang()
    res = subprocess.run(
        [*KVROUTE, "launch", "--profile", "kimi-k2.6-b200-tp4", "--check", "--sglang-python", py],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["resolved"]["speculative_algorithm"] == "EAGLE3"


def test_build_script_is_valid_bash() -> None:
    script = Path(__file__).resolve().parents[2] / "replica" / "build_sglang_cpu_env.sh"
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, "-n", str(script)], check=True, timeout=30)


def test_cli_reports_a_missing_interpreter() -> None:
    res = subprocess.run(
        [*KVROUTE, "launch", "--python", "/nonexistent/python3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 127 and "cannot run /nonexistent/python3" in res.stderr


# ---- the CPU runtime (sglang-cpu-tiny) -----------------------------------------------------------


def test_sglang_home_is_a_user_cache_dir_never_a_fixed_path(tmp_path: Path) -> None:
    assert sglang_home({"KVROUTE_SGLANG_HOME": "/x/y"}) == Path("/x/y")
    assert sglang_home({"XDG_CACHE_HOME": "/c", "HOME": "/u"}) == Path("/c/kvroute/sglang-cpu")
    assert sglang_home({"HOME": "/u"}) == Path("/u/.cache/kvroute/sglang-cpu")
    # only a finished build counts: READY is written last
    home = tmp_path / "rt"
    (home / "venv" / "bin").mkdir(parents=True)
    (home / "venv" / "bin" / "python").write_text("")
    assert sglang_python({"KVROUTE_SGLANG_HOME": str(home)}) is None
    (home / "READY").write_text("x\n")
    assert sglang_python({"KVROUTE_SGLANG_HOME": str(home)}) == str(home / "venv" / "bin" / "python")
    assert sglang_python({"KVROUTE_SGLANG_HOME": str(home), SGLANG_PYTHON_ENV: "/p"}) == "/p"


def test_the_cpu_profile_runs_bf16_only_where_the_cpu_has_bf16_instructions() -> None:
    # without them torch emulates bf16: 0.3 GFLOP/s against 135 in float32 on an AVX2-only EPYC
    assert cpu_dtype(frozenset({"avx2", "avx512f"})) == "float32"
    assert cpu_dtype(frozenset({"avx2", "avx512f", "avx512_bf16"})) == "bfloat16"
    assert cpu_dtype(frozenset({"amx_bf16"})) == "bfloat16"
    assert cpu_dtype(frozenset()) == "float32"
    env = launch_environ({"HOME": "/u"}, frozenset({"avx512_bf16"}))
    assert env["KVROUTE_SGLANG_CPU_DTYPE"] == "bfloat16" and env["KVROUTE_SGLANG_HOME"] == "/u/.cache/kvroute/sglang-cpu"
    # the operator's choice wins over the CPU's
    assert launch_environ({"KVROUTE_SGLANG_CPU_DTYPE": "float16"}, frozenset({"avx512_bf16"}))[
        "KVROUTE_SGLANG_CPU_DTYPE"] == "float16"


def test_cpu_tiny_profile_uses_the_runtime_and_the_cpu_flags(tmp_path: Path) -> None:
    env = {**os.environ, "KVROUTE_SGLANG_HOME": str(tmp_path / "home")}
    env.pop("KVROUTE_SGLANG_CPU_DTYPE", None)
    out = subprocess.run(
        [*KVROUTE, "launch", "--profile", "sglang-cpu-tiny", "--dry-run", "--json", "--port", "31011",
         "--set", 'kv-events-config={"publisher": "zmq", "endpoint": "tcp://*:5557"}'],
        capture_output=True, text=True, check=True, timeout=60, env=env,
    )
    doc = json.loads(out.stdout)
    argv = tuple(doc["argv"])
    assert argv[0] == str(tmp_path / "home" / "venv" / "bin" / "python")
    assert _flag_value(argv, "--model-path") == str(tmp_path / "home" / "model" / "tiny-qwen2")
    for flag, value in {"--device": "cpu", "--load-format": "dummy", "--attention-backend": "torch_native",
                        "--port": "31011", "--max-total-tokens": "40000", "--dtype": cpu_dtype(cpu_flags())}.items():
        assert _flag_value(argv, flag) == value, flag
    for flag in ("--sleep-on-idle", "--enable-metrics", "--enable-cache-report", "--skip-server-warmup"):
        assert flag in argv
    assert json.loads(_flag_value(argv, "--kv-events-config") or "") == {
        "endpoint": "tcp://*:5557", "publisher": "zmq"}
    assert doc["env"]["SGLANG_USE_CPU_ENGINE"] == "1" and doc["env"]["HF_HUB_OFFLINE"] == "1"


def test_cli_pins_the_server_to_the_cpus_asked(tmp_path: Path) -> None:
    (tmp_path / "fake_server.py").write_text(
        "import json, os\nprint(json.dumps(sorted(os.sched_getaffinity(0))))\n"
    )
    profile = tmp_path / "fake.yaml"
    profile.write_text("name: fake\nmodule: fake_server\nargs: {}\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cpu = min(os.sched_getaffinity(0))
    res = subprocess.run(
        [*KVROUTE, "launch", "--profile", str(profile), "--cpus", str(cpu)],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    )
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [cpu]
    bad = subprocess.run(
        [*KVROUTE, "launch", "--profile", str(profile), "--cpus", "x"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )
    assert bad.returncode == 2 and "--cpus expects" in bad.stderr
