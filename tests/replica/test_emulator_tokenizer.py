from __future__ import annotations

import time

import pytest

from replica.emulator.tokenizer import (
    GENERATION_PROMPT,
    ChainMemo,
    block_hashes,
    decode_ids,
    encode_ids,
    encode_text,
    output_text,
    render_chat,
    salt_seed,
    token_ids,
)


def test_four_bytes_per_token_and_roundtrip() -> None:
    p = encode_text("hello world, ünïcode!")  # 23 bytes -> 6 tokens
    assert p.num_tokens == 6
    ids = token_ids(p)
    assert len(ids) == 6
    assert decode_ids(ids) == "hello world, ünïcode!"
    assert encode_ids(ids).data == p.data


def test_input_ids_hash_like_the_text() -> None:
    text = "x" * 1000
    p = encode_text(text)
    ids = token_ids(p)
    assert block_hashes(encode_ids(ids), 16) == block_hashes(p, 16)


def test_bad_input_ids_rejected() -> None:
    with pytest.raises(ValueError):
        encode_ids([1, -2])
    with pytest.raises(ValueError):
        encode_ids([2**33])
    with pytest.raises(ValueError):
        encode_ids(["a"])  # type: ignore[list-item]


def test_chained_hashes_share_exact_prefix() -> None:
    a = encode_text("A" * 4 * 64 * 3 + "B" * 4 * 64 * 2)
    b = encode_text("A" * 4 * 64 * 3 + "C" * 4 * 64 * 2)
    ha, hb = block_hashes(a, 64), block_hashes(b, 64)
    assert len(ha) == len(hb) == 5
    assert ha[:3] == hb[:3]
    assert ha[3] != hb[3] and ha[4] != hb[4]
    # chaining: the same block content at a different position hashes differently
    c = encode_text("A" * 4 * 64)
    assert block_hashes(c, 64)[0] == ha[0]
    d = encode_text("B" * 4 * 64)
    assert block_hashes(d, 64)[0] != ha[3]


def test_salt_namespaces_chain() -> None:
    p = encode_text("z" * 4096)
    assert block_hashes(p, 64, seed=salt_seed("tenant-a")) != block_hashes(p, 64)
    assert salt_seed(None) == 0


def test_partial_block_not_hashed() -> None:
    assert len(block_hashes(encode_text("q" * (4 * 64 - 4)), 64)) == 0
    assert len(block_hashes(encode_text("q" * (4 * 64 * 2 + 8)), 64)) == 2


def test_chain_extension_equals_full_hash() -> None:
    data = encode_text("k" * 4 * 64 * 7)
    full = block_hashes(data, 64)
    ext = block_hashes(data, 64, start_block=4, prev_hash=full[3])
    assert ext == full[4:]


def test_chat_turns_share_token_prefix() -> None:
    msgs = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "fix bug " * 300},
    ]
    turn1 = render_chat(msgs)
    answer = output_text(50, seed=3)
    msgs2 = msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": "now test"}]
    turn2 = render_chat(msgs2)
    assert turn1.endswith(GENERATION_PROMPT)
    assert turn2.startswith(turn1 + answer)
    h1, h2 = block_hashes(encode_text(turn1), 16), block_hashes(encode_text(turn2), 16)
    assert h2[: len(h1) - 1] == h1[:-1]


def test_chat_tools_and_parts_render() -> None:
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "u"}}],
        }
    ]
    s = render_chat(msgs, tools=[{"type": "function", "function": {"name": "f"}}])
    assert "tool_declare" in s and "hi" in s and '"image_url"' in s
    with pytest.raises(ValueError):
        render_chat([{"content": "no role"}])
    with pytest.raises(ValueError):
        render_chat(["not a dict"])  # type: ignore[list-item]


def test_output_text_is_four_bytes_per_token_and_deterministic() -> None:
    t = output_text(1000, seed=7)
    assert len(t.encode()) == 4000
    assert t == output_text(1000, seed=7)
    assert t != output_text(1000, seed=8)
    assert output_text(0) == ""


def test_large_prompt_is_fast() -> None:
    text = ("def f(x):\n    return x * 2  # comment\n" * 11000)[:400_000]
    t0 = time.process_time()
    for _ in range(5):
        p = encode_text(text)
        hashes = block_hashes(p, 64)
    per = (time.process_time() - t0) / 5
    assert p.num_tokens == 100_000 and len(hashes) == 1562
    assert per < 0.02, per  # well under 20 ms for a 100k-token prompt


def test_chain_memo_matches_full_hashing_and_reuses() -> None:
    memo = ChainMemo(max_entries=2)
    base = "conversation " * 2000
    turns = [base, base + "more " * 300, base + "more " * 300 + "and more " * 100]
    for t in turns:
        p = encode_text(t)
        assert memo.hashes(p, 16, key="s1") == block_hashes(p, 16)
    assert memo.reused_blocks > memo.hashed_blocks
    # a different conversation under the same key (compaction): detected, rehashed correctly
    p = encode_text("compacted " * 1000)
    assert memo.hashes(p, 16, key="s1") == block_hashes(p, 16)
    # salted chains differ and are still exact; no key -> keyed by the first block
    assert memo.hashes(p, 16, seed=7) == block_hashes(p, 16, seed=7)
    assert memo.hashes(encode_text("ab"), 16) == []
