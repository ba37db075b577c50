"""SGLang's engine sessions (``/open_session``, ``session_params`` on ``/generate``): a pure table.

No I/O, no clock: ``now`` is passed in (the server passes its modelled time).

What SGLang 0.5.23 does (``srt/session/session_controller.py``, non-streaming sessions), and so this:

Rule 1: a session is a tree of its requests, keyed by request id. A request naming ``rid`` continues
        that request: its prompt is the parent's prompt + the parent's output + the new tokens.
        ``drop_previous_output`` leaves the parent's output out; ``offset`` (non-zero) keeps only the
        first ``offset`` tokens of that history (a Python slice, so negative counts from the end).
        Without ``rid`` the request starts a new branch from the root: its prompt is its own tokens.
Rule 2: continuing a request that has not finished is refused; ``replace`` instead aborts it (the
        history is its output so far) and drops its descendants, aborting those still running.
        ``replace`` without ``rid`` drops every request of the session.
Rule 3: a session unused (no request started in it) for ``timeout`` seconds is closed. SGLang sweeps
        about once a second; here a lookup also closes an expired session at once, and a sweep over
        all sessions runs at most once per ``reap_interval_s``.

Token sequences are bytes, 4 per token (``tokenizer.BYTES_PER_TOKEN``), so slicing is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from replica.emulator.tokenizer import BYTES_PER_TOKEN

__all__ = ["Continuation", "SessionError", "SessionParams", "SessionTable"]


class SessionError(Exception):
    """SGLang's scheduler aborts the request with this message (status 400)."""


@dataclass(frozen=True, slots=True)
class SessionParams:
    """``session_params`` of a ``/generate`` body (SGLang's ``SessionParams``)."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False
    id_is_str: bool = True  # an id of another JSON type names no session (SGLang looks it up as given)

    @classmethod
    def from_json(cls, obj: Any) -> SessionParams | None:
        """None when the request is not a session request (SGLang: a falsy value or no ``id``).
        Raises ``TypeError``/``ValueError`` on a shape SGLang cannot take (it crashes on those: a 500)."""
        if not obj:
            return None
        if not isinstance(obj, Mapping):
            raise TypeError("session_params must be an object")
        unknown = sorted(set(obj) - {"id", "rid", "offset", "replace", "drop_previous_output"})
        if unknown:
            raise ValueError(f"Unexpected keyword argument '{unknown[0]}'")
        sid = obj.get("id")
        if sid is None:
            return None
        offset = obj.get("offset")
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)):
            raise ValueError("session_params.offset must be an integer")
        rid = obj.get("rid")
        return cls(
            id=str(sid),
            rid=None if rid is None else str(rid),
            offset=offset,
            replace=bool(obj.get("replace")),
            drop_previous_output=bool(obj.get("drop_previous_output")),
            id_is_str=isinstance(sid, str),
        )


@dataclass(slots=True)
class _Node:
    prompt: bytes
    parent: str | None
    output: bytes | None = None  # None while the request runs
    children: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Session:
    capacity_of_str_len: int
    timeout_s: float | None
    last_active: float
    nodes: dict[str, _Node] = field(default_factory=dict)

    def expired(self, now: float) -> bool:
        return self.timeout_s is not None and now - self.last_active > self.timeout_s


@dataclass(frozen=True, slots=True)
class Continuation:
    """Where a request goes in its session, and its whole prompt (history + its own tokens)."""

    session_id: str
    parent: str | None
    prompt: bytes


class SessionTable:
    """The replica's open sessions (one table per replica, like SGLang's ``SessionController``)."""

    def __init__(self, reap_interval_s: float = 1.0) -> None:
        self._sessions: dict[str, _Session] = {}
        self._reap_interval_s = reap_interval_s
        self._last_reap = float("-inf")

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def open(self, session_id: str, capacity_of_str_len: int, timeout_s: float | None, now: float) -> bool:
        """False if a session with this id is still open."""
        self._expire(session_id, now)
        if session_id in self._sessions:
            return False
        self._sessions[session_id] = _Session(capacity_of_str_len, timeout_s, now)
        return True

    def close(self, session_id: str) -> None:
        """Unknown ids are ignored (SGLang only logs them). Running requests keep running."""
        self._sessions.pop(session_id, None)

    def reap(self, now: float) -> list[str]:
        """Closes every expired session, at most once per ``reap_interval_s``; returns their ids."""
        if now - self._last_reap < self._reap_interval_s:
            return []
        self._last_reap = now
        gone = [sid for sid, s in self._sessions.items() if s.expired(now)]
        for sid in gone:
            del self._sessions[sid]
        return gone

    def begin(
        self, params: SessionParams, tokens: bytes, now: float, stop: Callable[[str], object]
    ) -> Continuation:
        """Places a new request with its own ``tokens`` in its session (Rules 1-2) and marks the
        session used.

        ``stop(rid)`` aborts a running request (``replace`` calls it); the caller reports the output
        it ended with through :meth:`finish`, before returning or later. Raises
        :class:`SessionError` with SGLang's message when the request is refused.
        """
        self._expire(params.id, now)
        s = self._sessions.get(params.id) if params.id_is_str else None
        if s is None:
            raise SessionError(f"Invalid request: session id {params.id} does not exist")
        parent: _Node | None = None
        if params.replace and params.rid is None:
            for rid, node in s.nodes.items():
                if node.output is None:
                    stop(rid)
            s.nodes.clear()
        elif params.rid is not None:
            parent = s.nodes.get(params.rid)
            if parent is None:
                raise SessionError("Invalid request session id")
            if params.replace:
                if parent.output is None:
                    stop(params.rid)
                    parent.output = parent.output or b""  # not reported yet: no output to continue
                self._drop_children(s, parent, stop)
            elif parent.output is None:
                raise SessionError("Session request is appending to a request that hasn't finished.")
        history = b""
        if parent is not None:
            assert parent.output is not None
            history = parent.prompt if params.drop_previous_output else parent.prompt + parent.output
            if params.offset:
                history = history[: params.offset * BYTES_PER_TOKEN]
        if not history and not tokens:
            raise SessionError("A session request must contain input tokens after restoring history.")
        s.last_active = now
        return Continuation(params.id, params.rid if parent is not None else None, history + tokens)

    def add(self, cont: Continuation, rid: str) -> None:
        """Registers a submitted request under its parent; a no-op if the session closed meanwhile.
        A reused request id replaces the older node, as in SGLang."""
        s = self._sessions.get(cont.session_id)
        if s is None:
            return
        s.nodes[rid] = _Node(cont.prompt, cont.parent)
        parent = s.nodes.get(cont.parent) if cont.parent is not None else None
        if parent is not None:
            parent.children.append(rid)

    def finish(self, session_id: str, rid: str, output: bytes) -> None:
        """A session request ended (finished or aborted) with ``output``: it can be continued."""
        s = self._sessions.get(session_id)
        node = s.nodes.get(rid) if s is not None else None
        if node is not None and node.output is None:
            node.output = output

    def _expire(self, session_id: str, now: float) -> None:
        s = self._sessions.get(session_id)
        if s is not None and s.expired(now):
            del self._sessions[session_id]

    def _drop_children(self, s: _Session, node: _Node, stop: Callable[[str], object]) -> None:
        for rid in node.children:
            child = s.nodes.pop(rid, None)
            if child is None:
                continue
            if child.output is None:
                stop(rid)
            self._drop_children(s, child, stop)
        node.children = []
