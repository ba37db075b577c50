"""What ``kvroute bench peers --engine-dp N`` starts each router as (``with_engine_dp``), checked
against kvroute's own configuration parser."""

from __future__ import annotations

from loadtests.peers import PEERS, peer_argv, with_engine_dp
from router.config import load_config

URLS = ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]


def _kvroute_specs(target: str, dp: int) -> list[tuple[str, int | None]]:
    argv = peer_argv(with_engine_dp(PEERS[target], dp), "kvroute", 8000, URLS)
    assert argv[:2] == ["kvroute", "serve"]
    return [(s.id, s.dp_rank) for s in load_config(argv[2:], {}).replica_specs()]


def test_kvroute_places_over_the_ranks_of_data_parallel_engines_unless_told_not_to() -> None:
    assert _kvroute_specs("kvroute", 1) == [("127.0.0.1:30001", None), ("127.0.0.1:30002", None)]
    assert _kvroute_specs("kvroute", 2) == [
        ("127.0.0.1:30001-dp0", 0), ("127.0.0.1:30001-dp1", 1), ("127.0.0.1:30002-dp0", 0), ("127.0.0.1:30002-dp1", 1)
    ]  # fmt: skip
    # the comparison target: each engine one replica, its rank picked when forwarding
    assert _kvroute_specs("kvroute-engines", 2) == [("127.0.0.1:30001", None), ("127.0.0.1:30002", None)]
    assert with_engine_dp(PEERS["kvroute-engines"], 2) == PEERS["kvroute-engines"]


def test_each_peer_gets_its_own_data_parallel_flags_only_on_data_parallel_engines() -> None:
    for name, spec in PEERS.items():
        assert with_engine_dp(spec, 1) == spec, name
    assert with_engine_dp(PEERS["sglang-cache_aware"], 4).args[-1:] == ("--dp-aware",)
    vllm = with_engine_dp(PEERS["vllm-sticky_least_loaded"], 4).args
    assert vllm[vllm.index("--intra-node-data-parallel-size") + 1] == "4"
    assert with_engine_dp(PEERS["python-floor"], 4) == PEERS["python-floor"]
