"""``kvroute bench``: every listed benchmark resolves to a real entry point, and --help works."""

from __future__ import annotations

import importlib

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
