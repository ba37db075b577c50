"""Rule 7: a routing key for requests without a session id, from the start of their prompt.

``prefix_key`` renders the part of the prompt that identifies a *conversation* and hashes it as a
chain over fixed-size blocks (mmh3, deterministic across processes):

* chat (``messages``; Anthropic's Messages API with its top-level ``system``; OpenAI's Responses API,
  whose ``input`` is the messages and ``instructions`` the system prompt): the model, the tool
  definitions, and every message up to and including the first user message. That anchor never
  changes as the conversation grows (later turns only append), so every turn gets the same key;
  conversations that share a system prompt and tools but start with a different question get
  different keys, so shared system prompts do not herd everything onto one replica. The shared head
  (system prompt + tools) and the first user message are chained separately, each capped at
  ``blocks`` blocks of ``block_chars`` characters.
* completions ``prompt`` / generate ``text`` / ``input_ids``: no structure to find the conversation
  in, so the key covers the first ``blocks`` *full* blocks (a prompt shorter than one block is keyed
  whole). Choose ``blocks × block_chars`` above the longest shared system prompt you expect, or all
  such traffic gets one key (DESIGN §3 rule 7, docs/POLICY.md).

Returns ``None`` when there is nothing to key on.

``chain_key`` is a short key from the same kind of anchor for a chat request that *has* a session
id: which of the session's conversations (the parent's or one sub-agent's, each with its own system
prompt and first task message) the request continues, so the policy can send it to where that
conversation's own context is cached (docs/POLICY.md, round 17).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import mmh3

from router.policy.hashing import utf8

__all__ = ["chain_key", "prefix_key", "render_chat_anchor"]

_SEP = "\x1e"


def prefix_key(body: Mapping[str, Any], route: str, block_chars: int, blocks: int) -> str | None:
    if block_chars < 1 or blocks < 1:
        raise ValueError("block_chars and blocks must be ≥ 1")
    head = _model_head(body)
    chat_like = _conversation(body) is not None and "prompt" not in body
    if route.endswith(("/chat/completions", "/responses")) or chat_like:
        anchor = render_chat_anchor(body)
        if anchor is None:
            return None
        shared, first_user = anchor
        h = _chain(head, _blocks(shared, block_chars, blocks, full_only=False))
        return "p" + _chain(h, _blocks(first_user, block_chars, blocks, full_only=False))
    text = _plain_prompt(body)
    if text is None:
        return None
    return "p" + _chain(head, _blocks(text, block_chars, blocks, full_only=True))


def chain_key(body: Mapping[str, Any], route: str, block_chars: int, blocks: int) -> str | None:
    """16 hex digits naming the chat conversation ``body`` continues, or None (no messages).

    The anchor is ``prefix_key``'s shared head (model, tools, system prompt) and only the first block
    of the first user message: clients that keep a whole transcript in one growing user message keep
    the key as it grows, and agents that append messages never change it. Flat prompts (``prompt``,
    ``text``, ``input_ids``) have no conversation structure to anchor on: None."""
    if "prompt" in body or _conversation(body) is None:
        return None
    anchor = render_chat_anchor(body)
    if anchor is None:
        return None
    shared, first_user = anchor
    h = _chain(_model_head(body), _blocks(shared, block_chars, blocks, full_only=False))
    return _chain(h, [first_user[:block_chars]])[:16]


def render_chat_anchor(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(system prompt + tools + messages before the first user message, first user message)."""
    conversation = _conversation(body)
    if conversation is None or not conversation[0]:
        return None
    messages, system = conversation
    tools = body.get("tools")
    parts = [_canonical(tools) if tools else ""]
    if system:
        parts.append(f"system:{_content_text(system)}")
    first_user: str | None = None
    for msg in messages:
        if not isinstance(msg, Mapping):
            continue
        role = str(msg.get("role", ""))
        text = f"{role}:{_content_text(msg.get('content'))}"
        if role == "user":
            first_user = text
            break
        parts.append(text)
    if first_user is None:
        first_user = ""
    shared = _SEP.join(parts)
    if not shared.strip(_SEP) and not first_user:
        return None
    return shared, first_user


def _conversation(body: Mapping[str, Any]) -> tuple[list[Any], Any] | None:
    """(messages, the system prompt kept out of them) of a chat-like body; None for a flat prompt.
    Anthropic's Messages API keeps the system prompt in ``system``; OpenAI's Responses API takes the
    messages as ``input`` (a string is one user message) and the system prompt as ``instructions``."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return messages, body.get("system")
    given = body.get("input")
    if isinstance(given, str):
        return [{"role": "user", "content": given}], body.get("instructions")
    if isinstance(given, list):
        return given, body.get("instructions")
    return None


def _model_head(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    return f"m={model if isinstance(model, str) else ''}{_SEP}"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, Mapping):
                if isinstance(part.get("text"), str):
                    out.append(part["text"])
                else:
                    out.append(_canonical(part))
            elif isinstance(part, str):
                out.append(part)
        return "\n".join(out)
    if content is None:
        return ""
    return _canonical(content)


def _plain_prompt(body: Mapping[str, Any]) -> str | None:
    for field in ("prompt", "text", "input_ids"):
        value = body.get(field)
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            value = value[0]  # a batch: key on its first prompt
        if isinstance(value, str) and value:
            return value
        if (
            isinstance(value, list)
            and value
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        ):
            # ~6 characters per token: a block covers a little less prompt than with text
            return ",".join(map(str, value)) + ","
    return None


def _blocks(text: str, block_chars: int, blocks: int, full_only: bool) -> list[str]:
    n_full = len(text) // block_chars
    if full_only and n_full >= 1:
        n = min(n_full, blocks)
        return [text[i * block_chars : (i + 1) * block_chars] for i in range(n)]
    end = min(len(text), blocks * block_chars)
    return [text[i : i + block_chars] for i in range(0, end, block_chars)] or [""]


def _chain(seed: str, blocks: Sequence[str]) -> str:
    h = seed
    for block in blocks:
        h = format(mmh3.hash128(utf8(h + _SEP + block), 0x6B76, signed=False), "032x")
    return h


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
