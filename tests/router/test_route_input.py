"""``router.route_input``: the one place both drivers turn request facts into a ``RouteRequest``."""

from __future__ import annotations

from router.model import KeySource, SessionState
from router.route_input import DEFAULT_BYTES_PER_TOKEN, prompt_tokens_estimate, route_request, wants_chain_key


def test_estimate_uses_the_sessions_learned_bytes_per_token() -> None:
    assert prompt_tokens_estimate(40_000, None) == int(40_000 / DEFAULT_BYTES_PER_TOKEN)
    learned = SessionState("s", home="r", bytes_per_token=3.2)
    assert prompt_tokens_estimate(32_000, learned) == 10_000
    assert prompt_tokens_estimate(32_000, SessionState("s", home="r")) == 8_000  # nothing learned yet


def test_route_request_reads_only_its_own_sessions_ratio() -> None:
    mine = SessionState("s1", home="r", bytes_per_token=2.0)
    req = route_request("s1", KeySource.HEADER, route="/v1/completions", body_bytes=2000, session=mine,
                        excluded=frozenset({"r9"}))  # fmt: skip
    assert (req.session_key, req.key_source, req.route) == ("s1", KeySource.HEADER, "/v1/completions")
    assert (req.body_bytes, req.prompt_tokens_estimate, req.excluded) == (2000, 1000, frozenset({"r9"}))
    other = route_request("s2", KeySource.HEADER, route="/v1/completions", body_bytes=2000, session=mine)
    assert other.prompt_tokens_estimate == 500  # another session's ratio is not this one's


def test_the_conversation_key_is_asked_for_only_when_the_session_may_be_split() -> None:
    """``wants_chain_key``: a lone conversation goes home whatever its key, so the gateway does not
    parse its body; a session with something in flight, or a conversation that ran off home, needs it."""
    calls: list[int] = []

    def key() -> str:
        calls.append(1)
        return "c1"

    def req(session: SessionState | None) -> str | None:
        return route_request("s1", KeySource.HEADER, route="/v1/chat/completions", body_bytes=400,
                             session=session, chain_key=key).chain_key  # fmt: skip

    assert req(None) is None and req(SessionState("s1")) is None  # new session: placed by load
    assert req(SessionState("s1", home="a")) is None  # idle, one conversation, at home
    assert not calls
    assert req(SessionState("s1", home="a", in_flight=(("a", 1),))) == "c1"  # a sub-agent may be beside it
    assert req(SessionState("s1", home="a", chains=(("c9", "b"),))) == "c1"  # one of them ran on b
    assert req(SessionState("s2", home="a", in_flight=(("a", 1),))) is None  # another session's state
    assert len(calls) == 2
    assert not wants_chain_key(SessionState("s1", home="a", chains=(("c1", "a"),)))
    plain = route_request("s1", KeySource.HEADER, route="/v1/chat/completions", body_bytes=4,
                          session=SessionState("s1", home="a", in_flight=(("a", 1),)), chain_key="k")  # fmt: skip
    assert plain.chain_key == "k"
