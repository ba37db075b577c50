"""PolicyParams validation / round trip, the registry, exports and the import rule."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest

import router.policy
from router.policy import POLICIES, Policy, PolicyParams, make_policy


def test_defaults_are_documented_values() -> None:
    p = PolicyParams()
    assert p.default_capacity_tokens == 850_000
    assert p.thicc_threshold >= 2 and p.max_overflow >= 1


def test_with_changes_returns_a_new_validated_copy() -> None:
    p = PolicyParams()
    q = p.with_changes(thicc_threshold=5, w_sessions=0.1, hard_bound_min=10.0)
    assert (q.thicc_threshold, q.w_sessions, q.hard_bound_min) == (5, 0.1, 10)
    assert isinstance(q.hard_bound_min, int)
    assert p.thicc_threshold == PolicyParams().thicc_threshold  # unchanged: frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.thicc_threshold = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"nope": 1}, "nope"),
        ({"thicc_threshold": 0}, "thicc_threshold"),
        ({"thicc_threshold": 2.5}, "thicc_threshold"),
        ({"thicc_threshold": "3"}, "thicc_threshold"),
        ({"max_overflow": True}, "max_overflow"),
        ({"w_sessions": -0.1}, "w_sessions"),
        ({"bounded_load_epsilon": 0.5}, "bounded_load_epsilon"),  # a constant since round 29
        ({"ramp_cap_factor": 3}, "ramp_cap_factor"),  # a constant since round 31
        ({"panic_threshold": 1.5}, "panic_threshold"),
        ({"hard_bound_factor": 0.5}, "hard_bound_factor"),
        ({"score_quantum": 0.5}, "score_quantum"),  # removed in round 16: unknown now
        ({"w_sessions": float("nan")}, "w_sessions"),
        ({"w_working_set": float("inf")}, "w_working_set"),
        ({"working_set_limit": 1.5}, "working_set_limit"),
        ({"prefix_blocks": 0}, "prefix_blocks"),
    ],
)
def test_with_changes_rejects_and_names_the_key(changes: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=rf"^{key}:"):
        PolicyParams().with_changes(**changes)


def test_dict_round_trip() -> None:
    p = PolicyParams().with_changes(thicc_threshold=4, w_sessions=0.5)
    d = p.to_dict()
    assert d["thicc_threshold"] == 4 and set(d) == {f.name for f in dataclasses.fields(PolicyParams)}
    assert PolicyParams.from_dict(d) == p
    assert PolicyParams.from_dict({}) == PolicyParams()
    with pytest.raises(ValueError, match="^bogus:"):
        PolicyParams.from_dict({"bogus": 1})


def test_registry_names_and_factories() -> None:
    assert set(POLICIES) == {"kv_aware", "random", "round_robin", "least_loaded", "hash", "sticky_least_loaded"}
    params = PolicyParams().with_changes(thicc_threshold=7)
    for name in POLICIES:
        policy: Policy = make_policy(name, params)
        assert policy.name == name
    assert make_policy("kv_aware", params).params.thicc_threshold == 7  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope", params)


def test_exported_members() -> None:
    assert sorted(router.policy.__all__) == sorted(
        [
            "POLICIES",
            "HashPolicy",
            "KvAwarePolicy",
            "LeastLoadedPolicy",
            "Policy",
            "PolicyParams",
            "RandomPolicy",
            "RoundRobinPolicy",
            "classify_break",
            "home_found",
            "hrw_rank",
            "hrw_top",
            "make_policy",
            "prefix_key",
        ]
    )
    for name in router.policy.__all__:
        assert hasattr(router.policy, name)


ALLOWED_ROUTER = {"router.model", "router.errors", "router.events"}
FORBIDDEN_STDLIB = {"time", "asyncio", "logging", "socket", "threading", "os", "subprocess", "datetime"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: use absolute imports"
            out.add(node.module or "")
    return out


def test_policy_imports_only_model_errors_events_stdlib_mmh3() -> None:
    root = Path(router.policy.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) >= 7
    for path in files:
        for mod in _imports(path):
            top = mod.split(".")[0]
            if top == "router":
                ok = mod in ALLOWED_ROUTER or mod == "router.policy" or mod.startswith("router.policy.")
            else:
                ok = top == "mmh3" or (top in sys.stdlib_module_names and top not in FORBIDDEN_STDLIB)
            assert ok, f"{path.name} imports {mod}"
