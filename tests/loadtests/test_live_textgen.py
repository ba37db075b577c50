"""Prompt text for the live driver: deterministic, append-only, sized in emulated tokens."""

from __future__ import annotations

import json

import pytest

from loadtests.textgen import BYTES_PER_TOKEN, Conversation, emulated_tokens, filler, shared_prefix


def _render(conv: Conversation) -> str:
    return "".join(m["content"] for m in conv.messages)


def test_filler_is_deterministic_ascii_and_exact_length() -> None:
    a = filler("s1/1", 1000)
    assert a == filler("s1/1", 1000)
    assert len(a) == 1000 and len(a.encode()) == 1000
    assert a != filler("s1/2", 1000)
    assert json.dumps(a) == f'"{a}"'  # no escapes needed
    assert filler("x", 0) == ""


def test_shared_prefix_is_identical_across_conversations() -> None:
    a = Conversation(key="a", shared_prefix_tokens=500)
    b = Conversation(key="b", shared_prefix_tokens=500)
    a.add_user(100)
    b.add_user(100)
    ra, rb = _render(a), _render(b)
    sp = shared_prefix(500 * BYTES_PER_TOKEN)
    assert ra.startswith(sp) and rb.startswith(sp)
    assert ra[len(sp)] == rb[len(sp)] == "["  # the per-conversation marker follows
    assert ra[len(sp) :] != rb[len(sp) :]


def test_conversation_is_append_only_and_counts_tokens() -> None:
    c = Conversation(key="sess", shared_prefix_tokens=200)
    c.add_user(300)
    t1, n1 = _render(c), c.prompt_tokens
    c.add_assistant(5)
    c.add_user(40)
    t2, n2 = _render(c), c.prompt_tokens
    assert t2.startswith(t1)
    assert n1 == len(t1) // BYTES_PER_TOKEN == 500
    assert n2 == len(t2) // BYTES_PER_TOKEN == 545
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user"]


@pytest.mark.parametrize(("model", "unit", "expected"), [(100_000, 100, 1000), (49, 100, 1), (0, 100, 0), (7, 1, 7)])
def test_emulated_tokens(model: int, unit: int, expected: int) -> None:
    assert emulated_tokens(model, unit) == expected


def test_emulated_tokens_rejects_bad_unit() -> None:
    with pytest.raises(ValueError, match="token_unit"):
        emulated_tokens(10, 0)
