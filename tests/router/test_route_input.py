"""``router.route_input``: the one place both drivers turn request facts into a ``RouteRequest``."""

from __future__ import annotations

from router.model import KeySource, SessionState
from router.route_input import DEFAULT_BYTES_PER_TOKEN, prompt_tokens_estimate, route_request


def test_estimate_uses_the_sessions_learned_bytes_per_token() -> None:
    assert prompt_tokens_estimate(40_000, None) == int(40_000 / DEFAULT_BYTES_PER_TOKEN)
    learned = SessionState("s", home="r", bytes_per_token=3.2)
    assert prompt_tokens_estimate(32_000, learned) == 10_000
    assert prompt_tokens_estimate(32_000, SessionState("s", home="r")) == 8_000  # nothing learned yet


def test_route_request_reads_only_its_own_sessions_ratio() -> None:
    mine = SessionState("s1", home="r", bytes_per_token=2.0)
    req = route_request("s1", KeySource.HEADER, route="/v1/completions", model="m", body_bytes=2000, session=mine,
                        excluded=frozenset({"r9"}))  # fmt: skip
    assert (req.session_key, req.key_source, req.route, req.model) == ("s1", KeySource.HEADER, "/v1/completions", "m")
    assert (req.body_bytes, req.prompt_tokens_estimate, req.excluded) == (2000, 1000, frozenset({"r9"}))
    other = route_request("s2", KeySource.HEADER, route="/v1/completions", model=None, body_bytes=2000, session=mine)
    assert other.prompt_tokens_estimate == 500  # another session's ratio is not this one's
