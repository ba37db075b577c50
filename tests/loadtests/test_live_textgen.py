"""Prompt text for the live driver: deterministic, append-only, sized in emulated tokens."""

from __future__ import annotations

import itertools
import json
import os

import pytest

from loadtests.textgen import (
    BYTES_PER_TOKEN,
    Conversation,
    emulated_tokens,
    filler,
    shared_prefix,
)
from replica.emulator.tokenizer import GENERATION_PROMPT, render_chat
from router.policy.prefix_key import chain_key


def _render(conv: Conversation) -> str:
    return render_chat(conv.messages)


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
    a.add(100)
    b.add(100)
    assert a.messages[0] == b.messages[0]
    assert a.messages[0]["content"] == shared_prefix(len(a.messages[0]["content"]))
    assert a.messages[1]["content"] != b.messages[1]["content"]  # the id messages part at once
    assert a.messages[2]["content"] != b.messages[2]["content"]
    # what the two render alike (the shared prompt and the template around it) is the shared prefix
    common = len(os.path.commonprefix([_render(a), _render(b)]))
    assert common // BYTES_PER_TOKEN == 500
    assert a.prompt_tokens == len(_render(a)) // BYTES_PER_TOKEN == 600


def test_conversations_share_exactly_the_shared_prefix_at_any_unit() -> None:
    for unit in (1, 100):
        keys = [f"s{i:05d}-{i * 7919:08x}~0" for i in range(40)]  # ids with a long common head
        convs = [Conversation(key=k, shared_prefix_tokens=20_000, token_unit=unit) for k in keys]
        for c in convs:
            c.add(10_000)
        shared_bytes = 20_000 * BYTES_PER_TOKEN // unit
        for a, b in itertools.pairwise(convs):
            common = len(os.path.commonprefix([_render(a), _render(b)]))
            assert shared_bytes <= common < shared_bytes + BYTES_PER_TOKEN, (unit, a.key, b.key)


def test_conversation_is_append_only_and_counts_tokens() -> None:
    c = Conversation(key="sess", shared_prefix_tokens=200)
    c.add(300)
    t1, n1 = _render(c), c.prompt_tokens
    c.add(5)
    c.add(40)
    t2, n2 = _render(c), c.prompt_tokens
    closing = len("<|im_end|>") + len(GENERATION_PROMPT)
    assert t2.startswith(t1[:-closing])  # a prefix up to the history's closing marker
    assert [m["role"] for m in c.messages] == ["system", "user", "user"]  # id, one growing history message
    # the rendered prompt (the id, the template's markers) is as long as the workload says
    assert n1 == len(t1) // BYTES_PER_TOKEN == 200 + 300
    assert n2 == len(t2) // BYTES_PER_TOKEN == 545


def test_token_unit_scales_text_without_rounding_drift() -> None:
    c = Conversation(key="k", shared_prefix_tokens=20_000, token_unit=100)
    assert c.prompt_tokens == len(_render(c)) // BYTES_PER_TOKEN > 200  # the id and the template
    for _ in range(1000):
        c.add(30)  # 0.3 emulated tokens each: rounding per call would give 0 or 1000
    assert c.prompt_tokens == pytest.approx(200 + 300, abs=2)


@pytest.mark.parametrize(("model", "unit", "expected"), [(100_000, 100, 1000), (49, 100, 1), (0, 100, 0), (7, 1, 7)])
def test_emulated_tokens(model: int, unit: int, expected: int) -> None:
    assert emulated_tokens(model, unit) == expected


def test_bad_unit_is_rejected() -> None:
    with pytest.raises(ValueError, match="token_unit"):
        emulated_tokens(10, 0)
    with pytest.raises(ValueError, match="token_unit"):
        Conversation(key="k", shared_prefix_tokens=1, token_unit=0)


def test_shared_prefixes_of_different_sizes_share_their_common_part() -> None:
    short, long = shared_prefix(9_000 * BYTES_PER_TOKEN), shared_prefix(20_000 * BYTES_PER_TOKEN)
    assert len(short) == 36_000 and len(long) == 80_000
    assert long.startswith(short)


def test_truncate_keeps_a_prefix_and_the_next_turn_extends_it() -> None:
    from loadtests.textgen import Conversation

    c = Conversation(key="s~0", shared_prefix_tokens=0, token_unit=1)
    c.add(100)
    before = c.messages[-1]["content"]
    c.truncate(60)
    assert c.history_model_tokens == 60
    kept = c.messages[-1]["content"]
    assert before.startswith(kept) and len(kept) < len(before)
    c.add(50)
    assert c.history_model_tokens == 110 and c.messages[-1]["content"].startswith(kept)
    c.truncate(500)  # never grows
    assert c.history_model_tokens == 110


def test_text_added_after_a_cut_is_new_text() -> None:
    # a trace that rewrites its context back to a chunk's start: what follows is not the cut text
    # (chunks named by their position repeated it, and the emulator served the rewrite as cached)
    c = Conversation(key="s~0", shared_prefix_tokens=0, token_unit=1)
    c.add(100)
    before = c.messages[-1]["content"]
    c.truncate(0)
    kept = c.messages[-1]["content"]
    c.add(100)
    after = c.messages[-1]["content"]
    assert after.startswith(kept) and len(after) == len(before)
    assert after[len(kept) : len(kept) + 16] != before[len(kept) : len(kept) + 16]


def test_a_short_growing_conversation_keeps_its_name() -> None:
    """The gateway names a conversation by its first user message's first block; at ``token_unit``
    100 a sub-agent's whole history is shorter than that block, so it must not be in that message."""
    a, b = (Conversation(key=k, shared_prefix_tokens=9_000, token_unit=100) for k in ("s/a00~0", "s/a01~0"))
    names = set()
    for _ in range(6):
        a.add(1_500)
        b.add(1_500)
        assert len(a.messages[-1]["content"]) < 1024
        names.add(chain_key({"model": "m", "messages": a.messages}, "/v1/chat/completions", 1024, 64))
    assert len(names) == 1
    assert chain_key({"model": "m", "messages": b.messages}, "/v1/chat/completions", 1024, 64) not in names


def test_truncate_never_cuts_into_the_conversations_id() -> None:
    c = Conversation(key="s~0", shared_prefix_tokens=0, token_unit=1)
    c.add(100)
    first = c.messages[-1]["content"][0]
    c.truncate(0)
    # the id stays, and the history keeps its first character: no router sees an empty message
    assert c.messages[0]["content"].startswith("[") and c.messages[1:] == [{"role": "user", "content": first}]
    c.add(50)
    assert c.prompt_tokens == 50 and c.messages[-1]["content"].startswith(first)


def test_no_message_is_ever_empty() -> None:
    for shared in (0, 9_000):
        c = Conversation(key="s/a00~0", shared_prefix_tokens=shared, token_unit=100)
        assert all(m["content"] for m in c.messages)
        c.add(1)
        assert all(m["content"] for m in c.messages)
