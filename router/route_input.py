"""How a driver turns what it knows of a request into the policy's ``RouteRequest``. PURE.

The live gateway (``router/gateway/handlers.py``) and the simulator (``loadtests/sim/run.py``) both
call :func:`route_request` with the same facts: the session key and where it came from, the route,
the body's size in bytes, the key of the conversation the request continues (``chain_key``: the
gateway hashes the prompt's anchor, the simulator names the trace's conversation; the parity test
holds both to the same partition of requests), and the session's state from the snapshot. Neither driver estimates
anything on its own, so the policy sees the same inputs in both (the parity test holds them to it).

The prompt's size in tokens is not known before the engine answers. It is estimated from the body
size and the session's own bytes-per-token, learned from the usage of its previous turn at home
(``SessionState.bytes_per_token``: a session's next prompt is its previous one plus a little more
of the same text, so the ratio carries over); without one, ``DEFAULT_BYTES_PER_TOKEN``.
"""

from __future__ import annotations

from collections.abc import Callable

from router.model import KeySource, ReplicaId, RouteRequest, SessionState

__all__ = ["DEFAULT_BYTES_PER_TOKEN", "prompt_tokens_estimate", "route_request", "wants_chain_key"]

DEFAULT_BYTES_PER_TOKEN = 4.0
"""Bytes of request body per prompt token before a session's usage says better: English and code
run at 3.5-4.5 characters per token in BPE tokenizers, and the JSON framing adds a little."""


def prompt_tokens_estimate(body_bytes: int, session: SessionState | None) -> int:
    """Prompt tokens of a request whose body has ``body_bytes`` bytes, for ``session``."""
    ratio = session.bytes_per_token if session is not None and session.bytes_per_token > 0 else 0.0
    return int(body_bytes / (ratio or DEFAULT_BYTES_PER_TOKEN))


def wants_chain_key(session: SessionState | None) -> bool:
    """Does the policy need to know which conversation a request of ``session`` continues? Only when
    the session is split or may be: something of it is in flight (a sub-agent may be running beside
    the parent), or one of its conversations last ran off home. A lone conversation, the common case,
    goes home either way, and the gateway then does not parse its body."""
    if session is None or session.home is None:
        return False
    return session.in_flight_total > 0 or any(rid != session.home for _, rid in session.chains)


def route_request(
    session_key: str | None,
    key_source: KeySource,
    *,
    route: str,
    body_bytes: int,
    session: SessionState | None,
    excluded: frozenset[ReplicaId] = frozenset(),
    chain_key: str | Callable[[], str | None] | None = None,
) -> RouteRequest:
    """The policy's view of one request (one attempt: ``excluded`` grows on retries). ``chain_key``
    (or a function computing it, called only when ``wants_chain_key``) names the conversation."""
    own = session if session is not None and session.session_id == session_key else None
    chain: str | None = None
    if chain_key is not None and wants_chain_key(own):
        chain = chain_key() if callable(chain_key) else chain_key
    return RouteRequest(
        session_key=session_key,
        key_source=key_source,
        route=route,
        body_bytes=body_bytes,
        prompt_tokens_estimate=prompt_tokens_estimate(body_bytes, own),
        excluded=excluded,
        chain_key=chain,
    )
