"""The pure engine-session table (``replica/emulator/sessions.py``): SGLang 0.5.23's session rules."""

from __future__ import annotations

import pytest

from replica.emulator.sessions import SessionError, SessionParams, SessionTable


def tok(*ids: int) -> bytes:
    """Token sequences are 4 bytes a token."""
    return b"".join(i.to_bytes(4, "little") for i in ids)


def never_stopped(rid: str) -> None:
    raise AssertionError(f"{rid} should not be stopped")


def run(
    table: SessionTable, sid: str, new_rid: str, tokens: bytes, now: float = 0.0, **params: object
) -> bytes:
    """Places and registers request ``new_rid``; returns its whole prompt."""
    cont = table.begin(SessionParams(sid, **params), tokens, now, never_stopped)  # type: ignore[arg-type]
    table.add(cont, new_rid)
    return cont.prompt


def test_open_duplicate_close_and_reopen() -> None:
    t = SessionTable()
    assert t.open("s", 100, None, 0.0) is True
    assert t.open("s", 100, None, 1.0) is False
    assert "s" in t and len(t) == 1
    t.close("s")
    t.close("never-opened")  # ignored
    assert "s" not in t and len(t) == 0
    assert t.open("s", 100, None, 2.0) is True


def test_unknown_session_and_unknown_rid_are_refused() -> None:
    t = SessionTable()
    with pytest.raises(SessionError, match=r"^Invalid request: session id x does not exist$"):
        t.begin(SessionParams("x"), tok(1), 0.0, never_stopped)
    t.open("s", 1, None, 0.0)
    with pytest.raises(SessionError, match=r"^Invalid request session id$"):
        t.begin(SessionParams("s", rid="nope"), tok(1), 0.0, never_stopped)
    # an id that is not a string names no session, even one spelled the same
    t.open("5", 1, None, 0.0)
    with pytest.raises(SessionError, match="session id 5 does not exist"):
        t.begin(SessionParams.from_json({"id": 5}) or SessionParams("?"), tok(1), 0.0, never_stopped)


def test_continuation_is_parent_prompt_plus_output_plus_new() -> None:
    t = SessionTable()
    t.open("s", 1, None, 0.0)
    assert run(t, "s", "a", tok(1, 2, 3)) == tok(1, 2, 3)  # no rid: a branch from the root
    t.finish("s", "a", tok(7, 8))
    assert run(t, "s", "b", tok(4), rid="a") == tok(1, 2, 3, 7, 8, 4)
    t.finish("s", "b", tok(9))
    assert run(t, "s", "c", tok(5), rid="b") == tok(1, 2, 3, 7, 8, 4, 9, 5)
    # the same parent twice: two branches
    assert run(t, "s", "d", tok(6), rid="a") == tok(1, 2, 3, 7, 8, 6)
    # history only: no new tokens are needed
    assert run(t, "s", "e", b"", rid="a") == tok(1, 2, 3, 7, 8)


def test_offset_and_drop_previous_output() -> None:
    t = SessionTable()
    t.open("s", 1, None, 0.0)
    run(t, "s", "a", tok(1, 2, 3))
    t.finish("s", "a", tok(7, 8))
    assert run(t, "s", "b", tok(4), rid="a", drop_previous_output=True) == tok(1, 2, 3, 4)
    assert run(t, "s", "c", tok(4), rid="a", offset=2) == tok(1, 2, 4)
    assert run(t, "s", "d", tok(4), rid="a", offset=-1) == tok(1, 2, 3, 7, 4)  # a Python slice, as SGLang's
    assert run(t, "s", "e", tok(4), rid="a", offset=4, drop_previous_output=True) == tok(1, 2, 3, 4)
    assert run(t, "s", "f", tok(4), offset=1) == tok(4)  # no rid: nothing to cut


def test_appending_to_a_running_request_is_refused_replace_stops_it() -> None:
    t = SessionTable()
    t.open("s", 1, None, 0.0)
    run(t, "s", "a", tok(1))
    t.finish("s", "a", tok(2))
    run(t, "s", "b", tok(3), rid="a")  # still running
    run(t, "s", "c", tok(4), rid="a")  # a sibling, finished
    t.finish("s", "c", tok(5))
    run(t, "s", "c1", tok(6), rid="c")  # c's child, running
    with pytest.raises(
        SessionError, match=r"^Session request is appending to a request that hasn't finished\.$"
    ):
        t.begin(SessionParams("s", rid="b"), tok(9), 0.0, never_stopped)
    stopped: list[str] = []

    def stop(rid: str) -> None:
        stopped.append(rid)
        t.finish("s", rid, tok(42))  # the abort reports its output so far

    cont = t.begin(SessionParams("s", rid="b", replace=True), tok(9), 0.0, stop)
    assert stopped == ["b"] and cont.prompt == tok(1, 2, 3, 42, 9)
    t.add(cont, "b2")
    # replace on "a" drops its descendants (b, b2, c, c1), stopping those still running (b2, c1)
    stopped.clear()
    cont = t.begin(SessionParams("s", rid="a", replace=True), tok(8), 0.0, stop)
    assert sorted(stopped) == ["b2", "c1"] and cont.prompt == tok(1, 2, 8)
    for gone in ("b", "b2", "c", "c1"):
        with pytest.raises(SessionError, match="Invalid request session id"):
            t.begin(SessionParams("s", rid=gone), tok(1), 0.0, never_stopped)
    # replace without rid: every request of the session goes (the running ones stopped)
    t.add(cont, "a2")
    stopped.clear()
    assert t.begin(SessionParams("s", replace=True), tok(5), 0.0, stop).prompt == tok(5)
    assert stopped == ["a2"]
    with pytest.raises(SessionError, match="Invalid request session id"):
        t.begin(SessionParams("s", rid="a"), tok(1), 0.0, never_stopped)


def test_empty_prompt_after_history_is_refused() -> None:
    t = SessionTable()
    t.open("s", 1, None, 0.0)
    with pytest.raises(
        SessionError, match=r"^A session request must contain input tokens after restoring history\.$"
    ):
        t.begin(SessionParams("s"), b"", 0.0, never_stopped)


def test_timeout_counts_from_the_last_request_started() -> None:
    t = SessionTable(reap_interval_s=1.0)
    t.open("s", 1, 10.0, 0.0)
    t.open("idle", 1, 10.0, 0.0)
    t.open("forever", 1, None, 0.0)
    run(t, "s", "a", tok(1), now=8.0)  # used at 8: lives until 18
    assert t.reap(9.0) == []
    assert t.reap(10.5) == ["idle"]  # idle since 0
    assert t.reap(17.9) == []
    assert "s" in t
    # a lookup closes an expired session at once, between sweeps
    with pytest.raises(SessionError, match="does not exist"):
        t.begin(SessionParams("s"), tok(1), 18.1, never_stopped)
    assert "s" not in t and "forever" in t
    assert t.open("s", 1, None, 18.2) is True  # the id is free again


def test_reap_sweeps_at_most_once_per_interval() -> None:
    t = SessionTable(reap_interval_s=1.0)
    t.open("a", 1, 0.5, 0.0)
    assert t.reap(0.2) == []  # swept at 0.2: nothing had expired
    assert t.reap(1.0) == []  # the next sweep is due at 1.2
    assert t.reap(1.3) == ["a"]


def test_finish_and_add_after_close_are_ignored() -> None:
    t = SessionTable()
    t.open("s", 1, None, 0.0)
    cont = t.begin(SessionParams("s"), tok(1), 0.0, never_stopped)
    t.close("s")
    t.add(cont, "a")
    t.finish("s", "a", tok(2))
    assert "s" not in t


@pytest.mark.parametrize(
    ("obj", "want"),
    [
        (None, None),
        ({}, None),
        ({"rid": "r"}, None),  # no id: a normal request
        ({"id": "s"}, SessionParams("s")),
        (
            {"id": "s", "rid": "r", "offset": 3, "replace": True, "drop_previous_output": 1},
            SessionParams("s", "r", 3, True, True),
        ),
    ],
)
def test_session_params_from_json(obj: object, want: SessionParams | None) -> None:
    assert SessionParams.from_json(obj) == want


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ("s", "session_params must be an object"),
        ({"id": "s", "bogus": 1}, "Unexpected keyword argument 'bogus'"),
        ({"id": "s", "offset": "3"}, "session_params.offset must be an integer"),
    ],
)
def test_session_params_shapes_sglang_cannot_take(obj: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        SessionParams.from_json(obj)
