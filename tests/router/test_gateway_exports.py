"""Public names of the gateway modules: the ones other parts rely on must stay (others may be added)."""

from __future__ import annotations

import importlib

import pytest

EXPECTED = {
    "router.gateway": [],
    "router.gateway.app": [
        "CONFIG_KEY",
        "EMITTER_KEY",
        "RUNTIME_KEY",
        "STORE_KEY",
        "GatewayRuntime",
        "make_app",
    ],
    "router.gateway.serve": ["RunningGateway", "cli_main", "make_store", "start_gateway"],
    "router.events": [
        "AffinityBroken",
        "Emitter",
        "Event",
        "Hook",
        "ReplicaActivated",
        "ReplicaEjected",
        "ReplicaReadmitted",
        "RequestFinished",
        "RequestRouted",
        "StoreDegraded",
        "StoreRecovered",
        "UpstreamRetry",
    ],
    "router.engine_metrics": ["MetricsParseError", "parse_engine_metrics", "scrape_values"],
    "router.discovery": ["Discovery", "HealthTrack", "health_transition"],
}


@pytest.mark.parametrize("module", sorted(EXPECTED))
def test_exports(module: str) -> None:
    mod = importlib.import_module(module)
    assert set(EXPECTED[module]) <= set(mod.__all__)
    assert len(set(mod.__all__)) == len(mod.__all__)
    for name in mod.__all__:
        assert hasattr(mod, name), name
