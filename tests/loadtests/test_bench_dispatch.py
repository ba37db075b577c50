"""``kvroute bench``: every listed benchmark resolves to a real entry point, and --help works."""

from __future__ import annotations

import importlib
import json

import pytest

from loadtests.bench import BENCHES, cli_main


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_benchmark_resolves(name: str) -> None:
    module_name, func, _ = BENCHES[name]
    assert callable(getattr(importlib.import_module(module_name), func))


@pytest.mark.parametrize("name", ["faults", "soak", "overhead", "redis", "probes"])
def test_help_of_each_benchmark_exits_zero(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main([name, "--help"])
    assert exc.value.code == 0
    assert f"bench {name}" in capsys.readouterr().out


def test_unknown_benchmark_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["nope"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_peers_real_fleet_runs_in_real_time_and_needs_the_runtime(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    from loadtests.bench_peers import REAL_DEFAULTS, _scenario, bench_peers_main

    with pytest.raises(SystemExit) as exc:
        bench_peers_main(["--fleet", "real-sglang", "--time-scale", "0.1"])
    assert exc.value.code == 2 and "real time" in capsys.readouterr().err
    for args in (["--engine-dp", "0"], ["--fleet", "real-sglang", "--engine-dp", "0"], ["--gateways", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench_peers_main(args)
        assert exc.value.code == 2 and "at least 1" in capsys.readouterr().err
    monkeypatch.setenv("KVROUTE_SGLANG_HOME", str(tmp_path))  # nothing built there
    monkeypatch.delenv("KVROUTE_SGLANG_PYTHON", raising=False)
    with pytest.raises(SystemExit) as exc:
        bench_peers_main(["--fleet", "real-sglang"])
    assert exc.value.code == 2 and "build_sglang_cpu_env.sh" in capsys.readouterr().err

    class NS:  # what the parser leaves for a real fleet once the defaults are filled in
        fleet, profile, hicache, workload, trace, policy_param = "real-sglang", "x", False, "synthetic", None, []
        kv_events = no_session_id = False
        engine_set = ()
        api = "chat"
        replicas, sessions, token_unit, time_scale = 2, 40, 40, 1.0
        duration = REAL_DEFAULTS["duration_s"]
        engine_dp = gateways = 1
        gateway_assign = "round_robin"

    sc = _scenario(NS, 3)
    assert (sc.replicas, sc.time_scale, sc.token_unit, sc.page_size, sc.seed) == (2, 1.0, 40, 1, 3)
    assert sc.session_ids and sc.load_config("http://127.0.0.1:1", ()).session_headers
    NS.no_session_id = True  # clients without a session id: the driver sends no session header
    sc = _scenario(NS, 3)
    assert not sc.session_ids and sc.load_config("http://127.0.0.1:1", ()).session_headers == ()
    NS.api = "responses"  # Codex's clients: the driver speaks the Responses API to every router
    assert _scenario(NS, 3).load_config("http://127.0.0.1:1", ()).api == "responses"
    assert _scenario(NS, 3).dp_size == 1  # a real fleet's ranks are the servers' own (_fleet)
    NS.gateways = 4  # kvroute's gateways on one Redis (the peers run one router each)
    assert _scenario(NS, 3).gateways == 4
    NS.gateway_assign = "sticky"  # each session's requests to one of them, as a client pod's sidecar
    assert _scenario(NS, 3).load_config("http://127.0.0.1:1", ()).gateway_assign == "sticky"
    NS.fleet, NS.engine_dp, NS.kv_events = "emulated", 2, True
    args = _scenario(NS, 3).emulator_args()
    assert args[args.index("--dp-size") + 1] == "2"
    kv = json.loads(args[args.index("--kv-events-config") + 1])  # a port per rank: numbers, not "*"
    ports = [int(kv[k].rpartition(":")[2]) for k in ("endpoint", "replay_endpoint")]
    assert ports[1] - ports[0] == 2
