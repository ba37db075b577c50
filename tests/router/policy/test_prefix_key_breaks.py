"""Rule 7 prefix keys and rule 6 affinity-break classification."""

from __future__ import annotations

from typing import Any

import pytest

from router.model import AffinityBreak, Completion, KeySource, Lease, Reason
from router.policy.breaks import classify_break, home_found
from router.policy.prefix_key import chain_key, prefix_key

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
SYSTEM = "You are a coding agent. " * 400  # ~9.6k chars, shared by every conversation


def chat(
    first: str, *later: str, system: str = SYSTEM, tools: Any = TOOLS, model: str = "kimi"
) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    for i, text in enumerate(later):
        msgs.append({"role": "assistant" if i % 2 == 0 else "user", "content": text})
    return {"model": model, "messages": msgs, "tools": tools}


def key(body: dict[str, Any], route: str = CHAT) -> str | None:
    return prefix_key(body, route, block_chars=1024, blocks=64)


def test_same_conversation_keeps_its_key_as_it_grows() -> None:
    k1 = key(chat("fix the failing test in foo.py"))
    k3 = key(chat("fix the failing test in foo.py", "looking at foo.py", "now run it"))
    assert k1 is not None and k1 == k3 and k1.startswith("p")


def test_chain_key_names_each_conversation_of_a_session() -> None:
    """A session's parent and its sub-agents (own system prompt, own task) get different chain keys;
    each keeps its key as it grows; the key is ``prefix_key``'s anchor, shortened."""
    parent = chain_key(chat("fix the failing test in foo.py", "looking"), CHAT, 1024, 64)
    grown = chain_key(chat("fix the failing test in foo.py", "looking", "more", "and more"), CHAT, 1024, 64)
    sub_a = chain_key(chat("find every caller of bar()", system="You are a search sub-agent."), CHAT, 1024, 64)
    sub_b = chain_key(chat("summarise the test log", system="You are a search sub-agent."), CHAT, 1024, 64)
    assert parent is not None and len(parent) == 16 and parent == grown
    assert len({parent, sub_a, sub_b}) == 3
    # a client that keeps the whole transcript in one growing user message keeps its key too
    one = [chain_key(chat("fix it. " + "history " * n), CHAT, 1024, 64) for n in (200, 300, 5000)]
    assert len(set(one)) == 1 and one[0] != parent
    assert chain_key({"messages": []}, CHAT, 1024, 64) is None
    assert chain_key({"prompt": "flat text " * 300}, "/v1/completions", 1024, 64) is None


def test_anthropic_messages_anchor_on_their_top_level_system_prompt() -> None:
    """Anthropic's Messages API (``/v1/messages``) keeps the system prompt out of ``messages``: a
    parent and its sub-agent asked the same first question are still two conversations."""

    def messages(first: str, *later: str, system: Any = SYSTEM) -> dict[str, Any]:
        body = chat(first, *later, system=system)
        body["messages"] = body["messages"][1:]
        body["system"] = system
        return body

    route = "/v1/messages"
    parent = chain_key(messages("look at foo.py"), route, 1024, 64)
    sub = chain_key(messages("look at foo.py", system="You are a search sub-agent."), route, 1024, 64)
    blocks = [{"type": "text", "text": "You are a search sub-agent."}]
    assert chain_key(messages("look at foo.py", system=blocks), route, 1024, 64) == sub  # blocks read as text
    assert parent is not None and sub is not None and parent != sub
    assert parent == chain_key(messages("look at foo.py", "reading it", "go on"), route, 1024, 64)
    assert key(messages("look at foo.py"), route) != key(messages("look at foo.py", system="other"), route)


def test_responses_api_anchors_on_input_and_instructions() -> None:
    """OpenAI's Responses API (``/v1/responses``, Codex) takes the messages as ``input`` (a string is
    one user message, items carry content parts) and the system prompt as ``instructions``: the same
    conversation has the same key as its chat form, keeps it as it grows, and a sub-agent with its own
    instructions is another conversation."""
    route = "/v1/responses"

    def responses(first: Any, *later: dict[str, Any], instructions: str = SYSTEM) -> dict[str, Any]:
        given = first if isinstance(first, str) else [first, *later]
        return {"model": "kimi", "instructions": instructions, "input": given, "tools": TOOLS}

    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "look at foo.py"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": '{"cmd": "cat foo.py"}'}
    out = {"type": "function_call_output", "call_id": "c1", "output": "def foo(): ..."}
    parent = chain_key(responses(user), route, 1024, 64)
    assert parent is not None and parent == chain_key(responses(user, call, out), route, 1024, 64)
    assert parent == chain_key(responses("look at foo.py"), route, 1024, 64)  # a string input is that message
    assert parent == chain_key(chat("look at foo.py"), CHAT, 1024, 64)  # the same conversation as chat
    sub = chain_key(responses(user, instructions="You are a review sub-agent."), route, 1024, 64)
    assert sub is not None and sub != parent
    assert key(responses(user), route) == key(responses(user, call, out), route) != key(responses("other"), route)
    assert chain_key({"model": "kimi", "input": []}, route, 1024, 64) is None


def test_shared_system_prompt_does_not_herd_conversations() -> None:
    keys = {key(chat(f"task number {i}: refactor module {i}")) for i in range(200)}
    assert len(keys) == 200


@pytest.mark.parametrize(
    "other",
    [
        chat("hello", system="another system prompt"),
        chat("hello", tools=None),
        chat("hello", model="other-model"),
        chat("hello!"),
    ],
)
def test_key_depends_on_system_tools_model_and_first_message(other: dict[str, Any]) -> None:
    assert key(chat("hello")) != key(other)


def test_content_parts_render_like_strings() -> None:
    as_parts = chat("x")
    as_parts["messages"][1]["content"] = [{"type": "text", "text": "x"}]
    assert key(as_parts) == key(chat("x"))


def test_huge_first_message_is_capped_but_stable() -> None:
    big = "y" * 500_000
    assert key(chat(big)) == key(chat(big + "z"))  # beyond 64 blocks of 1024 chars
    assert key(chat(big)) != key(chat("q" + big))


@pytest.mark.parametrize(
    ("route", "field", "make"),
    [
        ("/v1/completions", "prompt", lambda n: "p" * n),
        ("/generate", "text", lambda n: "t" * n),
        ("/generate", "input_ids", lambda n: [7] * (n // 2)),
    ],
)
def test_plain_prompts_key_on_full_leading_blocks(route: str, field: str, make: Any) -> None:
    base = make(64 * 1024 + 100)
    longer = make(90 * 1024)
    assert prefix_key({field: base}, route, 1024, 64) == prefix_key({field: longer}, route, 1024, 64)
    short = prefix_key({field: make(3000)}, route, 1024, 64)
    assert short is not None and short != prefix_key({field: base}, route, 1024, 64)


def test_prompt_batch_keys_on_first_prompt() -> None:
    assert prefix_key({"prompt": ["abc", "def"]}, "/v1/completions", 16, 4) == prefix_key(
        {"prompt": "abc"}, "/v1/completions", 16, 4
    )


@pytest.mark.parametrize(
    ("body", "route"),
    [
        ({}, CHAT),
        ({"messages": []}, CHAT),
        ({"messages": "nope"}, CHAT),
        ({"prompt": ""}, "/v1/completions"),
        ({"input_ids": []}, "/generate"),
        ({"input_ids": [True, 2]}, "/generate"),
    ],
)
def test_nothing_to_key_on(body: dict[str, Any], route: str) -> None:
    assert prefix_key(body, route, 1024, 64) is None


def test_keys_are_deterministic_across_processes() -> None:
    import subprocess
    import sys

    code = (
        "from router.policy.prefix_key import prefix_key;"
        "print(prefix_key({'messages':[{'role':'user','content':'hi'}]}, '/v1/chat/completions', 1024, 64))"
    )
    out = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed)},
        ).stdout.strip()
        for seed in (1, 2)
    }
    assert out == {key({"messages": [{"role": "user", "content": "hi"}]})}


def test_bad_block_params() -> None:
    with pytest.raises(ValueError):
        prefix_key({"prompt": "x"}, "/v1/completions", 0, 4)


# ---- breaks ------------------------------------------------------------------------------------


def lease(reason: Reason = Reason.AFFINITY, prev: int = 100_000, disagreement: bool = False) -> Lease:
    return Lease("l1", "a", "s1", reason, 0.0, disagreement=disagreement, prev_context_tokens=prev)


def done(prompt: int | None = 101_000, cached: int | None = 100_000, ok: bool = True) -> Completion:
    return Completion(ok=ok, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=200)


@pytest.mark.parametrize(
    ("lease_", "completion", "source", "expected"),
    [
        (lease(), done(cached=100_000), KeySource.HEADER, None),
        (lease(), done(cached=98_000), KeySource.HEADER, None),  # 2 % + a page of slack
        (lease(), done(cached=97_000), KeySource.HEADER, AffinityBreak.EVICTED),
        (lease(), done(cached=0), KeySource.HEADER, AffinityBreak.EVICTED),
        (lease(Reason.THICC_SPLIT), done(cached=15_000), KeySource.HEADER, AffinityBreak.THICC_SPLIT),
        (lease(Reason.REASSIGNED_OVERLOAD), done(cached=0), KeySource.HEADER, AffinityBreak.OVERLOAD_SPILL),
        (lease(Reason.REASSIGNED_GONE), done(cached=0), KeySource.HEADER, AffinityBreak.REPLICA_GONE),
        (lease(Reason.REASSIGNED_DRAINING), done(cached=0), KeySource.HEADER, AffinityBreak.REPLICA_GONE),
        (lease(Reason.RETRY), done(cached=0), KeySource.HEADER, AffinityBreak.REPLICA_GONE),
        (lease(Reason.PLACED_EVICTED), done(cached=0), KeySource.HEADER, AffinityBreak.EVICTED),
        (lease(Reason.LEAST_LOADED), done(cached=0), KeySource.HEADER, AffinityBreak.OVERLOAD_SPILL),
        (lease(disagreement=True), done(cached=0), KeySource.HEADER, AffinityBreak.GATEWAY_DISAGREEMENT),
        (
            lease(Reason.THICC_SPLIT, disagreement=True),
            done(cached=0),
            KeySource.HEADER,
            AffinityBreak.GATEWAY_DISAGREEMENT,
        ),
        (lease(), done(cached=0), KeySource.PREFIX, AffinityBreak.NO_SESSION_ID),
        (lease(prev=0), done(cached=0), KeySource.HEADER, None),  # first turn: nothing to lose
        (
            lease(),
            done(prompt=20_000, cached=19_900),
            KeySource.HEADER,
            None,
        ),  # history rewritten, all cached
        # a prompt smaller than the session's context (a sub-agent's turn, a compacted history) does
        # not continue it: its low hit says nothing about eviction
        (lease(), done(prompt=20_000, cached=5_000), KeySource.HEADER, None),
        (lease(), done(prompt=90_000, cached=5_000), KeySource.HEADER, None),
        (lease(), done(prompt=96_000, cached=5_000), KeySource.HEADER, AffinityBreak.EVICTED),
        (lease(), done(cached=None), KeySource.HEADER, None),  # engine did not report
        (lease(), done(ok=False, cached=0), KeySource.HEADER, None),
        (lease(prev=100), done(prompt=500, cached=40), KeySource.HEADER, None),  # within one partial page
    ],
)
def test_classify_break(
    lease_: Lease, completion: Completion, source: KeySource, expected: AffinityBreak | None
) -> None:
    assert classify_break(lease_, completion, source) is expected


@pytest.mark.parametrize(
    ("lease_", "completion", "expected"),
    [
        (lease(), done(cached=100_000), True),
        (lease(), done(cached=98_000), True),  # the break's slack: a page and 2 %
        (lease(), done(cached=97_000), False),
        (lease(), done(cached=0), False),
        (lease(prev=0), done(cached=0), None),  # nothing was there to find
        (lease(), done(prompt=20_000, cached=5_000), None),  # a sub-agent's prompt: no evidence
        (lease(), done(cached=None), None),  # the engine did not report
        (lease(), done(ok=False, cached=0), None),
        # not sent home for its cache: its hit says nothing about the residency the decision read
        (lease(Reason.PLACED_EVICTED), done(cached=0), None),
        (lease(Reason.THICC_SPLIT), done(cached=0), None),
        (lease(Reason.HASH), done(cached=0), None),
        (lease(disagreement=True), done(cached=0), None),  # another gateway's home
    ],
)
def test_home_found_judges_only_turns_sent_home_for_their_cache(
    lease_: Lease, completion: Completion, expected: bool | None
) -> None:
    assert home_found(lease_, completion) is expected
    if expected is not None:  # the same judgement as the break's
        assert (classify_break(lease_, completion, KeySource.HEADER) is None) is expected


@pytest.mark.parametrize(
    ("resident", "cached", "expected"),
    [
        (40_000, 60_000, True),  # exact residency kept home a session with part of its cache left
        (40_000, 39_200, True),  # within a page and 2 %
        (40_000, 30_000, False),  # the events promised more than the engine had
        (0, 0, True),
        (200_000, 101_000, True),  # no more than the prompt can be found
    ],
)
def test_home_found_with_exact_residency_holds_the_engine_to_what_the_events_promised(
    resident: int, cached: int, expected: bool
) -> None:
    assert home_found(lease(), done(cached=cached), resident_tokens=resident) is expected
    assert home_found(lease(), done(prompt=20_000, cached=0), resident_tokens=resident) is None  # not continuing
